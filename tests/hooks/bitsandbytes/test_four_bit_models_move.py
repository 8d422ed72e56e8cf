"""The four-bit-models-move shim with real pre-quantized 4-bit transformers models on simulated GPUs.

A moved model is compared, tensor by tensor (packed weights, every quant-state tensor, flags, other
parameters and buffers, devices included), with the same checkpoint loaded straight onto the target
device: bitsandbytes' 4-bit forward reads nothing else. Where bitsandbytes runs 4-bit matmuls without
its CUDA library (0.46 and later), forward outputs of a moved model are compared with the unmoved
model too. Where the matrix says the row applies, the tests first show transformers refusing the
move without the shim.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")  # imported before any simulation starts (it probes CUDA)
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from bitsandbytes.nn import Params4bit  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import devmap_shims  # noqa: E402
from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.devices.quant_state import state_tensors  # noqa: E402
from devmap_shims.hooks.bitsandbytes import four_bit_models_move as hook  # noqa: E402
from devmap_shims.testing.nf4 import linear4bit  # noqa: E402
from devmap_shims.versions import installed_versions, version_in  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

MATRIX = load_matrix()
VERSIONS = installed_versions(MATRIX.distributions())
HERE = MATRIX.get(hook.BUG_ID).applies(VERSIONS)
KERNELS = version_in(VERSIONS["bitsandbytes"], ">=0.46.0")  # older ones need their CUDA library for matmuls
SIM = pytest.mark.simulated_gpus(n=2, memory="2GiB")
PATH = hook.prequantized_llama_dir()


def load(device):
    return AutoModelForCausalLM.from_pretrained(PATH, device_map={"": device})


def devices(model):
    found = {str(t.device) for t in list(model.parameters()) + list(model.buffers())}
    for param in model.parameters():
        state = param.__dict__.get("quant_state")
        found |= {str(t.device) for _o, _a, _n, t in state_tensors(state)} if state is not None else set()
    return found


def same_as_loaded_on(model, device):
    return hook.differences(hook.four_bit_state(model), hook.four_bit_state(load(device)))


# -- what the user sees -----------------------------------------------------------------------------
@SIM
def test_without_the_shim_transformers_refuses_where_the_matrix_says(no_shim):
    model = load(0)
    if not HERE:
        model.to("cuda:1")
        assert next(model.parameters()).device == torch.device("cuda", 1)
        return
    for move in (lambda: model.to("cuda:1"), lambda: model.to("cpu"), lambda: model.cuda(1)):
        with pytest.raises(ValueError, match="not supported for `4-bit`"):
            move()
    assert devices(model) == {"cuda:0"}


ONLY_HERE = pytest.mark.skipif(not HERE, reason="transformers moves 4-bit models itself here")


@SIM
@ONLY_HERE
def test_with_the_shim_moved_models_equal_models_loaded_there(shim):
    model = load(0)
    assert model.to("cuda:1") is model
    assert same_as_loaded_on(model, 1) == [] and devices(model) == {"cuda:1"}
    model.to("cpu")
    assert devices(model) == {"cpu"}
    model.to(torch.device("cuda", 0))
    assert same_as_loaded_on(model, 0) == [] and devices(model) == {"cuda:0"}
    assert all(p.bnb_quantized for p in model.parameters() if isinstance(p, Params4bit))


@SIM
@ONLY_HERE
def test_cuda_moves_a_refused_model_to_the_device_asked_for(shim):
    model = load(0)
    assert model.cuda(1) is model
    assert same_as_loaded_on(model, 1) == []
    torch.cuda.set_device(1)
    model.to("cpu").cuda()
    assert same_as_loaded_on(model, 1) == []


@SIM
@ONLY_HERE
def test_dtype_casts_are_still_refused(shim):
    model = load(0)
    for cast in (lambda: model.to(torch.float16), lambda: model.to("cuda:1", torch.float16),
                 lambda: model.to(torch.zeros(1, dtype=torch.float16))):
        with pytest.raises(ValueError, match="not supported"):
            cast()
    assert devices(model) == {"cuda:0"} and same_as_loaded_on(model, 0) == []


def test_models_with_8bit_weights_are_not_4bit_models():
    model = torch.nn.Sequential(bnb.nn.Linear8bitLt(8, 8, has_fp16_weights=True))
    model.quantization_method, model.is_loaded_in_4bit = "bitsandbytes", True
    assert not hook.is_4bit_model(model)
    model[0] = linear4bit(torch.nn.Linear(8, 8), "cpu")
    assert hook.is_4bit_model(model)
    model.quantization_method = "gptq"
    assert not hook.is_4bit_model(model)


@SIM
def test_with_every_shim_installed_the_moved_model_runs_on_its_new_device(no_shim):
    devmap_shims.install()
    model = load(0)
    model.to("cuda:1")
    assert same_as_loaded_on(model, 1) == []
    hook_device = getattr(getattr(model, "_hf_hook", None), "execution_device", None)
    assert hook_device in (None, 1, "cuda:1", torch.device("cuda", 1))  # accelerate < 1.2 hooks 4-bit models
    if KERNELS:
        ids = torch.tensor([[1, 5, 9, 2]])
        with torch.no_grad():
            assert torch.equal(model(ids.to("cuda:1")).logits.cpu(), load(0)(ids.to("cuda:0")).logits.cpu())


@SIM
@ONLY_HERE
def test_the_shims_move_puts_left_state_and_lost_flags_right(shim):
    """What a move leaves behind (QuantState.to skips ``code`` before 0.45.3) and a weight marked
    unquantized (by an earlier Params4bit.to before 0.46.1) are put right by the shim's move."""
    model = load(0)
    layer = model.model.layers[0].self_attn.q_proj
    layer.weight.__dict__["bnb_quantized"] = False
    model.to("cuda:1")
    assert layer.weight.bnb_quantized is True
    assert same_as_loaded_on(model, 1) == [] and devices(model) == {"cuda:1"}


