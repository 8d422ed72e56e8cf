"""one-device-4bit-unhooked: which dispatched models lose accelerate's hooks, and that nothing else does.

Real ``accelerate.dispatch_model`` on simulated GPUs with the shim forced on (so every stack checks
the wrapper, fixed accelerate releases included, where it finds no hooks to remove).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("bitsandbytes")

from devmap_shims.hooks.accelerate import one_device_4bit_unhooked as hook  # noqa: E402
from devmap_shims.testing import simulated_gpus  # noqa: E402


@pytest.fixture
def gpus():
    with simulated_gpus(2, memory="1GiB"):
        yield


def two_layers(quantized: bool, devices=("cuda:0", "cuda:0")):
    """Two linears, 4-bit ones made on ``devices`` (where a device map will want them: moving 4-bit
    weights is another row's bug on older bitsandbytes)."""
    from devmap_shims.testing.nf4 import linear4bit

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    if quantized:
        for index in range(2):
            model[index] = linear4bit(model[index], devices[index])
        # what transformers' and diffusers' bitsandbytes quantizers mark a model with
        model.is_quantized, model.quantization_method, model.is_loaded_in_4bit = True, "bitsandbytes", True
    else:
        model.to("cuda:0")
    return model


def dispatched(model, device_map, **kwargs):
    from accelerate import dispatch_model

    return dispatch_model(model, device_map=device_map, **kwargs)


def hooked(model) -> bool:
    return any(hasattr(m, "_hf_hook") for m in model.modules())


@pytest.mark.parametrize("device_map, expected", [
    ({"": 0}, True), ({"": "cuda:1"}, True), ({"0": 0, "1": 0}, True),
    ({"": "cpu"}, False), ({"0": 0, "1": 1}, False), ({}, False), (None, False),
    # one GPU spelled three ways in a hand-written map
    ({"0": 0, "1": "cuda:0", "2": torch.device("cuda", 0)}, True), ({"0": 0, "1": "disk"}, False),
])
def test_one_gpu(device_map, expected):
    assert hook.one_gpu(device_map) is expected


def test_a_one_gpu_4bit_model_is_left_without_hooks_or_guards(shim, gpus):
    if not hook.bnb_moves_4bit():
        pytest.skip("bitsandbytes < 0.43.2 cannot move 4-bit weights: the hooks stay (next test)")
    model = dispatched(two_layers(quantized=True), {"": 0})
    assert not hooked(model)
    assert not {"to", "cuda"} & set(vars(model))
    assert model[0].weight.device == torch.device("cuda:0") and hook.bnb_kinds(model) == {"Params4bit"}
    out = model.to("cuda:1")  # moves whole, as bitsandbytes >= 0.43.2 allows
    assert out[1].weight.device == torch.device("cuda:1")


@pytest.mark.parametrize("device_map, kwargs", [
    ({"0": 0, "1": 1}, {}),            # split over two GPUs: the hooks move activations between them
    ({"": 0}, {"force_hooks": True}),  # asked for
])
def test_hooks_that_are_needed_or_asked_for_stay(shim, gpus, device_map, kwargs):
    devices = tuple(f"cuda:{device_map.get(str(i), device_map.get(''))}" for i in range(2))
    assert hooked(dispatched(two_layers(quantized=True, devices=devices), device_map, **kwargs))


def accelerate_hooks_one_gpu_4bit() -> bool:
    """What the installed accelerate does by itself: before 1.2.0 it hooks every bitsandbytes model,
    from 1.2.0 only 4-bit ones whose bitsandbytes is older than 0.43.2."""
    from devmap_shims.versions import installed_version, version_in

    return version_in(installed_version("accelerate"), "<1.2.0") or not version_in(
        installed_version("bitsandbytes"), ">=0.43.2")


def test_with_a_bitsandbytes_that_cannot_move_4bit_weights_the_hooks_stay(shim, gpus, monkeypatch):
    monkeypatch.setattr(hook, "bnb_moves_4bit", lambda: False)
    assert hooked(dispatched(two_layers(quantized=True), {"": 0})) is accelerate_hooks_one_gpu_4bit()


def test_without_the_shim_accelerate_hooks_a_one_gpu_4bit_model_inside_the_row(no_shim, gpus):
    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.versions import installed_versions

    matrix = load_matrix()
    affected = matrix.get(hook.BUG_ID).applies(installed_versions(matrix.distributions()))
    is_hooked = hooked(dispatched(two_layers(quantized=True), {"": 0}))
    assert is_hooked is accelerate_hooks_one_gpu_4bit()
    if affected:
        assert is_hooked


def test_an_unquantized_model_is_not_touched(direct, gpus):
    model = two_layers(quantized=False)
    seen = []

    def dispatch(model, device_map, force_hooks=False):
        model._hf_hook = "kept"
        seen.append(device_map)
        return model

    assert direct(hook.SHIM, hook.unhook_one_device_4bit)(dispatch, None, (model, {"": 0}), {}) is model
    assert model._hf_hook == "kept" and seen == [{"": 0}]
