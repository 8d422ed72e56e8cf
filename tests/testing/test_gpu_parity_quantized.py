"""bitsandbytes' quantized weights on a real ``cuda:0`` against the simulated one (``pytest -m gpu``).

On the simulated GPUs bitsandbytes quantizes with its CPU kernels (>= 0.46), and the shims' own
tests build 4-bit weights with the pure-torch NF4 quantizer (``devmap_shims/testing/nf4.py``); on a
real GPU bitsandbytes quantizes with its CUDA kernels. Here the same quantizations and moves run on
both, and what a user sees is compared: the packed bytes and statistics, the device, dtype and
shape of every tensor a layer holds after each move, the outcome of a forward, and the same moves
with the shims installed. Skipped where no GPU is present (CI has none).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")  # imported before any simulation starts (it probes CUDA)

import devmap_shims  # noqa: E402
from devmap_shims.checks import check_devices  # noqa: E402
from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.devices.quant_state import state_tensors  # noqa: E402
from devmap_shims.shims.engine import ENGINE  # noqa: E402
from devmap_shims.testing import nf4, simulated_gpus  # noqa: E402
from devmap_shims.versions import installed_versions, version_in  # noqa: E402


pytestmark = [
    pytest.mark.gpu,  # skipped without a real GPU (tests/conftest.py)
    pytest.mark.skipif(
        not version_in(bnb.__version__, ">=0.46.0"),
        reason=f"bitsandbytes {bnb.__version__} has no CPU kernels: the simulated half cannot quantize",
    ),
]

CASES = [
    pytest.param((64, 128), torch.float32, id="64x128-fp32"),
    pytest.param((33, 7), torch.float16, id="33x7-fp16-odd"),
    pytest.param((128, 256), torch.bfloat16, id="128x256-bf16"),
    pytest.param((3, 1000), torch.float32, id="3x1000-fp32-partial-block"),
    pytest.param((512, 1024), torch.float16, id="512x1024-fp16"),
]
MATRIX = load_matrix()
INT8_BUG = "bnb-int8-stats-stay-on-old-device"
#: the shims that repair quantized weights' moves, forced on in one test
SHIM_IDS = ("quant-state-follows-weight", "int8-state-follows-weight", "int8-cb-follows-data")
#: the moves a user makes with a quantized model on one GPU, in order
MOVES: Tuple[Any, ...] = ("cuda:0", "cpu", "cuda:0", torch.float16, "cuda", "cpu", torch.device("cuda", 0))


@pytest.fixture(autouse=True)
def inference_without_shims():
    ENGINE.uninstall()
    with torch.no_grad():
        yield
    ENGINE.uninstall()


def sample(shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _differ(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where two tensors differ, for a failure message: shapes, or how many elements and the first."""
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    unequal = (got != want).reshape(-1).nonzero()
    if not len(unequal):
        return "equal"
    first = int(unequal[0])
    return (f"{len(unequal)} of {got.numel()} differ, first at {first}: "
            f"{got.reshape(-1)[first].item()} vs {want.reshape(-1)[first].item()}")


# -- the NF4 reference against bitsandbytes' CUDA kernels ----------------------------------------------
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("shape, dtype", CASES)
def test_nf4_reference_equals_the_cuda_kernel(shape, dtype, nested):
    w = sample(shape, dtype)
    data, state = nf4.quantize_nf4(w, compress_statistics=nested)
    ref_data, ref_state = bnb.functional.quantize_4bit(w.to("cuda:0"), quant_type="nf4", compress_statistics=nested)
    assert ref_data.device == torch.device("cuda", 0)
    assert torch.equal(data, ref_data.cpu()), _differ(data, ref_data)
    assert torch.equal(state.absmax, ref_state.absmax.cpu()), _differ(state.absmax, ref_state.absmax)
    assert torch.equal(state.code, ref_state.code.cpu())
    if nested:
        assert torch.equal(state.offset, ref_state.offset.cpu())
        assert torch.equal(state.state2.absmax, ref_state.state2.absmax.cpu())
        assert torch.equal(state.state2.code, ref_state.state2.code.cpu())
    decoded = bnb.functional.dequantize_4bit(ref_data, ref_state)
    assert torch.equal(nf4.dequantize_nf4(data, state), decoded.cpu()), _differ(nf4.dequantize_nf4(data, state), decoded)


