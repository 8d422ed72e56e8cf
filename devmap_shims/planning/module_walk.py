"""The walk that turns a model into a :class:`~devmap_shims.planning.layout.Layout`, module by
module the way accelerate's placer walks it: a module's own parameters, then its children, then
its own buffers; a child is split unless it is childless or its class is in the no-split list.

Torch modules are read through their ``_parameters`` / ``_modules`` / ``_buffers`` dicts (what
``named_*(recurse=False)`` iterate, without the generator machinery), any other object through its
``named_*`` methods (duck typing), so this module imports no torch.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from devmap_shims.planning.layout import Layout, with_ties


def _module_entries(module: Any, prefix: str) -> List[Tuple[str, Any]]:
    """``module``'s own parameters, children and own buffers, in that order, full names; each
    object once (a second name for the same tensor or module is dropped, as torch's ``named_*``
    drop it), each name once."""
    own = _own(module)
    seen = set()
    out = []
    if own is None:  # not a torch module: its named_* methods say what it holds, once each
        for group in (module.named_parameters(recurse=False), module.named_children(),
                      module.named_buffers(recurse=False)):
            for name, obj in group:
                if name not in seen:
                    seen.add(name)
                    out.append((f"{prefix}.{name}" if prefix else name, obj))
        return out
    for group in own:
        objects = set()
        for name, obj in group.items():
            if obj is None or id(obj) in objects or name in seen:
                continue
            objects.add(id(obj))
            seen.add(name)
            out.append((f"{prefix}.{name}" if prefix else name, obj))
    return out


def _own(module: Any) -> Optional[Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]]:
    """The ``_parameters``, ``_modules`` and ``_buffers`` of a torch module (what its
    ``named_*(recurse=False)`` iterate, without the generator machinery), or None."""
    namespace = getattr(module, "__dict__", None)
    if not namespace:
        return None
    params, children, buffers = namespace.get("_parameters"), namespace.get("_modules"), namespace.get("_buffers")
    if type(params) is not dict or type(children) is not dict or type(buffers) is not dict:
        return None
    return params, children, buffers


def layout_from_module(
    model: Any,
    module_sizes: Mapping[str, float],
    no_split_classes: Iterable[str] = (),
    tied_groups: Iterable[Iterable[str]] = (),
) -> Layout:
    """Walk ``model`` the way accelerate's placer does.

    module_sizes:
        Bytes per module / tensor name, as computed by the installed stack (accelerate's or
        transformers' ``compute_module_sizes``, which already know the target dtype, the
        quantizer and ``special_dtypes``). Names absent from it count 0 bytes (tied duplicates).

    A model whose every Linear is a block has tens of thousands of units, so the walk over torch
    modules reads their ``_parameters`` / ``_modules`` / ``_buffers`` directly and decides whether
    a child is split where it meets it; other objects go through their ``named_*`` methods.
    """
    no_split = frozenset(no_split_classes or ())
    children: Dict[str, Sequence[str]] = {}
    spans: Dict[str, Tuple[int, int]] = {}
    names: List[str] = []
    add = names.append

    def is_splittable(obj: Any) -> bool:
        if type(obj).__name__ in no_split:
            return False
        try:
            kids = obj.__dict__.get("_modules")
        except AttributeError:
            kids = None
        if type(kids) is dict:  # a torch module: split unless childless
            return bool(kids) and (None not in kids.values() or any(c is not None for c in kids.values()))
        named_children = getattr(obj, "named_children", None)
        return named_children is not None and next(iter(named_children()), None) is not None

    if not is_splittable(model):
        return Layout.of([""], [int(module_sizes.get("", 0))], spans={})

    def visit(name: str, obj: Any) -> None:  # pre-order; depth is the module tree's (a handful)
        start = len(names)
        own = _own(obj)
        if own is None:
            kids = _module_entries(obj, name)
            children[name] = tuple(k for k, _ in kids)
            for kid, sub in kids:
                if is_splittable(sub):
                    visit(kid, sub)
                else:
                    add(kid)
            spans[name] = (start, len(names))
            return
        params, modules, buffers = own
        dot = name + "." if name else ""
        entries: List[str] = []
        taken: Any = _tensor_entries(params, dot, (), entries, add) if params else ()
        if modules:
            record = entries.append
            track = bool(buffers)  # the children's names matter only to the buffers that follow
            if track:
                taken = set(taken)
            for key, sub in _once(modules, taken):
                if track:
                    taken.add(key)
                kid = dot + key
                record(kid)
                if is_splittable(sub):
                    visit(kid, sub)
                else:
                    add(kid)
        if buffers:
            _tensor_entries(buffers, dot, taken, entries, add)
        children[name] = tuple(entries)  # a tuple of strings: no object for the collector to follow
        spans[name] = (start, len(names))

    visit("", model)
    sizes = list(map(module_sizes.get, names, repeat(0)))
    if any(type(s) is not int for s in sizes):
        sizes = list(map(int, map(round, sizes)))
    return with_ties(Layout.of(names, sizes, children, spans=spans), tied_groups)


def _once(entries: Dict[str, Any], taken: Any) -> Iterable[Tuple[str, Any]]:
    """``entries``' items as torch's ``named_*`` yield them: no None, each object under its first
    name only; and no name in ``taken``. The usual dict, with none of these, is returned as it is."""
    ids = set(map(id, entries.values()))  # ids, not values: a tensor compared with None dispatches
    if len(ids) == len(entries) and id(None) not in ids and not (taken and not taken.isdisjoint(entries)):
        return entries.items()
    objects = set()
    out = []
    for key, obj in entries.items():
        if obj is None or key in taken or id(obj) in objects:
            continue
        objects.add(id(obj))
        out.append((key, obj))
    return out


def _tensor_entries(tensors: Dict[str, Any], dot: str, taken: Any, entries: List[str], add: Any) -> Any:
    """A module's own parameters or buffers, each a unit: each tensor once, each name once (not
    one in ``taken``); returns the names taken, these included."""
    taken = set(taken)
    for key, _tensor in _once(tensors, taken):
        taken.add(key)
        kid = dot + key
        entries.append(kid)
        add(kid)
    return taken
