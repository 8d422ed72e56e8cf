"""The planning arithmetic (what ``plan`` and the device-map shim judge maps with) counts a module
tied to several parameters of another once: accelerate's ``get_module_size_with_ties`` does not
(row accelerate-tied-size-overcount)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

from devmap_shims.planning import layout_from_module  # noqa: E402
from devmap_shims.planning.assess import OFFLOADED, OK, assess  # noqa: E402
from devmap_shims.testing.models.tied import TIED_NO_SPLIT, tied_backbone_model, tied_backbone_sizes  # noqa: E402


def test_each_encoder_layer_carries_its_decoder_layer_once():
    model = tied_backbone_model(layers=3)
    sizes = tied_backbone_sizes(model)
    layout = _layout(model)
    assert [u.name for u in layout.placed] == [f"encoder.layers.{i}" for i in range(3)]
    assert layout.followers == {f"decoder.layers.{i}": f"encoder.layers.{i}" for i in range(3)}
    per_layer = sizes["encoder_layer"] + sizes["decoder_layer_own"]
    assert [u.size for u in layout.placed] == [per_layer] * 3
    assert layout.total == sizes["total"] and layout.largest == per_layer


def _layout(model):
    from accelerate.utils.modeling import compute_module_sizes, find_tied_parameters

    return layout_from_module(model, compute_module_sizes(model), TIED_NO_SPLIT, find_tied_parameters(model))


def test_the_map_accelerate_gives_without_the_shim_is_degenerate_and_the_shims_keep_every_layer_on_a_gpu():
    model = tied_backbone_model(layers=3)
    sizes = tied_backbone_sizes(model)
    layout = _layout(model)
    budgets = {0: 100_000, 1: 120_000, "cpu": 10**9}
    # accelerate 1.2-1.15 alone: GPU 0 skipped, two layers to the CPU; with the shim: both GPUs
    accelerate_alone = {"encoder.layers.0": 1, "decoder.layers.0": 1, "encoder.layers.1": "cpu",
                        "decoder.layers.1": "cpu", "encoder.layers.2": "cpu", "decoder.layers.2": "cpu"}
    with_shim = {"encoder.layers.0": 0, "decoder.layers.0": 0, "encoder.layers.1": 1, "decoder.layers.1": 1,
                 "encoder.layers.2": 1, "decoder.layers.2": 1}
    alone = assess(layout, layout.unit_devices(accelerate_alone), budgets)
    # not "collapsed": GPU 1 holds one layer, which no split could spread; the layers on the CPU fit the GPUs
    assert alone.verdict == OFFLOADED and alone.offloaded == 2 * (sizes["encoder_layer"] + sizes["decoder_layer_own"])
    assert alone.skipped == [0] and not alone.collapsed
    # the shims' map is uneven (over 1.10x the bound) but no contiguous split of these layers does
    # better, so it is not blamed; nothing is offloaded
    shimmed = assess(layout, layout.unit_devices(with_shim), budgets)
    assert shimmed.verdict == OK and shimmed.ratio > 1.10
    assert shimmed.offloaded == 0 and not shimmed.skipped
