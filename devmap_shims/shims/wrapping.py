"""Putting a wrapper on a target, finding it again, and taking only our layer off.

Two kinds of wrapper:

* a wrapt ``FunctionWrapper`` subclass, :class:`DevmapFunctionWrapper`, for targets that run in
  plain Python (``infer_auto_device_map``, ``generate``, ``DiffusionPipeline.to``). It keeps the
  original's signature, docstring and descriptor behaviour.
* a plain ``functools.wraps`` function for targets reachable from ``torch.compile``d code
  (``Params4bit.to``): Dynamo traces the original ``__code__`` of a wrapt proxy and silently skips
  the wrapper, or crashes on its guards when the original has defaults.

Ownership is decided by type (wrapt) or identity (plain functions), never by ``__wrapped__``:
``GenerationMixin.generate`` already has a ``__wrapped__`` from ``torch.no_grad()``, and a marker
attribute on our proxy is visible through a foreign proxy stacked on top of it.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType
TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

    GuardedCall = Callable[[Callable[..., Any], Any, Tuple[Any, ...], Dict[str, Any]], Any]

_wrapper_type: Optional[type] = None


def devmap_wrapper_type() -> type:
    """The wrapt ``FunctionWrapper`` subclass that marks our layer (wrapt is imported on first use)."""
    global _wrapper_type
    if _wrapper_type is None:
        import wrapt

        class DevmapBoundFunctionWrapper(wrapt.BoundFunctionWrapper):  # type: ignore[misc, name-defined]
            """Our layer as read from an instance or a class (``model.generate``, ``Model.from_pretrained``)."""

            def __reduce_ex__(self, protocol: int) -> Any:
                # As the original's bound (or plain) function pickles: by reference, getattr(owner, name).
                if self._self_instance is not None:
                    return getattr, (self._self_instance, self.__wrapped__.__name__)
                wrapped = self.__wrapped__
                owner = getattr(self, "_self_owner", None)  # wrapt >= 2.0 keeps the class it was read from
                if owner is None:  # wrapt 1.x: the class that defines it, found as pickle finds a function
                    owner = _owner_of(sys.modules[wrapped.__module__], wrapped.__qualname__)
                return getattr, (owner, wrapped.__name__)

            @property
            def __func__(self) -> Any:
                # As a bound method's: the function the class holds, our layer included. accelerate's
                # prepare_model (mixed precision) rebinds MethodType(autocast(model.forward.__func__),
                # model), and peft does the same with forward and generate; the wrapped original's
                # __func__ would leave the repair out of every later call. Read from the class, the
                # layer takes the instance from the call's first argument, as for Class.method(obj).
                func = self.__wrapped__.__func__  # AttributeError where the original has none
                if self._self_binding == "function" and self._self_instance is not None:
                    return self._self_parent.__get__(None, type(self._self_instance))
                return func

            def __copy__(self) -> Any:
                return self

            def __deepcopy__(self, memo: Any) -> Any:
                # As a bound method deep-copies: bound to the copy of its instance (a
                # functools.partial(model.generate) copied with the model calls the copy).
                if self._self_instance is None or isinstance(self._self_instance, type):
                    return self
                import copy

                return getattr(copy.deepcopy(self._self_instance, memo), self.__wrapped__.__name__)

        class DevmapFunctionWrapper(wrapt.FunctionWrapper):  # type: ignore[misc, name-defined]
            """A devmap_shims layer. Recognised by ``type(x) is DevmapFunctionWrapper``."""

            __bound_function_wrapper__ = DevmapBoundFunctionWrapper

            def __copy__(self) -> Any:
                return self

            def __deepcopy__(self, memo: Any) -> Any:
                return self  # functions are copied as themselves

            def __reduce_ex__(self, protocol: int) -> Any:
                # Pickle by reference, as the original function would be: the module attribute
                # (this layer here, the plain original in a process without devmap_shims).
                wrapped = self.__wrapped__
                name = getattr(wrapped, "__qualname__", None)
                if name and callable(wrapped):
                    return name
                return wrapped.__reduce_ex__(protocol)

        _wrapper_type = DevmapFunctionWrapper
    return _wrapper_type


class InheritedFromAnotherLibrary(AttributeError):
    """The target is a method this release of the library does not define, only inherits from
    another library's class (torch's ``Module.cuda`` as transformers 4.27's
    ``PreTrainedModel.cuda``): nothing of this library's to wrap, and nothing missing."""


