"""Rules a device map must satisfy, checked independently of devmap_shims.planning.

For real model skeletons (:func:`check_map`), sizes come from the installed library (accelerate's /
transformers' own ``compute_module_sizes``, called the way ``from_pretrained`` calls them); the
walk, the tie handling, the bound and the exact contiguous optimum (a dynamic programme, not the
binary search under test) are written out again here. :func:`check_placement` applies the same
rules to module trees given as plain data and imports nothing (the fuzzed placements).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

TOLERANCE = 1.10


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def library_sizes(meta: Any, strategy: str) -> Dict[str, int]:
    """Bytes per module / tensor name as the installed stack's device-map step sizes them."""
    model, quantizer = meta.model, meta.quantizer
    if transformers_major() >= 5:
        from transformers.integrations.accelerate import compute_module_sizes

        sizes, _ = compute_module_sizes(model, quantizer, only_modules=False)
        return dict(sizes)
    from accelerate.utils.modeling import compute_module_sizes

    dtype, special = meta.dtype, None
    if quantizer is not None:
        special = quantizer.get_special_dtypes_update(model, meta.dtype)
        dtype = quantizer.adjust_target_dtype(meta.dtype)
    model.tie_weights()
    return dict(compute_module_sizes(model, dtype=dtype, special_dtypes=special))


def tied_groups(model: Any) -> List[List[str]]:
    if transformers_major() >= 5:
        keys = dict(getattr(model, "all_tied_weights_keys", None) or {})
        return [sorted([k for k, v in keys.items() if v == t] + [t]) for t in set(keys.values())]
    from accelerate.utils import find_tied_parameters

    return [list(g) for g in find_tied_parameters(model)]


def no_split_classes(model: Any, strategy: str) -> List[str]:
    if transformers_major() >= 5:
        return list(model._no_split_modules or [])
    return list(model._get_no_split_modules(strategy))


def resolve(device_map: Mapping[str, Any], name: str) -> Any:
    probe = name
    while True:
        if probe in device_map:
            return device_map[probe]
        if not probe:
            raise KeyError(f"{name} is not placed by the device map")
        probe = probe.rpartition(".")[0]


def units_in_order(model: Any, no_split: Sequence[str]) -> List[str]:
    """Recursive restatement of accelerate's walk: a module's own parameters, children, buffers;
    no-split and childless modules are not entered."""
    out: List[str] = []

    def visit(module: Any, prefix: str) -> None:
        entries = [(n, p, False) for n, p in module.named_parameters(recurse=False)]
        entries += [(n, c, True) for n, c in module.named_children()]
        entries += [(n, b, False) for n, b in module.named_buffers(recurse=False)]
        for name, obj, is_module in entries:
            full = f"{prefix}.{name}" if prefix else name
            if is_module and type(obj).__name__ not in no_split and len(list(obj.named_children())) > 0:
                visit(obj, full)
            else:
                out.append(full)

    visit(model, "")
    return out


def exact_contiguous_optimum(sizes: Sequence[int], caps: Sequence[float]) -> Optional[float]:
    """min over contiguous splits of the max GPU load (dynamic programme over cut points)."""
    inf = float("inf")
    u = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    best = [0.0] + [inf] * u  # best[i]: first i units placed on the GPUs seen so far
    for cap in caps:
        new = [inf] * (u + 1)
        for i in range(u + 1):
            for j in range(i + 1):
                load = prefix[i] - prefix[j]
                if load <= cap and best[j] < inf:
                    new[i] = min(new[i], max(best[j], load))
        best = new
    return None if best[u] == inf else best[u]


