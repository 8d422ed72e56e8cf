"""The four-bit-models-move shim with real pre-quantized 4-bit transformers models on simulated GPUs.

A moved model is compared, tensor by tensor (packed weights, every quant-state tensor, flags, other
parameters and buffers, devices included), with the same checkpoint loaded straight onto the target
device. Where bitsandbytes runs 4-bit matmuls without its CUDA library (0.46 and later), forward
outputs after the moves are compared with the unmoved model too. Where the matrix says the row
applies, the tests first show transformers refusing the move without the shim.
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
from devmap_shims.testing.nf4 import linear4bit, params4bit  # noqa: E402
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


@SIM
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
@pytest.mark.skipif(not HERE, reason="transformers' own cuda() is used where it lets 4-bit models move")
def test_cuda_moves_a_refused_model_to_the_device_asked_for(shim):
    model = load(0)
    assert model.cuda(1) is model
    assert same_as_loaded_on(model, 1) == []
    torch.cuda.set_device(1)
    model.to("cpu").cuda()
    assert same_as_loaded_on(model, 1) == []


@SIM
def test_dtype_casts_are_still_refused(shim):
    if not HERE:
        pytest.skip("transformers decides about casts of 4-bit models here")
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


# -- Params4bit.to --------------------------------------------------------------------------------------
def weight(seed=0):
    return torch.randn(64, 128, generator=torch.Generator().manual_seed(seed))


@SIM
def test_params4bit_to_keeps_quant_storage_where_0_43_1_drops_it(no_shim):
    param = params4bit(weight(), "cuda:0", quant_storage=torch.bfloat16)
    assert param.dtype == torch.bfloat16
    unrepaired = param.to("cuda:1").quant_storage
    assert (unrepaired == torch.uint8) if HERE else (unrepaired == torch.bfloat16)
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    moved = param.to("cuda:1")
    assert moved.quant_storage == torch.bfloat16 and moved.bnb_quantized is True
    assert {str(t.device) for _o, _a, _n, t in state_tensors(moved.quant_state)} == {"cuda:1"}
    if HERE:  # from_prequantized leaves quant_storage unset before 0.43.2 (later .to() reads it)
        del param.__dict__["quant_storage"]
        assert param.to("cpu").quant_storage == torch.bfloat16


@SIM
def test_params4bit_moves_never_change_the_packed_data_or_the_state(shim):
    param = params4bit(weight(1), "cuda:0", compress_statistics=True)
    packed = param.data.cpu().clone()
    reference = {n: t.cpu().clone() for _o, _a, n, t in state_tensors(param.quant_state)}
    for device in ("cuda:1", "cpu", torch.device("cuda", 0), "cuda:1"):
        param = param.to(device)
        assert param.bnb_quantized is True and torch.equal(param.data.cpu(), packed)
        state = {n: t for _o, _a, n, t in state_tensors(param.quant_state)}
        assert state.keys() == reference.keys() and {str(t.device) for t in state.values()} == {str(param.device)}
        assert all(torch.equal(state[n].cpu(), reference[n]) for n in reference)


@SIM
@pytest.mark.skipif(not KERNELS, reason="bitsandbytes < 0.46 runs 4-bit matmuls only with its CUDA library")
def test_forward_after_moves_equals_the_unmoved_model(shim):
    torch.manual_seed(0)
    model = torch.nn.Sequential(linear4bit(torch.nn.Linear(128, 64), "cuda:0", compress_statistics=True),
                                torch.nn.ReLU(), linear4bit(torch.nn.Linear(64, 32), "cuda:0"))
    x = torch.randn(3, 128)
    with torch.no_grad():
        expected = model(x.to("cuda:0")).cpu()
        for device in ("cuda:1", "cpu", "cuda:0"):
            model.to(device)
            if device != "cpu":
                assert torch.equal(model(x.to(device)).cpu(), expected), device


def test_a_params4bit_without_quant_state_passes_through(shim):
    data = weight()[:8, :16].clone()
    moved = Params4bit(data, quant_type="nf4").to(torch.float16)
    assert type(moved) is Params4bit and moved.quant_state is None and torch.equal(moved, data.half())
