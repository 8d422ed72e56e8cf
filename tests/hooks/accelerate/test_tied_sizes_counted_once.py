"""tied-sizes-counted-once: each tied module counted once, the original's answer where nothing repeats,
no IndexError for a tied module placed already; on the real accelerate, alone and with the other
device-map shims."""

from __future__ import annotations

import os

import pytest

from devmap_shims.hooks.accelerate import tied_sizes_counted_once as hook

SENTINEL = object()


def _never(*args, **kwargs):
    raise AssertionError("the original must not run for a call the shim repairs")


def _returns_sentinel(*args, **kwargs):
    return SENTINEL


# -- the sum, on accelerate's argument shapes (no library needed) ------------------------------------
MODULES = [("dec", "DEC"), ("head", "HEAD")]
SIZES = {"dec": 1000, "dec.q": 0, "dec.k": 0, "dec.v": 0, "head": 300, "head.w": 0}


def test_a_module_holding_several_tied_parameters_is_counted_once(direct):
    repair = direct(hook.SHIM, hook.count_tied_modules_once)
    tied = ["dec.q", "dec.k", "head.w", "dec.v"]
    size, names, modules = repair(_never, None, (tied, 50, SIZES, MODULES), {})
    assert (size, names, modules) == (50 + 1000 + 300, ["dec", "head"], ["DEC", "HEAD"])


def test_each_tied_parameters_own_size_is_still_subtracted_as_accelerate_does(direct):
    repair = direct(hook.SHIM, hook.count_tied_modules_once)
    sizes = dict(SIZES, **{"dec.q": 10, "dec.k": 20})
    size, _, _ = repair(_never, None, (), dict(tied_params=["dec.q", "dec.k"], module_size=50, module_sizes=sizes,
                                                 modules_to_treat=MODULES))
    assert size == 50 + 1000 - 10 - 20


@pytest.mark.parametrize("tied", [[], ["dec.q"], ["dec.q", "head.w"]])
def test_without_a_repeated_module_the_original_answers(direct, tied):
    repair = direct(hook.SHIM, hook.count_tied_modules_once)
    assert repair(_returns_sentinel, None, (tied, 50, SIZES, MODULES), {}) is SENTINEL


def test_a_tied_module_placed_already_adds_nothing_instead_of_raising(direct):
    repair = direct(hook.SHIM, hook.count_tied_modules_once)
    placed_already = [("head", "HEAD")]  # "dec" went to a device with an earlier part of this module
    assert repair(_never, None, (["dec.q", "head.w"], 50, SIZES, placed_already), {}) == (350, ["head"], ["HEAD"])
    assert repair(_never, None, (["dec.q"], 50, SIZES, placed_already), {}) == (50, [], [])


def test_a_module_is_found_by_its_name_and_a_dot_not_as_a_prefix(direct):
    repair = direct(hook.SHIM, hook.count_tied_modules_once)
    modules = [("layers.1", "ONE"), ("layers.10", "TEN")]
    sizes = {"layers.1": 7, "layers.10": 100, "layers.10.a": 0, "layers.10.b": 0}
    assert repair(_never, None, (["layers.10.a", "layers.10.b"], 5, sizes, modules), {}) == (105, ["layers.10"], ["TEN"])


# -- on the real accelerate ---------------------------------------------------------------------------
@pytest.fixture
def modeling():
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    import accelerate.utils.modeling as modeling

    if not hasattr(modeling, "get_module_size_with_ties"):
        pytest.skip("accelerate < 1.2.0 sizes tied modules inside infer_auto_device_map (no shim)")
    return modeling


def _encoder_call(modeling, model):
    """The arguments ``infer_auto_device_map`` passes when it treats ``encoder``."""
    sizes = modeling.compute_module_sizes(model)
    tied = [p for group in modeling.find_tied_parameters(model) for p in group if not p.startswith("encoder.")]
    return tied, sizes["encoder"], sizes, [("decoder", model.decoder)]


