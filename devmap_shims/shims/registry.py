"""The registry: which shims exist, which are selected, and the state of every (shim, target) pair.

States of a target entry:

``pending``   selected, its module not imported yet (the post-import hook is waiting);
``active``    wrapped;
``skipped``   not wrapped, with the reason (bug fixed in the installed version, target not used by
              this version of the consumer, signature drift, excluded by the user ...);
``failed``    wrapping or a repair raised; the error is kept, the original runs unchanged.

Applicability is decided lazily, when a target's module is imported (or when ``status()`` asks):
reading versions and parsing specifiers costs tens of milliseconds that a process which never
imports transformers should not pay.
"""

from __future__ import annotations

import sys
import threading
# typing costs ~20 ms to import; annotations are strings here, so it is only needed by type checkers
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from devmap_shims.shims import importhook
from devmap_shims.shims.record import Shim, Target, resolve_ref

LOGGER_NAME = "devmap_shims"

PENDING, ACTIVE, SKIPPED, FAILED = "pending", "active", "skipped", "failed"


def _logger() -> Any:
    import logging

    return logging.getLogger(LOGGER_NAME)


class ShimError(RuntimeError):
    """Raised in strict mode when a shim cannot be applied or its repair fails."""


class TargetEntry:
    __slots__ = (
        "shim_entry", "target", "state", "reason", "error", "owner", "name",
        "original", "layer", "rebound", "enabled", "hook", "seq",
    )

    def __init__(self, shim_entry: ShimEntry, target: Target) -> None:
        self.shim_entry = shim_entry
        self.target = target
        self.state = PENDING
        self.reason = f"waiting for {target.module} to be imported"
        self.error: Optional[str] = None
        self.owner: Any = None
        self.name = ""
        self.original: Any = None
        self.layer: Any = None
        self.rebound: List[Tuple[str, str]] = []
        self.enabled = True
        self.hook: Optional[Callable[[Any], None]] = None
        self.seq = 0  # arming order: layers come off last-on, first-off

    def as_dict(self) -> Dict[str, Any]:
        return {
            "target": self.target.key,
            "state": self.state,
            "reason": self.reason,
            "error": self.error,
            "rebound": [f"{m}.{k}" for m, k in self.rebound],
        }


class ShimEntry:
    __slots__ = ("shim", "selected", "forced", "why_not_selected", "decision", "targets", "call_failures", "warned")

    def __init__(self, shim: Shim) -> None:
        self.shim = shim
        self.selected = True
        self.forced = False
        self.why_not_selected = ""
        self.decision: Optional[Tuple[bool, str]] = None
        self.targets: List[TargetEntry] = []
        self.call_failures = 0
        self.warned = False


class Registry:
    """Process-wide state behind ``install()``, ``uninstall()`` and ``status()``."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.installed = False
        self.strict = False
        self.options: Dict[str, Any] = {}
        self.shims: Dict[str, ShimEntry] = {}
        self.extra_rows: List[Dict[str, Any]] = []
        self.warnings: List[str] = []
        self.imported_before_install: List[str] = []
        self.killed = False
        self.armed_count = 0
        self._matrix: Any = None
        self._versions: Optional[Dict[str, Optional[str]]] = None

    # -- knowledge -----------------------------------------------------------------------------
    def matrix(self) -> Any:
        if self._matrix is None:
            from devmap_shims.compat_matrix import MatrixError, load_matrix

            try:
                self._matrix = load_matrix(extra_rows=self.extra_rows)
            except MatrixError:
                # One malformed plugin row must not take the built-in rows down with it.
                good: List[Dict[str, Any]] = []
                for row in self.extra_rows:
                    try:
                        load_matrix(extra_rows=good + [row])
                    except MatrixError as exc:
                        self.warn(f"{exc}; the row is ignored")
                    else:
                        good.append(row)
                self._matrix = load_matrix(extra_rows=good)
        return self._matrix

    def versions(self) -> Dict[str, Optional[str]]:
        if self._versions is None:
            from devmap_shims.versions import TARGET_DISTRIBUTIONS, installed_versions

            names = set(TARGET_DISTRIBUTIONS)
            for row in self.matrix().rows:
                names.update(row.affected)
            for entry in self.shims.values():
                for target in entry.shim.targets:
                    names.update(target.when)
            self._versions = installed_versions(sorted(names))
        return self._versions

    def decide(self, entry: ShimEntry) -> Tuple[bool, str]:
        """Whether ``entry``'s bug applies here: ``(applies, reason)``; cached."""
        if entry.decision is None:
            reasons = []
            applies = False
            matrix = self.matrix()
            for bug_id in entry.shim.fixes:
                try:
                    row = matrix.get(bug_id)
                except KeyError:
                    reasons.append(f"{bug_id}: no such row in the compat matrix")
                    continue
                ok, why = row.applicability(self.versions())
                applies = applies or ok
                reasons.append(f"{bug_id}: {'affected' if ok else 'not affected'} ({why})")
            entry.decision = (applies, "; ".join(reasons))
        return entry.decision

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        _logger().warning("devmap_shims: %s", message)

    def reset_knowledge(self) -> None:
        self._matrix = None
        self._versions = None
        for entry in self.shims.values():
            entry.decision = None


