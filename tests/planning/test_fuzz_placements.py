"""Fuzzed placements: random module trees, GPU topologies and budgets through the device-map repair.

Each example builds a module tree (decoder-shaped or arbitrary; no-split classes, tied tensors in
distant modules, large unquantized leaves such as embeddings), a topology of 1-8 GPUs with a
``max_memory`` dict (some GPUs capped or left out by the user, ``cpu`` / ``disk`` entries or not,
bitsandbytes' x0.9 trim or not), a strategy, and the map a library could have computed (collapsed
onto one GPU, accelerate-style greedy over balanced caps, random cuts, a healthy map, arbitrary
assignments). What ``repair`` returns (or the original, when it declines) is judged by
``device_map_checks.check_placement``, which answers every "could it have been better" question
exactly with a dynamic programme over cut points.

Pure arithmetic: nothing here imports torch (see ``test_planning_runs_without_torch``), so the file
also runs where no target library is installed. The worst balance ratio seen is printed in the
terminal summary (tests/planning/conftest.py).
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_map_checks import (
    SUMMARY_LINES,
    TOLERANCE,
    PlacementCheck,
    check_placement,
    exact_contiguous_optimum,
    library_like_units,
    module_sizes,
    tensor_names,
)
from devmap_shims.planning import (
    Layout,
    assess,
    layout_from_module,
    lower_bound,
    plainly_healthy,
    plan_units,
    repair,
)

EXAMPLES = {
    "rules": 2000,
    "determinism": 600,
    "pass_through": 400,
    "quick_check": 1500,
    "tree_walk": 400,
}


def fuzz_settings(name: str):
    return settings(
        max_examples=EXAMPLES[name],
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# -- module trees ---------------------------------------------------------------------------------


class FakeModule:
    """Enough of ``nn.Module`` for the placement walk: parameters, children, buffers by name."""

    def __init__(self, params=(), children=(), buffers=()):
        self._params = [(n, None) for n in params]
        self._children = list(children)
        self._buffers = [(n, None) for n in buffers]

    def named_parameters(self, recurse=False):
        assert not recurse
        return iter(self._params)

    def named_children(self):
        return iter(self._children)

    def named_buffers(self, recurse=False):
        assert not recurse
        return iter(self._buffers)


POOL = ("Block", "Attention", "MLP", "Linear", "Norm", "Embedding", "Expert")
CLASSES = {
    name: type(name, (FakeModule,), {}) for name in POOL + ("DecoderLayer", "Model", "ForCausalLM", "Root")
}


def module(cls: str, params=(), children=(), buffers=()) -> FakeModule:
    return CLASSES[cls](params, children, buffers)


@dataclass
class Tree:
    model: FakeModule
    tensor_sizes: Dict[str, int]
    no_split: Tuple[str, ...]
    tied: Tuple[Tuple[str, ...], ...]
    shape: str


# The shape of an example (tree kind, layer count, sizes' scale, GPU count, budget factors, map
# kind) is drawn by hypothesis; the many small details (per-tensor sizes, which GPUs are capped,
# an arbitrary assignment) come from a seeded ``random.Random`` drawn with it, which keeps an
# example to a few dozen choices (fast to generate and to shrink) and stays reproducible.

_seeds = st.integers(0, 2**32 - 1)


@st.composite
def decoder_trees(draw) -> Tree:
    """A causal LM: embedding (unquantized, often several layers' worth), decoder layers (no-split
    unless the model says otherwise), final norm, lm_head tied to the embedding or not."""
    rng = random.Random(draw(_seeds))
    split_layers = draw(st.integers(0, 7)) == 0
    layers = draw(st.integers(1, 5 if split_layers else 24))
    base = draw(st.integers(1, 400))
    embed = int(base * 12 * draw(st.sampled_from([0, 0.1, 0.5, 1, 2, 4, 8.5, 20])))
    uneven_layers = draw(st.booleans())
    sizes: Dict[str, int] = {"model.embed_tokens.weight": embed}
    blocks = []
    for i in range(layers):
        m = rng.choice([1, 1, 1, 1, 2, 3]) if uneven_layers else 1
        p = f"model.layers.{i}"
        sizes.update({
            f"{p}.self_attn.qkv.weight": 3 * base * m,
            f"{p}.self_attn.o.weight": base * m,
            f"{p}.mlp.up.weight": 4 * base * m,
            f"{p}.mlp.down.weight": 4 * base * m,
            f"{p}.norm.weight": rng.randint(0, 2),
        })
        linear = lambda: module("Linear", ["weight"])  # noqa: E731
        attn = module("Attention", children=[("qkv", linear()), ("o", linear())])
        mlp = module("MLP", children=[("up", linear()), ("down", linear())])
        layer = [("self_attn", attn), ("mlp", mlp), ("norm", module("Norm", ["weight"]))]
        blocks.append((str(i), module("DecoderLayer", children=layer)))
    rotary = rng.random() < 0.5
    inner = [("embed_tokens", module("Embedding", ["weight"])), ("layers", module("Block", children=blocks))]
    inner.append(("norm", module("Norm", ["weight"])))
    sizes["model.norm.weight"] = rng.randint(0, 3)
    if rotary:
        sizes["model.inv_freq"] = rng.randint(0, 2)
    root_params = ["logit_scale"] if rng.random() < 0.125 else []
    if root_params:
        sizes["logit_scale"] = 1
    tie = draw(st.sampled_from(["tied-dedup", "tied-dedup", "tied-counted", "untied", "untied-quantized"]))
    head = {"tied-dedup": 0, "tied-counted": embed, "untied": embed, "untied-quantized": embed // 4}
    sizes["lm_head.weight"] = head[tie]
    model = module(
        "ForCausalLM",
        params=root_params,
        children=[("model", module("Model", children=inner, buffers=["inv_freq"] if rotary else [])),
                  ("lm_head", module("Linear", ["weight"]))],
    )
    no_split = () if split_layers else ("DecoderLayer",)
    if rng.random() < 0.15:
        no_split += ("Attention",)
    tied = (("model.embed_tokens.weight", "lm_head.weight"),) if tie.startswith("tied") else ()
    return Tree(model, sizes, no_split, tied, "decoder")


def _leaf_size(rng: random.Random, big: float) -> int:
    r = rng.random()
    if r < big:
        return rng.randint(1500, 20000)  # a large unquantized leaf
    return rng.randint(0, 40) if r < big + 0.3 else rng.randint(40, 1500)


@st.composite
def random_trees(draw) -> Tree:
    """Arbitrary nesting (up to 3 levels, at most ~36 tensors), classes from a small pool, a random
    subset of them unsplittable, tied tensors drawn from the first and the last third of the walk."""
    rng = random.Random(draw(_seeds))
    width = draw(st.integers(1, 5))
    big = draw(st.sampled_from([0.0, 0.05, 0.2]))
    count = [0]
    sizes: Dict[str, int] = {}

    def node(prefix: str, depth: int) -> FakeModule:
        max_kids = 0 if depth >= 3 or count[0] >= 30 else width
        kids = rng.randint(1 if depth == 0 else 0, max_kids)
        n_params = rng.randint(0 if kids else 1, 2)
        params = [f"w{i}" for i in range(n_params)]
        buffers = ["buf"] if rng.random() < 0.1 else []
        count[0] += n_params + len(buffers)
        for name in params + buffers:
            sizes[f"{prefix}.{name}" if prefix else name] = _leaf_size(rng, big)
        children = []
        for i in range(kids):
            if count[0] >= 36:
                break
            children.append((str(i), node(f"{prefix}.{i}" if prefix else str(i), depth + 1)))
        cls = "Root" if depth == 0 else rng.choice(POOL)
        return module(cls, params, children, buffers)

    model = node("", 0)
    names = tensor_names(model)
    no_split = tuple(sorted(rng.sample(POOL, draw(st.integers(0, 3)))))
    tied: List[Tuple[str, ...]] = []
    if len(names) >= 3:
        third = max(1, len(names) // 3)
        for _ in range(draw(st.integers(0, 2))):
            group = [rng.choice(names[:third]), rng.choice(names[-third:])]
            if rng.random() < 0.25:
                group.append(rng.choice(names))
            group = sorted(set(group), key=names.index)
            if len(group) < 2:
                continue
            for follower in group[1:]:
                if rng.random() < 0.7:  # accelerate counts a tied tensor once
                    sizes[follower] = 0
            tied.append(tuple(group))
    return Tree(model, sizes, no_split, tuple(tied), "random")


trees = st.one_of(decoder_trees(), random_trees())


# -- topologies and budgets -----------------------------------------------------------------------


@st.composite
def topologies(draw, total: int, largest: int) -> Tuple[Dict[Any, float], int]:
    """``max_memory`` after the library resolved it: GPU ids (some capped or left out by the user),
    maybe ``cpu`` and ``disk``, maybe the quantizer's x0.9 trim."""
    rng = random.Random(draw(_seeds))
    n = draw(st.integers(1, 8))
    share = max(total, 1) / n
    per_gpu = share * draw(st.sampled_from([0.2, 0.5, 0.8, 0.95, 1.0, 1.05, 1.2, 1.5, 2.0, 4.0, 12.0]))
    if draw(st.booleans()):
        per_gpu = max(per_gpu, largest * draw(st.sampled_from([0.9, 1.0, 1.1])))
    uneven = draw(st.integers(0, 3)) == 0
    capped = draw(st.sampled_from([0.0, 0.0, 0.2, 0.5]))  # how often the user caps a GPU
    budgets: Dict[Any, float] = {}
    for g in range(n):
        hw = per_gpu * (rng.choice([0.5, 0.8, 1.0, 1.25, 2.0]) if uneven else 1.0)
        if rng.random() < capped:
            hw = min(hw, per_gpu * rng.choice([0.0, 0.1, 0.3, 0.6, 0.9]))
        budgets[g] = int(hw)
    if n > 1 and draw(st.integers(0, 7)) == 0:  # the user's max_memory names only some GPUs
        for g in rng.sample(range(n), rng.randint(1, n - 1)):
            budgets.pop(g)
    cpu = draw(st.sampled_from([None, None, 0.0, 0.1, 0.5, 2.0]))
    if cpu is not None:
        budgets["cpu"] = int(total * cpu)
    if draw(st.integers(0, 3)) == 0:
        budgets["disk"] = 10 * total + 1
    if not any(v > 0 for k, v in budgets.items() if isinstance(k, int)):
        budgets[min(k for k in budgets if isinstance(k, int))] = max(1, int(per_gpu))  # one GPU has room
    if draw(st.integers(0, 3)) == 0:
        budgets = {k: v * 0.9 for k, v in budgets.items()}
    return budgets, n