def test_the_tied_backbone_is_sized_as_its_bytes_where_accelerate_counts_the_decoder_eight_times(modeling, direct):
    from devmap_shims.testing.models.tied import tied_backbone_model, tied_backbone_sizes

    model = tied_backbone_model()
    sizes = tied_backbone_sizes(model)
    tied, encoder, module_sizes, modules = _encoder_call(modeling, model)
    assert len(tied) == 8
    original = modeling.get_module_size_with_ties
    accelerate_says = original(tied, encoder, module_sizes, modules)[0]
    assert accelerate_says == encoder + 8 * module_sizes["decoder"]  # the bug, on this stack
    size, names, _ = direct(hook.SHIM, hook.count_tied_modules_once)(original, None, (tied, encoder, module_sizes, modules), {})
    assert (size, names) == (sizes["total"], ["decoder"])


def test_a_single_tie_gets_accelerates_own_answer(modeling, direct):
    import torch

    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16, bias=False))
    model[2].weight = model[0].weight
    module_sizes = modeling.compute_module_sizes(model)
    args = (["2.weight"], module_sizes["0"], module_sizes, [("1", model[1]), ("2", model[2])])
    original = modeling.get_module_size_with_ties
    assert direct(hook.SHIM, hook.count_tied_modules_once)(original, None, args, {}) == original(*args)


def _three_layer_map(max_memory):
    from accelerate import infer_auto_device_map, init_empty_weights

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models.tied import TIED_NO_SPLIT, tied_backbone_model

    with simulated_gpus(2, memory="1GiB"):
        with init_empty_weights():
            model = tied_backbone_model(layers=3)  # 138,240 bytes: more than one GPU holds below
        return infer_auto_device_map(model, max_memory=dict(max_memory, cpu=10**9), no_split_module_classes=list(TIED_NO_SPLIT))


def test_a_model_over_one_gpu_is_split_over_both_with_each_layer_beside_its_tied_layer(modeling, shim):
    from devmap_shims.shims import wrapping

    assert wrapping.is_ours(vars(modeling)["get_module_size_with_ties"])
    device_map = _three_layer_map({0: 100_000, 1: 120_000})
    assert set(device_map.values()) == {0, 1}, device_map
    for i in range(3):
        assert device_map[f"encoder.layers.{i}"] == device_map[f"decoder.layers.{i}"], device_map


def test_accelerate_raises_index_error_where_the_shim_maps_the_model(modeling, no_shim):
    # GPU 0 holds the first encoder layer with the whole decoder; the next encoder layer's tied
    # module (the decoder) is then no longer in the list accelerate looks it up in
    with pytest.raises(IndexError):
        _three_layer_map({0: 40_000, 1: 150_000})
    from devmap_shims.shims.engine import ENGINE

    assert ENGINE.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    device_map = _three_layer_map({0: 40_000, 1: 150_000})
    assert "cpu" not in device_map.values() and "disk" not in device_map.values(), device_map


def test_load_checkpoint_and_dispatch_auto_with_every_shim(modeling, tmp_path, no_shim):
    """The user's path: all shims installed (device-map-balance and split-module-buffers-placed wrap
    infer_auto_device_map too), device_map="auto", a forward equal to the CPU's."""
    import torch
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    import devmap_shims
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models.tied import TIED_NO_SPLIT, tied_backbone_model

    reference = tied_backbone_model()
    path = os.path.join(tmp_path, "model.bin")
    torch.save(reference.state_dict(), path)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(1))
    devmap_shims.install(force=[hook.SHIM.id])
    try:
        active = {s["id"]: s["state"] for s in devmap_shims.status()["shims"]}
        assert active[hook.SHIM.id] == "active"
        with torch.no_grad(), simulated_gpus(2, memory="1GiB"):
            with init_empty_weights():
                model = tied_backbone_model()
            model = load_checkpoint_and_dispatch(model, path, device_map="auto", no_split_module_classes=list(TIED_NO_SPLIT),
                                                 max_memory={0: 120_000, 1: 120_000, "cpu": 10**9})
            device_map = dict(model.hf_device_map)
            devices = set(device_map.values())
            # one device: dispatch_model moves the model there without hooks, so the input goes too
            out = model(x.to(f"cuda:{devices.pop()}") if len(devices) == 1 else x).cpu()
            expected = reference(x)
    finally:
        devmap_shims.uninstall()
    assert set(device_map.values()) <= {0, 1} and 0 in device_map.values(), device_map
    assert torch.allclose(out, expected, atol=1e-5)
