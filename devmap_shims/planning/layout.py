"""A model reduced to what placement needs: an ordered sequence of unsplittable units.

accelerate walks a model in module order (a module's own parameters, then its children, then its
own buffers) and splits a module into its children unless it is childless or its class is in the
no-split list. The same walk gives the *units* here: every unit must land on exactly one device,
and placing units in this order, contiguously, keeps activations flowing forward through the
dispatch hooks.

Tied weights (a tied ``lm_head`` sharing ``embed_tokens.weight``) must share a device. The later
units of a tied group *follow* the earliest one: they are removed from the sequence that gets
partitioned and are given their anchor's device, which is what accelerate's own placer does.

:func:`~devmap_shims.planning.module_walk.layout_from_module` builds a :class:`Layout` from an
``nn.Module``; :func:`build_layout` builds one from plain data. Nothing here imports torch.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import compress, count, groupby
from operator import itemgetter, ne
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

_NAME, _SIZE = itemgetter(0), itemgetter(1)  # of a Unit, at C speed
_NOT_IN_TREE = object()


def _same_device(device: Any, other: Any, kind: type) -> bool:
    """``device == other`` where ``kind`` is ``type(other)``: 0 and False, 1 and "1" differ."""
    return type(device) is kind and device == other


class Unit(NamedTuple):
    """A block placed whole: its module (or tensor) name and its bytes."""

    name: str
    size: int


class Layout:
    """Units in placement order, plus the module tree needed to write a compact device map.

    names, sizes:
        The units' names and bytes, in placement order (:attr:`units` pairs them as
        :class:`Unit`). Two flat lists rather than a tuple per unit: a model whose every Linear is
        a block has tens of thousands of units, and objects that outlive a garbage collection of
        the young generation are what brings on a full one over the whole model (over a second
        at 79,246 modules); a list of strings or integers is one such object, a tuple subclass
        per unit is one each.
    children:
        For every module that was split, its direct entries in walk order (full names). A name
        without an entry here is a unit.
    followers:
        Unit name -> the anchor unit whose device it shares (tied weights).
    placed_names, placed_sizes:
        The sequence that is partitioned: the units without followers, anchors carrying their
        followers' bytes.
    """

    def __init__(
        self,
        units: Iterable[Tuple[str, int]] = (),
        children: Optional[Dict[str, Sequence[str]]] = None,
        followers: Optional[Dict[str, str]] = None,
    ) -> None:
        pairs = list(units)
        self._set(list(map(_NAME, pairs)), list(map(_SIZE, pairs)), children, followers, None)

    @classmethod
    def of(
        cls,
        names: List[str],
        sizes: List[int],
        children: Optional[Dict[str, Sequence[str]]] = None,
        followers: Optional[Dict[str, str]] = None,
        spans: Optional[Dict[str, Tuple[int, int]]] = None,
    ) -> "Layout":
        """A layout of units given as two parallel lists (kept, not copied). ``spans``: for every
        split module, the range of unit indexes under it (what :func:`layout_from_module` walks)."""
        layout = cls.__new__(cls)
        layout._set(names, sizes, children, followers, spans)
        return layout

    def _set(
        self, names: List[str], sizes: List[int], children: Optional[Dict[str, Sequence[str]]],
        followers: Optional[Dict[str, str]], spans: Optional[Dict[str, Tuple[int, int]]],
    ) -> None:
        self.names, self.sizes = names, sizes
        self.spans = spans
        self.children: Dict[str, Sequence[str]] = children if children is not None else {}
        self.followers: Dict[str, str] = followers if followers is not None else {}
        self._index = dict(zip(names, range(len(names))))
        self.placed_names, self.placed_sizes = names, sizes
        if self.followers:
            merged = dict(zip(names, sizes))
            for follower, anchor in self.followers.items():
                merged[anchor] += merged.pop(follower)
            self.placed_names = [n for n in names if n in merged]
            self.placed_sizes = [merged[n] for n in self.placed_names]
        self._total = sum(sizes)
        self._largest = max(self.placed_sizes, default=0)

    @property
    def units(self) -> List[Unit]:
        """Every unit in placement order (built on each call)."""
        return list(map(Unit._make, zip(self.names, self.sizes)))

    @property
    def placed(self) -> List[Unit]:
        """The partitioned sequence as units (built on each call)."""
        return list(map(Unit._make, zip(self.placed_names, self.placed_sizes)))

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
        if self.spans is not None:
            by_tree = self._unit_devices_by_spans(device_map)
            if by_tree is not _NOT_IN_TREE:
                return by_tree
        missing = object()
        get = device_map.get
        # a module's device, once looked up, serves its other units (256 experts share a layer)
        found: Dict[str, Any] = {}
        look = found.get

        def device_of(name: str) -> Any:
            device = get(name, missing)
            if device is missing and name:
                parent = name.rpartition(".")[0]
                device = look(parent, missing)
                if device is missing:
                    device = found[parent] = device_of(parent)
            return device

        devices = list(map(device_of, self.names))
        if missing in devices:
            return None
        for key in device_map:
            probe = key.rpartition(".")[0] if key else ""
            while probe:
                if probe in self._index:
                    return None  # the map places part of a unit on its own
                probe = probe.rpartition(".")[0]
        return dict(zip(self.names, devices))

    def _unit_devices_by_spans(self, device_map: Mapping[str, Any]) -> Any:
        """:meth:`unit_devices` down the module tree: a module the map names and no map entry lies
        below gives its whole span of units its device at once. :data:`_NOT_IN_TREE` when the map
        names something that is not a module or unit of the walk."""
        index, children = self._index, self.children
        inner = set()  # modules with a map entry somewhere below them
        for key in device_map:
            if key not in index and key not in children:
                return _NOT_IN_TREE  # a name the walk did not meet: matched by prefix instead
            probe = key
            while probe:
                probe = probe.rpartition(".")[0]
                if probe in index:
                    return None  # the map places part of a unit on its own
                if probe in inner:
                    break
                if probe not in children:
                    return _NOT_IN_TREE
                inner.add(probe)
        missing = object()
        get, spans = device_map.get, self.spans
        devices: List[Any] = [missing] * len(self.names)

        def walk(name: str, inherited: Any) -> None:
            device = get(name, inherited)
            kids = children.get(name)
            if kids is None:
                devices[index[name]] = device
            elif name in inner:
                for kid in kids:
                    walk(kid, device)
            else:
                start, end = spans[name]
                devices[start:end] = [device] * (end - start)

        walk("", missing)
        if missing in devices:
            return None
        return dict(zip(self.names, devices))

    def bytes_per_device(self, unit_devices: Mapping[str, Any]) -> Dict[Any, int]:
        out: Dict[Any, int] = {}
        # units come in runs on one device: one Python step per run, the units summed at C speed
        for device, run in groupby(zip(map(unit_devices.__getitem__, self.names), self.sizes), key=_NAME):
            out[device] = out.get(device, 0) + sum(map(_SIZE, run))
        return out

    def compact_map(self, unit_devices: Mapping[str, Any]) -> Dict[str, Any]:
        """Smallest device map giving every unit its device, in module order (like accelerate's
        ``clean_device_map``: a module whose units all share a device becomes one entry)."""
        if self.spans is not None and self.names:
            return self._compact_by_spans(unit_devices)

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
                if not _same_device(device, first, kind):
                    return entries
            return [(name, first)]

        return dict(walk(""))

    def _compact_by_spans(self, unit_devices: Mapping[str, Any]) -> Dict[str, Any]:
        """:meth:`compact_map` for a layout that knows the units each split module spans: a module
        is one entry when its first and last units lie in the same run of one device, so only
        the modules on the way to a device change are visited."""
        devices = list(map(unit_devices.__getitem__, self.names))
        # where a new run of one device begins, compared at C speed; devices of more than one
        # type are compared as (type, device) pairs, so 0 and False, 1 and "1" differ as in
        # _same_device
        keyed = devices if len(set(map(type, devices))) == 1 else list(zip(map(type, devices), devices))
        changes = list(compress(count(1), map(ne, keyed[1:], keyed)))
        children, spans = self.children, self.spans
        out: Dict[str, Any] = {}

        def walk(name: str) -> None:
            kids = children.get(name)
            if kids is None:
                out[name] = unit_devices[name]
                return
            start, end = spans[name]
            if start == end:
                return
            if bisect_right(changes, start) == bisect_right(changes, end - 1):  # one run
                out[name] = devices[start]
                return
            for kid in kids:
                walk(kid)

        walk("")
        return out

    def unit_map(self, unit_devices: Mapping[str, Any]) -> Dict[str, Any]:
        """Uncompacted map: one entry per unit (accelerate's ``clean_result=False``)."""
        return {name: unit_devices[name] for name in self.names}


def build_layout(
    entries: Sequence[Tuple[str, int]],
    children: Optional[Dict[str, List[str]]] = None,
    tied_groups: Iterable[Iterable[str]] = (),
) -> Layout:
    """Layout from plain data: ``entries`` are (unit name, bytes) in placement order."""
    names = [n for n, _ in entries]
    if children is None:
        children = {"": list(names)}
    layout = Layout.of(names, [int(s) for _, s in entries], children)
    return with_ties(layout, tied_groups)


def with_ties(layout: Layout, tied_groups: Iterable[Iterable[str]]) -> Layout:
    """``layout`` with the later units of each tied group following the earliest one."""
    parent: Dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    order = layout._index
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
    return Layout.of(layout.names, layout.sizes, layout.children, followers, layout.spans)
