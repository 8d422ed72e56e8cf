"""The call-time guard around a shim's repair: fail open, never swallow the library's own errors.

When the repair itself raises, the shim is switched off, one warning names it, and the call goes
on as the library would run it: the original's result if it already ran, else a plain call of the
original. An error raised by the original always reaches the caller unchanged. In strict mode a
failing repair raises :class:`ShimError` instead.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, Tuple

from devmap_shims.shims.record import takes_context
from devmap_shims.shims.registry import (
    ACTIVE, FAILED, Registry, ShimContext, ShimEntry, ShimError, TargetEntry,
)


def bind_context(repair: Callable[..., Any], context: Any) -> Callable[..., Any]:
    """``repair`` with wrapt's four-argument signature: a :func:`with_context` wrapper gets
    ``context`` bound in front."""
    if takes_context(repair):

        def with_its_context(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
            return repair(context, wrapped, instance, args, kwargs)

        return with_its_context
    return repair


def guarded_call(registry: Registry, entry: TargetEntry, repair: Callable[..., Any]) -> Callable[..., Any]:
    """The function our layer calls: ``repair`` (wrapt's signature) behind the guard."""

    def guarded(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not entry.enabled or entry.state != ACTIVE:
            return wrapped(*args, **kwargs)
        call = _OriginalCall(wrapped)
        try:
            # the repair gets its own dict: one that edits it and then fails must not hand the
            # plain call its half-made arguments
            return repair(call, instance, args, dict(kwargs))
        except BaseException as exc:
            if call.raised is not None:  # the library's own error: always the library's
                if exc is call.raised:
                    raise
                raise call.raised from None
            if _not_the_repairs_fault(exc):
                raise
            _repair_failed(registry, entry.shim_entry, entry.target.key, exc)
            if call.called:
                return call.result
            return wrapped(*args, **kwargs)

    return guarded


#: Set on an exception raised by library code a repair ran for the user (:func:`library_call`).
LIBRARY_ERROR = "_devmap_shims_library_error"


def library_call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``func(*args, **kwargs)``, where ``func`` is library code a repair runs in place of the
    original, with the user's arguments (torch's own ``Module.cuda`` for a model the library
    would not move): what it raises is the user's error, as from a fixed release, and reaches
    the caller as it is; the shim stays on."""
    try:
        return func(*args, **kwargs)
    except Exception as exc:
        try:
            setattr(exc, LIBRARY_ERROR, True)
        except AttributeError:  # an exception type with __slots__: taken as the repair's own
            pass
        raise


def later_call(
    context: ShimContext, where: str, repair: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``repair(*args, **kwargs)`` for shim code that runs after the call it hooked has returned (a
    function the shim left on an object, as ``hooks-follow-moved-weights`` does on the ``to`` guard
    that ``dispatch_model`` puts on a model), under :func:`guarded_call`'s rule: if it raises, the
    shim is switched off with one warning naming ``where`` (:class:`ShimError` in strict mode) and
    None is returned. Nothing runs (None) once the shim is off: failed, switched off, or
    uninstalled (``context`` no longer the installed shim's)."""
    registry = context.registry
    shim_entry = registry.shims.get(context.shim_id) if registry is not None else None
    if registry is not None and (shim_entry is None or shim_entry.context is not context or not any(
        t.enabled and t.state == ACTIVE for t in shim_entry.targets
    )):
        return None
    try:
        return repair(*args, **kwargs)
    except BaseException as exc:
        if shim_entry is None or _not_the_repairs_fault(exc):
            raise  # no registry (a wrapper called directly), or not a broken repair
        _repair_failed(registry, shim_entry, where, exc, after_call=True)
        return None


def _not_the_repairs_fault(exc: BaseException) -> bool:
    """An error that goes to the caller as it is, the shim left on: anything that is not an
    ``Exception`` (an interrupt or exit, ``GeneratorExit``, ``asyncio.CancelledError``: control
    flow, not a fault), a :class:`ShimError` (a repair refusing on purpose, strict mode), the
    library's own answer to the user's call (:func:`library_call`), or no memory left
    (:func:`out_of_memory`)."""
    return (not isinstance(exc, Exception) or isinstance(exc, ShimError) or getattr(exc, LIBRARY_ERROR, False)
            or out_of_memory(exc))


def out_of_memory(exc: BaseException) -> bool:
    """``MemoryError``, or torch's ``OutOfMemoryError`` (for a GPU): the machine's limit, met by the
    work the user asked for, not a broken repair; it goes to the caller and the shim stays on."""
    return isinstance(exc, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__)


def _repair_failed(
    registry: Registry, shim_entry: ShimEntry, where: str, exc: BaseException, after_call: bool = False
) -> None:
    """Switch the shim off with one warning (strict mode: raise :class:`ShimError`); ``after_call``:
    the call had run when the shim's follow-up failed (:func:`later_call`), and what it did stands."""
    shim = shim_entry.shim
    shim_entry.call_failures += 1
    failed = (
        f"shim {shim.id!r} (fixes {', '.join(shim.fixes)}) failed inside {where}: "
        f"{type(exc).__name__}: {exc}."
    )
    strict = "Strict mode (DEVMAP_SHIMS_STRICT=1 or install(strict=True)) raises"
    if registry.strict:
        raise ShimError(
            f"{failed} {strict}; the call itself had run, and what it did stands." if after_call else
            f"{failed} {strict} instead of running the call without the repair."
        ) from exc
    went_on = "The call had run; what it did stands without the repair" if after_call else (
        "The call went on without the repair")
    message = f"{failed} {went_on} and this shim is now off; set DEVMAP_SHIMS_STRICT=1 to raise instead."
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
        self.raised = None  # a repair that caught an error and called again: that error was handled
        return self.result

    @property
    def __signature__(self) -> Any:
        # inspect.signature would otherwise read the forwarded __code__ and, for a bound method,
        # count its ``self``: a repair reading arguments by position would be off by one.
        import inspect

        return inspect.signature(self.wrapped)

    def __getattr__(self, name: str) -> Any:
        # Look like the original to the repair (inspect.signature, __wrapped__, __self__ ...).
        # Own slots are never delegated: tracers such as Dynamo probe them before __init__ ran.
        if name in _OriginalCall.__slots__:
            raise AttributeError(name)
        return getattr(self.wrapped, name)
