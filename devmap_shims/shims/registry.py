"""The registry: the shims of this install, what was selected, and the state of each (shim, target).

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

import threading

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

from devmap_shims.shims.record import Shim, Target

LOGGER_NAME = "devmap_shims"

PENDING, ACTIVE, SKIPPED, FAILED = "pending", "active", "skipped", "failed"

#: Different warnings a registry keeps (``status()["warnings"]``); later ones are only counted.
MAX_WARNINGS = 100


def logger() -> Any:
    import logging

    return logging.getLogger(LOGGER_NAME)


class ShimError(RuntimeError):
    """Raised in strict mode when a shim cannot be applied or its repair fails."""


class ShimContext:
    """What the engine gives a shim's wrappers (see :func:`devmap_shims.shims.with_context`).

    ``state`` is the shim's own state (``Shim(state=factory)``), made fresh at each ``install()``
    and dropped at ``uninstall()``; ``strict`` says whether strict mode is on; :meth:`warn` adds a
    message to the report (``status()["warnings"]`` and the ``devmap_shims`` logger), once.
    A context made without a registry (to call a shim's wrappers directly, as ``devmap-shims plan``
    does) is never strict and logs its warnings.
    """

    __slots__ = ("shim_id", "state", "_registry", "__weakref__")

    def __init__(self, shim: Shim, registry: Optional[Registry] = None, make_state: bool = True) -> None:
        self.shim_id = shim.id
        self.state = shim.state() if make_state and shim.state is not None else None
        self._registry = registry

    @property
    def registry(self) -> Optional[Registry]:
        """The registry of the install that made this context; None for a context made without one."""
        return self._registry

    @property
    def strict(self) -> bool:
        return bool(self._registry is not None and self._registry.strict)

    def warn(self, message: str) -> None:
        if self._registry is None:
            logger().warning("%s", message)
        else:
            self._registry.warn(message)

    def refuse(self, message: str) -> None:
        """Raise :class:`ShimError` in strict mode, else :meth:`warn`."""
        if self.strict:
            raise ShimError(message)
        self.warn(message)


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
    __slots__ = (
        "shim", "selected", "forced", "why_not_selected", "decision", "targets", "call_failures", "warned",
        "context", "expanded",
    )

    def __init__(self, shim: Shim, context: ShimContext) -> None:
        self.shim = shim
        self.selected = True
        self.forced = False
        self.why_not_selected = ""
        self.decision: Optional[Tuple[bool, str]] = None
        self.targets: List[TargetEntry] = []
        self.call_failures = 0
        self.warned = False
        self.context = context
        self.expanded = False  # Shim.more_targets already asked


class Registry:
    """The shims of the current install and what is known about the machine (matrix, versions)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.strict = False
        self.shims: Dict[str, ShimEntry] = {}
        self.extra_rows: List[Dict[str, Any]] = []
        self.warnings: List[str] = []
        self.warnings_dropped = 0
        self._warned: set = set()
        self.armed_count = 0
        # while watch() arms the targets of modules already imported: the entries whose by-name
        # copies are still to be rebound, in one pass over sys.modules at the end (None otherwise)
        self.pending_rebinds: Optional[List[TargetEntry]] = None
        self._matrix: Any = None
        self._versions: Optional[Dict[str, Optional[str]]] = None

    def add(self, shim: Shim, *, selected: bool = True, why_not: str = "", forced: bool = False) -> ShimEntry:
        """A new entry for ``shim``, with a fresh context and one pending (or skipped) entry per
        target; failed ones, with one warning, when the shim's state cannot be made (strict mode:
        :class:`ShimError`)."""
        broken = ""
        try:
            context = ShimContext(shim, self)
        except Exception as exc:
            broken = f"{type(exc).__name__}: {exc}"
            if self.strict:
                raise ShimError(
                    f"shim {shim.id!r}: making its state (Shim(state=...)) raised {broken}") from exc
            context = ShimContext(shim, self, make_state=False)
        entry = ShimEntry(shim, context)
        entry.selected, entry.why_not_selected, entry.forced = selected, why_not, forced
        for target in shim.targets:
            target_entry = TargetEntry(entry, target)
            if broken and selected:
                target_entry.state, target_entry.error = FAILED, broken
                target_entry.reason = "its state could not be made"
            elif not selected:
                target_entry.state, target_entry.reason = SKIPPED, why_not
            entry.targets.append(target_entry)
        self.shims[shim.id] = entry
        if broken and selected:
            self.warn(f"shim {shim.id!r} is off: making its state (Shim(state=...)) raised {broken}; "
                      "the other shims are installed")
        return entry

    def target_entries(self) -> List[TargetEntry]:
        return [t for e in self.shims.values() for t in e.targets]

    # -- knowledge -----------------------------------------------------------------------------
    def matrix(self) -> Any:
        if self._matrix is None:
            from devmap_shims.compat_matrix import load_matrix_skipping_bad_rows

            self._matrix, problems = load_matrix_skipping_bad_rows(self.extra_rows)
            for problem in problems:
                self.warn(problem)
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

    def not_present(self, entry: ShimEntry) -> Optional[str]:
        """Why ``entry``'s shim stays off here (no row it fixes applies, and it is not forced), or None."""
        applies, why = self.decide(entry)
        return None if applies or entry.forced else f"bug not present here: {why}"

    def warn(self, message: str, logged: bool = False) -> None:
        """Report ``message`` once: a message already reported is not repeated, and past
        :data:`MAX_WARNINGS` different ones only a count is kept (memory stays bounded).
        ``logged``: said already (at start-up), so only kept for the report."""
        if message in self._warned:
            return
        if len(self.warnings) >= MAX_WARNINGS:
            self.warnings_dropped += 1
            if self.warnings_dropped == 1:
                logger().warning("more than %d different warnings; the rest are counted, not kept", MAX_WARNINGS)
            return
        self._warned.add(message)
        self.warnings.append(message)
        if not logged:
            logger().warning("%s", message)

    def reset_knowledge(self) -> None:
        self._matrix = None
        self._versions = None
        for entry in self.shims.values():
            entry.decision = None