def avoidable_skips(
    seq: Sequence[int], devices: Sequence[Any], loads: Mapping[int, int], gpus: Sequence[int],
    active: Sequence[int], budgets: Mapping[Any, float], offloaded: int,
) -> List[int]:
    """The GPUs of ``active`` left empty before a used one although their budget holds the
    modules that open the next used GPU (up to the first with bytes); GPU 0, when something is
    offloaded, after keeping room to stream the largest offloaded block back in, as accelerate
    does. ``seq`` / ``devices``: the unit sequence's bytes and devices."""
    room = {g: float(budgets[g]) for g in gpus}
    if offloaded and gpus:
        room[gpus[0]] = max(0.0, room[gpus[0]] - max((s for s, d in zip(seq, devices) if d not in loads), default=0))
    skips = []
    for i, g in enumerate(active):
        later = [h for h in active[i + 1:] if loads[h]]
        if loads[g] or not later:
            continue
        opening = 0
        for s, d in zip(seq, devices):
            if d == later[0]:
                opening += s
                if s:
                    break
        if opening <= room[g]:
            skips.append(g)
    return skips


@dataclass
class MapReport:
    bytes_per_device: Dict[Any, int]
    total: int
    lower_bound: float
    largest_block: int
    max_gpu_load: int
    gpus_used: List[int]
    offloaded: int
    optimum: Optional[float]
    violations: List[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.max_gpu_load / self.lower_bound

    @property
    def optimum_ratio(self) -> Optional[float]:
        return None if self.optimum is None else self.optimum / self.lower_bound


def check_map(
    meta: Any,
    device_map: Mapping[str, Any],
    budgets: Mapping[Any, float],
    strategy: str,
    sizes: Mapping[str, int],
) -> MapReport:
    model = meta.model
    low_zero = strategy == "balanced_low_0"
    no_split = no_split_classes(model, strategy)
    violations: List[str] = []
    gpus = sorted(k for k, v in budgets.items() if isinstance(k, int) and v > 0)
    active = gpus[1:] if low_zero and len(gpus) > 1 else gpus

    # every tensor is placed; bytes per device
    per_device: Dict[Any, int] = {}
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name in tensors:
        try:
            device = resolve(device_map, name)
        except KeyError as exc:
            violations.append(str(exc))
            continue
        per_device[device] = per_device.get(device, 0) + int(sizes.get(name, 0))
    total = sum(per_device.values())

    # no unsplittable block is split
    blocks = [n for n, m in model.named_modules() if n and type(m).__name__ in no_split]
    for key in device_map:
        for block in blocks:
            if key.startswith(block + "."):
                violations.append(f"no-split block {block} is split ({key} placed separately)")
                break

    # tied weights share a device
    for group in tied_groups(model):
        devices = {repr(resolve(device_map, p)) for p in group if p}
        if len(devices) > 1:
            violations.append(f"tied parameters {group} on different devices {devices}")

    # budgets
    for device, used in per_device.items():
        if device in budgets and device != "disk" and used > budgets[device]:
            violations.append(f"{device} holds {used} B, over its budget {budgets[device]:.0f} B")

    # unit sequence, tied followers folded into their anchor
    units = units_in_order(model, no_split)
    unit_size = {u: int(sizes.get(u, 0)) for u in units}
    anchor_of: Dict[str, str] = {}
    position = {u: i for i, u in enumerate(units)}

    def unit_of(name: str) -> str:
        probe = name
        while probe not in position:
            probe = probe.rpartition(".")[0]
        return probe

    for group in tied_groups(model):
        owners = sorted({unit_of(p) for p in group if p}, key=position.get)
        for follower in owners[1:]:
            anchor_of[follower] = owners[0]
    sequence = [u for u in units if u not in anchor_of]
    seq_size = dict(unit_size)
    for follower, anchor in anchor_of.items():
        seq_size[anchor] += unit_size[follower]
    largest = max(seq_size[u] for u in sequence)

    # contiguity: GPUs in order, then cpu, then disk
    rank = {g: i for i, g in enumerate(gpus)}
    rank.update({"cpu": len(gpus), "disk": len(gpus) + 1})
    seq = [seq_size[u] for u in sequence]
    devices = [resolve(device_map, u) for u in sequence]
    ranks = [rank.get(d, -1) for d in devices]
    if ranks != sorted(ranks):
        violations.append("modules are not placed contiguously in module order")

    loads = {g: per_device.get(g, 0) for g in gpus}
    used = [g for g in gpus if loads[g] > 0]
    offloaded = per_device.get("cpu", 0) + per_device.get("disk", 0)
    bound = max(total / max(len(active), 1), largest)

    if len(active) >= 2 and total > TOLERANCE * bound and len(used) < 2:
        violations.append(f"collapsed onto GPU {used}")
    for g in avoidable_skips(seq, devices, loads, gpus, active, budgets, offloaded):
        violations.append(f"GPU {g} skipped although it could hold the next block")
    # offload is avoidable only when the units, in order and whole, fit on the GPUs
    if offloaded and exact_contiguous_optimum(seq, [budgets[g] for g in gpus]) is not None:
        violations.append(f"{offloaded} B offloaded although the units fit on the GPUs in order")

    caps = [budgets[g] for g in active]
    optimum = exact_contiguous_optimum(seq, caps) if not offloaded else None
    return MapReport(
        bytes_per_device=per_device,
        total=total,
        lower_bound=bound,
        largest_block=largest,
        max_gpu_load=max([loads[g] for g in gpus] or [0]),
        gpus_used=used,
        offloaded=offloaded,
        optimum=optimum,
        violations=violations,
    )


def budgets_for(meta: Any, max_memory: Mapping[Any, int]) -> Dict[Any, float]:
    """The user's budgets after the quantizer's own adjustment (x0.9 for bitsandbytes)."""
    budgets: Dict[Any, float] = dict(max_memory)
    if meta.quantizer is not None:
        budgets = dict(meta.quantizer.adjust_max_memory(budgets))
    return budgets


def table_row(case_id: str, without: MapReport, with_shim: MapReport) -> Tuple[str, ...]:
    return (
        case_id,
        f"{without.ratio:.3f}",
        f"{with_shim.ratio:.3f}",
        "-" if with_shim.optimum_ratio is None else f"{with_shim.optimum_ratio:.3f}",
        f"{len(without.gpus_used)}->{len(with_shim.gpus_used)}",
    )


# -- the same rules on plain module trees (no torch) -----------------------------------------------
#
# For fuzzed trees built from duck-typed modules (``named_parameters(recurse=False)``,
# ``named_children()``, ``named_buffers(recurse=False)``) with tensor sizes given as data. Every
# "could it have been better" question is answered exactly (a dynamic programme over cut points for
# the best split, never the binary search + greedy under test).

INF = float("inf")


def tensor_names(model: Any) -> List[str]:
    """Every parameter and buffer, full names, in walk order."""
    out: List[str] = []

    def visit(module: Any, prefix: str) -> None:
        for name, _ in module.named_parameters(recurse=False):
            out.append(f"{prefix}.{name}" if prefix else name)
        for name, child in module.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name)
        for name, _ in module.named_buffers(recurse=False):
            out.append(f"{prefix}.{name}" if prefix else name)

    visit(model, "")
    return out


