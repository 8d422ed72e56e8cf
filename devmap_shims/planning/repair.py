"""Compute a balanced device map and decide whether it should replace the library's.

Why the library's map goes wrong (huggingface/transformers#34751, huggingface/accelerate#3244,
never merged): ``get_balanced_memory`` caps every GPU but the last at ``total / n + buffer``
where the buffer does not cover the largest unsplittable leaf (an unquantized 2.2 GiB embedding
next to 0.26 GiB 4-bit layers), and ``infer_auto_device_map`` never returns to a GPU it skipped,
so the embedding and everything after it land on the last GPU.

The plan here works from the budgets the user (or the hardware) actually gave, after the
quantizer's own adjustment, and never from the balanced caps:

1. Units in module order (see :mod:`devmap_shims.planning.layout`) are split into contiguous runs,
   one per GPU, minimising the busiest GPU's load exactly (binary search on the cap + greedy),
   then spread so each GPU gets close to an even share of what is left.
2. ``balanced_low_0`` keeps GPU 0 as empty as the other GPUs' budgets allow.
3. Only when the model does not fit on the GPUs at all is anything offloaded: the longest
   prefix that fits stays on the GPUs (keeping, like accelerate, room on GPU 0 and on the CPU for
   the largest offloaded block), the rest goes to the CPU and then to disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from devmap_shims.planning import partition
from devmap_shims.planning.assess import OK, Assessment, assess, gpu_ids
from devmap_shims.planning.layout import Layout

_KNOWN_KEYS = ("cpu", "disk")


@dataclass
class RepairOutcome:
    """``device_map`` is the map to use instead of the original, or None to keep the original."""

    original: Optional[Assessment]
    planned: Optional[Assessment]
    device_map: Optional[Dict[str, Any]]
    reason: str

    @property
    def repaired(self) -> bool:
        return self.device_map is not None


def supported_budgets(budgets: Mapping[Any, float]) -> Optional[str]:
    """None when the budgets name only integer GPUs, ``cpu`` and ``disk``; else why not."""
    for key in budgets:
        if isinstance(key, bool) or not (isinstance(key, int) or key in _KNOWN_KEYS):
            return f"device {key!r} in max_memory is not an integer GPU id, 'cpu' or 'disk'"
    return None


def plan_units(layout: Layout, budgets: Mapping[Any, float], low_zero: bool = False) -> Optional[Dict[str, Any]]:
    """Device of every unit in a balanced, contiguous placement (None if there is no GPU)."""
    gpus = gpu_ids(budgets)
    if not gpus:
        return None
    sizes = layout.placed_sizes
    caps = [int(budgets[g]) for g in gpus]
    devices: Optional[List[Any]] = None
    if low_zero and len(gpus) > 1:
        devices = _low_zero(sizes, gpus, caps)
    if devices is None:
        assignment = partition.balanced_assignment(sizes, caps)
        if assignment is not None:
            devices = [gpus[b] for b in assignment]
    if devices is None:
        devices = _with_offload(sizes, gpus, caps, budgets)
    placed = dict(zip(layout.placed_names, devices))
    for follower, anchor in layout.followers.items():
        placed[follower] = placed[anchor]
    return placed


def _low_zero(sizes: List[int], gpus: List[int], caps: List[int]) -> Optional[List[Any]]:
    rest_caps = caps[1:]
    prefix = partition._prefix(sizes)
    k = partition._earliest_starts(sizes, rest_caps, prefix)[0]
    if prefix[k] > caps[0]:
        return None
    rest = partition.balanced_assignment(sizes[k:], rest_caps)
    if rest is None:  # pragma: no cover - k guarantees the rest fits
        return None
    return [gpus[0]] * k + [gpus[1 + b] for b in rest]


def _with_offload(sizes: List[int], gpus: List[int], caps: List[int], budgets: Mapping[Any, float]) -> List[Any]:
    k, reserve = partition.longest_prefix_with_reserve(sizes, caps)
    gpu_caps = [max(0, caps[0] - reserve)] + caps[1:]
    head = partition.balanced_assignment(sizes[:k], gpu_caps) or []
    devices: List[Any] = [gpus[b] for b in head]
    cpu_left = max(0, int(budgets.get("cpu", 0)) - reserve) if "cpu" in budgets else 0
    for s in sizes[k:]:
        if cpu_left >= s and "cpu" in budgets:
            devices.append("cpu")
            cpu_left -= s
        else:
            cpu_left = -1  # keep order: once something goes to disk, the rest follows
            devices.append("disk")
    return devices


def repair(
    layout: Layout,
    device_map: Mapping[str, Any],
    budgets: Mapping[Any, float],
    low_zero: bool = False,
    clean: bool = True,
) -> RepairOutcome:
    """Assess ``device_map`` and return a balanced replacement when it is degenerate and the
    replacement is strictly better (fewer overfull devices, less offload, no collapse, fewer
    skipped GPUs, lighter busiest GPU, in that order of importance)."""
    why_not = supported_budgets(budgets)
    if why_not:
        return RepairOutcome(None, None, None, why_not)
    original_units = layout.unit_devices(device_map)
    if original_units is None:
        return RepairOutcome(None, None, None, "the map places parts of an unsplittable block separately")
    original = assess(layout, original_units, budgets, low_zero)
    if original.verdict == OK:
        return RepairOutcome(original, None, None, "map is healthy")
    planned_units = plan_units(layout, budgets, low_zero)
    if planned_units is None:
        return RepairOutcome(original, None, None, "no GPU has budget")
    planned = assess(layout, planned_units, budgets, low_zero)
    if planned.badness() >= original.badness():
        return RepairOutcome(original, planned, None, "no better contiguous placement exists")
    new_map = layout.compact_map(planned_units) if clean else layout.unit_map(planned_units)
    return RepairOutcome(original, planned, new_map, f"{original.summary()} -> {planned.summary()}")
