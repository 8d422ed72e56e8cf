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

_POSITIONS: Dict[Any, Tuple[Dict[str, int], Any]] = {}
_SIGNATURES: Dict[Any, Tuple[Any, Any, Any]] = {}


def _key(func: Callable[..., Any]) -> Any:
    """A cache key that two callables share only when their signatures are the same: the code
    object of the function ``inspect.signature`` would read (decorators' ``__wrapped__`` followed,
    as it does; a ``__signature__`` of its own keys by the object itself) and whether it is bound
    (a bound method has no ``self`` parameter; a wrapper such as accelerate's hooked ``forward``,
    ``update_wrapper(partial(new_forward, module), module.forward)``, is bound when what it wraps
    is). None when there is no stable key (a ``functools.partial`` made per call): such signatures
    are not cached. Defaults are not in the key (:func:`bind` checks them)."""
    return _unwrapped(func)[0]


def _unwrapped(func: Callable[..., Any]) -> Tuple[Any, Any]:
    """``(key, inner)``: :func:`_key`, and the object at the end of the ``__wrapped__`` chain, whose
    ``__defaults__`` a call of ``func`` uses (closures made by one factory share a code object, and
    so a key, with defaults of their own)."""
    bound = False
    inner = func
    for _ in range(16):
        bound = bound or getattr(inner, "__self__", None) is not None
        if "__signature__" in getattr(inner, "__dict__", ()):
            return (inner, bound), inner
        wrapped = getattr(inner, "__wrapped__", None)
        if wrapped is None:
            break
        inner = wrapped
    code = getattr(inner, "__code__", None)
    return ((code, bound) if code is not None else None), inner


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
    return _positions(func)[0]


def _positions(func: Callable[..., Any]) -> Tuple[Dict[str, int], Any]:
    """:func:`positions`, and the names of the positional-only parameters among them (a keyword of
    that name is not them: it goes to ``**kwargs``)."""
    key = _key(func)
    found = _POSITIONS.get(key) if key is not None else None
    if found is None:
        import inspect

        indices: Dict[str, int] = {}
        only = set()
        for index, param in enumerate(inspect.signature(func).parameters.values()):
            if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                indices[param.name] = index
            if param.kind == param.POSITIONAL_ONLY:
                only.add(param.name)
        found = indices, frozenset(only)
        if key is not None:
            _POSITIONS[key] = found
    return found


def argument(func: Callable[..., Any], name: str, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tuple[bool, Any]:
    """``(given, value)`` of parameter ``name`` in a call ``func(*args, **kwargs)``; ``(False, None)``
    when the caller left it to its default."""
    indices, only = _positions(func)
    if name in kwargs and name not in only:
        return True, kwargs[name]
    index = indices.get(name)
    if index is not None and index < len(args):
        return True, args[index]
    return False, None


def with_argument(
    func: Callable[..., Any], name: str, value: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``(args, kwargs)`` of the same call with parameter ``name`` set to ``value``, in the place the
    caller used for it (by keyword when the caller did not pass it; by position, after the defaults
    of the parameters before it, for a positional-only one)."""
    indices, only = _positions(func)
    index = indices.get(name)
    if index is not None and index < len(args) and (name in only or name not in kwargs):
        return args[:index] + (value,) + args[index + 1 :], kwargs
    if name in only and index is not None:
        import inspect

        params = list(inspect.signature(func).parameters.values())
        filler = tuple(p.default for p in params[len(args):index])
        if any(default is inspect.Parameter.empty for default in filler):
            raise TypeError(f"{name!r} is positional-only and the parameters before it have no defaults")
        return tuple(args) + filler + (value,), kwargs
    return args, dict(kwargs, **{name: value})


def _same_items(copy: Any, current: Any) -> bool:
    """Does dict ``current`` hold the very objects ``copy`` does, under the same keys (or are
    both None)?"""
    if copy is None or current is None:
        return copy is current
    if len(copy) != len(current):
        return False
    return all(name in current and current[name] is value for name, value in copy.items())


def bind(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """Every parameter of a call ``func(*args, **kwargs)`` by name, defaults filled in.

    Raises TypeError, as the call itself would, when the arguments do not fit the signature.
    """
    key, inner = _unwrapped(func)
    # __defaults__ is a tuple, replaced whole; __kwdefaults__ a dict that can change in place, so
    # the cache keeps a copy of it and compares its values by identity (== could be a tensor's)
    defaults, kwdefaults = getattr(inner, "__defaults__", None), getattr(inner, "__kwdefaults__", None)
    cached = _SIGNATURES.get(key) if key is not None else None
    if cached is not None and cached[1] is defaults and _same_items(cached[2], kwdefaults):
        sig = cached[0]
    else:  # not read yet, or another closure of the same code, or defaults set since
        import inspect

        sig = inspect.signature(func)
        if key is not None:
            _SIGNATURES[key] = (sig, defaults, dict(kwdefaults) if kwdefaults is not None else None)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


__all__ = ["argument", "argument_at", "bind", "positions", "with_argument"]
