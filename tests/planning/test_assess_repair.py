"""Verdicts and repairs on synthetic layouts (pure arithmetic, no torch)."""

from __future__ import annotations

import pytest

from devmap_shims.planning import assess, build_layout, layout_from_module, plan_units, repair
from devmap_shims.planning.assess import COLLAPSED, IMBALANCED, OFFLOADED, OK, SKIPPED
from devmap_shims.planning.layout import Layout

G = 1000  # one "GiB" in these toy models


def llm_layout(embed=22 * G // 10, layer=G // 4, layers=46, tied=True):
    """A Gemma-2-27B-shaped toy: big embedding, small layers, tied lm_head (0 bytes, follows embed)."""
    entries = [("model.embed_tokens", embed)]
    entries += [(f"model.layers.{i}", layer) for i in range(layers)]
    entries += [("model.norm", 1), ("lm_head", 0 if tied else embed)]
    children = {
        "": ["model", "lm_head"],
        "model": ["model.embed_tokens", "model.layers", "model.norm"],
        "model.layers": [f"model.layers.{i}" for i in range(layers)],
    }
    ties = [["model.embed_tokens.weight", "lm_head.weight"]] if tied else []
    return build_layout(entries, children, ties)


def gpus(n, each, cpu=None):
    budgets = {i: each for i in range(n)}
    if cpu is not None:
        budgets["cpu"] = cpu
    return budgets


def test_collapsed_map_is_detected_and_spread():
    layout = llm_layout()
    budgets = gpus(8, 20 * G)
    outcome = repair(layout, {"": 7}, budgets)
    assert outcome.original.verdict == COLLAPSED
    assert outcome.repaired
    new = outcome.device_map
    assert set(new.values()) == set(range(8))
    assert new["lm_head"] == new["model.embed_tokens"], "tied weights share a device"
    assert outcome.planned.verdict == OK
    assert outcome.planned.max_gpu_load <= 1.10 * outcome.planned.lower_bound


def test_healthy_map_is_left_alone():
    layout = llm_layout()
    budgets = gpus(8, 20 * G)
    planned = layout.compact_map(plan_units(layout, budgets))
    outcome = repair(layout, planned, budgets)
    assert outcome.original.verdict == OK
    assert not outcome.repaired


def test_skipped_gpu_in_the_middle():
    layout = build_layout([(f"l{i}", 10) for i in range(8)])
    m = {f"l{i}": (0 if i < 4 else 2) for i in range(8)}
    a = assess(layout, layout.unit_devices(m), gpus(3, 100))
    assert a.verdict == SKIPPED and a.skipped == [1]
    outcome = repair(layout, m, gpus(3, 100))
    assert outcome.repaired and set(outcome.device_map.values()) == {0, 1, 2}


def test_gpu_too_small_for_the_next_block_is_not_a_skip():
    layout = llm_layout()
    budgets = gpus(4, 20 * G)
    budgets[0] = G  # smaller than the 2.2 "GiB" embedding that must come first
    outcome = repair(layout, {"": 3}, budgets)
    assert outcome.repaired
    planned = outcome.planned
    assert 0 not in planned.used_gpus and planned.skipped == [] and planned.used_gpus == [1, 2, 3]
    # GPU 0 can take nothing (the embedding comes first), so the other three share evenly
    assert planned.max_gpu_load <= 1.10 * layout.total / 3


def test_balanced_low_0_keeps_gpu0_empty_and_is_not_a_skip():
    layout = llm_layout()
    budgets = gpus(4, 20 * G)
    outcome = repair(layout, {"": 3}, budgets, low_zero=True)
    assert outcome.repaired
    assert 0 not in outcome.planned.used_gpus and outcome.planned.used_gpus == [1, 2, 3]


def test_balanced_low_0_uses_gpu0_only_for_what_does_not_fit_elsewhere():
    layout = build_layout([(f"l{i}", 10) for i in range(10)])
    budgets = {0: 100, 1: 40, 2: 40}
    units = plan_units(layout, budgets, low_zero=True)
    assert [units[f"l{i}"] for i in range(10)] == [0, 0] + [1] * 4 + [2] * 4


def test_avoidable_offload_is_repaired_and_budgets_hold():
    layout = build_layout([(f"l{i}", 10) for i in range(10)])
    budgets = gpus(2, 60, cpu=1000)
    m = {**{f"l{i}": 0 for i in range(3)}, **{f"l{i}": 1 for i in range(3, 5)}}
    m.update({f"l{i}": "cpu" for i in range(5, 10)})
    outcome = repair(layout, m, budgets)
    assert outcome.original.verdict == OFFLOADED
    assert outcome.repaired and outcome.planned.offloaded == 0
    assert all(outcome.planned.bytes_per_device[g] <= 60 for g in (0, 1))


def test_necessary_offload_keeps_room_on_gpu0_for_the_largest_offloaded_block():
    layout = build_layout([(f"l{i}", 10) for i in range(10)])
    budgets = gpus(2, 30, cpu=1000)
    units = plan_units(layout, budgets)
    per = {}
    for name, dev in units.items():
        per[dev] = per.get(dev, 0) + 10
    assert per[0] <= 30 - 10, "GPU 0 keeps room to stream an offloaded block back in"
    assert per[1] <= 30 and per["cpu"] == 100 - per[0] - per[1]
    order = [units[f"l{i}"] for i in range(10)]
    rank = {0: 0, 1: 1, "cpu": 2, "disk": 3}
    assert [rank[d] for d in order] == sorted(rank[d] for d in order)
    a = assess(layout, units, budgets)
    assert a.verdict in (OK, IMBALANCED) and a.verdict != OFFLOADED


def test_disk_after_cpu():
    layout = build_layout([(f"l{i}", 10) for i in range(6)])
    units = plan_units(layout, {0: 20, "cpu": 20})
    assert [units[f"l{i}"] for i in range(6)] == [0, "cpu", "disk", "disk", "disk", "disk"]


def test_lower_bound_accounts_for_gpus_capped_below_an_even_share():
    from devmap_shims.planning import lower_bound

    layout = build_layout([(f"l{i}", 10) for i in range(12)])
    assert lower_bound(layout, gpus(3, 1000)) == 40
    assert lower_bound(layout, {0: 10, 1: 1000, 2: 1000}) == 55
    assert lower_bound(layout, {0: 1000, 1: 1000, 2: 1000}, low_zero=True) == 60
    assert lower_bound(layout, gpus(2, 30)) == 30  # does not fit: the largest budget


def test_user_caps_are_respected_even_when_they_hurt_balance():
    layout = build_layout([(f"l{i}", 10) for i in range(12)])
    budgets = {0: 10, 1: 200, 2: 200}
    units = plan_units(layout, budgets)
    loads = {}
    for name, dev in units.items():
        loads[dev] = loads.get(dev, 0) + 10
    assert loads[0] <= 10 and loads[1] <= 200 and loads[2] <= 200


def test_imbalance_that_cannot_be_improved_is_not_touched():
    # two blocks of very different size on two GPUs: 90/10 is the only split
    layout = build_layout([("a", 90), ("b", 10)])
    outcome = repair(layout, {"a": 0, "b": 1}, gpus(2, 100))
    assert outcome.original.verdict == OK  # bound is the 90 block
    # 160 over two GPUs: the bound is 80, but [60 | 50 50] is the best contiguous split, so that
    # map is not blamed (1.25x the bound); [60 50 | 50] is, and is repaired to the best split
    layout = build_layout([("a", 60), ("b", 50), ("c", 50)])
    outcome = repair(layout, {"a": 0, "b": 1, "c": 1}, gpus(2, 200))
    assert outcome.original.verdict == OK and outcome.original.ratio > 1.10
    assert not outcome.repaired
    outcome = repair(layout, {"a": 0, "b": 0, "c": 1}, gpus(2, 200))
    assert outcome.original.verdict == IMBALANCED and outcome.planned.max_gpu_load == 100


def test_a_map_no_contiguous_split_beats_is_never_degenerate():
    """Whole blocks in module order: an earlier GPU can take only the first block, a later one
    only the last, and the even share is often out of reach; such maps are "ok"."""
    # one GPU in use, but GPU 0 (20) cannot take the first block (30): nothing better exists
    layout = build_layout([("embed", 30), ("layer", 20)])
    outcome = repair(layout, {"": 1}, {0: 20, 1: 80})
    assert outcome.original.verdict == OK and not outcome.repaired
    # the same map when GPU 0 can take the first block is collapsed, and repaired
    outcome = repair(layout, {"": 1}, {0: 30, 1: 80})
    assert outcome.original.verdict == COLLAPSED and outcome.repaired
    # three equal blocks on two GPUs: 200 on the busiest is the best there is
    layout = build_layout([("a", 100), ("b", 100), ("c", 100)])
    outcome = repair(layout, {"a": 0, "b": 0, "c": 1}, gpus(2, 1000))
    assert outcome.original.verdict == OK and outcome.original.ratio == pytest.approx(200 / 150)


def test_map_that_splits_a_unit_is_not_judged():
    layout = llm_layout()
    bad = {"model.embed_tokens": 0, "model.layers.0.mlp": 1, "": 2}
    outcome = repair(layout, bad, gpus(8, 20 * G))
    assert not outcome.repaired and outcome.original is None


def test_non_integer_devices_are_not_judged():
    layout = llm_layout()
    outcome = repair(layout, {"": "mps"}, {"mps": 100 * G, "cpu": 100 * G})
    assert not outcome.repaired and "mps" in outcome.reason


def test_unclean_output_has_one_entry_per_unit():
    layout = llm_layout(layers=4)
    outcome = repair(layout, {"": 3}, gpus(4, 20 * G), clean=False)
    assert set(outcome.device_map) == {u.name for u in layout.units}


def test_compact_map_merges_modules_like_clean_device_map():
    layout = llm_layout(layers=4)
    units = {u.name: 0 for u in layout.units}
    assert layout.compact_map(units) == {"": 0}
    units["lm_head"] = 1
    assert layout.compact_map(units) == {"model": 0, "lm_head": 1}


class FakeModule:
    """Just enough of nn.Module for the walk."""

    def __init__(self, children=(), params=(), buffers=()):
        self._children = list(children)
        self._params = list(params)
        self._buffers = list(buffers)

    def named_children(self):
        return iter(self._children)

    def named_parameters(self, recurse=False):
        return iter(self._params)

    def named_buffers(self, recurse=False):
        return iter(self._buffers)


class DecoderLayer(FakeModule):
    pass


def test_compact_map_keeps_devices_of_different_types_apart():
    """0 and False, 1 and "1" are equal in Python but not the same placement to accelerate: a
    compact map never merges them into one entry, down the module tree (a walked layout) as by
    name (a layout from plain data)."""
    block = FakeModule([("a", FakeModule()), ("b", FakeModule())])
    walked = layout_from_module(FakeModule([("block", block), ("head", FakeModule())]), {})
    assert walked.spans is not None
    by_name = Layout.of(walked.names, walked.sizes, walked.children)
    cases = [
        ({"block.a": 0, "block.b": False, "head": False}, {"block.a": 0, "block.b": False, "head": False}),
        ({"block.a": 1, "block.b": "1", "head": 1}, {"block.a": 1, "block.b": "1", "head": 1}),
        ({"block.a": 0, "block.b": 0, "head": 1}, {"block": 0, "head": 1}),
        ({"block.a": "cpu", "block.b": "cpu", "head": "cpu"}, {"": "cpu"}),
    ]
    for units, expected in cases:
        assert walked.compact_map(units) == expected
        assert by_name.compact_map(units) == expected


def test_layout_from_module_walks_like_accelerate():
    layer = lambda: DecoderLayer([("mlp", FakeModule(params=[("weight", None)]))])  # noqa: E731
    model = FakeModule(
        [
            ("model", FakeModule([
                ("embed", FakeModule(params=[("weight", None)])),
                ("layers", FakeModule([("0", layer()), ("1", layer())])),
            ], buffers=[("scale", None)])),
            ("head", FakeModule(params=[("weight", None)])),
        ],
        params=[("logit_bias", None)],
    )
    sizes = {"model.embed": 100, "model.layers.0": 10, "model.layers.1": 10, "model.scale": 1, "head": 0, "logit_bias": 3}
    layout = layout_from_module(model, sizes, ["DecoderLayer"], [["model.embed.weight", "head.weight"]])
    assert [u.name for u in layout.units] == [
        "logit_bias", "model.embed", "model.layers.0", "model.layers.1", "model.scale", "head",
    ]
    assert layout.followers == {"head": "model.embed"}
    assert layout.unit_of("model.layers.1.mlp.weight") == "model.layers.1"
    assert layout.total == 124 and layout.largest == 100


@pytest.mark.parametrize("bad_budget", [{0: 10, "xpu:1": 10}, {True: 10}])
def test_supported_budgets(bad_budget):
    from devmap_shims.planning.repair import supported_budgets

    assert supported_budgets(bad_budget)
    assert supported_budgets({0: 1, 1: 2, "cpu": 3, "disk": 4}) is None


def test_gpu0_left_empty_by_the_offload_reserve_is_not_a_skip():
    # DeepSeek-V3-shaped: every layer (21 "GiB") is bigger than what GPU 0 has left (24 - 21) once
    # accelerate keeps room there for streaming an offloaded layer back in
    layout = build_layout([(f"l{i}", 21 * G) for i in range(8)])
    budgets = gpus(4, 24 * G, cpu=1000 * G)
    m = {"l0": 1, "l1": 2, "l2": 3, **{f"l{i}": "cpu" for i in range(3, 8)}}
    a = assess(layout, layout.unit_devices(m), budgets)
    assert a.skipped == [] and a.verdict in (OK, IMBALANCED), a.problems
    assert not repair(layout, m, budgets).repaired
    # without offload there is nothing to reserve: GPU 0 could take l0, so it is a skip
    small = build_layout([(f"l{i}", 21 * G) for i in range(3)])
    b = assess(small, small.unit_devices({"l0": 1, "l1": 2, "l2": 3}), budgets)
    assert b.verdict == SKIPPED and b.skipped == [0]


# -- unavoidable offload and sequential maps ------------------------------------------------------


def test_unavoidable_offload_says_what_the_model_needs_and_what_the_gpus_offer():
    """100 bytes of layers on two 30-byte GPUs: GPU 0 keeps 10 free to stream an offloaded
    layer in, so 50 bytes of GPU room and 50 bytes that no placement keeps on the GPUs."""
    layout = build_layout([(f"l{i}", 10) for i in range(10)])
    budgets = gpus(2, 30, cpu=1000)
    m = {"l0": 0, "l1": 0, "l2": 1, "l3": 1, "l4": 1, **{f"l{i}": "cpu" for i in range(5, 10)}}
    a = assess(layout, m, budgets)
    assert a.verdict == OK and a.unavoidable and a.offloaded == 50
    assert a.reserve == 10 and a.gpu_room == 50
    reason = a.offload_reason(layout.total)
    assert reason.startswith("offload unavoidable: the model needs 100 B, the 2 GPUs offer 50 B")
    assert "after accelerate's reserves (10 B kept free on GPU 0" in reason
    assert reason.endswith("50 B goes to the CPU in whole modules")


def test_avoidable_offload_is_not_called_unavoidable():
    layout = build_layout([(f"l{i}", 10) for i in range(10)])
    m = {**{f"l{i}": 0 for i in range(3)}, **{f"l{i}": 1 for i in range(3, 5)}}
    m.update({f"l{i}": "cpu" for i in range(5, 10)})
    a = assess(layout, m, gpus(2, 60, cpu=1000))
    assert a.verdict == OFFLOADED and not a.unavoidable
    assert a.offload_reason(layout.total) == ""


def test_offload_beyond_the_best_prefix_is_not_called_unavoidable():
    """A map that offloads a large block justifies a large reserve on GPU 0, but a placement that
    keeps that block on a GPU needs less: 84 bytes offloaded where 24 have to be is avoidable,
    and the repair offloads only those 24 (the last block), room for it kept on GPU 0."""
    sizes = [7, 8, 4, 1, 8, 1, 1, 6]
    layout = build_layout([(f"l{i}", 4 * s) for i, s in enumerate(sizes)])
    budgets = {0: 56, 1: 52, 2: 44, "cpu": 1000}
    library = {"l0": 1, "l1": 2, **{f"l{i}": "cpu" for i in range(2, 8)}}
    a = assess(layout, library, budgets)
    assert a.verdict == OFFLOADED and not a.unavoidable and a.offloaded == 84
    out = repair(layout, library, budgets, clean=False)
    assert out.repaired and out.planned.verdict == OK and out.planned.unavoidable
    assert out.planned.offloaded == 24 and out.device_map["l7"] == "cpu"
    assert sum(4 * s for i, s in enumerate(sizes) if out.device_map[f"l{i}"] == 0) <= 56 - 24


def test_a_gpu_holding_only_a_tied_weight_gets_a_verdict():
    """A map that puts a tied weight on a later GPU than the weight it is tied to (possible in a
    user's map) leaves that GPU with bytes but no block of its own: still judged, GPU 1 skipped."""
    layout = build_layout([("a", 0), ("b", 5), ("c", 5), ("d", 5)], tied_groups=[["a", "d"]])
    a = assess(layout, {"a": 0, "b": 0, "c": 0, "d": 2}, gpus(3, 100))
    assert a.verdict == SKIPPED and a.skipped == [1]


def test_no_offload_has_no_reason():
    layout = build_layout([(f"l{i}", 10) for i in range(10)])
    a = assess(layout, {f"l{i}": i // 5 for i in range(10)}, gpus(2, 60))
    assert a.verdict == OK and not a.unavoidable and a.offload_reason(layout.total) == ""


def test_a_sequential_map_on_one_gpu_is_not_collapsed_nor_imbalanced():
    """sequential fills GPU 0 first on purpose; the same map under auto is collapsed."""
    layout = build_layout([(f"l{i}", 10) for i in range(10)])
    m = {f"l{i}": 0 for i in range(10)}
    assert assess(layout, m, gpus(4, 200)).verdict == COLLAPSED
    assert assess(layout, m, gpus(4, 200), in_order=True).verdict == OK
    uneven = {f"l{i}": 0 if i < 8 else 1 for i in range(10)}
    assert assess(layout, uneven, gpus(2, 200)).verdict == IMBALANCED
    assert assess(layout, uneven, gpus(2, 200), in_order=True).verdict == OK


def test_a_sequential_map_still_may_skip_a_gpu():
    layout = build_layout([(f"l{i}", 10) for i in range(8)])
    m = {f"l{i}": (0 if i < 4 else 2) for i in range(8)}
    a = assess(layout, m, gpus(3, 100), in_order=True)
    assert a.verdict == SKIPPED and a.skipped == [1]


def test_unavoidable_offload_with_room_in_total_blames_the_largest_block():
    """A 40-byte first block and four 30-byte GPUs: 80 bytes of room (40 kept free on GPU 0) for
    a 50-byte model, but the first block fits no GPU, and what follows it in order stays off too."""
    layout = build_layout([("embed", 40), ("l0", 5), ("l1", 5)])
    budgets = gpus(4, 30, cpu=1000)
    a = assess(layout, {"embed": "cpu", "l0": "cpu", "l1": "cpu"}, budgets)
    assert a.verdict == OK and a.unavoidable
    reason = a.offload_reason(layout.total)
    assert "as much as the model's 50 B, but not in whole blocks placed in order" in reason
    assert "the largest block (40 B) is larger than every GPU's budget (largest budget 30 B)" in reason


def test_one_gpu_holding_what_no_split_could_spread_is_not_collapsed():
    """A small embedding, then layers larger than every GPU: the embedding on GPU 1 and the rest on
    the CPU is the best a contiguous placement does (GPU 0 keeps a layer's room free), not a
    collapse onto one GPU; the same loads with layers that fit the other GPUs are one."""
    layout = build_layout([("embed", 5)] + [(f"l{i}", 40) for i in range(4)] + [("head", 5)])
    m = {"embed": 1, **{f"l{i}": "cpu" for i in range(4)}, "head": "cpu"}
    a = assess(layout, m, gpus(4096, 30, cpu=1000))
    assert not a.collapsed and a.verdict == OK and a.unavoidable, a.problems
    # GPU 0 (3) less the room it keeps for streaming an offloaded block (4) takes no block of 4
    small_gpu0 = build_layout([(f"l{i}", 4) for i in range(10)])
    c = assess(small_gpu0, {f"l{i}": 1 if i < 3 else "cpu" for i in range(10)}, {0: 3, 1: 12, "cpu": 1000})
    assert not c.collapsed and c.verdict == OK and c.unavoidable, c.problems
    spreadable = build_layout([(f"l{i}", 10) for i in range(6)])
    b = assess(spreadable, {f"l{i}": 1 if i < 3 else "cpu" for i in range(6)}, gpus(4, 30, cpu=1000))
    assert b.collapsed and b.verdict == COLLAPSED