REGISTRY = Registry()


# -- arming a target ----------------------------------------------------------------------------
def arm(registry: Registry, entry: TargetEntry, module: Any) -> None:
    """Post-import hook body: wrap ``entry``'s target in ``module`` if everything says so."""
    shim_entry = entry.shim_entry
    shim = shim_entry.shim
    with registry.lock:
        if not registry.installed or entry.state != PENDING:
            return
        try:
            _arm(registry, entry, module)
        except Exception as exc:
            entry.state = FAILED
            entry.error = f"{type(exc).__name__}: {exc}"
            entry.reason = f"could not wrap {entry.target.key}"
            message = (
                f"shim {shim.id!r} could not wrap {entry.target.key} ({entry.error}); "
                "the library runs unpatched. Report this with `devmap-shims doctor --json`."
            )
            if registry.strict:
                raise ShimError(message) from exc
            registry.warn(message)


def _arm(registry: Registry, entry: TargetEntry, module: Any) -> None:
    import inspect

    from devmap_shims.shims import wrapping
    from devmap_shims.versions import satisfies

    shim_entry = entry.shim_entry
    shim = shim_entry.shim
    target = entry.target
    applies, why = registry.decide(shim_entry)
    if not applies and not shim_entry.forced:
        entry.state, entry.reason = SKIPPED, f"bug not present here: {why}"
        return
    if target.when:
        ok, why_when = satisfies(registry.versions(), target.when)
        if not ok:
            entry.state, entry.reason = SKIPPED, f"target not used on this stack ({why_when})"
            return
    try:
        owner, name, raw = wrapping.resolve(module, target.qualname)
    except AttributeError as exc:
        entry.state, entry.reason = SKIPPED, f"target missing: {exc} (the library changed; shim not applied)"
        return
    existing = wrapping.owned_original(raw)
    live = any(t.layer is raw and t.state == ACTIVE for e in registry.shims.values() for t in e.targets)
    if existing is not None and not live:  # a layer left by an earlier install: keep the first original
        raw = existing
    func = wrapping.callable_of(raw)
    if target.expect_params:
        try:
            params = set(inspect.signature(func).parameters)
        except (TypeError, ValueError):
            params = set()
        missing = [p for p in target.expect_params if p not in params]
        if missing:
            entry.state = SKIPPED
            entry.reason = (
                f"signature drift: {target.key} has no parameter(s) {', '.join(missing)}; "
                "shim not applied"
            )
            return
    repair = resolve_ref(shim.wrapper_for(target))
    guarded = _guarded_call(registry, entry, repair)
    if shim.compile_reachable:
        layer = wrapping.make_plain(raw, guarded, owner)
    else:
        layer = wrapping.make_proxy(raw, guarded)
    wrapping.remember(layer, raw)
    setattr(owner, name, layer)
    entry.owner, entry.name, entry.original, entry.layer = owner, name, raw, layer
    registry.armed_count += 1
    entry.seq = registry.armed_count
    if not isinstance(owner, type):
        entry.rebound = wrapping.rebind_aliases(raw, layer)
    entry.state = ACTIVE
    entry.reason = "forced outside its range" if not applies else why
    _logger().info(
        "devmap_shims: %s active on %s (fixes %s)", shim.id, target.key, ", ".join(shim.fixes)
    )