# -- quantized layers moved on a real and on a simulated cuda:0 -----------------------------------------
def _model() -> torch.nn.Sequential:
    """Two 4-bit layers (plain and nested statistics), an 8-bit one and a LayerNorm, all on the CPU,
    unquantized: the first move to a GPU quantizes them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(
            bnb.nn.Linear4bit(256, 128, compute_dtype=torch.float16, quant_type="nf4",
                              compress_statistics=False).half(),
            bnb.nn.Linear4bit(128, 128, compute_dtype=torch.float16, quant_type="nf4",
                              compress_statistics=True).half(),
            bnb.nn.Linear8bitLt(128, 64, has_fp16_weights=False).half(),
            torch.nn.LayerNorm(64).half(),
        )


def _held(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every tensor the model holds: parameters, buffers, each 4-bit weight's quant state (nested
    too) and each 8-bit layer's CB/SCB on its weight and on its state."""
    held = dict(model.named_parameters())
    held.update(model.named_buffers())
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if getattr(weight, "quant_state", None) is not None:
            for _owner, _attr, dotted, tensor in state_tensors(weight.quant_state):
                held[f"{name}.weight.quant_state.{dotted}"] = tensor
        for owner in ("weight", "state"):
            for attr in ("CB", "SCB"):
                tensor = getattr(getattr(module, owner, None), attr, None)
                if isinstance(tensor, torch.Tensor):
                    held[f"{name}.{owner}.{attr}"] = tensor
    return held


def _layout(held: Dict[str, torch.Tensor]) -> Dict[str, Tuple[str, str, Tuple[int, ...]]]:
    return {name: (str(t.device), str(t.dtype), tuple(t.shape)) for name, t in held.items()}


def _outcome(fn: Callable[[], Any]) -> Tuple[str, str]:
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what is compared
        return type(e).__name__, str(e).split("\n")[0]
    return "ok", f"{out.device} {out.dtype} {tuple(out.shape)}"


def _run_moves(model: torch.nn.Sequential, x: torch.Tensor, checks: bool = False) -> List[Dict[str, Any]]:
    """Move ``model`` through :data:`MOVES`; after each, where every tensor is and what a forward on
    the first weight's device gives (its output and the bytes of each quantized weight as CPU
    copies, taken while they exist)."""
    steps = []
    for move in MOVES:
        model.to(move)
        held = _held(model)
        device = held["0.weight"].device
        out: List[torch.Tensor] = []
        outcome = _outcome(lambda: out.append(model(x.to(device))) or out[-1])
        steps.append({
            "move": str(move),
            "layout": _layout(held),
            "forward": outcome,
            "after_forward": _layout(_held(model)),
            "output": out[0].cpu() if out else None,
            "bytes": {name: t.detach().cpu().clone() for name, t in held.items()
                      if name.endswith(("0.weight", "1.weight", "2.weight", ".absmax", ".CB", ".SCB"))},
            "strays": check_devices(model) if checks else None,
        })
    return steps


def _x() -> torch.Tensor:
    return torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).half()


def _real_moves(checks: bool = False) -> List[Dict[str, Any]]:
    return _run_moves(_model(), _x(), checks)


def _simulated_moves() -> List[Dict[str, Any]]:
    with simulated_gpus(1, memory="8GiB"):
        return _run_moves(_model(), _x())


def test_quantized_moves_place_every_tensor_as_on_the_simulated_gpu():
    real, simulated = _real_moves(), _simulated_moves()
    assert [s["move"] for s in real] == [str(m) for m in MOVES]
    for got, want in zip(simulated, real):
        assert got["layout"] == want["layout"], got["move"]
        assert got["forward"] == want["forward"], got["move"]
        assert got["after_forward"] == want["after_forward"], got["move"]
    first = real[0]["layout"]
    assert first["0.weight"][:2] == ("cuda:0", "torch.uint8") and first["2.weight"][:2] == ("cuda:0", "torch.int8")
    assert "0.weight.quant_state.state2.absmax" not in first
    assert first["1.weight.quant_state.state2.absmax"][0] == "cuda:0"


