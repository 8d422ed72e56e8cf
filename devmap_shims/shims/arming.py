"""Arming: from a registered (shim, target) pair to a layer on the target, and back.

:func:`watch` registers a post-import hook per pending target; the hook (:func:`arm`) runs when
the target's module has been imported and wraps the target if the matrix says its bug applies
(or the shim is forced), the consumer versions match the target's ``when``, the target exists and
its signature has the parameters the wrapper expects. Every "no" is recorded as the target's
reason. :func:`unwatch_and_unwrap` takes our layers off again, last on first off.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

from devmap_shims.shims import importhook
from devmap_shims.shims.guard import bind_context, guarded_call
from devmap_shims.shims.record import resolve_ref
from devmap_shims.shims.registry import (
    ACTIVE,
    FAILED,
    PENDING,
    SKIPPED,
    Registry,
    ShimEntry,
    ShimError,
    TargetEntry,
    logger,
)


def arm(registry: Registry, entry: TargetEntry, module: Any) -> None:
    """Post-import hook body: wrap ``entry``'s target in ``module`` if everything says so."""
    shim = entry.shim_entry.shim
    with registry.lock:
        if entry.state != PENDING or registry.shims.get(shim.id) is not entry.shim_entry:
            return  # uninstalled meanwhile, or already decided
        try:
            _arm(registry, entry, module)
        except Exception as exc:
            entry.state = FAILED
            entry.error = f"{type(exc).__name__}: {exc}"
            entry.reason = f"could not wrap {entry.target.key}"
            # a shim's own mistake (a plugin's) or a library that changed, or else ours to hear of
            report = "" if isinstance(exc, (LibraryChanged, RepairRefused)) else (
                " Report this with `devmap-shims doctor --json`.")
            message = (
                f"shim {shim.id!r} could not wrap {entry.target.key} ({entry.error}); "
                f"the library runs unpatched.{report}"
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
    not_present = registry.not_present(shim_entry)
    if not_present:
        entry.state, entry.reason = SKIPPED, not_present
        return
    if shim.more_targets is not None and not shim_entry.expanded:
        _expand(registry, shim_entry)
    if target.when:
        ok, why_when = satisfies(registry.versions(), target.when)
        if not ok:
            entry.state, entry.reason = SKIPPED, f"target not used on this stack ({why_when})"
            return
    try:
        owner, name, raw = wrapping.resolve(module, target.qualname)
        if registry.pending_rebinds and any(e.original is raw for e in registry.pending_rebinds):
            # a by-name copy of a function armed in this batch: rebind first, as arming one at a
            # time would have, so this target is wrapped over that layer
            flush_rebinds(registry)
            owner, name, raw = wrapping.resolve(module, target.qualname)
    except wrapping.InheritedFromAnotherLibrary as exc:  # this release has no such method of its own
        entry.state, entry.reason = SKIPPED, f"target missing: {exc} (nothing of the library's to wrap)"
        return
    except AttributeError as exc:
        missing = f"target missing: {exc} (the library changed; shim not applied)"
        _not_applied(registry, entry, missing, applies, exc)
        return
    # the attribute itself, not what __wrapped__ claims: an override decorated with
    # functools.wraps(Base.m) need not call Base.m
    wrapped_already = next((t for t in shim_entry.targets if t is not entry and t.state == ACTIVE
                            and (raw is t.layer or (t.owner is owner and t.name == name))
                            and shim.wrapper_for(t.target) == shim.wrapper_for(target)), None)
    if wrapped_already is not None:  # Sub.m inherited from Base.m, both targets: one layer, one repair
        entry.state = SKIPPED
        entry.reason = f"the same attribute as {wrapped_already.target.key}, which this shim wraps already"
        return
    existing = wrapping.owned_original(raw)
    # a layer of this install (one whose repair failed too: it still holds the attribute and comes
    # off in turn) is wrapped over; one left by an earlier install is not: keep the first original
    live = any(t.layer is raw and t.state in (ACTIVE, FAILED) for t in registry.target_entries())
    if existing is not None and not live:
        raw = existing
    func = wrapping.callable_of(raw)
    if target.expect_params:
        try:
            params = set(inspect.signature(func).parameters)
        except (TypeError, ValueError):
            params = set()
        missing = [p for p in target.expect_params if p not in params]
        if missing:
            _not_applied(registry, entry, (
                f"signature drift: {target.key} has no parameter(s) {', '.join(missing)}; "
                "shim not applied"
            ), applies)
            return
    wrapper = wrapper_of(shim, target)
    deferred = _deferred_kind(wrapper)
    if deferred:
        raise RepairRefused(
            f"its repair {getattr(wrapper, '__qualname__', wrapper)!r} is {deferred}: the call would return "
            "before the repair's body runs, where no error in it can fall back to the library; a repair "
            "is a plain function that returns the call's result"
        )
    repair = bind_context(wrapper, shim_entry.context)
    guarded = guarded_call(registry, entry, repair)
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
        if registry.pending_rebinds is not None:
            registry.pending_rebinds.append(entry)
        else:
            entry.rebound = wrapping.rebind_aliases(raw, layer)
    entry.state = ACTIVE
    entry.reason = "forced outside its range" if not applies else why
    logger().info("%s active on %s (fixes %s)", shim.id, target.key, ", ".join(shim.fixes))


def displaced(entry: TargetEntry) -> Optional[str]:
    """Why the layer of ``entry`` (an active target) no longer runs when its target is called, or
    None while it does. ``importlib.reload`` of the target's module makes a new class or function
    without the layer, and an assignment over the attribute replaces it; the layer then only
    serves objects made before."""
    import sys

    from devmap_shims.shims import wrapping

    target = entry.target
    module = sys.modules.get(target.module)
    if module is None or entry.layer is None:
        return None  # nothing to compare with: the module left sys.modules
    try:
        current = wrapping.resolve(module, target.qualname)[2]
    except Exception as exc:
        current, gone = None, f"{type(exc).__name__}: {exc}"
    else:
        if wrapping.leads_to(current, entry.layer):
            return None
        gone = "its module was reloaded, or the attribute replaced"
    return (
        f"{target.key} no longer calls the layer of shim {entry.shim_entry.shim.id!r} ({gone}); "
        "the library runs unpatched there. Arm it again with devmap_shims.uninstall() then "
        "devmap_shims.install()."
    )


class LibraryChanged(LookupError):
    """A target of a shim whose bug applies here is gone or has other parameters (strict mode)."""


class RepairRefused(TypeError):
    """A repair the guard cannot cover (a generator or coroutine function)."""


def _not_applied(
    registry: Registry, entry: TargetEntry, reason: str, applies: bool, cause: Optional[BaseException] = None
) -> None:
    """``entry``'s target cannot take the repair (the library changed) though a row of its shim
    ``applies`` here: skipped with one warning, as that call runs unrepaired; strict mode raises
    instead (:func:`arm` makes it a :class:`ShimError`). A shim forced outside its rows' range is
    only skipped: an older release may well not have the target yet."""
    if not applies:
        entry.state, entry.reason = SKIPPED, reason
        return
    if registry.strict:
        raise LibraryChanged(reason) from cause
    entry.state, entry.reason = SKIPPED, reason
    shim = entry.shim_entry.shim
    registry.warn(
        f"shim {shim.id!r} is not applied to {entry.target.key}, which runs unrepaired: {reason} "
        f"(the shim fixes {', '.join(shim.fixes)}). A devmap-shims release that knows this library version "
        "may; `devmap-shims doctor` lists every target."
    )


def _deferred_kind(wrapper: Any) -> str:
    """What kind of function ``wrapper`` is when calling it does not run it (a generator, a
    coroutine or an async generator function), else ""."""
    import inspect

    for test, kind in ((inspect.isgeneratorfunction, "a generator function"),
                       (inspect.iscoroutinefunction, "a coroutine function (async def)"),
                       (inspect.isasyncgenfunction, "an async generator function")):
        if test(wrapper):
            return kind
    return ""


def wrapper_of(shim: Any, target: Any) -> Any:
    """The wrapper ``shim`` declares for ``target``, imported if it is a lazy reference."""
    return resolve_ref(shim.wrapper_for(target))


def _expand(registry: Registry, shim_entry: ShimEntry) -> None:
    """Add and watch the targets ``Shim.more_targets`` finds (once per install)."""
    shim_entry.expanded = True
    shim = shim_entry.shim
    try:
        more = list(resolve_ref(shim.more_targets)())
    except Exception as exc:
        registry.warn(
            f"shim {shim.id!r} could not list its further targets ({type(exc).__name__}: {exc}); "
            "its declared targets are still wrapped"
        )
        return
    known = {t.target.key for t in shim_entry.targets}
    added = [TargetEntry(shim_entry, t) for t in more if t.key not in known]
    shim_entry.targets.extend(added)
    _watch_entries(registry, added)


def watch(registry: Registry) -> None:
    """Register the post-import hooks of every selected target (arming those already imported)."""
    _watch_entries(registry, registry.target_entries())


def _watch_entries(registry: Registry, entries: List[TargetEntry]) -> None:
    def on_error(module_name: str, hook: Any, exc: BaseException) -> None:
        if isinstance(exc, ShimError):
            raise exc  # strict mode: the import fails with the shim's error
        registry.warn(f"post-import hook for {module_name} failed ({type(exc).__name__}: {exc}); import went on")

    # targets in modules already imported are armed right here; their by-name copies are rebound
    # in one pass at the end instead of one pass over sys.modules per target
    outermost = registry.pending_rebinds is None
    if outermost:
        registry.pending_rebinds = []
    try:
        for target_entry in entries:
            if target_entry.state != PENDING or target_entry.hook is not None:
                continue

            def hook(module: Any, _entry: TargetEntry = target_entry) -> None:
                arm(registry, _entry, module)

            target_entry.hook = hook
            importhook.when_imported(target_entry.target.module, hook, on_error)
    finally:
        if outermost:
            flush_rebinds(registry)
            registry.pending_rebinds = None


def flush_rebinds(registry: Registry) -> None:
    """Rebind the by-name copies of every layer armed since the batch began (one pass)."""
    from devmap_shims.shims import wrapping

    pending = [e for e in registry.pending_rebinds or () if e.layer is not None and e.state == ACTIVE]
    if registry.pending_rebinds:
        registry.pending_rebinds.clear()
    if not pending:
        return
    found = wrapping.rebind_many([(e.original, e.layer) for e in pending])
    for entry, rebound in zip(pending, found):
        entry.rebound = rebound


def unwatch_and_unwrap(registry: Registry) -> None:
    from devmap_shims.shims import wrapping

    removed: Dict[int, Tuple[Any, Any]] = {}  # module functions' layers: id -> (layer, original)
    for target_entry in sorted(registry.target_entries(), key=lambda t: -t.seq):  # outer layer first
        if target_entry.hook is not None:
            importhook.cancel(target_entry.hook)
        if target_entry.layer is None:
            continue
        outcome = wrapping.splice_out(
            target_entry.owner, target_entry.name, target_entry.layer, target_entry.original
        )
        if not isinstance(target_entry.owner, type):
            removed[id(target_entry.layer)] = (target_entry.layer, target_entry.original)
        # anything still holding the layer (a closure, a foreign wrapper) now reaches the original
        target_entry.enabled = False
        if outcome in ("buried", "absent"):
            # A foreign wrapper captured our layer (in a closure, or an object we cannot see
            # into), or the attribute was replaced: the layer may still be called, so it stays
            # in the call chain doing nothing (switched off above), and a new install wraps
            # whatever is there now.
            registry.warn(
                f"{target_entry.target.key}: devmap_shims' layer is no longer the attribute (a foreign "
                "wrapper holds it, or the attribute was replaced); it was switched off instead of removed"
            )
        wrapping.forget(target_entry.layer)
    # every by-name copy of a layer goes back to the original in one pass over sys.modules: those
    # rebound at arming and those made while it was on (a module imported since, such as
    # transformers copying accelerate's functions by name)
    wrapping.unbind_layers(removed)

