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

from itertools import groupby, repeat
from operator import itemgetter
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

_NO_DICT: Dict[str, Any] = {}
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
        self._set(list(map(_NAME, pairs)), list(map(_SIZE, pairs)), children, followers)
        self.spans: Optional[Dict[str, Tuple[int, int]]] = None

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
        layout._set(names, sizes, children, followers)
        layout.spans = spans
        return layout

    def _set(
        self, names: List[str], sizes: List[int], children: Optional[Dict[str, Sequence[str]]],
        followers: Optional[Dict[str, str]],
    ) -> None:
        self.names, self.sizes = names, sizes
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

        devices = []
        keep = devices.append
        for name in self.names:
            device = get(name, missing)
            if device is missing:
                if not name:
                    return None
                parent = name.rpartition(".")[0]
                device = look(parent, missing)
                if device is missing:
                    device = found[parent] = device_of(parent)
                    if device is missing:
                        return None
            keep(device)
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
        run_of = [0] * len(devices)
        run, previous = 0, devices[0]
        kind = type(previous)
        for i, device in enumerate(devices):
            if not _same_device(device, previous, kind):
                run, previous, kind = run + 1, device, type(device)
            run_of[i] = run
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
            if run_of[start] == run_of[end - 1]:
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
    return _with_ties(layout, tied_groups)


def _with_ties(layout: Layout, tied_groups: Iterable[Iterable[str]]) -> Layout:
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
        kids = getattr(obj, "__dict__", {}).get("_modules")
        if type(kids) is dict:  # a torch module
            return any(child is not None for child in kids.values()) if kids else False
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
                try:
                    kids = sub.__dict__.get("_modules")
                except AttributeError:
                    kids = None
                if type(kids) is dict:  # a torch module: split unless childless or no-split
                    if kids and type(sub).__name__ not in no_split and (
                        None not in kids.values() or any(c is not None for c in kids.values())
                    ):
                        visit(kid, sub)
                    else:
                        add(kid)
                elif is_splittable(sub):
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
    return _with_ties(Layout.of(names, sizes, children, spans=spans), tied_groups)


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