def _guarded_call(registry: Registry, entry: TargetEntry, repair: Callable[..., Any]) -> Callable[..., Any]:
    """The call-time guard around a shim's repair (lesson: fail open, never swallow the library's errors)."""

    def guarded(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not entry.enabled or entry.state != ACTIVE:
            return wrapped(*args, **kwargs)
        call = _OriginalCall(wrapped)
        try:
            return repair(call, instance, args, kwargs)
        except BaseException as exc:
            if call.raised is not None:  # the library's own error: always the library's
                if exc is call.raised:
                    raise
                raise call.raised from None
            if isinstance(exc, (KeyboardInterrupt, SystemExit, ShimError)):
                raise  # ShimError: a repair refusing on purpose (strict mode), not a broken repair
            _repair_failed(registry, entry, exc)
            if call.called:
                return call.result
            return wrapped(*args, **kwargs)

    return guarded


def _repair_failed(registry: Registry, entry: TargetEntry, exc: BaseException) -> None:
    shim_entry = entry.shim_entry
    shim = shim_entry.shim
    shim_entry.call_failures += 1
    message = (
        f"shim {shim.id!r} (fixes {', '.join(shim.fixes)}) failed inside {entry.target.key}: "
        f"{type(exc).__name__}: {exc}. The call went on without the repair and this shim is now off; "
        "set DEVMAP_SHIMS_STRICT=1 to raise instead."
    )
    if registry.strict:
        raise ShimError(message) from exc
    with registry.lock:
        for target_entry in shim_entry.targets:
            if target_entry.state == ACTIVE:
                target_entry.state = FAILED
                target_entry.error = f"{type(exc).__name__}: {exc}"
                target_entry.reason = "repair raised at call time"
        if not shim_entry.warned:
            shim_entry.warned = True
            registry.warn(message)


class _OriginalCall:
    """Calls the original and remembers what happened, so the guard can tell whose error it is."""

    __slots__ = ("wrapped", "called", "result", "raised")

    def __init__(self, wrapped: Callable[..., Any]) -> None:
        self.wrapped = wrapped
        self.called = False
        self.result: Any = None
        self.raised: Optional[BaseException] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.called = True
        try:
            self.result = self.wrapped(*args, **kwargs)
        except BaseException as exc:
            self.raised = exc
            raise
        return self.result

    def __getattr__(self, name: str) -> Any:
        # Look like the original to the repair (inspect.signature, __wrapped__, __self__ ...).
        # Own slots are never delegated: tracers such as Dynamo probe them before __init__ ran.
        if name in _OriginalCall.__slots__:
            raise AttributeError(name)
        return getattr(self.wrapped, name)


# -- selection ------------------------------------------------------------------------------------
def select(
    registry: Registry,
    shims: Iterable[Shim],
    only: Optional[Iterable[str]],
    exclude: Iterable[str],
    force: Iterable[str],
    disable_all: bool,
) -> List[str]:
    """Build the entries; returns problems with the given ids."""
    registry.shims = {shim.id: ShimEntry(shim) for shim in shims}
    known = list(registry.shims)
    problems = []
    only_set = None if only is None else set(only)
    for name, ids in (("only", only_set or ()), ("exclude", exclude), ("force", force)):
        for shim_id in ids:
            if shim_id not in registry.shims:
                close = _close(shim_id, known)
                problems.append(
                    f"install({name}=...) names unknown shim {shim_id!r}"
                    + (f"; did you mean {close!r}?" if close else f"; known shims: {', '.join(sorted(known))}")
                )
    exclude = set(exclude)
    force = set(force)
    for shim_id, entry in registry.shims.items():
        if disable_all:
            entry.selected, entry.why_not_selected = False, "disabled by DEVMAP_SHIMS_DISABLE=*"
        elif only_set is not None and shim_id not in only_set:
            entry.selected, entry.why_not_selected = False, "not in install(only=...)"
        elif shim_id in exclude:
            entry.selected, entry.why_not_selected = False, "excluded by the user"
        entry.forced = shim_id in force
        for target in entry.shim.targets:
            target_entry = TargetEntry(entry, target)
            if not entry.selected:
                target_entry.state, target_entry.reason = SKIPPED, entry.why_not_selected
            entry.targets.append(target_entry)
    return problems


def _close(name: str, known: List[str]) -> Optional[str]:
    import difflib

    match = difflib.get_close_matches(name, known, n=1)
    return match[0] if match else None


def watch(registry: Registry) -> None:
    """Register the post-import hooks of every selected target (arming those already imported)."""
    importhook.on_error = _hook_error
    for entry in registry.shims.values():
        for target_entry in entry.targets:
            if target_entry.state != PENDING:
                continue

            def hook(module: Any, _entry: TargetEntry = target_entry) -> None:
                arm(registry, _entry, module)

            target_entry.hook = hook
            importhook.when_imported(target_entry.target.module, hook)


def _hook_error(module_name: str, hook: Any, exc: BaseException) -> None:
    if isinstance(exc, ShimError):
        raise exc
    REGISTRY.warn(f"post-import hook for {module_name} failed ({type(exc).__name__}: {exc}); import went on")


def unwatch_and_unwrap(registry: Registry) -> None:
    from devmap_shims.shims import wrapping

    entries = [t for e in registry.shims.values() for t in e.targets]
    for target_entry in sorted(entries, key=lambda t: -t.seq):  # two shims on one target: outer first
        if target_entry.hook is not None:
            importhook.cancel(target_entry.hook)
        if target_entry.layer is None:
            continue
        outcome = wrapping.splice_out(
            target_entry.owner, target_entry.name, target_entry.layer, target_entry.original
        )
        wrapping.restore_aliases(target_entry.rebound, target_entry.original, target_entry.layer)
        if outcome == "buried":
            target_entry.enabled = False  # stays in the call chain, does nothing
            registry.warn(
                f"{target_entry.target.key}: a foreign wrapper holds devmap_shims' layer inside a "
                "closure; it was switched off instead of removed"
            )
        else:
            wrapping.forget(target_entry.layer)


def imported_targets(registry: Registry) -> List[str]:
    modules = sorted({t.target.module for e in registry.shims.values() for t in e.targets})
    return [m for m in modules if m in sys.modules]