def resolve(module: ModuleType, qualname: str) -> Tuple[Any, str, Any]:
    """``(owner, attribute name, raw attribute)`` for ``qualname`` inside ``module``.

    Class attributes are read from ``vars()`` along the MRO so that descriptors (staticmethod,
    classmethod, functions) are seen unbound. Raises AttributeError naming what is missing.
    """
    owner = _owner_of(module, qualname)
    name = qualname.rpartition(".")[2]
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                if klass is not owner:
                    # Inherited: wrap where it is defined, so every subclass sees the fix; but never
                    # in another library (diffusers 0.27's ModelMixin.to is torch.nn.Module.to).
                    if _top(klass.__module__) != _top(module.__name__):
                        raise InheritedFromAnotherLibrary(
                            f"{module.__name__}.{qualname} is inherited from {klass.__module__}."
                            f"{klass.__qualname__} in this release"
                        )
                    owner = klass
                return owner, name, vars(klass)[name]
        raise AttributeError(f"{module.__name__}.{qualname} does not exist")
    if name not in vars(owner):
        raise AttributeError(f"{module.__name__}.{qualname} does not exist")
    return owner, name, vars(owner)[name]


def _owner_of(module: ModuleType, qualname: str) -> Any:
    """What holds ``qualname``'s last part: ``module`` itself, or the class the dotted name reaches."""
    owner: Any = module
    for part in qualname.split(".")[:-1]:
        owner = getattr(owner, part)
    return owner


def _top(module_name: str) -> str:
    return (module_name or "").partition(".")[0]


def callable_of(raw: Any) -> Any:
    """The function behind a raw attribute (unwraps staticmethod/classmethod)."""
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def make_proxy(raw: Any, guarded: GuardedCall) -> Any:
    """A wrapt layer around ``raw`` (function, method, staticmethod or classmethod)."""
    return devmap_wrapper_type()(raw, guarded)


def make_plain(raw: Any, guarded: GuardedCall, owner: Any) -> Any:
    """A ``functools.wraps`` replacement for ``raw`` that Dynamo can trace."""
    func = callable_of(raw)
    if isinstance(raw, staticmethod) or not isinstance(owner, type):

        @functools.wraps(func)
        def plain_function(*args: Any, **kwargs: Any) -> Any:
            return guarded(func, None, args, kwargs)

        return staticmethod(plain_function) if isinstance(raw, staticmethod) else plain_function

    if isinstance(raw, classmethod):

        @functools.wraps(func)
        def plain_classmethod(cls: Any, *args: Any, **kwargs: Any) -> Any:
            return guarded(functools.partial(func, cls), cls, args, kwargs)

        return classmethod(plain_classmethod)

    # functools.partial rather than func.__get__: Dynamo (torch 2.6) cannot trace descriptor calls
    @functools.wraps(func)
    def plain_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return guarded(functools.partial(func, self), self, args, kwargs)

    return plain_method


_OURS: dict = {}


def remember(layer: Any, original: Any) -> None:
    """Record ``layer`` as ours, wrapping ``original``."""
    _OURS[id(layer)] = (layer, original)


def forget(layer: Any) -> None:
    _OURS.pop(id(layer), None)


def owned_original(obj: Any) -> Any:
    """The original behind ``obj`` if ``obj`` is one of our layers, else None."""
    record = _OURS.get(id(obj))
    if record is not None and record[0] is obj:
        return record[1]
    return None


def is_ours(obj: Any) -> bool:
    return owned_original(obj) is not None


def layers_in_place() -> int:
    """How many of our layers exist (0 after a complete ``uninstall``)."""
    return len(_OURS)


def splice_out(owner: Any, name: str, layer: Any, original: Any) -> str:
    """Remove our ``layer`` from the attribute ``owner.name``, leaving foreign layers in place.

    Returns ``"removed"`` (we were on top, original restored), ``"spliced"`` (a foreign wrapt layer
    on top now wraps the original directly), ``"absent"`` (our layer is no longer there) or
    ``"buried"`` (a foreign non-wrapt layer holds ours in a closure: it cannot be taken out, so the
    caller leaves it switched off).
    """
    current = vars(owner).get(name) if isinstance(owner, type) or isinstance(owner, ModuleType) else getattr(
        owner, name, None
    )
    if current is layer:
        setattr(owner, name, original)
        return "removed"
    outer = current
    for inner in _layers_below(current):
        if inner is layer:
            if _is_wrapt_proxy(outer):
                outer.__wrapped__ = original
                return "spliced"
            return "buried"
        outer = inner
    return "absent"


