"""A model reduced to what placement needs: an ordered sequence of unsplittable units.

accelerate walks a model in module order (a module's own parameters, then its children, then its
own buffers) and splits a module into its children unless it is childless or its class is in the
no-split list. The same walk gives the *units* here: every unit must land on exactly one device,
and placing units in this order, contiguously, keeps activations flowing forward through the
dispatch hooks.

Tied weights (a tied ``lm_head`` sharing ``embed_tokens.weight``) must share a device. The later
units of a tied group *follow* the earliest one: they are removed from the sequence that gets
partitioned and are given their anchor's device, which is what accelerate's own placer does.

:func:`layout_from_module` reads an ``nn.Module`` by duck typing (``named_children`` &
co.), so this module imports no torch; :class:`Layout` can also be built from plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple


class Unit(NamedTuple):
    """A block placed whole: its module (or tensor) name and its bytes. A tuple, as a model of
    62,896 modules makes tens of thousands of them per map."""

    name: str
    size: int


@dataclass
class Layout:
    """Units in placement order, plus the module tree needed to write a compact device map.

    children:
        For every module that was split, its direct entries in walk order (full names). A name
        without an entry here is a unit.
    followers:
        Unit name -> the anchor unit whose device it shares (tied weights).
    """

    units: List[Unit]
    children: Dict[str, List[str]] = field(default_factory=dict)
    followers: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {u.name: i for i, u in enumerate(self.units)}
        #: the sequence that is partitioned: anchors carry their followers' bytes
        self.placed: List[Unit] = self.units
        if self.followers:
            merged = {u.name: u.size for u in self.units}
            for follower, anchor in self.followers.items():
                merged[anchor] += merged.pop(follower)
            self.placed = [Unit(u.name, merged[u.name]) for u in self.units if u.name in merged]
        self._total = sum(u.size for u in self.units)
        self._largest = max((u.size for u in self.placed), default=0)

    @property
    def total(self) -> int:
        return self._total

    @property
    def largest(self) -> int:
        """Largest unsplittable block, tied partners included (a lower bound on any GPU's load)."""
        return self._largest

    def unit_of(self, tensor_or_module: str) -> Optional[str]:
        """The unit holding a parameter / module name (itself, or its nearest enclosing unit)."""
        name = tensor_or_module
        while True:
            if name in self._index:
                return name
            if not name:
                return None
            name = name.rpartition(".")[0]

    # -- device maps -------------------------------------------------------------------------

    def unit_devices(self, device_map: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
        """Device of every unit under ``device_map`` (longest matching prefix), or None when the
        map places something finer than a unit (a split no-split block) or misses a unit."""
        out: Dict[str, Any] = {}
        missing = object()
        # a module's device, once looked up, serves its other units (256 experts share a layer)
        found: Dict[str, Any] = {}

        def device_of(name: str) -> Any:
            device = device_map.get(name, missing)
            if device is missing and name:
                parent = name.rpartition(".")[0]
                device = found.get(parent, missing)
                if device is missing:
                    device = found[parent] = device_of(parent)
            return device

        for unit in self.units:
            device = device_of(unit.name)
            if device is missing:
                return None
            out[unit.name] = device
        for key in device_map:
            probe = key.rpartition(".")[0] if key else ""
            while probe:
                if probe in self._index:
                    return None  # the map places part of a unit on its own
                probe = probe.rpartition(".")[0]
        return out

    def bytes_per_device(self, unit_devices: Mapping[str, Any]) -> Dict[Any, int]:
        out: Dict[Any, int] = {}
        for unit in self.units:
            device = unit_devices[unit.name]
            out[device] = out.get(device, 0) + unit.size
        return out

    def compact_map(self, unit_devices: Mapping[str, Any]) -> Dict[str, Any]:
        """Smallest device map giving every unit its device, in module order (like accelerate's
        ``clean_device_map``: a module whose units all share a device becomes one entry)."""

        def walk(name: str) -> List[Tuple[str, Any]]:
            kids = self.children.get(name)
            if kids is None:
                return [(name, unit_devices[name])]
            entries: List[Tuple[str, Any]] = []
            for kid in kids:
                entries.extend(walk(kid))
            if not entries:
                return entries
            first = entries[0][1]
            kind = type(first)
            for _, device in entries:
                if type(device) is not kind or device != first:  # 0 and False, 1 and "1" differ
                    return entries
            return [(name, first)]

        return dict(walk(""))

    def unit_map(self, unit_devices: Mapping[str, Any]) -> Dict[str, Any]:
        """Uncompacted map: one entry per unit (accelerate's ``clean_result=False``)."""
        return {u.name: unit_devices[u.name] for u in self.units}


def build_layout(
    entries: Sequence[Tuple[str, int]],
    children: Optional[Dict[str, List[str]]] = None,
    tied_groups: Iterable[Iterable[str]] = (),
) -> Layout:
    """Layout from plain data: ``entries`` are (unit name, bytes) in placement order."""
    units = [Unit(n, int(s)) for n, s in entries]
    if children is None:
        children = {"": [u.name for u in units]}
    layout = Layout(units, children)
    return _with_ties(layout, tied_groups)


def _with_ties(layout: Layout, tied_groups: Iterable[Iterable[str]]) -> Layout:
    parent: Dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    order = {u.name: i for i, u in enumerate(layout.units)}
    for group in tied_groups:
        owners = sorted({o for o in (layout.unit_of(p) for p in group if p) if o is not None}, key=order.get)
        for other in owners[1:]:
            a, b = find(owners[0]), find(other)
            if a != b:
                first, second = (a, b) if order[a] < order[b] else (b, a)
                parent[second] = first
    followers = {name: find(name) for name in parent if find(name) != name}
    if not followers:
        return layout
    return Layout(layout.units, layout.children, followers)


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
        for name, obj in group:
            if obj is None or id(obj) in objects or name in seen:
                continue
            objects.add(id(obj))
            seen.add(name)
            out.append((f"{prefix}.{name}" if prefix else name, obj))
    return out


def _own(module: Any) -> Optional[Tuple[Any, Any, Any]]:
    """The ``_parameters``, ``_modules`` and ``_buffers`` items of a torch module (what its
    ``named_*(recurse=False)`` iterate, without the generator machinery), or None."""
    namespace = getattr(module, "__dict__", None)
    if not namespace:
        return None
    params, children, buffers = namespace.get("_parameters"), namespace.get("_modules"), namespace.get("_buffers")
    if type(params) is not dict or type(children) is not dict or type(buffers) is not dict:
        return None
    return params.items(), children.items(), buffers.items()


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
    """
    no_split = set(no_split_classes or ())
    children: Dict[str, List[str]] = {}
    units: List[Unit] = []

    def is_splittable(obj: Any) -> bool:
        if type(obj).__name__ in no_split:
            return False
        children = getattr(obj, "__dict__", {}).get("_modules")
        if type(children) is dict:  # a torch module
            return any(child is not None for child in children.values()) if children else False
        named_children = getattr(obj, "named_children", None)
        return named_children is not None and next(iter(named_children()), None) is not None

    if not is_splittable(model):
        return Layout([Unit("", int(module_sizes.get("", 0)))])
    names: List[str] = []
    add = names.append

    def visit(name: str, obj: Any) -> None:  # pre-order; depth is the module tree's (a handful)
        kids = _module_entries(obj, name)
        children[name] = [k for k, _ in kids]
        for kid, sub in kids:
            if is_splittable(sub):
                visit(kid, sub)
            else:
                add(kid)

    visit("", model)
    get = module_sizes.get
    for name in names:
        size = get(name, 0)
        units.append(Unit(name, size if type(size) is int else int(round(size))))
    return _with_ties(Layout(units, children), tied_groups)