@SIM
def test_where_transformers_moves_the_model_the_shim_changes_nothing(no_shim):
    if HERE:
        pytest.skip("transformers refuses the move here")
    expected = hook.four_bit_state(load(0).to("cuda:1"))
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    assert hook.differences(hook.four_bit_state(load(0).to("cuda:1")), expected) == []


CUDA_NOOP = MATRIX.get(hook.CUDA_BUG).applies(VERSIONS)


@SIM
@pytest.mark.skipif(not CUDA_NOOP, reason="transformers' .cuda() moves 4-bit models (or refuses them) here")
def test_a_cuda_call_that_returned_none_moves_the_model_and_returns_it(no_shim):
    model = load(0)
    assert model.cuda(1) is None and devices(model) == {"cuda:0"}  # transformers 4.45-4.52 alone
    devmap_shims.install(only=[hook.SHIM.id])
    model = load(0)
    assert model.cuda(1) is model and same_as_loaded_on(model, 1) == []
    torch.cuda.set_device(0)
    assert model.cuda() is model and same_as_loaded_on(model, 0) == []  # no index: the current GPU


@pytest.mark.skipif(not CUDA_NOOP, reason="transformers' .cuda() moves 4-bit models (or refuses them) here")
def test_a_move_torch_refuses_raises_to_the_caller_and_the_shim_stays_on(no_shim):
    # the repair's move is torch's own, as on transformers' fixed releases: a GPU that cannot hold
    # the model, or an argument torch's .cuda() does not take, is the caller's error, raised as such,
    # not a broken repair answered with None and a shim switched off
    from devmap_shims.testing import simulated_gpus

    with simulated_gpus(2, memory="2GiB"):
        size = sum(p.numel() * p.element_size() for p in load(0).parameters())
    devmap_shims.install(only=[hook.SHIM.id])
    with simulated_gpus(2, memory=["2GiB", size // 2]):  # cuda:1 holds half of the model
        model = load(0)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            model.cuda(1)
        with pytest.raises(TypeError, match="non_blocking"):
            load(0).cuda(0, non_blocking=True)
        state = next(s for s in devmap_shims.status()["shims"] if s["id"] == hook.SHIM.id)
        assert state["state"] == "active" and state["call_failures"] == 0
        model = load(0)
        assert model.cuda(0) is model and devices(model) == {"cuda:0"}  # and it still repairs
