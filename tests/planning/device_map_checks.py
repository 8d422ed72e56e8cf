"""Rules a device map must satisfy, checked independently of devmap_shims.planning.

Sizes come from the installed library (accelerate's / transformers' own ``compute_module_sizes``,
called the way ``from_pretrained`` calls them); the walk, the tie handling, the bound and the
exact contiguous optimum (a dynamic programme, not the binary search under test) are written
out again here.
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
    ranks = [rank.get(resolve(device_map, u), -1) for u in sequence]
    if ranks != sorted(ranks):
        violations.append("modules are not placed contiguously in module order")

    loads = {g: per_device.get(g, 0) for g in gpus}
    used = [g for g in gpus if loads[g] > 0]
    offloaded = per_device.get("cpu", 0) + per_device.get("disk", 0)
    bound = max(total / max(len(active), 1), largest)

    if len(active) >= 2 and total > TOLERANCE * bound and len(used) < 2:
        violations.append(f"collapsed onto GPU {used}")
    first_unit_on: Dict[Any, int] = {}
    for u in sequence:
        first_unit_on.setdefault(resolve(device_map, u), seq_size[u])
    for i, g in enumerate(active):
        later = [h for h in active[i + 1:] if loads[h] > 0]
        if loads[g] == 0 and later and budgets[g] >= first_unit_on[later[0]]:
            violations.append(f"GPU {g} skipped although it could hold the next block")
    gpu_budget = sum(budgets[g] for g in gpus)
    if offloaded and total <= gpu_budget - largest:
        violations.append(f"{offloaded} B offloaded although the GPUs' budgets hold the whole model")

    caps = [budgets[g] for g in active]
    optimum = exact_contiguous_optimum([seq_size[u] for u in sequence], caps) if not offloaded else None
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
