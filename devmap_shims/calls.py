"""A call's arguments by name, wherever the caller put them (by position or by keyword).

A wrapper receives ``(wrapped, instance, args, kwargs)``; ``argument(wrapped, "model", args,
kwargs)`` finds ``model`` whether the caller wrote ``f(m)`` or ``f(model=m)``. Signatures are read
once per function; ``inspect`` is imported on the first call, never at import time.

For callables without a Python signature (torch's C functions), :func:`argument_at` takes the
position and the keyword names directly.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Mapping, Sequence, Tuple

_POSITIONS: Dict[Any, Dict[str, int]] = {}
_SIGNATURES: Dict[Any, Any] = {}


def _key(func: Callable[..., Any]) -> Any:
    """A cache key that two callables share only when their signatures are the same: the code
    object of the function ``inspect.signature`` would read (decorators' ``__wrapped__`` followed,
    as it does; a ``__signature__`` of its own keys by the object itself) and whether it is bound
    (a bound method has no ``self`` parameter). None when there is no stable key (a
    ``functools.partial`` made per call): such signatures are not cached."""
    bound = getattr(func, "__self__", None) is not None
    inner = func
    for _ in range(16):
        if "__signature__" in getattr(inner, "__dict__", ()):
            return inner, bound
        wrapped = getattr(inner, "__wrapped__", None)
        if wrapped is None:
            break
        inner = wrapped
    code = getattr(inner, "__code__", None)
    return (code, bound) if code is not None else None


def argument_at(args: Sequence[Any], kwargs: Mapping[str, Any], position: int, *names: str) -> Any:
    """``args[position]`` if the caller passed that many positional arguments, else the first of
    ``names`` found in ``kwargs``, else None."""
    if len(args) > position:
        return args[position]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return None


def with_arguments_at(
    args: Sequence[Any], kwargs: Mapping[str, Any], names: Sequence[str], values: Sequence[Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The call's ``(args, kwargs)`` with its first arguments replaced, the inverse of
    :func:`argument_at`: ``values[i]`` at position ``i`` if the caller passed that many positional
    arguments, else as keyword ``names[i]`` (for callables without a signature, such as torch's
    builtins, where :func:`with_argument` cannot look one up)."""
    args = list(args)
    kwargs = dict(kwargs)
    for position, (name, value) in enumerate(zip(names, values)):
        if position < len(args):
            args[position] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def positions(func: Callable[..., Any]) -> Dict[str, int]:
    """Positional index of each parameter of ``func`` that can be passed by position."""
    key = _key(func)
    found = _POSITIONS.get(key) if key is not None else None
    if found is None:
        import inspect

        found = {}
        for index, param in enumerate(inspect.signature(func).parameters.values()):
            if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                found[param.name] = index
        if key is not None:
            _POSITIONS[key] = found
    return found


def argument(func: Callable[..., Any], name: str, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tuple[bool, Any]:
    """``(given, value)`` of parameter ``name`` in a call ``func(*args, **kwargs)``; ``(False, None)``
    when the caller left it to its default."""
    if name in kwargs:
        return True, kwargs[name]
    index = positions(func).get(name)
    if index is not None and index < len(args):
        return True, args[index]
    return False, None


def with_argument(
    func: Callable[..., Any], name: str, value: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``(args, kwargs)`` of the same call with parameter ``name`` set to ``value``, in the place the
    caller used for it (by keyword when the caller did not pass it)."""
    index = positions(func).get(name)
    if name not in kwargs and index is not None and index < len(args):
        return args[:index] + (value,) + args[index + 1 :], kwargs
    return args, dict(kwargs, **{name: value})


def bind(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """Every parameter of a call ``func(*args, **kwargs)`` by name, defaults filled in.

    Raises TypeError, as the call itself would, when the arguments do not fit the signature.
    """
    key = _key(func)
    sig = _SIGNATURES.get(key) if key is not None else None
    if sig is None:
        import inspect

        sig = inspect.signature(func)
        if key is not None:
            _SIGNATURES[key] = sig
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


__all__ = ["argument", "argument_at", "bind", "positions", "with_argument"]
