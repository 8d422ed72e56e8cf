"""Judge a device map against the rules of a healthy multi-GPU placement.

A map computed for ``device_map="auto" | "balanced" | "balanced_low_0"`` is *degenerate* when
(checked in this order, the first that holds is the verdict):

``collapsed``
    two or more GPUs have budget, the one GPU in use holds more than ``tolerance`` times what a
    balanced split of its load over them would put on it, and more than the best contiguous split
    of its blocks does, and a GPU before it could take its first block or one after it its last
    (GPU 0 less the room it keeps for streaming offloaded blocks) (huggingface/transformers#34751:
    Gemma-2-27B in 4-bit on 8 GPUs, every module on one GPU); a GPU holding a single block, the
    rest offloaded, is not collapsed.
``offloaded``
    modules went to the CPU or disk although some GPU still has room for one of them
    (after keeping aside, on the main GPU, room for the largest offloaded block, which
    accelerate needs to stream it back in).
``skipped GPU``
    a GPU that could have held the next module is left empty while a later GPU is used
    (balanced_low_0 exempts GPU 0, which it keeps empty on purpose; when modules are offloaded,
    GPU 0's room is its budget less the largest offloaded block, which accelerate keeps free there).
``imbalanced``
    the busiest GPU holds more than ``tolerance`` (1.10) times the lower bound
    ``max(total / number of GPUs, largest unsplittable block)`` (see :func:`lower_bound` for
    GPUs whose user budget is below an even share), and more than the busiest GPU of the best
    contiguous split of the blocks it places on GPUs: whole blocks in module order often cannot
    come within ``tolerance`` of the bound, and a map that no split can beat is not blamed.

Anything else is ``ok``. ``collapsed`` and ``imbalanced`` do not apply to ``sequential`` maps
(``in_order=True``): that strategy fills each GPU before the next on purpose.

An ``ok`` map may still offload: when the GPUs' budgets cannot hold the model in any placement,
:attr:`Assessment.unavoidable` says so and :meth:`Assessment.offload_reason` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from devmap_shims.planning.layout import Layout
from devmap_shims.planning.partition import longest_prefix_with_reserve, min_max_cap
from devmap_shims.planning.sizes import format_bytes

TOLERANCE = 1.10
_MARGIN = 1e-4
OK, COLLAPSED, OFFLOADED, SKIPPED, IMBALANCED = "ok", "collapsed", "offloaded", "skipped GPU", "imbalanced"


def gpu_ids(budgets: Mapping[Any, float]) -> List[int]:
    """GPU ids (integer keys) that have a positive budget, in order."""
    return sorted(k for k, v in budgets.items() if isinstance(k, int) and not isinstance(k, bool) and v > 0)


@dataclass
class Assessment:
    verdict: str
    bytes_per_device: Dict[Any, int]
    gpus: List[int]
    max_gpu_load: int
    lower_bound: int
    offloaded: int
    skipped: List[int] = field(default_factory=list)
    collapsed: bool = False
    overfull: List[Any] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)
    #: the offloaded bytes are no more than any placement must offload (the map is not to blame)
    unavoidable: bool = False
    #: what the GPUs can hold: their budgets less the room GPU 0 keeps for streaming offloaded blocks
    gpu_room: int = 0
    #: that room on GPU 0: the largest offloaded block (0 when nothing is offloaded)
    reserve: int = 0
    #: the largest block that cannot be split, and the largest GPU budget
    largest_block: int = 0
    largest_budget: int = 0
    #: the busiest GPU's load in the best contiguous split of the blocks the map puts on GPUs
    #: (computed only when the map is over ``tolerance`` times the lower bound, else None)
    best_split: Optional[int] = None

    def offload_reason(self, model_bytes: int) -> str:
        """Why the offload cannot be avoided, in one sentence ('' when it can, or nothing moves)."""
        if not (self.unavoidable and self.offloaded):
            return ""
        targets = [d for d in ("cpu", "disk") if self.bytes_per_device.get(d)]
        where = "the CPU and disk" if len(targets) == 2 else ("disk" if targets == ["disk"] else "the CPU")
        gpus = f"{len(self.gpus)} GPU" + ("s" if len(self.gpus) != 1 else "")
        reserve = ""
        if self.reserve and self.gpus:
            reserve = (f" ({format_bytes(self.reserve)} kept free on GPU {self.gpus[0]} "
                       "to stream offloaded layers in)")
        if self.gpu_room < model_bytes:
            text = (f"offload unavoidable: the model needs {format_bytes(model_bytes)}, the {gpus} offer "
                    f"{format_bytes(self.gpu_room)} after accelerate's reserves{reserve}")
        else:  # room enough in total, but not in whole blocks placed in order
            where_not = ("is larger than every GPU's budget" if self.largest_block > self.largest_budget
                         else "does not fit what is left on the GPUs")
            text = (f"offload unavoidable: the {gpus} offer {format_bytes(self.gpu_room)} after "
                    f"accelerate's reserves{reserve}, as much as the model's {format_bytes(model_bytes)}, "
                    "but not in whole blocks placed in order: the largest block "
                    f"({format_bytes(self.largest_block)}) {where_not} "
                    f"(largest budget {format_bytes(self.largest_budget)})")
        return text + f"; {format_bytes(self.offloaded)} goes to {where} in whole modules"

    @property
    def ratio(self) -> float:
        """Busiest GPU over the lower bound (1.0 is a perfect split)."""
        return self.max_gpu_load / self.lower_bound if self.lower_bound else 1.0

    @property
    def used_gpus(self) -> List[int]:
        return [g for g in self.gpus if self.bytes_per_device.get(g, 0) > 0]

    def badness(self) -> tuple:
        """Orders maps from worst to best; a repair must be strictly better than the original."""
        return (len(self.overfull), self.offloaded, self.collapsed, len(self.skipped), self.max_gpu_load)

    def summary(self) -> str:
        used = self.used_gpus
        where = f"GPU {used[0]}" if len(used) == 1 else (f"GPUs {_ranges(used)}" if used else "no GPU")
        text = f"{self.verdict}: {where}, busiest GPU {format_bytes(self.max_gpu_load)} ({self.ratio:.2f}x lower bound)"
        if self.offloaded:
            text += f", {format_bytes(self.offloaded)} offloaded"
        return text


def _ranges(ids: List[int]) -> str:
    parts, start, prev = [], None, None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)


def active_gpus(budgets: Mapping[Any, float], low_zero: bool) -> List[int]:
    gpus = gpu_ids(budgets)
    return gpus[1:] if low_zero and len(gpus) > 1 else gpus


def lower_bound(layout: Layout, budgets: Mapping[Any, float], low_zero: bool = False) -> int:
    """No placement can put less than this on its busiest GPU.

    ``max(total / GPUs in use, largest unsplittable block)``, where a GPU whose budget is below
    the even share takes only its budget and the others share the rest (with no user caps this
    is plain ``total / GPUs``). When the model does not fit at all, the largest GPU budget.
    """
    return split_bound(layout.total, layout.largest, budgets, low_zero)


def split_bound(total: float, largest: int, budgets: Mapping[Any, float], low_zero: bool = False) -> int:
    """The busiest GPU's load in the best split of ``total`` bytes whose largest block is
    ``largest``: :func:`even_level`, rounded up, or that block."""
    return max(int(-(-even_level(total, budgets, low_zero) // 1)), largest)


def even_level(total: float, budgets: Mapping[Any, float], low_zero: bool = False) -> float:
    """The busiest GPU's load in a perfectly even split of ``total`` bytes over the GPUs in use,
    GPUs whose budget is below their share taking only their budget (:func:`lower_bound` without
    the largest-block term)."""
    caps = sorted(float(budgets[g]) for g in active_gpus(budgets, low_zero))
    remaining = float(total)
    for i, cap in enumerate(caps):
        share = remaining / (len(caps) - i)
        if cap >= share:
            return share
        remaining -= cap
    return caps[-1] if caps else float(total)


def plainly_healthy(
    device_map: Mapping[str, Any],
    module_sizes: Mapping[str, float],
    budgets: Mapping[Any, float],
    low_zero: bool = False,
    tolerance: float = TOLERANCE,
) -> bool:
    """True when :func:`assess` is sure to call ``device_map`` ``ok``, judged from the map and the
    library's own module sizes alone (no :class:`Layout`): every entry on a GPU with a budget,
    none over it, every GPU in use holding something (so none is skipped and nothing collapsed),
    and the busiest GPU within ``tolerance`` of an even split. False means "look closer", not
    "degenerate": a map that leaves a GPU empty or offloads may still be the best there is.

    ``module_sizes`` maps module (and tensor) names to bytes, every name's size covering all
    tensors below it, as accelerate's and transformers' ``compute_module_sizes`` return them."""
    loads: Dict[Any, float] = {}
    for name, device in device_map.items():
        if type(device) is not int or device not in budgets:
            return False
        loads[device] = loads.get(device, 0) + module_sizes.get(name, 0)
    active = active_gpus(budgets, low_zero)
    if not active or any(loads.get(g, 0) <= 0 for g in active):
        return False
    # the Layout rounds each unit to whole bytes: keep a margin so that rounding never turns a
    # borderline "ok" here into another verdict there
    margin = 1 - _MARGIN
    if any(load > budgets[d] * margin for d, load in loads.items()):
        return False
    level = even_level(module_sizes.get("", 0), budgets, low_zero)
    return max(loads.values()) <= tolerance * level * margin


def unavoidable_offload(layout: Layout, budgets: Mapping[Any, float]) -> int:
    """Bytes that cannot stay on the GPUs in any contiguous placement, when GPU 0 keeps room for
    the largest offloaded block to stream it back in (as accelerate does), whichever blocks a
    placement offloads. 0 when the whole model fits on the GPUs: then nothing is streamed and no
    reserve is needed."""
    gpus = gpu_ids(budgets)
    if not gpus:
        return layout.total
    sizes = layout.placed_sizes
    k, _reserve = longest_prefix_with_reserve(sizes, [int(budgets[g]) for g in gpus])
    return sum(sizes[k:])


def assess(
    layout: Layout,
    unit_devices: Mapping[str, Any],
    budgets: Mapping[Any, float],
    low_zero: bool = False,
    tolerance: float = TOLERANCE,
    in_order: bool = False,
) -> Assessment:
    """Verdict on ``unit_devices`` (unit name -> device) under per-device ``budgets``;
    ``in_order`` for a ``sequential`` map (never collapsed nor imbalanced)."""
    per_device = layout.bytes_per_device(unit_devices)
    gpus = gpu_ids(budgets)
    active = active_gpus(budgets, low_zero)
    loads = {g: per_device.get(g, 0) for g in gpus}
    max_load = max([per_device.get(d, 0) for d in per_device if d not in ("cpu", "disk")] or [0])
    bound = lower_bound(layout, budgets, low_zero)
    offloaded_sizes: List[int] = []
    if "cpu" in per_device or "disk" in per_device:
        placed = zip(layout.placed_names, layout.placed_sizes)
        offloaded_sizes = [size for name, size in placed if unit_devices[name] in ("cpu", "disk")]
    offloaded = sum(offloaded_sizes)
    problems: List[str] = []

    overfull = [d for d, b in per_device.items() if d in budgets and d != "disk" and b > budgets[d]]
    for d in overfull:
        problems.append(f"{_dev(d)} holds {format_bytes(per_device[d])}, over its {format_bytes(budgets[d])} budget")

    used = [g for g in gpus if loads[g] > 0]
    # accelerate keeps room on its main GPU (the first) to stream an offloaded block back in
    reserve = max(offloaded_sizes, default=0)
    room = {g: budgets[g] - (reserve if g == gpus[0] else 0) for g in gpus}
    # collapsed: the one GPU in use holds more than a balanced split of its own load would put on
    # it (blocks offloaded because no GPU can take them could not be spread either), and another
    # GPU has room for one of its blocks
    collapsed = False
    best = None  # the busiest GPU of the best contiguous split of the blocks on GPUs, once needed
    if not in_order and len(active) >= 2 and len(used) == 1:
        on_gpus = _on_gpus(layout, unit_devices, loads)
        one = used[0]
        # blocks stay in module order: a GPU before the one in use can only take its first block,
        # a GPU after it only its last
        room_elsewhere = bool(on_gpus) and any(
            room[g] >= (on_gpus[0] if g < one else on_gpus[-1]) for g in active if g != one
        )
        spread = split_bound(loads[one], max(on_gpus, default=0), budgets, low_zero)
        if room_elsewhere and loads[one] > tolerance * spread:
            best = _best_split(on_gpus, room, active, gpus)
            collapsed = best is None or loads[one] > best
    if collapsed:
        problems.append(
            f"all modules on GPU {used[0]} while {len(active)} GPUs have budget "
            f"(a balanced split needs about {format_bytes(bound)} per GPU)"
        )

    unavoidable = False
    if offloaded_sizes:
        necessary = unavoidable_offload(layout, budgets)
        if offloaded > necessary:
            problems.append(
                f"{format_bytes(offloaded)} offloaded to CPU/disk although the GPUs' budgets leave only "
                f"{format_bytes(necessary)} that cannot stay on a GPU"
            )
        else:
            offloaded_sizes = []
            unavoidable = True

    skipped: List[int] = []
    first_unit_on: Dict[Any, int] = {}
    if any(loads[g] <= 0 for g in gpus):  # the size of each device's first unit, to judge an empty GPU
        for name, size in zip(layout.placed_names, layout.placed_sizes):
            if size:  # a module without bytes (Dropout, a deduplicated tied weight) opens nothing
                first_unit_on.setdefault(unit_devices[name], size)
    for i, g in enumerate(gpus):
        if loads[g] > 0 or (low_zero and g == gpus[0] and len(gpus) > 1):
            continue
        later = [h for h in gpus[i + 1:] if loads[h] > 0]
        # a GPU that holds only a tied weight's bytes (its anchor placed elsewhere) opens with them
        if later and room[g] >= first_unit_on.get(later[0], loads[later[0]]):
            skipped.append(g)
    if skipped:
        problems.append(f"GPU {_ranges(skipped)} left empty while GPU {_ranges(used)} hold the model")

    imbalanced = not in_order and max_load > tolerance * bound
    if imbalanced and not collapsed:
        if best is None:
            best = _best_split(_on_gpus(layout, unit_devices, loads), room, active, gpus)
        imbalanced = best is None or max_load > best
        if imbalanced:
            problems.append(
                f"busiest GPU holds {format_bytes(max_load)}, {max_load / bound:.2f}x the lower bound "
                f"{format_bytes(bound)}"
            )

    if collapsed:
        verdict = COLLAPSED
    elif offloaded_sizes:
        verdict = OFFLOADED
    elif skipped:
        verdict = SKIPPED
    elif imbalanced:
        verdict = IMBALANCED
    else:
        verdict = OK
    return Assessment(
        verdict=verdict,
        bytes_per_device=per_device,
        gpus=gpus,
        max_gpu_load=max_load,
        lower_bound=bound,
        offloaded=offloaded,
        skipped=skipped,
        collapsed=collapsed,
        overfull=overfull,
        problems=problems,
        unavoidable=unavoidable,
        gpu_room=max(0, int(sum(budgets[g] for g in gpus)) - reserve),
        reserve=reserve,
        largest_block=layout.largest,
        largest_budget=int(max([budgets[g] for g in gpus] or [0])),
        best_split=best,
    )


def _on_gpus(layout: Layout, unit_devices: Mapping[str, Any], loads: Mapping[Any, int]) -> List[int]:
    """Sizes of the blocks the map puts on GPUs, in module order (blocks without bytes left out)."""
    placed = zip(layout.placed_names, layout.placed_sizes)
    return [size for name, size in placed if size and unit_devices[name] in loads]


def _best_split(sizes: List[int], room: Mapping[int, float], active: List[int], gpus: List[int]) -> Any:
    """The busiest GPU's load in the best contiguous split of ``sizes`` over the active GPUs'
    room (over every GPU's when the active ones cannot hold them; None when no GPUs can)."""
    best = min_max_cap(sizes, [int(room[g]) for g in active])
    if best is None and len(active) < len(gpus):
        best = min_max_cap(sizes, [int(room[g]) for g in gpus])
    return best


def _dev(d: Any) -> str:
    return f"GPU {d}" if isinstance(d, int) else str(d)