# -- the library's map ----------------------------------------------------------------------------

KINDS = ("collapsed", "library", "library-reserve", "random-cuts", "healthy", "arbitrary", "split-unit")


@dataclass
class Case:
    tree: Tree
    layout: Any
    budgets: Dict[Any, float]
    n_gpus: int
    strategy: str
    kind: str
    original: Dict[str, Any]

    @property
    def low_zero(self) -> bool:
        return self.strategy == "balanced_low_0"

    def check(self, device_map) -> PlacementCheck:
        t = self.tree
        return check_placement(
            t.model, t.tensor_sizes, device_map, self.budgets, t.no_split, t.tied, self.low_zero
        )


def build_layout_for(tree: Tree, tied=None):
    sizes = module_sizes(tree.model, tree.tensor_sizes)
    return layout_from_module(tree.model, sizes, tree.no_split, tree.tied if tied is None else tied)


def _gpus(budgets) -> List[int]:
    return sorted(k for k, v in budgets.items() if isinstance(k, int) and v > 0)


@st.composite
def originals(draw, layout, tensors, budgets, strategy: str) -> Tuple[str, Dict[str, Any]]:
    rng = random.Random(draw(_seeds))
    kind = draw(st.sampled_from(KINDS))
    compact = draw(st.booleans())
    gpus = _gpus(budgets)
    placed = [u.size for u in layout.placed]
    names = [u.name for u in layout.placed]
    all_gpus = sorted(k for k in budgets if isinstance(k, int))
    tail = (["cpu"] if "cpu" in budgets else []) + ["disk"]

    def as_map(devices: Sequence[Any]) -> Dict[str, Any]:
        unit_devices = dict(zip(names, devices))
        for follower, anchor in layout.followers.items():
            unit_devices[follower] = unit_devices[anchor]
        return layout.compact_map(unit_devices) if compact else layout.unit_map(unit_devices)

    if kind == "collapsed":
        return kind, {"": rng.choice(all_gpus[-1:] * 3 + all_gpus)}
    if kind in ("library", "library-reserve"):
        total = sum(placed)
        active = gpus[1:] if strategy == "balanced_low_0" and len(gpus) > 1 else gpus
        buffer = rng.choice([0, max(placed, default=0), sorted(placed)[len(placed) // 2] if placed else 0])
        caps = [min(budgets[g], total / max(len(active), 1) + buffer) for g in gpus]
        caps[-1] = budgets[gpus[-1]]
        if strategy == "balanced_low_0" and len(gpus) > 1:
            caps[0] = 0
        if kind == "library-reserve":  # accelerate keeps the largest layer's room free on GPU 0
            caps[0] = max(0, caps[0] - max(placed, default=0))
        factor = rng.choice([1.0, 0.9])
        return kind, as_map(library_like_units(placed, gpus, [c * factor for c in caps], budgets))
    if kind == "random-cuts":
        devices_in_order = all_gpus + tail
        cuts = sorted(rng.randint(0, len(placed)) for _ in range(len(devices_in_order) - 1))
        bounds = [0] + cuts + [len(placed)]
        devices = []
        for d, (a, b) in zip(devices_in_order, zip(bounds, bounds[1:])):
            devices += [d] * (b - a)
        return kind, as_map(devices)
    if kind == "healthy":
        return kind, layout.compact_map(plan_units(layout, budgets, strategy == "balanced_low_0"))
    if kind == "split-unit":
        inside = [t for t in tensors if layout.unit_of(t) != t]
        if inside:
            return kind, {"": all_gpus[0], rng.choice(inside): all_gpus[-1]}
    return "arbitrary", as_map([rng.choice(all_gpus + tail) for _ in placed])


@st.composite
def cases(draw) -> Case:
    tree = draw(trees)
    layout = build_layout_for(tree)
    budgets, n = draw(topologies(layout.total, layout.largest))
    strategy = draw(st.sampled_from(["auto", "balanced", "balanced_low_0"]))
    kind, original = draw(originals(layout, tensor_names(tree.model), budgets, strategy))
    return Case(tree, layout, budgets, n, strategy, kind, original)


# -- what the run saw -----------------------------------------------------------------------------

STATS: Dict[str, Any] = {
    "examples": {name: 0 for name in EXAMPLES},
    "repaired": 0,
    "kept_over_budget": 0,
    "healthy_kept": 0,
    "kinds": {},
    "worst_ratio": (0.0, ""),  # busiest GPU / lower bound, every map returned without offload
    "worst_achievable": (0.0, ""),  # the same where a split within 1.10x of the bound exists
    "worst_vs_optimum": (0.0, ""),  # busiest GPU / best contiguous split
    "quick_ok": 0,  # maps the quick check kept without a layout
    "full_ok": 0,  # maps the full assessment calls ok
}


def _record(key: str, value: float, case: Case) -> None:
    if value > STATS[key][0]:
        where = (f"{case.tree.shape} tree, {len(case.layout.placed)} units, {case.n_gpus} GPUs, "
                 f"{case.strategy}, {case.kind} map")
        STATS[key] = (value, where)


# -- properties -----------------------------------------------------------------------------------


def _budget_violations(report: PlacementCheck) -> List[str]:
    return [v for v in report.violations if "over its budget" in v]


@fuzz_settings("rules")
@given(case=cases())
def test_returned_map_obeys_the_rules(case: Case):
    """Coverage, existing devices, budgets, ties, no-split units, order; no avoidable collapse,
    skipped GPU or offload; the busiest GPU at most 1.10x the lower bound or at the best
    contiguous split; a repaired map is the exact optimum and is not repaired again."""
    STATS["examples"]["rules"] += 1
    STATS["kinds"][case.kind] = STATS["kinds"].get(case.kind, 0) + 1
    outcome = repair(case.layout, case.original, case.budgets, low_zero=case.low_zero)
    result = outcome.device_map if outcome.repaired else case.original
    before = case.check(case.original)
    if case.kind == "split-unit" and not before.judged:
        assert not outcome.repaired and outcome.original is None, outcome.reason
        return
    assert before.judged, before.violations  # the generator only splits units on purpose
    after = case.check(result)
    if outcome.repaired:
        STATS["repaired"] += 1
        assert after.violations == [], (outcome.reason, result)
        again = repair(case.layout, result, case.budgets, low_zero=case.low_zero)
        assert not again.repaired, again.reason
    else:
        # Libraries stay within the budgets they were given, so an over-budget original is one of
        # the synthetic maps; assess reports the overfull device but does not call the map
        # degenerate for that alone, so it may be kept (counted in the summary). Never made worse:
        if _budget_violations(before):
            STATS["kept_over_budget"] += 1
        assert len(_budget_violations(after)) <= len(_budget_violations(before)), (outcome.reason, result)
    if _meets_every_rule(before):
        assert not outcome.repaired, f"a map that meets every rule was replaced: {outcome.reason}"
        STATS["healthy_kept"] += 1
    if not after.contiguous or _budget_violations(after):
        return  # an interleaved or over-budget map the repair accepted as it is: nothing more to judge
    assert not after.avoidable_collapse, (outcome.reason, result, after.loads)
    assert after.avoidable_skips == [], (outcome.reason, result, after.loads)
    assert after.avoidable_offload == 0, (outcome.reason, result, after.per_device)
    if after.fits and after.total:
        bound = lower_bound(case.layout, case.budgets, case.low_zero)
        assert abs(bound - after.bound) < 1 + 1e-9 * after.bound, (bound, after.bound)
    if after.offloaded or not after.gpus:
        return
    active_caps = [case.budgets[g] for g in after.active]
    if case.low_zero and exact_contiguous_optimum(after.sequence, active_caps) is None:
        _check_low_zero_overflow(case, after, outcome.repaired)
        return
    assert after.optimum is not None
    ceiling = max(TOLERANCE * after.bound, after.optimum)
    assert after.max_gpu_load <= ceiling * (1 + 1e-9), (after.max_gpu_load, after.bound, after.optimum)
    if outcome.repaired:
        assert after.max_gpu_load == after.optimum
        if case.low_zero and len(after.gpus) > 1:
            assert after.loads[after.gpus[0]] == 0, "balanced_low_0 keeps GPU 0 empty when the rest fits"
    _record("worst_ratio", after.ratio, case)
    _record("worst_vs_optimum", after.max_gpu_load / after.optimum if after.optimum else 1.0, case)
    if after.optimum <= TOLERANCE * after.bound:
        _record("worst_achievable", after.ratio, case)


def _meets_every_rule(report: PlacementCheck) -> bool:
    """Valid, contiguous, nothing avoidable, all on the GPUs, and the busiest GPU within 1.10x of
    the lower bound or at the best contiguous split."""
    return (
        report.judged
        and not report.violations
        and not report.avoidable_collapse
        and not report.avoidable_skips
        and not report.offloaded
        and report.optimum is not None
        and report.max_gpu_load <= max(TOLERANCE * report.bound, report.optimum)
    )


def _check_low_zero_overflow(case: Case, after: PlacementCheck, repaired: bool) -> None:
    """balanced_low_0 when GPUs 1.. cannot hold the model: GPU 0 takes only the shortest prefix
    that lets the rest fit on GPUs 1.., and the rest is split optimally (for a repaired map)."""
    if not repaired:
        return
    seq, rest_caps = after.sequence, [case.budgets[g] for g in after.active]
    k = next(k for k in range(len(seq) + 1) if exact_contiguous_optimum(seq[k:], rest_caps) is not None)
    gpu0 = after.loads[after.gpus[0]]
    assert gpu0 == sum(seq[:k]), (gpu0, sum(seq[:k]))
    assert max(after.loads[g] for g in after.active) == exact_contiguous_optimum(seq[k:], rest_caps)


def _permuted(d: Dict[Any, Any], order: Sequence[int]) -> Dict[Any, Any]:
    items = list(d.items())
    return dict(items[i] for i in order)


@fuzz_settings("determinism")
@given(case=cases(), data=st.data())
def test_repair_is_deterministic_and_ignores_insertion_order(case: Case, data):
    """Same inputs, same map (twice); the order of ``max_memory`` keys, of the original map's
    keys and of tied groups and their members does not change the answer."""
    STATS["examples"]["determinism"] += 1

    def answer(layout, device_map, budgets):
        outcome = repair(layout, device_map, budgets, low_zero=case.low_zero)
        return None if not outcome.repaired else list(outcome.device_map.items())

    first = answer(case.layout, case.original, case.budgets)
    assert answer(case.layout, case.original, case.budgets) == first
    budgets = _permuted(case.budgets, data.draw(st.permutations(range(len(case.budgets)))))
    original = _permuted(case.original, data.draw(st.permutations(range(len(case.original)))))
    tied = [tuple(data.draw(st.permutations(g))) for g in case.tree.tied]
    tied = [tied[i] for i in data.draw(st.permutations(range(len(tied))))]
    layout = build_layout_for(case.tree, tied)
    assert answer(layout, original, budgets) == first


@fuzz_settings("tree_walk")
@given(case=cases())
def test_the_module_tree_reads_and_writes_maps_as_the_names_do(case: Case):
    """A layout walked from a module reads a map (``unit_devices``) and writes one
    (``compact_map``) down the module tree; the same units without the tree's spans do both by
    name prefixes: the answers are equal, entry for entry and in order."""
    STATS["examples"]["tree_walk"] += 1
    layout = case.layout
    assert layout.spans is not None
    by_name = Layout.of(layout.names, layout.sizes, layout.children, layout.followers)
    read = layout.unit_devices(case.original)
    assert read == by_name.unit_devices(case.original)
    if read is not None:
        assert list(read) == layout.names
    for units in (plan_units(layout, case.budgets, case.low_zero), read):
        if units:
            assert list(layout.compact_map(units).items()) == list(by_name.compact_map(units).items())


# -- regressions found by the fuzzer --------------------------------------------------------------


def test_offload_while_the_whole_model_fits_is_repaired():
    """accelerate's greedy placer over balanced caps can send the last block to the CPU while a GPU
    is still empty. Judging that offload against a GPU 0 that keeps room for the offloaded block
    called it unavoidable; with nothing offloaded no room is kept, so the model fits."""
    from devmap_shims.planning import build_layout
    from devmap_shims.planning.assess import OFFLOADED

    layout = build_layout([("a", 50), ("b", 50), ("c", 50), ("d", 50), ("e", 90)])
    budgets = {0: 100, 1: 100, 2: 100, "cpu": 1000}
    outcome = repair(layout, {"a": 0, "b": 0, "c": 1, "d": 1, "e": "cpu"}, budgets)
    assert outcome.original.verdict == OFFLOADED
    assert outcome.repaired and outcome.device_map == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 2}


def test_a_module_without_bytes_does_not_make_a_skipped_gpu():
    """A leading 0-byte unit (a Dropout, a deduplicated embedding) on the first used GPU made any
    empty GPU before it count as skipped, so the optimal plan for a badly balanced map looked
    worse than the map and was thrown away."""
    from devmap_shims.planning import build_layout

    sizes = [0, 37, 36, 13, 14, 14, 12, 14, 13, 13, 26, 14, 13, 14, 3]
    layout = build_layout([(f"u{i}", s) for i, s in enumerate(sizes)])
    budgets = {0: 47, 1: 29, 2: 118, 3: 118, 4: 29, 5: 59, 6: 47, 7: 118}
    devices = [0, 2, 3, 3, 3, 4, 4, 5, 5, 5, 6, 6, 7, 7, 7]
    outcome = repair(layout, {f"u{i}": d for i, d in enumerate(devices)}, budgets, low_zero=True)
    assert outcome.original.max_gpu_load == 63
    assert outcome.repaired, outcome.reason
    assert outcome.planned.skipped == [] and outcome.planned.max_gpu_load == exact_contiguous_optimum(
        sizes, [budgets[g] for g in range(1, 8)]
    ) == 49


# -- sequential and explicit maps -----------------------------------------------------------------


@fuzz_settings("pass_through")
@given(case=cases(), strategy=st.sampled_from(["sequential", "explicit"]))
def test_sequential_and_explicit_maps_pass_through_the_hooks(case: Case, strategy: str):
    """The device-map shim's wrappers return the library's own object for ``sequential`` and for
    an explicit dict map (transformers 5 ``_get_device_map``), and for an ``infer_auto_device_map``
    call that no ``get_balanced_memory`` call prepared (accelerate's sequential path), however
    degenerate the map is."""
    from devmap_shims.hooks.accelerate import device_map_balance as hook
    from devmap_shims.shims import ShimContext
    from devmap_shims.shims.guard import bind_context

    STATS["examples"]["pass_through"] += 1
    computed = dict(case.original)
    requested = "sequential" if strategy == "sequential" else dict(case.original)

    def get_device_map(model, device_map, max_memory=None, hf_quantizer=None):
        return computed

    get_map = bind_context(hook.repair_get_device_map, ShimContext(hook.SHIM))
    out = get_map(get_device_map, None, (case.tree.model,), {"device_map": requested, "max_memory": dict(case.budgets)})
    assert out is computed

    def infer(model, max_memory=None, no_split_module_classes=None, dtype=None, special_dtypes=None,
              clean_result=True):
        return computed

    repair = bind_context(hook.repair_infer_auto_device_map, ShimContext(hook.SHIM))
    out = repair(infer, None, (case.tree.model,),
                 {"max_memory": dict(case.budgets), "no_split_module_classes": list(case.tree.no_split)})
    assert out is computed
    assert out == case.original


@fuzz_settings("quick_check")
@given(case=cases())
def test_quick_check_never_keeps_a_map_the_full_assessment_would_repair(case: Case):
    """``plainly_healthy`` (the map and the library's module sizes only, no layout) says "healthy"
    only for maps that :func:`assess` calls ``ok`` (or that place part of a block on its own, which
    the repair leaves alone too): the shim skips building the layout for those, so a wrong yes here
    would keep a degenerate map."""
    STATS["examples"]["quick_check"] += 1
    sizes = module_sizes(case.tree.model, case.tree.tensor_sizes)
    full = None
    units = case.layout.unit_devices(case.original)
    if units is not None:
        full = assess(case.layout, units, case.budgets, case.low_zero).verdict
    STATS["full_ok"] += full == "ok"
    if plainly_healthy(case.original, sizes, case.budgets, case.low_zero):
        STATS["quick_ok"] += 1
        assert full in ("ok", None), (case.kind, full)
        assert not repair(case.layout, case.original, case.budgets, case.low_zero).repaired


# -- torch-free -----------------------------------------------------------------------------------


def test_planning_runs_without_torch():
    """The planning package and the hook's pass-through path import no target library."""
    code = textwrap.dedent(
        """
        import sys
        from devmap_shims.planning import build_layout, repair
        from devmap_shims.hooks.accelerate import device_map_balance as hook
        layout = build_layout([("embed", 90)] + [(f"l{i}", 10) for i in range(8)])
        out = repair(layout, {"": 3}, {0: 100, 1: 100, 2: 100, 3: 100, "cpu": 1000})
        assert out.repaired and len(set(out.device_map.values())) > 1, out
        targets = ("torch", "transformers", "accelerate", "bitsandbytes", "diffusers", "numpy")
        loaded = sorted(m for m in targets if m in sys.modules)
        print(",".join(loaded) or "none")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "none", f"planning pulled in: {proc.stdout.strip()}"


# -- summary (keep last) --------------------------------------------------------------------------


def test_fuzz_summary():
    """Every property test ran its examples; the worst balance ratios go to the terminal summary."""
    counts = STATS["examples"]
    ran_all = all(counts.values())
    lines = [
        "fuzzed placements: " + ", ".join(f"{k} {v} examples" for k, v in counts.items())
        + f" ({sum(counts.values())} in all), {STATS['repaired']} maps repaired, "
        + f"{STATS['healthy_kept']} maps that meet every rule kept as they are, "
        + f"{STATS['kept_over_budget']} over-budget originals kept",
        f"  quick check: {STATS['quick_ok']} of the {STATS['full_ok']} maps the full assessment calls ok "
        "were kept without building a layout",
        "  original maps: " + ", ".join(f"{k} {v}" for k, v in sorted(STATS["kinds"].items())),
    ]
    for key, label in (
        ("worst_ratio", "worst balance ratio (busiest GPU / lower bound), every map without offload"),
        ("worst_achievable", "worst balance ratio where a split within 1.10x of the bound exists"),
        ("worst_vs_optimum", "worst busiest GPU / best contiguous split"),
    ):
        value, where = STATS[key]
        lines.append(f"  {label}: {value:.3f} ({where})")
    SUMMARY_LINES[:] = lines
    assert sum(EXAMPLES.values()) >= 2000
    if not ran_all:
        return  # a -k selection: nothing to total up
    assert sum(counts.values()) >= 2000
    assert STATS["worst_achievable"][0] <= TOLERANCE + 1e-9
    assert STATS["repaired"] > counts["rules"] // 10, "the generator should produce degenerate maps often"
    assert STATS["quick_ok"] > STATS["full_ok"] // 8, "the quick check should settle many healthy maps"