def module_names(model: Any) -> List[str]:
    out = [""]

    def visit(module: Any, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            out.append(full)
            visit(child, full)

    visit(model, "")
    return out


def module_sizes(model: Any, tensor_sizes: Mapping[str, int]) -> Dict[str, int]:
    """Bytes of every module prefix and tensor (what ``compute_module_sizes`` returns)."""
    sizes: Dict[str, int] = {}
    for tensor in tensor_names(model):
        size = int(tensor_sizes.get(tensor, 0))
        sizes[tensor] = sizes.get(tensor, 0) + size
        probe = tensor
        while probe:
            probe = probe.rpartition(".")[0]
            sizes[probe] = sizes.get(probe, 0) + size
    return sizes


def water_level_bound(total: int, largest: int, caps: Sequence[float]) -> float:
    """Lower bound on the busiest GPU: GPUs whose budget is below an even share take their budget,
    the others share the rest evenly; never below the largest unsplittable block."""
    remaining, level = float(total), None
    ordered = sorted(caps)
    for i, cap in enumerate(ordered):
        share = remaining / (len(ordered) - i)
        if cap >= share:
            level = share
            break
        remaining -= cap
    if level is None:  # the model does not fit: every GPU is full at best
        level = max(ordered, default=float(total))
    return max(level, float(largest))


@dataclass
class PlacementCheck:
    """A device map judged against the rules (see :func:`check_placement`)."""

    violations: List[str]
    judged: bool  # False when the map cannot be read unit by unit (coverage or split errors)
    contiguous: bool = True
    per_device: Dict[Any, int] = field(default_factory=dict)
    loads: Dict[int, int] = field(default_factory=dict)
    gpus: List[int] = field(default_factory=list)
    active: List[int] = field(default_factory=list)
    used: List[int] = field(default_factory=list)
    total: int = 0
    largest: int = 0
    offloaded: int = 0
    sequence: List[int] = field(default_factory=list)
    devices: List[Any] = field(default_factory=list)
    bound: float = 0.0
    fits: bool = False
    optimum: Optional[float] = None  # best busiest-GPU load over the GPUs the strategy may fill
    max_gpu_load: int = 0
    avoidable_collapse: bool = False
    avoidable_skips: List[int] = field(default_factory=list)
    avoidable_offload: int = 0

    @property
    def ratio(self) -> float:
        return self.max_gpu_load / self.bound if self.bound else 1.0


def _device_ok(device: Any, budgets: Mapping[Any, float]) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return device in budgets
    return device == "disk" or (device == "cpu" and "cpu" in budgets)


def check_placement(
    model: Any,
    tensor_sizes: Mapping[str, int],
    device_map: Mapping[str, Any],
    budgets: Mapping[Any, float],
    no_split: Sequence[str],
    tied: Sequence[Sequence[str]],
    low_zero: bool = False,
    tolerance: float = TOLERANCE,
) -> PlacementCheck:
    """Hard rules (recorded in ``violations``) and the exact answers to the soft ones.

    Hard: every tensor placed by exactly one entry (longest prefix), every key names a module or
    tensor of the model, no key inside an unsplittable unit, devices exist (GPU ids of
    ``budgets``, ``cpu`` when budgeted, ``disk``), no budget exceeded (``disk`` is unbounded),
    tied tensors together, units in module order on GPUs in order, then cpu, then disk.

    Soft, for contiguous maps: ``avoidable_collapse`` (one GPU holds everything although a
    contiguous split within the budgets over the strategy's GPUs has a busiest GPU below
    ``total / tolerance``), ``avoidable_skips`` (a GPU the strategy may fill left empty before a
    used one although its budget holds the module that opens the next used GPU; on GPU 0, after
    keeping room for the largest offloaded block), ``avoidable_offload`` (bytes offloaded
    although the whole model fits on the GPUs). Whether the busiest GPU could be lighter is
    ``max_gpu_load`` against ``optimum``.
    """
    violations: List[str] = []
    tensors = tensor_names(model)
    known = set(tensors) | set(module_names(model))
    for key in device_map:
        if key not in known:
            violations.append(f"key {key!r} names nothing in the model")
    for key, device in device_map.items():
        if not _device_ok(device, budgets):
            violations.append(f"{key!r} placed on {device!r}, which does not exist here")
    per_device: Dict[Any, int] = {}
    for name in tensors:
        try:
            device = resolve(device_map, name)
        except KeyError as exc:
            violations.append(str(exc))
            continue
        per_device[device] = per_device.get(device, 0) + int(tensor_sizes.get(name, 0))
    units = units_in_order(model, no_split)
    for key in device_map:
        for unit in units:
            if key.startswith(unit + "."):
                violations.append(f"unit {unit} is split ({key} placed separately)")
    if violations:
        return PlacementCheck(violations=violations, judged=False)

    for device, used in per_device.items():
        if device in budgets and device != "disk" and used > budgets[device]:
            violations.append(f"{device!r} holds {used} B, over its budget {budgets[device]} B")
    for group in tied:
        devices = {repr(resolve(device_map, p)) for p in group}
        if len(devices) > 1:
            violations.append(f"tied tensors {list(group)} on different devices {sorted(devices)}")

    # the unit sequence, tied followers folded into the earliest unit of their group
    sizes = module_sizes(model, tensor_sizes)
    position = {u: i for i, u in enumerate(units)}

    def unit_of(name: str) -> str:
        probe = name
        while probe not in position:
            probe = probe.rpartition(".")[0]
        return probe

    root: Dict[str, str] = {u: u for u in units}  # tied groups that share a unit merge

    def find(u: str) -> str:
        while root[u] != u:
            u = root[u]
        return u

    for group in tied:
        owners = [find(unit_of(p)) for p in group]
        for other in owners[1:]:
            a, b = sorted((find(owners[0]), find(other)), key=position.get)
            root[b] = a
    seq_size: Dict[str, int] = {}
    for u in units:  # every group's bytes go to its earliest unit
        seq_size[find(u)] = seq_size.get(find(u), 0) + sizes.get(u, 0)
    sequence = [u for u in units if u in seq_size]
    seq = [seq_size[u] for u in sequence]
    devices = [resolve(device_map, u) for u in sequence]

    gpus = sorted(k for k, v in budgets.items() if isinstance(k, int) and not isinstance(k, bool) and v > 0)
    active = gpus[1:] if low_zero and len(gpus) > 1 else gpus
    rank = {g: i for i, g in enumerate(sorted(k for k in budgets if isinstance(k, int)))}
    rank.update({"cpu": len(rank), "disk": len(rank) + 1})
    ranks = [rank[d] for d in devices]
    contiguous = ranks == sorted(ranks)
    if not contiguous:
        violations.append("units are not placed contiguously in module order")
    total = sum(seq)
    largest = max(seq, default=0)
    loads = {g: per_device.get(g, 0) for g in gpus}
    used = [g for g in gpus if loads[g] > 0]
    offloaded = per_device.get("cpu", 0) + per_device.get("disk", 0)
    caps_all = [float(budgets[g]) for g in gpus]
    fits = exact_contiguous_optimum(seq, caps_all) is not None
    optimum = exact_contiguous_optimum(seq, [float(budgets[g]) for g in active])
    if optimum is None and low_zero:
        optimum = exact_contiguous_optimum(seq, caps_all)
    report = PlacementCheck(
        violations=violations,
        judged=True,
        contiguous=contiguous,
        per_device=per_device,
        loads=loads,
        gpus=gpus,
        active=active,
        used=used,
        total=total,
        largest=largest,
        offloaded=offloaded,
        sequence=seq,
        devices=devices,
        bound=water_level_bound(total, largest, [float(budgets[g]) for g in active]),
        fits=fits,
        optimum=optimum,
        max_gpu_load=max([loads[g] for g in gpus] or [0]),
    )
    if not contiguous:
        return report
    if offloaded and fits:
        report.avoidable_offload = offloaded
    if not offloaded and len(active) >= 2 and len(used) == 1 and optimum is not None:
        report.avoidable_collapse = total > tolerance * optimum
    report.avoidable_skips = avoidable_skips(seq, devices, loads, gpus, active, budgets, offloaded)
    return report


def library_like_units(
    sequence: Sequence[int],
    gpus: Sequence[int],
    caps: Sequence[float],
    budgets: Mapping[Any, float],
) -> List[Any]:
    """accelerate's greedy placer in miniature: fill the GPUs in order up to ``caps`` (the
    balanced caps it was given), never return to a GPU it left, then cpu, then disk."""
    out: List[Any] = []
    b, load = 0, 0.0
    cpu_left = float(budgets.get("cpu", 0))
    for size in sequence:
        while b < len(gpus) and load + size > caps[b]:
            b, load = b + 1, 0.0
        if b < len(gpus):
            out.append(gpus[b])
            load += size
        elif "cpu" in budgets and size <= cpu_left and (not out or out[-1] != "disk"):
            out.append("cpu")
            cpu_left -= size
        else:
            out.append("disk")
    return out


#: Lines for pytest's terminal summary (printed by tests/planning/conftest.py, with or without -s).
SUMMARY_LINES: List[str] = []