def leads_to(current: Any, layer: Any) -> bool:
    """Whether a call through ``current`` (an attribute's raw value) reaches ``layer``: it is
    ``layer``, or a wrapper above it that says so through ``__wrapped__`` (wrapt, functools.wraps),
    also where that wrapper was made over the layer as read from the class (``Cls.m =
    deco(Cls.m)``: wrapt's bound layer names it as its parent, a bound method has it as ``__func__``)."""
    wanted = callable_of(layer)  # a staticmethod's or classmethod's function, else the layer
    for obj in (current, *_layers_below(current)):
        if obj is layer or obj is wanted:
            return True
        try:  # a staticmethod, classmethod or bound method holds it as __func__
            if getattr(obj, "_self_parent", None) is layer or getattr(obj, "__func__", None) is wanted:
                return True
        except Exception:  # an attribute that raises on a foreign object: it is not ours
            continue
    return False


def _layers_below(obj: Any) -> List[Any]:
    """What ``obj`` wraps, outermost first, through ``__wrapped__`` (at most 64 deep)."""
    below: List[Any] = []
    inner = _inner_of(obj)
    while inner is not None and len(below) < 64:
        below.append(inner)
        inner = _inner_of(inner)
    return below


def _inner_of(obj: Any) -> Any:
    try:
        inner = obj.__wrapped__
    except Exception:
        inner = None
    if inner is None and isinstance(obj, (staticmethod, classmethod)):
        inner = obj.__func__
    return inner


def _is_wrapt_proxy(obj: Any) -> bool:
    wrapt = sys.modules.get("wrapt")
    if wrapt is None:
        return False
    base = getattr(wrapt, "BaseObjectProxy", None) or getattr(wrapt, "ObjectProxy")
    return isinstance(obj, base)


def rebind_aliases(original: Any, replacement: Any, skip_prefixes: Tuple[str, ...] = ("devmap_shims",)) -> List[Tuple[str, str]]:
    """Point every by-name copy of ``original`` in ``sys.modules`` at ``replacement``.

    ``from accelerate.utils import infer_auto_device_map`` made before the wrapper existed leaves a
    copy of the original in the importing module; this finds such copies by identity (reading
    ``__dict__`` so lazy modules' ``__getattr__`` is never triggered) and returns
    ``[(module name, attribute)]`` (what ``status()`` reports as rebound).
    """
    return rebind_many([(original, replacement)], skip_prefixes)[0]


def rebind_many(
    pairs: List[Tuple[Any, Any]], skip_prefixes: Tuple[str, ...] = ("devmap_shims",)
) -> List[List[Tuple[str, str]]]:
    """:func:`rebind_aliases` for several ``(original, replacement)`` pairs in one pass over
    ``sys.modules`` (a pass reads every module's namespace: with torch and transformers imported,
    thousands of modules). A replacement that is the original of a later pair (a second layer on
    the same function) is followed to the last, as separate passes in that order would. Returns,
    per pair, the ``(module name, attribute)`` copies it rebound."""
    index = {id(original): k for k, (original, _) in enumerate(pairs)}
    rebound: List[List[Tuple[str, str]]] = [[] for _ in pairs]
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name.startswith(skip_prefixes):
            continue
        try:
            namespace = module.__dict__
        except Exception:
            continue
        try:
            hits = [(key, value) for key, value in list(namespace.items()) if id(value) in index]
        except Exception:
            continue
        for key, value in hits:
            k = index[id(value)]
            if pairs[k][0] is not value:
                continue
            chain = []
            while True:
                chain.append(k)
                value = pairs[k][1]
                later = index.get(id(value))
                if later is None or later <= k or pairs[later][0] is not value:
                    break
                k = later
            if not _assign(namespace, key, value):
                continue
            for k in chain:
                rebound[k].append((mod_name, key))
    return rebound


def _assign(namespace: Any, key: str, value: Any) -> bool:
    """``namespace[key] = value``; False for a namespace that refuses it (the ``mappingproxy`` of a
    class placed in ``sys.modules``), which keeps what it holds."""
    try:
        namespace[key] = value
    except Exception:
        return False
    return True


def unbind_layers(removed: Dict[int, Tuple[Any, Any]]) -> None:
    """Point every by-name copy of a removed layer in ``sys.modules`` at what that layer wrapped
    (``removed``: ``id(layer) -> (layer, original)``; an original that is itself a removed layer,
    two shims on one function, is followed to the end)."""
    if not removed:
        return
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name.startswith("devmap_shims"):
            continue
        try:
            namespace = module.__dict__
            hits = [(key, value) for key, value in list(namespace.items()) if id(value) in removed]
        except Exception:
            continue
        for key, value in hits:
            while id(value) in removed and removed[id(value)][0] is value:
                value = removed[id(value)][1]
            _assign(namespace, key, value)
