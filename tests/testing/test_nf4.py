"""The pure-torch NF4 quantizer behind the quant-state tests: bitsandbytes' layout, checked against
bitsandbytes' own quantize/dequantize where it runs on the CPU (bitsandbytes >= 0.46), and against
the NF4 error bound and ``Params4bit.from_prequantized`` everywhere."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")

from bitsandbytes.functional import QuantState  # noqa: E402
from bitsandbytes.nn import Linear4bit, Params4bit  # noqa: E402

from devmap_shims.testing import nf4  # noqa: E402

CASES = [
    pytest.param((64, 128), torch.float32, id="64x128-fp32"),
    pytest.param((33, 7), torch.float16, id="33x7-fp16-odd"),
    pytest.param((128, 256), torch.bfloat16, id="128x256-bf16"),
    pytest.param((3, 1000), torch.float32, id="3x1000-fp32-partial-block"),
]


def sample(shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def bnb_quantizes_on_cpu() -> bool:
    try:
        bnb.functional.quantize_4bit(torch.ones(64), quant_type="nf4")
    except Exception:
        return False
    return True


needs_bnb_cpu = pytest.mark.skipif(
    not bnb_quantizes_on_cpu(), reason=f"bitsandbytes {bnb.__version__} quantizes with CUDA kernels only"
)


def bnb_rewrites_its_dynamic_map() -> bool:
    """bitsandbytes 0.48's CPU quantize_blockwise kernel writes -1.0 into the shared dynamic map it is
    given, so its nested states no longer carry ``create_dynamic_map()`` (later releases do not)."""
    if not bnb_quantizes_on_cpu():
        return False
    functional = bnb.functional
    functional.quantize_blockwise(torch.ones(256))
    cached = functional.name2qmap.get("dynamic")
    return cached is not None and not torch.equal(cached.cpu(), functional.create_dynamic_map())


@needs_bnb_cpu
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("shape, dtype", CASES)
def test_packed_data_and_statistics_equal_bitsandbytes_quantize_4bit(shape, dtype, nested):
    if nested and bnb_rewrites_its_dynamic_map():
        pytest.skip(f"bitsandbytes {bnb.__version__}'s CPU kernel rewrites its dynamic map: no nested reference")
    w = sample(shape, dtype)
    data, state = nf4.quantize_nf4(w, compress_statistics=nested)
    try:
        ref_data, ref_state = bnb.functional.quantize_4bit(w, quant_type="nf4", compress_statistics=nested)
    except RuntimeError as exc:  # bitsandbytes 0.48: partial fp16 blocks fail in its pure-torch kernel
        pytest.skip(f"bitsandbytes {bnb.__version__} cannot quantize {tuple(shape)} {dtype} on CPU: {exc}")
    assert torch.equal(data, ref_data)
    assert torch.equal(state.absmax, ref_state.absmax)
    assert torch.equal(state.code, ref_state.code)
    assert (state.shape, state.dtype, state.blocksize, state.quant_type, state.nested) == (
        ref_state.shape, ref_state.dtype, ref_state.blocksize, ref_state.quant_type, ref_state.nested
    )
    if nested:
        assert torch.equal(state.offset, ref_state.offset)
        assert torch.equal(state.state2.absmax, ref_state.state2.absmax)
        assert torch.equal(state.state2.code, ref_state.state2.code)


@needs_bnb_cpu
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("shape, dtype", CASES)
def test_reference_decoder_equals_bitsandbytes_dequantize(shape, dtype, nested):
    data, state = nf4.quantize_nf4(sample(shape, dtype, seed=1), compress_statistics=nested)
    from bitsandbytes.backends.default import ops as default_ops  # bitsandbytes' pure-torch kernel

    kernel = getattr(default_ops, "_dequantize_4bit_compute", None)
    if kernel is None:
        pytest.skip("this bitsandbytes has no pure-torch dequantize kernel")
    absmax = state.absmax
    if nested:
        absmax = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    reference = kernel(data.reshape(-1), absmax, state.code, state.blocksize, state.shape, state.dtype)
    assert torch.equal(nf4.dequantize_nf4(data, state), reference.reshape(state.shape).to(state.dtype))


def _half_gap(code):
    return float(code.sort().values.diff().max() / 2)


def _block_absmax(values, blocksize):
    flat = values.float().reshape(-1)
    blocks = (flat.numel() + blocksize - 1) // blocksize
    padded = torch.zeros(blocks * blocksize)
    padded[: flat.numel()] = flat
    return padded.view(blocks, -1).abs().amax(dim=1)


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("shape, dtype", CASES)
def test_round_trip_error_is_within_the_nf4_bound(shape, dtype, nested):
    w = sample(shape, dtype, seed=2)
    data, state = nf4.quantize_nf4(w, compress_statistics=nested)
    assert data.dtype == torch.uint8 and data.shape == ((w.numel() + 1) // 2, 1)
    absmax = _block_absmax(w, state.blocksize)
    absmax_error = torch.zeros_like(absmax)
    if nested:
        plain_data, _ = nf4.quantize_nf4(w)
        assert torch.equal(data, plain_data)  # nesting changes how absmax is stored, not the codes
        centred = absmax - state.offset
        nested_max = _block_absmax(centred, state.state2.blocksize).repeat_interleave(state.state2.blocksize)
        absmax_error = nested_max[: absmax.numel()] * _half_gap(nf4.dynamic_code()) + 1e-6
    per_value = lambda t: t.repeat_interleave(state.blocksize)[: w.numel()]  # noqa: E731
    bound = per_value(absmax) * _half_gap(nf4.nf4_code()) + per_value(absmax_error)
    if dtype != torch.float32:
        bound = bound + per_value(absmax + absmax_error) * 2 ** -7  # rounding of the decoded value
    error = (nf4.dequantize_nf4(data, state).float().reshape(-1) - w.float().reshape(-1)).abs()
    assert bool((error <= bound + 1e-6).all()), float((error - bound).max())


def test_odd_tail_packs_the_code_of_zero():
    w = sample((3, 5), torch.float32)
    data, _state = nf4.quantize_nf4(w)
    zero_index = int(nf4.nf4_code().abs().argmin())
    assert int(data[-1, 0]) & 0x0F == zero_index


def test_all_zero_block_decodes_to_zero():
    w = torch.zeros(2, 64)
    w[1] = 1.0
    data, state = nf4.quantize_nf4(w)
    assert torch.equal(nf4.dequantize_nf4(data, state), w)


def test_other_quant_storage_is_a_view_of_the_same_bytes():
    w = sample((16, 64), torch.float32)
    data, _ = nf4.quantize_nf4(w)
    as_bf16, _ = nf4.quantize_nf4(w, quant_storage=torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16.reshape(-1).view(torch.uint8), data.reshape(-1))


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_from_prequantized_rebuilds_the_same_state(nested):
    w = sample((64, 128), torch.float16)
    data, state = nf4.quantize_nf4(w, compress_statistics=nested)
    param = nf4.params4bit(w, "cpu", compress_statistics=nested)
    assert type(param) is Params4bit and param.bnb_quantized is True and param.quant_type == "nf4"
    assert torch.equal(param.data, data)
    assert isinstance(param.quant_state, QuantState) and param.quant_state.nested == nested
    assert torch.equal(nf4.dequantize_nf4(param.data, param.quant_state), nf4.dequantize_nf4(data, state))


def test_linear4bit_holds_the_quantized_weight_and_the_bias():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 32)
    layer = nf4.linear4bit(linear, "cpu", compress_statistics=True)
    assert isinstance(layer, Linear4bit) and layer.quant_state is layer.weight.quant_state
    assert torch.equal(layer.bias, linear.bias.detach())
    decoded = nf4.dequantize_nf4(layer.weight.data, layer.weight.quant_state)
    assert decoded.shape == linear.weight.shape
    assert float((decoded - linear.weight).abs().max()) < float(linear.weight.abs().max()) * 0.2


@needs_bnb_cpu
def test_linear4bit_forward_matches_the_dequantized_matmul():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64)
    layer = nf4.linear4bit(linear, "cpu")
    x = torch.randn(3, 128)
    decoded = nf4.dequantize_nf4(layer.weight.data, layer.weight.quant_state)
    expected = torch.nn.functional.linear(x, decoded, linear.bias)
    with torch.no_grad():
        assert torch.allclose(layer(x), expected, atol=1e-4)


def test_quantize_linears_replaces_every_linear():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()))
    assert nf4.quantize_linears_(model) == 2
    assert [type(m).__name__ for m in model.modules()].count("Linear4bit") == 2


def test_prequantized_flux_checkpoint_loads_in_diffusers(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    try:
        from diffusers import BitsAndBytesConfig, FluxTransformer2DModel  # noqa: F401
    except ImportError:
        pytest.skip(f"diffusers {diffusers.__version__} has no Flux or bitsandbytes quantization")

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import tiny_flux_pipeline

    path = nf4.save_prequantized_flux_transformer(tmp_path / "transformer")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["load_in_4bit"] is True
    reference = dict(tiny_flux_pipeline().transformer.named_modules())
    with simulated_gpus(2, memory="1GiB"):  # diffusers < 0.33 loads quantized models on the current GPU only
        model = FluxTransformer2DModel.from_pretrained(path)
        quantized = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear4bit)]
        assert quantized and len(quantized) == sum(type(m) is torch.nn.Linear for m in reference.values())
        for name, module in quantized:
            expected = reference[name].weight.detach()
            decoded = nf4.dequantize_nf4(module.weight.data, module.weight.quant_state).float()
            assert str(module.weight.device) == "cuda:0"
            assert float((decoded - expected).abs().max()) <= float(expected.abs().max()) * 0.2, name