def _nested_absmax(name: str, tensor: torch.Tensor) -> bool:
    """The 8-bit codes of a 4-bit weight's absmax (nested statistics)."""
    return name.endswith("quant_state.absmax") and tensor.dtype == torch.uint8


def test_quantized_bytes_and_forward_match_the_simulated_gpu():
    """Packed 4-bit data, int8 weights and every float statistic are equal byte for byte. The 8-bit
    codes of nested absmax come from bitsandbytes' CPU kernel on the simulated GPU and its CUDA
    kernel here; where a value lies within rounding of the midpoint between two codes they may pick
    neighbours, never more than one code apart."""
    real, simulated = _real_moves(), _simulated_moves()
    neighbours = total = 0
    for got, want in zip(simulated, real):
        assert got["bytes"].keys() == want["bytes"].keys()
        for name, tensor in want["bytes"].items():
            mine = got["bytes"][name]
            if _nested_absmax(name, tensor) and mine.shape == tensor.shape:
                apart = (mine.int() - tensor.int()).abs()
                assert int(apart.max()) <= 1, f"{got['move']}: {name}: {_differ(mine, tensor)}"
                neighbours, total = neighbours + int((apart > 0).sum()), total + apart.numel()
                continue
            assert torch.equal(mine, tensor), f"{got['move']}: {name}: {_differ(mine, tensor)}"
        if want["output"] is not None:
            # CUDA's fp16 matmuls and bitsandbytes' CUDA int8 kernels round differently from the CPU's
            torch.testing.assert_close(got["output"], want["output"], rtol=0.02, atol=0.02)
    print(f"nested absmax codes one step apart: {neighbours} of {total}")


def test_an_int8_layer_moved_to_the_cpu_keeps_its_gpu_state_where_the_matrix_says():
    """bnb-int8-stats-stay-on-old-device on a real GPU: ``model.to("cpu")`` moves the 8-bit weight
    but leaves ``state.CB`` (made by the first forward) on ``cuda:0``, and the next forward fails."""
    applies = MATRIX.get(INT8_BUG).applies(installed_versions(MATRIX.distributions()))
    real = _real_moves(checks=True)
    on_cpu = real[MOVES.index("cpu")]
    if applies:
        assert on_cpu["layout"]["2.state.CB"][0] == "cuda:0"
        assert on_cpu["forward"][0] == "RuntimeError" and "same device" in on_cpu["forward"][1]
        assert any(s["name"].endswith("state.CB") for s in on_cpu["strays"]), on_cpu["strays"]
    else:
        assert {d for d, _t, _s in on_cpu["layout"].values()} == {"cpu"}
        assert on_cpu["forward"] == ("ok", "cpu torch.float16 (4, 64)")


@pytest.mark.parametrize("arming", ["install", "forced"])
def test_with_the_shims_every_move_keeps_every_tensor_together_and_the_bytes(arming):
    plain = _real_moves()
    if arming == "install":
        devmap_shims.install()
    else:
        assert devmap_shims.install(only=list(SHIM_IDS), force=list(SHIM_IDS))
        active = {s["id"] for s in devmap_shims.status()["shims"] if s["state"] == "active"}
        assert set(SHIM_IDS) <= active, active
    shimmed = _real_moves(checks=True)
    for got, want in zip(shimmed, plain):
        device = got["layout"]["0.weight"][0]
        assert device == want["layout"]["0.weight"][0], got["move"]
        after = got["after_forward"]  # the 8-bit layer's state is put right when it next runs
        assert {d for d, _t, _s in after.values()} == {device}, (got["move"], after)
        assert {k: v[1:] for k, v in after.items()} == {k: v[1:] for k, v in want["after_forward"].items()}
        assert got["strays"] == [], got["move"]
        assert got["forward"] == ("ok", f"{device} torch.float16 (4, 64)"), got["move"]
        for name, tensor in want["bytes"].items():
            assert torch.equal(got["bytes"][name], tensor), f"{got['move']}: {name}"
