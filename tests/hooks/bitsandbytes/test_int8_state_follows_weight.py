"""The int8-state-follows-weight shim with the real ``Linear8bitLt`` of the installed bitsandbytes,
on simulated GPUs. Where the matrix says the bug applies, the tests first show it without the shim."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")  # imported before any simulation starts (it probes CUDA)

from bitsandbytes.nn import Linear8bitLt  # noqa: E402

from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.devices.int8_state import align_int8_state, int8_state_off_device  # noqa: E402
from devmap_shims.hooks.bitsandbytes import int8_state_follows_weight as hook  # noqa: E402
from devmap_shims.versions import installed_version, installed_versions, version_in  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)
if not version_in(installed_version("bitsandbytes") or "0", ">=0.46.0"):
    pytest.skip("bitsandbytes before 0.46 quantizes to 8-bit with its CUDA library only", allow_module_level=True)

MATRIX = load_matrix()
BUG_HERE = MATRIX.get(hook.BUG_ID).applies(installed_versions(MATRIX.distributions()))
SIM = pytest.mark.simulated_gpus(n=2, memory="1GiB")


@pytest.fixture(autouse=True)
def inference():
    with torch.no_grad():  # the simulator runs inference only
        yield


def model_and_input():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Linear8bitLt(64, 32, has_fp16_weights=False), torch.nn.ReLU())
        return model, torch.randn(4, 64).half()


def holders(layer):
    return {"weight.CB": layer.weight.CB, "weight.SCB": layer.weight.SCB,
            "state.CB": layer.state.CB, "state.SCB": layer.state.SCB}


@SIM
def test_without_the_shim_a_moved_layer_fails_where_the_matrix_says(no_shim):
    model, x = model_and_input()
    model.to("cuda:0")
    reference = model(x.to("cuda:0")).cpu()
    model.to("cuda:1")
    assert str(model[0].weight.device) == "cuda:1"
    if BUG_HERE:
        assert str(model[0].state.CB.device) == "cuda:0"
        with pytest.raises(RuntimeError, match="same device"):
            model(x.to("cuda:1"))
    else:
        assert torch.equal(model(x.to("cuda:1")).cpu(), reference)


@SIM
@pytest.mark.parametrize("run_first", [True, False], ids=["after-forward", "before-forward"])
def test_with_the_shim_the_moved_layer_gives_the_same_output(shim, run_first):
    model, x = model_and_input()
    model.to("cuda:0")
    reference = model(x.to("cuda:0")).cpu() if run_first else None
    model.to("cuda:1")
    out = model(x.to("cuda:1"))
    assert str(out.device) == "cuda:1"
    layer = model[0]
    assert not int8_state_off_device(layer)
    assert layer.state.CB.data_ptr() == layer.weight.data.data_ptr()
    if reference is not None:
        assert torch.equal(out.cpu(), reference)
    model.to("cuda:0")  # and back
    assert torch.equal(model(x.to("cuda:0")).cpu(), out.cpu())


@SIM
def test_the_wrapper_leaves_an_aligned_layer_alone(shim):
    model, x = model_and_input()
    model.to("cuda:1")
    model(x.to("cuda:1"))
    layer = model[0]
    before = holders(layer)
    assert align_int8_state(layer) == 0
    calls = []
    hook.realign_before_forward(lambda *a: calls.append(a) or "out", layer, (x,), {})
    assert calls == [(x,)]
    assert all(holders(layer)[k] is v for k, v in before.items())


def test_an_unquantized_layer_passes_through(shim):
    layer = Linear8bitLt(8, 4, has_fp16_weights=True)
    assert not hook.is_int8_linear(layer)
    weight = layer.weight.data.clone()
    assert layer(torch.randn(2, 8)).shape == (2, 4)
    assert torch.equal(layer.weight.data, weight)
