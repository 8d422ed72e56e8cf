"""The simulated multi-GPU machine: torch.cuda answers, tensor placement, CUDA's device checks,
memory accounting and OOM, exact restoration on exit (training: test_sim_training.py)."""

from __future__ import annotations

import copy
import gc
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if torch.version.cuda is None:  # pragma: no cover - the simulator needs the CUDA build
    pytest.skip("the simulator needs a CUDA build of torch", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from devmap_shims.testing import (  # noqa: E402
    format_size,
    is_simulated,
    parse_memory,
    real_cpu_tensor,
    simulated_gpus,
)
from devmap_shims.testing import simulator as sim_module  # noqa: E402

NEW_MESSAGES = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 8)


def mismatch_ti(a: str, b: str) -> str:
    return f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!"


def mismatch_exact(common: str, other: str, arg: str, method: str) -> str:
    if NEW_MESSAGES:
        return (
            f"Expected all tensors to be on the same device, but got {arg} is on {other}, different from "
            f"other tensors on {common} (when checking argument in method {method})"
        )
    return (
        f"Expected all tensors to be on the same device, but found at least two devices, {common} and "
        f"{other}! (when checking argument for argument {arg} in method {method})"
    )


# ------------------------------------------------------------------------------------------------
# machine and torch.cuda
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, expected",
    [("23GiB", 23 * 2**30), ("512MiB", 512 * 2**20), ("10GB", 10 * 10**9), ("1.5 GiB", int(1.5 * 2**30)), (4096, 4096)],
)
def test_parse_memory(spec, expected):
    assert parse_memory(spec) == expected


@pytest.mark.parametrize("bad", ["lots", "12XB", 0, -1, True, None])
def test_parse_memory_rejects(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_memory(bad)


@pytest.mark.parametrize("name", [None, 123, ""])
def test_a_gpu_name_that_is_no_name_is_refused(name):
    # torch.cuda.get_device_name() answered None or 123 with it
    with pytest.raises(TypeError, match="the GPUs' name, a non-empty string"):
        with simulated_gpus(1, name=name):
            pass


def test_format_size_matches_caching_allocator():
    assert format_size(512) == "512 bytes"
    assert format_size(1024) == "1024 bytes"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(20 * 2**20) == "20.00 MiB"
    assert format_size(2**30) == "1024.00 MiB"
    assert format_size(23 * 2**30) == "23.00 GiB"


def test_cuda_api_answers_as_the_machine():
    with simulated_gpus(3, memory=["1GiB", "2GiB", "512MiB"], name="NVIDIA L4") as m:
        assert torch.cuda.is_available() and torch.cuda.is_initialized()
        assert torch.cuda.device_count() == m.device_count == 3
        assert torch.cuda.current_device() == 0
        assert torch.cuda.get_device_name(1) == "NVIDIA L4"
        props = torch.cuda.get_device_properties(1)
        assert props.total_memory == m.capacity(1) == 2 * 2**30
        assert (props.major, props.minor) == torch.cuda.get_device_capability(1) == (8, 9)
        assert props.multi_processor_count > 0 and props.name == "NVIDIA L4"
        assert torch.cuda.mem_get_info(2) == (512 * 2**20, 512 * 2**20)
        assert torch.cuda.mem_get_info("cuda:1")[1] == 2 * 2**30
        assert torch.cuda.memory_allocated(0) == torch.cuda.max_memory_allocated(0) == 0
        assert torch.cuda.memory_reserved(0) == 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.init()
        torch.cuda.set_device(2)
        assert torch.cuda.current_device() == 2
        assert torch.ones(1, device="cuda").device == torch.device("cuda", 2)
        with torch.cuda.device(1):
            assert torch.cuda.current_device() == 1
            assert torch.zeros(1, device="cuda").get_device() == 1
        assert torch.cuda.current_device() == 2
        with pytest.raises(ValueError, match="with a specified index or an integer, but got:cuda"):
            torch.cuda.set_device("cuda")  # set_device needs an index; torch.cuda.device("cuda") does not
        with pytest.raises(ValueError, match="but got:None"):
            torch.cuda.set_device(None)
        with torch.cuda.device("cuda"):
            assert torch.cuda.current_device() == 2


def test_invalid_ordinal_raises():
    with simulated_gpus(2):
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.ones(1, device="cuda:2")
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.ones(1).to(5)


def test_torch_accelerator_answers_as_the_machine():
    acc = getattr(torch, "accelerator", None)
    if acc is None:
        pytest.skip("torch.accelerator arrived in torch 2.6")
    with simulated_gpus(2):
        assert acc.is_available() and acc.device_count() == 2
        assert acc.current_accelerator().type == "cuda"
        acc.set_device_index(1)
        assert acc.current_device_index() == 1 == torch.cuda.current_device()


def test_int_device_is_cuda():
    with simulated_gpus(2):
        d = torch.device(1)
        assert isinstance(d, torch.device) and d == torch.device("cuda", 1)
        assert torch.zeros(2, device=1).device == d


def test_device_standin_for_torch_25_26(monkeypatch):
    """torch 2.5/2.6 ask the driver in torch.device(0); the stand-in must answer instead."""
    real_device = torch.device
    monkeypatch.setattr(sim_module, "FORCE_DEVICE_STANDIN", True)
    with simulated_gpus(2):
        assert torch.device is not real_device
        d = torch.device(1)
        assert type(d) is real_device and isinstance(d, torch.device)
        assert torch.device("cuda:0") == real_device("cuda", 0)
        assert torch.nn.Linear(2, 2).to(1).weight.device == d
        with torch.device("meta"):
            assert torch.ones(1).is_meta
    assert torch.device is real_device


def test_nesting_is_refused():
    with simulated_gpus(2):
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with simulated_gpus(1):
                pass  # pragma: no cover
        assert torch.cuda.device_count() == 2


def test_cpu_build_error(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(RuntimeError) as exc:
        with simulated_gpus(2):
            pass  # pragma: no cover
    msg = str(exc.value)
    assert "CUDA build of torch" in msg and "CPU-only build" in msg
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu121" in msg
    assert "plain PyPI wheel" in msg


# ------------------------------------------------------------------------------------------------
# tensors and modules on simulated devices
# ------------------------------------------------------------------------------------------------
def test_factories_and_moves_report_the_device():
    with simulated_gpus(4):
        a = torch.tensor([1.0, 2.0], device="cuda:1")
        assert a.device == torch.device("cuda:1") and a.is_cuda and not a.is_cpu and a.get_device() == 1
        assert is_simulated(a)
        assert torch.zeros(2, 2, device=1).device.index == 1
        b = a.to("cuda:3")
        assert b.device.index == 3 and b is not a and a.device.index == 1
        assert a.to("cuda:1") is a and a.cuda(1) is a
        assert a.cuda().device.index == 0
        assert torch.ones(1).cuda(2).device.index == 2
        c = b.cpu()
        assert c.device.type == "cpu" and not c.is_cuda and c.get_device() == -1 and not is_simulated(c)
        assert torch.equal(c, torch.tensor([1.0, 2.0]))
        assert a.to(torch.float16).device.index == 1
        assert a.to(b).device.index == 3
        assert torch.empty_like(a).device.index == 1
        assert a.new_zeros(3).device.index == 1
        assert a.new_tensor([1, 2]).device.index == 1
        assert torch.zeros_like(a, device="cpu").device.type == "cpu"
        assert a.double().device.index == 1
        assert torch.ones(2).type_as(b).device.index == 3
        assert a.type() == "torch.cuda.FloatTensor"
        assert "device='cuda:1'" in repr(a)


@pytest.mark.parametrize("move", [lambda t: t.to("cuda:1"), lambda t: t.cuda(1), lambda t: t.cuda(),
                                  lambda t: torch.nn.Parameter(t).cuda(0)], ids=["to", "cuda(1)", "cuda()", "param"])
def test_a_meta_tensor_cannot_be_copied_to_a_gpu(move):
    # a real GPU refuses it with torch's own error (the symptom of huggingface/accelerate#2742)
    with simulated_gpus(2):
        with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor; no data!"):
            move(torch.empty(3, device="meta"))


def test_views_data_and_parameters_share_the_device():
    with simulated_gpus(2):
        a = torch.arange(6.0, device="cuda:1").reshape(2, 3)
        assert a[0].device.index == 1 and a.t().device.index == 1 and a.view(-1).device.index == 1
        assert a.data.device.index == 1 and a.detach().device.index == 1
        p = torch.nn.Parameter(a)
        assert isinstance(p, torch.nn.Parameter) and p.device.index == 1
        cpu = torch.zeros(1)
        cpu.data = a
        assert cpu.device.index == 1


def test_modules_move_between_devices():
    with simulated_gpus(3):
        lin = torch.nn.Linear(4, 4)
        assert lin.to("cuda:1").weight.device.index == 1
        assert lin.cuda(2).bias.device.index == 2
        assert isinstance(lin.weight, torch.nn.Parameter)
        assert lin.to(torch.device("cuda", 0)).weight.device.index == 0
        assert lin.cpu().weight.device.type == "cpu"
        emb = torch.nn.Embedding(5, 3).to(0)
        dup = copy.deepcopy(emb)
        assert dup.weight.device.index == 0 and dup.weight is not emb.weight


def test_ops_follow_their_inputs_and_match_cpu():
    torch.manual_seed(0)
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    ref = F.softmax(F.linear(x, w), dim=-1)
    with simulated_gpus(2), torch.no_grad():
        out = F.softmax(F.linear(x.to(1), w.to(1)), dim=-1)
        assert out.device.index == 1
        assert torch.equal(real_cpu_tensor(out), ref)
        q = torch.randn(1, 2, 4, 8, device="cuda:1")
        assert F.scaled_dot_product_attention(q, q, q, is_causal=True).device.index == 1
        values, idx = torch.topk(out, 2)
        assert values.device.index == 1 and idx.device.index == 1
        assert [t.device.index for t in out.split(1)] == [1, 1, 1]


def test_real_cpu_tensor_and_exit_leave_valid_cpu_tensors():
    with simulated_gpus(2):
        a = torch.arange(3.0, device="cuda:1")
        r = real_cpu_tensor(a)
        assert r.device.type == "cpu" and torch.equal(r, torch.arange(3.0))
        assert not is_simulated(r)
    # after the simulation the same tensor object is an ordinary CPU tensor
    assert a.device.type == "cpu" and not a.is_cuda and torch.equal(a + 1, torch.arange(1.0, 4.0))
    assert torch.equal(real_cpu_tensor(a), a)


def test_generator_on_a_simulated_device():
    with simulated_gpus(2):
        g = torch.Generator(device="cuda:1").manual_seed(0)
        assert isinstance(g, torch.Generator) and g.device == torch.device("cuda:1")
        assert isinstance(torch.Generator(), torch.Generator)
        first = torch.randn(3, generator=g, device="cuda:1")
        g.manual_seed(0)
        assert torch.equal(first, torch.randn(3, generator=g, device="cuda:1"))
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
            torch.randn(2, generator=torch.Generator(), device="cuda:0")
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'cuda'"):
            torch.randn(2, generator=g)


def test_cuda_rng_is_seeded_by_torch_manual_seed():
    with simulated_gpus(2):
        torch.manual_seed(1)
        a = torch.randn(4, device="cuda:0")
        torch.manual_seed(1)
        assert torch.equal(a, torch.randn(4, device="cuda:0"))
        state = torch.cuda.get_rng_state(0)
        b = torch.rand(2, device="cuda:0")
        torch.cuda.set_rng_state(state, 0)
        assert torch.equal(b, torch.rand(2, device="cuda:0"))


# the random ops whose signatures take no generator (functional and in-place forms among them)
def _stacked(rnn, x):
    """Two layers of ``rnn`` built on ``x``'s GPU with dropout between them, run on ``x``."""
    return rnn(8, 8, num_layers=2, dropout=0.5, device=x.device)(x.view(4, 2, 8))[0]


NO_GENERATOR = {
    "dropout": lambda x: F.dropout(x, 0.5),
    "nn.Dropout": torch.nn.Dropout(0.5),
    "dropout_": lambda x: F.dropout(x.clone(), 0.5, inplace=True),
    "dropout2d": lambda x: F.dropout2d(x.view(2, 8, 4, 1), 0.5),
    "alpha_dropout": lambda x: F.alpha_dropout(x, 0.5, training=True),
    "feature_alpha_dropout": lambda x: F.feature_alpha_dropout(x.view(2, 8, 4, 1), 0.5, training=True),
    "torch.dropout": lambda x: torch.dropout(x, 0.5, True),
    "rrelu": lambda x: F.rrelu(-x, training=True),
    "rrelu_": lambda x: F.rrelu_(-x, training=True),
    "gumbel_softmax": lambda x: F.gumbel_softmax(x.view(8, 8)),
    "sdpa dropout_p": lambda x: F.scaled_dot_product_attention(*(x.view(1, 2, 4, 8),) * 3, dropout_p=0.5),
    "sdpa positional": lambda x: F.scaled_dot_product_attention(*(x.view(1, 2, 4, 8),) * 3, None, 0.5),
    # built on the GPU: an init on the CPU would move the CPU's generator itself
    "nn.MultiheadAttention": lambda x: torch.nn.MultiheadAttention(8, 2, dropout=0.5, device=x.device)(
        *(x.view(4, 2, 8),) * 3)[0],
    "nn.LSTM dropout": lambda x: _stacked(torch.nn.LSTM, x),
    "nn.GRU dropout": lambda x: _stacked(torch.nn.GRU, x),
    "fractional_max_pool2d": lambda x: F.fractional_max_pool2d(x.cumsum(0).view(1, 1, 8, 8), 2,
                                                               output_size=5),
}


@pytest.mark.parametrize("op", list(NO_GENERATOR.values()), ids=list(NO_GENERATOR))
def test_random_ops_without_a_generator_draw_from_the_simulated_gpus_generator(op):
    """As on CUDA: the GPU's seed decides them, the CPU's generator does not move, and each GPU
    draws from its own generator."""
    with simulated_gpus(2):
        x = torch.ones(64, device="cuda:1")
        torch.cuda.manual_seed_all(3)
        first = op(x)
        assert first.device == torch.device("cuda:1")
        torch.default_generator.manual_seed(2)  # the CPU's generator alone
        torch.cuda.manual_seed_all(3)
        cpu_state = torch.get_rng_state()
        again = op(x)
        assert torch.equal(torch.get_rng_state(), cpu_state)
        assert torch.equal(real_cpu_tensor(again), real_cpu_tensor(first))
        torch.cuda.manual_seed_all(3)
        torch.cuda.manual_seed(4)  # cuda:0 alone, the current device
        assert torch.equal(real_cpu_tensor(op(x)), real_cpu_tensor(first))
        torch.cuda.manual_seed_all(4)
        assert not torch.equal(real_cpu_tensor(op(x)), real_cpu_tensor(first))


INITS = {
    "nn.init.uniform_": lambda t: torch.nn.init.uniform_(t),
    "nn.init.normal_": lambda t: torch.nn.init.normal_(t),
    "nn.init.kaiming_uniform_": lambda t: torch.nn.init.kaiming_uniform_(t, a=5 ** 0.5),
    "nn.Linear on the GPU": lambda t: torch.nn.Linear(8, 8, device=t.device).weight,
}


@pytest.mark.parametrize("init", list(INITS.values()), ids=list(INITS))
def test_inits_on_a_simulated_gpu_draw_from_its_generator(init):
    """nn.init's uniform_, normal_ and kaiming_uniform_ (nn.Linear's init) hand themselves whole to
    __torch_function__, so the draw inside them was the CPU's: a module built on a simulated GPU
    moved the CPU's generator and ignored torch.cuda.manual_seed."""
    with simulated_gpus(2):
        t = torch.empty(8, 8, device="cuda:1")
        torch.cuda.manual_seed_all(3)
        cpu_state = torch.get_rng_state()
        first = real_cpu_tensor(init(t)).clone()
        assert torch.equal(torch.get_rng_state(), cpu_state)
        torch.cuda.manual_seed_all(3)
        torch.cuda.manual_seed(5)  # cuda:0 alone
        assert torch.equal(real_cpu_tensor(init(t)), first)
        torch.cuda.manual_seed_all(4)
        assert not torch.equal(real_cpu_tensor(init(t)), first)


_EVAL_ATTENTION = torch.nn.MultiheadAttention(8, 2, dropout=0.5).eval()  # moved to the GPU, a copy per call
NO_DRAW = {
    "nn.Dropout in eval mode": torch.nn.Dropout(0.5).eval(),
    "dropout training=False": lambda x: F.dropout(x, 0.5, training=False),
    "dropout p=0": lambda x: F.dropout(x, 0.0),
    "nn.Dropout(0.0)": torch.nn.Dropout(0.0),
    "dropout2d training=False": lambda x: F.dropout2d(x.view(2, 8, 4, 1), 0.5, training=False),
    "alpha_dropout default": lambda x: F.alpha_dropout(x, 0.5),
    "torch.dropout train False": lambda x: torch.dropout(x, 0.5, False),
    "torch.dropout p=0": lambda x: torch.dropout(x, 0.0, True),
    "native_dropout train False": lambda x: torch.native_dropout(x, 0.5, False)[0],
    "rrelu default": lambda x: F.rrelu(-x),
    "sdpa without dropout_p": lambda x: F.scaled_dot_product_attention(*(x.view(1, 2, 4, 8),) * 3),
    "nn.MultiheadAttention in eval mode": lambda x: copy.deepcopy(_EVAL_ATTENTION).to(x.device)(
        *(x.view(4, 2, 8),) * 3)[0],
}


@pytest.mark.parametrize("op", list(NO_DRAW.values()), ids=list(NO_DRAW))
def test_random_ops_that_draw_nothing_leave_the_generators_alone(op, monkeypatch):
    """Dropout outside training or with p == 0 (as in every forward of a model in eval mode) draws
    nothing, on CUDA as on the CPU: the simulator does not swap generators for it (1.5-5 us a
    call), while the same ops in training still do."""
    from devmap_shims.testing import _sim_random

    swaps = []
    real = _sim_random.drawing_from
    monkeypatch.setattr(_sim_random, "drawing_from", lambda *a: swaps.append(1) or real(*a))
    with simulated_gpus(2):
        x = torch.ones(64, device="cuda:1")
        torch.cuda.manual_seed_all(3)
        gpu_state = torch.cuda.get_rng_state(1)
        out = op(x)
        assert out.device == torch.device("cuda:1")
        assert torch.equal(torch.cuda.get_rng_state(1), gpu_state)
        assert swaps == []
        NO_GENERATOR["dropout"](x)  # the same handler still swaps for a draw
        assert swaps == [1]


def test_native_dropout_with_p_0_still_draws_as_on_cuda():
    """CUDA's native_dropout moves its generator even with p == 0; the simulator keeps the draw."""
    with simulated_gpus(1):
        x = torch.ones(64, device="cuda:0")
        before = torch.cuda.get_rng_state(0)
        torch.native_dropout(x, 0.0, True)
        assert not torch.equal(torch.cuda.get_rng_state(0), before)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_rnns_run_on_simulated_gpus_as_on_the_cpu(packed):
    """nn.LSTM/GRU on a CUDA device flatten their weights with a cuDNN kernel, which the CPU lacks:
    on a simulated GPU cuDNN is never acceptable, so they run torch's own RNN, with the CPU's result.
    A packed sequence keeps its lengths and batch sizes on the CPU, as CUDA requires them."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    lengths = torch.tensor([2, 5, 4])

    def run(model, x):
        if not packed:
            return model(x)[0]
        sequence = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        assert sequence.batch_sizes.device.type == "cpu" and sequence.data.device == x.device
        out, sizes = pad_packed_sequence(model(sequence)[0], batch_first=True)
        assert sizes.device.type == "cpu" and torch.equal(sizes, lengths)
        return out

    torch.manual_seed(0)
    for make in (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN):
        ref = make(8, 8, num_layers=2, bidirectional=True, batch_first=True)
        x = torch.rand(3, 5, 8)
        expected = run(ref, x)
        with simulated_gpus(2):
            assert torch.backends.cudnn.is_acceptable(torch.ones(1, device="cuda:1")) is False
            model = copy.deepcopy(ref).to("cuda:1")
            out = run(model, x.to("cuda:1"))
            out.sum().backward()
            assert out.device == torch.device("cuda:1") and model.weight_ih_l0.grad.device == out.device
            assert torch.allclose(real_cpu_tensor(out), expected)


def test_saved_tensor_hooks_see_a_packed_rnns_tensors_on_its_gpu_and_the_sizes_on_the_cpu():
    """A packed RNN call runs in a handler of its own: what its ops save for backward must still
    reach saved-tensor hooks (activation offloading, checkpointing) on the GPU, as on CUDA, and
    the batch sizes, which CUDA keeps on the CPU, on the CPU."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    ref = torch.nn.LSTM(4, 4, batch_first=True)
    with simulated_gpus(2):
        model = copy.deepcopy(ref).to("cuda:1")
        x = torch.rand(3, 5, 4, device="cuda:1", requires_grad=True)
        seen = set()

        def pack(t):
            seen.add((str(t.device), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lengths = torch.tensor([2, 5, 4])
            sequence = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out = pad_packed_sequence(model(sequence)[0], batch_first=True)[0]
        out.sum().backward()
        assert x.grad.device == model.weight_hh_l0.grad.device == torch.device("cuda:1")
    assert ("cuda:1", torch.float32) in seen and ("cpu", torch.int64) in seen
    assert seen <= {("cuda:1", torch.float32), ("cuda:1", torch.int64), ("cpu", torch.int64)}, seen


def test_streams_events_pinned_memory():
    with simulated_gpus(2):
        s = torch.cuda.Stream(device=1)
        assert s.device == torch.device("cuda:1") and isinstance(s, torch.cuda.Stream)
        with torch.cuda.stream(s):
            x = torch.ones(2, device="cuda:1")
        torch.cuda.current_stream().wait_stream(s)
        x.record_stream(s)
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        e.synchronize()
        assert e.query()
        p = torch.ones(3).pin_memory()
        assert p.is_pinned() and p.device.type == "cpu"
        assert torch.empty(2, pin_memory=True).is_pinned()
        assert p.to("cuda:0", non_blocking=True).device.index == 0


def test_numpy_of_a_cuda_tensor_raises_like_cuda():
    with simulated_gpus(1):
        with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
            torch.ones(2, device="cuda:0").numpy()


def test_default_device_and_device_context():
    with simulated_gpus(2):
        with torch.device("cuda:1"):
            assert torch.ones(2).device.index == 1
            assert torch.nn.Linear(2, 2).weight.device.index == 1  # in-place init of a fresh parameter
        torch.set_default_device("cuda:1")
        try:
            assert torch.zeros(1).device.index == 1
        finally:
            torch.set_default_device(None)
            # torch 2.9 leaves device_context=None behind and get_default_device() then raises
            # AttributeError for the rest of the process (later releases check for None)
            if getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", False) is None:
                del torch._GLOBAL_DEVICE_CONTEXT.device_context
        assert torch.zeros(1).device.type == "cpu"
        with torch.device("meta"):
            assert torch.ones(1).is_meta


def test_torch_load_onto_simulated_gpus(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    with simulated_gpus(2) as m:
        w = torch.load(path, map_location="cuda:1", weights_only=True)["w"]
        assert w.device.index == 1 and m.allocated(1) == 512
        assert torch.load(path, map_location={"cpu": "cuda:0"}, weights_only=True)["w"].device.index == 0
        assert torch.load(path, weights_only=True)["w"].device.type == "cpu"
        assert torch.equal(real_cpu_tensor(w), torch.arange(4.0))


def test_autocast_on_cuda_is_accepted():
    with simulated_gpus(1), torch.autocast("cuda", dtype=torch.float16):
        x = torch.ones(2, 2, device="cuda:0")
        assert (x @ x).device.index == 0  # CPU kernels: the dtype stays float32 (documented)


def test_torch_compile_runs_eagerly():
    def f(x):
        return x * 2

    with simulated_gpus(1):
        assert torch.compile(f) is f
        assert torch.compile(mode="reduce-overhead")(f) is f
        lin = torch.nn.Linear(2, 2).to(0)
        assert torch.compile(lin) is lin


def test_worker_threads_run_in_the_simulation():
    with simulated_gpus(2):
        with ThreadPoolExecutor(2) as pool:
            t = pool.submit(lambda: torch.ones(2).to("cuda:1")).result()
        assert t.device.index == 1



def test_a_stream_context_makes_its_gpu_and_stream_current_and_restores_them():
    """As torch.cuda.StreamContext and set_stream: a stream on cuda:1 entered from cuda:0 makes
    cuda:1 the current device (new "cuda" tensors land there) and itself the current stream."""
    with simulated_gpus(2):
        s1 = torch.cuda.Stream(device=1)
        assert torch.cuda.current_stream(1) is torch.cuda.default_stream(1) and torch.cuda.current_stream(1) != s1
        with torch.cuda.stream(s1):
            assert torch.cuda.current_device() == 1 and torch.cuda.current_stream() == s1
            assert torch.empty(1, device="cuda").device.index == 1
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(1) == torch.cuda.default_stream(1)
        torch.cuda.set_stream(s1)
        assert torch.cuda.current_device() == 1 and torch.cuda.current_stream(1) == s1
        with torch.cuda.stream(None):  # no stream: nothing changes
            assert torch.cuda.current_device() == 1
        torch.cuda.set_stream(torch.cuda.default_stream(0))

        def worker():  # the current stream is per thread too: another thread's is its own
            with torch.cuda.stream(s1):
                return torch.cuda.current_stream(1) == s1

        torch.cuda.set_stream(torch.cuda.default_stream(1))
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(worker).result()
        assert torch.cuda.current_stream(1) == torch.cuda.default_stream(1)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(torch.cuda.set_stream, s1).result()  # left set in that thread
        assert torch.cuda.current_stream(1) == torch.cuda.default_stream(1)


def test_the_current_device_is_per_thread():
    """cudaSetDevice sets the device of the calling thread; a new thread starts on device 0."""
    with simulated_gpus(2):
        torch.cuda.set_device(1)

        def worker():
            start = torch.cuda.current_device()
            torch.cuda.set_device(0)
            return start, torch.empty(1, device="cuda").device.index

        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(worker).result() == (0, 0)
        assert torch.cuda.current_device() == 1 and torch.empty(1, device="cuda").device.index == 1

# ------------------------------------------------------------------------------------------------
# CUDA's device checks
# ------------------------------------------------------------------------------------------------
def test_mismatch_between_two_gpus():
    with simulated_gpus(2):
        a, b = torch.ones(2, device="cuda:0"), torch.ones(2, device="cuda:1")
        with pytest.raises(RuntimeError) as exc:
            a + b
        assert str(exc.value) == mismatch_ti("cuda:0", "cuda:1")
        with pytest.raises(RuntimeError) as exc:
            b * a
        assert str(exc.value) == mismatch_ti("cuda:1", "cuda:0")


@pytest.mark.parametrize("cpu_first", [False, True])
def test_mismatch_between_cpu_and_gpu(cpu_first):
    with simulated_gpus(2):
        g, c = torch.ones(2, device="cuda:1"), torch.ones(2)
        with pytest.raises(RuntimeError) as exc:
            (c + g) if cpu_first else (g + c)
        # TensorIterator names the first non-CPU device first, whatever the operand order
        assert str(exc.value) == mismatch_ti("cuda:1", "cpu")


def test_in_place_on_cpu_with_gpu_operand():
    with simulated_gpus(1):
        with pytest.raises(RuntimeError) as exc:
            torch.zeros(()).add_(torch.ones((), device="cuda:0").expand(()))
        assert str(exc.value) == mismatch_ti("cuda:0", "cpu")


def test_cpu_scalars_and_python_scalars_are_allowed():
    with simulated_gpus(2):
        g = torch.ones(3, device="cuda:1")
        assert (g * torch.tensor(2.0)).device.index == 1
        assert (torch.tensor(2.0) + g).device.index == 1
        assert torch.where(g > 0, g, torch.tensor(0.0)).device.index == 1
        assert (g * 3).device.index == 1
        assert g[torch.tensor([0, 2])].device.index == 1  # CPU indices index CUDA tensors


def test_one_element_cpu_tensor_is_not_a_scalar():
    with simulated_gpus(1):
        with pytest.raises(RuntimeError) as exc:
            torch.ones(3, device="cuda:0") * torch.tensor([2.0])
        assert str(exc.value) == mismatch_ti("cuda:0", "cpu")


def test_advanced_index_assignment_checks_the_values_device():
    """``x[idx] = v`` with tensor indices runs ``index_put_``: a value with elements on another
    device is refused (a VLM writing image features from another GPU into its embeddings this way
    must fail here as on hardware); a 0-dim value is copied over, and basic indexing copies."""
    with simulated_gpus(2):
        x = torch.zeros(3, 2, device="cuda:0")
        rows, mask = torch.tensor([0, 2]), torch.tensor([True, False, True])
        for index in (rows, mask, [0, 2]):
            with pytest.raises(RuntimeError) as exc:
                x[index] = torch.ones(2, 2, device="cuda:1")
            assert str(exc.value) == mismatch_ti("cuda:0", "cuda:1")
        with pytest.raises(RuntimeError) as exc:
            x[rows] = torch.ones(2, 2)
        assert str(exc.value) == mismatch_ti("cuda:0", "cpu")
        with pytest.raises(RuntimeError) as exc:
            x.index_put_((rows,), torch.ones(2, 2, device="cuda:1"))
        assert str(exc.value) == mismatch_ti("cuda:0", "cuda:1")
        x[rows] = torch.tensor(5.0, device="cuda:1")  # 0-dim: copied to cuda:0
        x[mask.to("cuda:0")] = torch.tensor([7.0])  # one CPU element under a mask on x's device
        x[:, torch.tensor([True, False], device="cuda:0")] = torch.tensor([7.0])  # the mask after a slice
        x[torch.tensor(1)] = torch.ones(2, device="cuda:1")  # a 0-dim integer index selects, then copies
        with pytest.raises(RuntimeError, match="^expected device cuda:0 but got device cpu for value tensor$"):
            x.index_put_((mask.to("cuda:0"),), torch.tensor([7.0]), accumulate=True)  # no masked_fill_ there
        x[0:2] = torch.ones(2, 2, device="cuda:1")  # basic indexing: a copy, across devices
        x[rows] = torch.full((2, 2), 3.0, device="cuda:0")
        assert x.device.index == 0 and x.cpu().tolist() == [[3.0, 3.0], [1.0, 1.0], [3.0, 3.0]]


def test_a_zero_dim_integer_index_on_another_device_is_read_as_a_number():
    """torch reads a 0-dim integer or bool index with ``item()`` (``handleDimInMultiDimIndexing``),
    wherever it lives: ``hidden[mask.sum() - 1]`` with the mask on another GPU works on hardware.
    A 1-dim index on another GPU is still refused."""
    with simulated_gpus(2):
        h = torch.arange(10.0, device="cuda:1")
        last = torch.tensor(3, device="cuda:0")
        assert h[last].device.index == 1 and h[last].cpu().item() == 3.0
        assert torch.arange(10)[last].item() == 3
        h[last] = 0.0
        assert h.cpu()[3].item() == 0.0
        assert h[torch.tensor(True, device="cuda:0")].shape == (1, 10)
        with pytest.raises(RuntimeError, match=r"indices should be either on cpu or on the same device as the "
                                                r"indexed tensor \(cuda:1\)"):
            h[torch.tensor([3], device="cuda:0")]


def test_new_tensors_go_to_the_device_they_name():
    """``new_zeros(..., device=...)`` and the other ``new_*`` take the device they are given, and
    only that device is charged; without one they follow self."""
    with simulated_gpus(2, memory="1GiB"):
        x = torch.ones(4, device="cuda:0")
        before = torch.cuda.memory_allocated(0)
        cpu = x.new_zeros(1024, device="cpu")
        assert cpu.device.type == "cpu" and not is_simulated(cpu)
        assert torch.cuda.memory_allocated(0) == before
        other = x.new_full((1024,), 2.0, device="cuda:1")
        assert other.device.index == 1 and torch.cuda.memory_allocated(1) >= 4096
        assert x.new_empty(2, device=1).device.index == 1 and x.new_tensor([1], device="cuda:1").device.index == 1
        assert x.new_ones(2).device.index == 0


def test_zero_dim_values_cross_devices_where_cuda_kernels_read_them():
    """where moves a 0-dim operand to the result's device; fill_ and masked_fill read a 0-dim value
    with item(); a list of 0-dim tensors is read as numbers, on the default device."""
    with simulated_gpus(2):
        a = torch.arange(-1.0, 2.0, device="cuda:0")
        v1, v0 = torch.tensor(9.0, device="cuda:1"), torch.tensor(4.0, device="cuda:0")
        assert torch.where(a > 0, a, v1).cpu().tolist() == [9.0, 9.0, 1.0]
        assert a.where(a > 0, v1).device.index == 0
        assert a.clone().fill_(v1).cpu().tolist() == [9.0] * 3
        assert torch.zeros(2).fill_(v0).tolist() == [4.0, 4.0]
        assert a.masked_fill(a > 0, v1).cpu().tolist() == [-1.0, 0.0, 9.0]
        assert torch.masked_fill(input=a, mask=a > 0, value=v1).cpu().tolist() == [-1.0, 0.0, 9.0]
        assert torch.where(condition=a > 0, input=a, other=v1).cpu().tolist() == [9.0, 9.0, 1.0]
        out = torch.empty(3, device="cuda:0")
        assert torch.where(a > 0, a, v1, out=out) is out and out.cpu().tolist() == [9.0, 9.0, 1.0]
        assert a.clone().fill_(value=v1).cpu().tolist() == [9.0] * 3
        with pytest.raises(RuntimeError, match="^masked_fill_: Expected inputs to be on same device$"):
            torch.zeros(2).masked_fill(torch.tensor([True, False]), v0)  # into a CPU tensor: no
        with pytest.raises(RuntimeError) as exc:
            a.masked_fill((a > 0).to("cuda:1"), 0.0)
        assert str(exc.value) == (
            "expected self and mask to be on the same device, but got mask on cuda:1 and self on cuda:0"
        )
        with pytest.raises(RuntimeError) as exc:
            torch.where(a > 0, a, torch.ones(3, device="cuda:1"))  # not 0-dim: still refused
        assert "cuda:0" in str(exc.value) and "cuda:1" in str(exc.value)
        b0, b1 = torch.broadcast_tensors(a, torch.ones(1, device="cuda:1"))  # views only, no check
        assert (b0.device.index, b1.device.index, tuple(b1.shape)) == (0, 1, (3,))
        listed = torch.tensor([v0, v1])
        assert listed.device.type == "cpu" and (listed + torch.ones(2)).tolist() == [5.0, 10.0]
        assert torch.tensor(data=[v1]).device.type == "cpu"
        assert torch.tensor(v1).device.index == 1  # a tensor itself keeps its device


def test_index_select_and_embedding_messages():
    with simulated_gpus(8):
        w = torch.randn(10, 4, device="cuda:7")
        idx = torch.tensor([1, 2], device="cuda:0")
        with pytest.raises(RuntimeError) as exc:
            torch.index_select(w, 0, idx)
        assert str(exc.value) == mismatch_exact("cuda:7", "cuda:0", "index", "wrapper_CUDA__index_select")
        emb = torch.nn.Embedding(10, 4).to("cuda:7")
        with torch.no_grad(), pytest.raises(RuntimeError) as exc:
            emb(idx)
        assert str(exc.value) == mismatch_exact("cuda:7", "cuda:0", "index", "wrapper_CUDA__index_select")
        with torch.no_grad(), pytest.raises(RuntimeError) as exc:
            emb(torch.tensor([1]))
        assert str(exc.value) == mismatch_exact("cuda:7", "cpu", "index", "wrapper_CUDA__index_select")


def test_matmul_linear_cat_messages():
    with simulated_gpus(2), torch.no_grad():
        x = torch.randn(2, 4, device="cuda:0")
        with pytest.raises(RuntimeError) as exc:
            F.linear(x, torch.randn(3, 4))
        assert str(exc.value) == mismatch_exact("cuda:0", "cpu", "mat2", "wrapper_CUDA_mm")
        with pytest.raises(RuntimeError) as exc:
            F.linear(torch.randn(2, 4), torch.randn(3, 4, device="cuda:1"), torch.randn(3, device="cuda:1"))
        assert str(exc.value) == mismatch_exact("cuda:1", "cpu", "mat1", "wrapper_CUDA_addmm")
        with pytest.raises(RuntimeError) as exc:
            x @ torch.randn(4, 2, device="cuda:1")
        assert str(exc.value) == mismatch_exact("cuda:0", "cuda:1", "mat2", "wrapper_CUDA_mm")
        with pytest.raises(RuntimeError) as exc:
            torch.cat([x, torch.randn(2, 4)])
        assert str(exc.value) == mismatch_exact("cuda:0", "cpu", "tensors", "wrapper_CUDA_cat")
        with pytest.raises(RuntimeError) as exc:
            torch.cat([x, torch.tensor(1.0).expand(2, 4)])  # no CPU-scalar allowance outside TensorIterator
        assert "tensors" in str(exc.value)


def test_sizes_given_as_gpu_tensors_are_not_operands():
    # Qwen2-VL's rot_pos_emb: torch.arange(h).unsqueeze(1).expand(-1, w) with h and w read from grid_thw on a GPU
    with simulated_gpus(2):
        h, w = torch.tensor([[1, 4, 4]], device="cuda:0")[0, 1:]
        grid = torch.arange(h).unsqueeze(1).expand(-1, w)
        assert grid.device.type == "cpu" and grid.shape == (4, 4)
        assert torch.zeros(4).view(h).device.type == "cpu"
        assert torch.zeros(2).repeat(w).shape == (8,)
        on_gpu = torch.zeros(4, 1, device="cuda:1").expand(-1, w)
        assert on_gpu.device.index == 1
        with pytest.raises(RuntimeError, match="same device"):
            torch.zeros(4, device="cuda:1") + torch.ones(4, device="cuda:0")  # operands are still checked


def test_factories_given_gpu_numbers_make_their_result_on_the_default_device():
    with simulated_gpus(2):
        n = torch.tensor([True, True, False, True], device="cuda:1").sum()  # a count, on the GPU
        assert n.device.index == 1
        made = {
            "arange": torch.arange(0, 1 - 1e-6, 1 / n),
            "arange(n)": torch.arange(n),
            "full": torch.full((2,), n),
            "linspace": torch.linspace(0, n, 3),
            "zeros": torch.zeros(n),
            "randint": torch.randint(0, n, (2,)),
        }
        assert {name: str(t.device) for name, t in made.items()} == {name: "cpu" for name in made}
        assert torch.arange(n).tolist() == [0, 1, 2]
        assert torch.arange(n, device="cuda:0").device.index == 0
        with torch.device("cuda:1"):
            assert torch.arange(0, 1, 1 / n).device.index == 1
        assert (n + torch.ones((), device="cuda:1")).device.index == 1  # ordinary ops still follow their operands


def test_bucketize_message_names_the_boundaries():
    with simulated_gpus(2):
        x = torch.arange(4.0, device="cuda:1") / 4
        with pytest.raises(RuntimeError) as exc:
            torch.bucketize(x, torch.tensor([0.25, 0.5, 0.75]), right=True)
        assert str(exc.value) == mismatch_exact("cuda:1", "cpu", "boundaries", "wrapper_CUDA_Tensor_bucketize")
        with pytest.raises(RuntimeError) as exc:
            torch.bucketize(torch.arange(4.0), boundaries=torch.tensor([0.5], device="cuda:0"))
        assert str(exc.value) == mismatch_exact("cpu", "cuda:0", "boundaries", "wrapper_CUDA_Tensor_bucketize")
        same = torch.bucketize(x, torch.tensor([0.25, 0.5, 0.75], device="cuda:1"), right=True)
        assert same.device.index == 1 and same.cpu().tolist() == [0, 1, 2, 3]


def test_masked_scatter_names_the_mask():
    # the message of huggingface/transformers#33816 (Qwen2-VL split over GPUs), from masked_scatter_'s wrapper
    with simulated_gpus(2), torch.no_grad():
        embeds = torch.zeros(1, 3, 2, device="cuda:1")
        source = torch.ones(2, 2, device="cuda:1")
        mask = torch.tensor([[False, True, False]]).unsqueeze(-1).expand_as(embeds)
        for bad_mask, other in ((mask.to("cuda:0"), "cuda:0"), (mask, "cpu")):
            with pytest.raises(RuntimeError) as exc:
                embeds.masked_scatter(bad_mask, source)
            assert str(exc.value) == mismatch_exact("cuda:1", other, "mask", "wrapper_CUDA__masked_scatter_")
            with pytest.raises(RuntimeError) as exc:
                embeds.clone().masked_scatter_(bad_mask, source)
            assert str(exc.value) == mismatch_exact("cuda:1", other, "mask", "wrapper_CUDA__masked_scatter_")
        with pytest.raises(RuntimeError) as exc:
            embeds.masked_scatter(mask.to("cuda:1"), source.to("cuda:0"))
        assert str(exc.value) == mismatch_exact("cuda:1", "cuda:0", "source", "wrapper_CUDA__masked_scatter_")
        out = embeds.masked_scatter(mask.to("cuda:1"), source)
        assert out.device.index == 1 and out.cpu()[0, 1].tolist() == [1.0, 1.0] and out.cpu().sum() == 2


def test_copy_across_devices_is_allowed():
    with simulated_gpus(2):
        dst = torch.zeros(3, device="cuda:1")
        dst.copy_(torch.arange(3.0))
        dst.copy_(torch.ones(3, device="cuda:0"))
        assert dst.device.index == 1 and torch.equal(dst.cpu(), torch.ones(3))


def test_moved_copies_are_independent():
    with simulated_gpus(2):
        a = torch.zeros(2, device="cuda:0")
        b = a.to("cuda:1")
        b.add_(1)
        assert torch.equal(a.cpu(), torch.zeros(2))
        c = torch.as_tensor(a, device="cuda:1")
        assert c.device.index == 1 and a.device.index == 0
        assert torch.as_tensor(a, device="cuda:0") is a


# ------------------------------------------------------------------------------------------------
# memory accounting and OOM
# ------------------------------------------------------------------------------------------------
def test_memory_is_charged_per_storage_and_freed():
    with simulated_gpus(2, memory="1GiB") as m:
        a = torch.empty(1000, dtype=torch.float32, device="cuda:1")  # 4000 bytes -> 4096
        assert m.allocated(1) == torch.cuda.memory_allocated(1) == 4096 and m.allocated(0) == 0
        v = a[10:20]  # a view costs nothing
        assert m.allocated(1) == 4096
        b = torch.empty(3, device="cuda:1")  # rounded to one 512-byte block
        assert m.allocated(1) == 4096 + 512
        assert torch.cuda.mem_get_info(1) == (2**30 - 4608, 2**30)
        del a
        assert m.allocated(1) == 4608  # the view keeps the storage alive
        del v
        gc.collect()
        assert m.allocated(1) == 512 and m.max_allocated(1) == 4608
        torch.cuda.reset_peak_memory_stats(1)
        assert torch.cuda.max_memory_allocated(1) == 512
        del b
        assert m.allocated(1) == 0


def test_storages_resized_in_place_are_charged_what_they_hold():
    """``Tensor.resize_``, an ``out=`` that grows its tensor and ``UntypedStorage.resize_`` (FSDP frees
    and refills its flat parameters that way) change what a GPU holds: CUDA takes a block of the
    new size while the old one is held, and refuses before anything changes past capacity."""
    with simulated_gpus(2, memory="16MiB") as m:
        x = torch.empty(10, device="cuda:1")
        with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate 32.00 MiB. GPU 1 "):
            x.resize_(8 * 2**20)
        assert x.shape == (10,) and m.allocated(1) == 512 and m.num_ooms(1) == 1
        x.resize_((2**20,))  # 4 MiB
        assert m.allocated(1) == 4 * 2**20 and x.device == torch.device("cuda:1")
        x.resize_(5)  # smaller: the storage stays
        assert m.allocated(1) == 4 * 2**20
        y = torch.empty(2**20, device="cuda:1")
        y.untyped_storage().resize_(0)
        assert m.allocated(1) == 4 * 2**20
        torch.cuda.reset_peak_memory_stats(1)
        y.untyped_storage().resize_(4 * 2**20)
        assert m.allocated(1) == 8 * 2**20
        with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate 12.00 MiB"):
            y.untyped_storage().resize_(12 * 2**20)  # 8 MiB held + a new 12 MiB block
        assert y.untyped_storage().nbytes() == 4 * 2**20
        out = torch.empty(0, device="cuda:1")
        torch.add(torch.ones(2**20, device="cuda:1"), 1, out=out)
        gc.collect()
        assert m.allocated(1) == 12 * 2**20 and out.device == torch.device("cuda:1")
        torch.empty(0, device="cuda:1").resize_as_(out)
        torch.resize_as_(torch.empty(0, device="cuda:1"), out)
        gc.collect()
        assert m.allocated(1) == 12 * 2**20
        grown = torch.empty(0, device="cuda:1")
        torch.zeros(2**18, out=grown)  # a factory's out=
        assert m.allocated(1) == 13 * 2**20
        grown.resize_(np.int64(2**19))  # one size, not a Python int
        assert m.allocated(1) == 14 * 2**20 and grown.shape == (2**19,)
        del grown
        del x, y, out
        gc.collect()
        assert m.allocated(1) == 0 and m.allocated(0) == 0
    assert torch.empty(3).untyped_storage().resize_(0).nbytes() == 0  # torch's own method again


def test_module_memory_moves_with_the_module():
    with simulated_gpus(2) as m:
        lin = torch.nn.Linear(128, 128)  # 64 KiB weight + 512 B bias
        lin.to("cuda:0")
        assert m.allocated(0) == 128 * 128 * 4 + 512
        lin.to("cuda:1")
        assert m.allocated(0) == 0 and m.allocated(1) == 128 * 128 * 4 + 512
        lin.cpu()
        assert m.allocated(1) == 0


def test_oom_past_capacity_names_the_device():
    with simulated_gpus(2, memory=["1GiB", "64MiB"]) as m:
        keep = torch.empty(44 * 2**20, dtype=torch.uint8, device="cuda:1")
        with pytest.raises(torch.cuda.OutOfMemoryError) as exc:
            torch.empty(20 * 2**20 + 1, dtype=torch.uint8, device="cuda:1")
        msg = str(exc.value)
        assert msg.startswith(
            "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1 has a total capacity of 64.00 MiB of which "
            "20.00 MiB is free."
        ), msg
        assert "Of the allocated memory 44.00 MiB is allocated by PyTorch" in msg
        # the trailing link as in libc10_cuda of the 2.4-2.15 wheels (moved in 2.11)
        new_link = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 11)
        assert msg.endswith(
            "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
            if new_link
            else "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )
        assert isinstance(exc.value, RuntimeError)
        assert m.allocated(1) == 44 * 2**20 and m.num_ooms(1) == 1
        with pytest.raises(torch.cuda.OutOfMemoryError, match="GPU 1 has a total capacity"):
            torch.ones(6 * 2**20, device="cpu").to("cuda:1")  # 24 MiB move
        with pytest.raises(torch.cuda.OutOfMemoryError, match="GPU 1 "):
            keep.float()  # an op's output counts too
        assert torch.empty(40 * 2**20, dtype=torch.uint8, device="cuda:0").device.index == 0
        del keep


def test_oom_type_is_torchs():
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    with simulated_gpus(1, memory="1MiB"):
        with pytest.raises(oom):
            torch.zeros(2**20, device="cuda:0")


# ------------------------------------------------------------------------------------------------
# restoration
# ------------------------------------------------------------------------------------------------
def _owners():
    owners = [torch, torch.Tensor, torch.cuda, torch.cuda.memory, torch.cuda.random, torch.cuda.streams]
    owners += [torch.serialization, torch.backends.cudnn, torch.UntypedStorage]
    if hasattr(torch, "accelerator"):
        owners.append(torch.accelerator)
        if hasattr(torch.accelerator, "memory"):
            owners.append(torch.accelerator.memory)
    import concurrent.futures

    owners.append(concurrent.futures.ThreadPoolExecutor)
    # autograd: the engine, the optimizers' grouping, saved-tensor hooks, custom Functions
    owners += [torch.autograd.variable.Variable, torch._C, torch._C._autograd]
    owners += [torch.autograd.function.Function, torch.autograd.function.BackwardCFunction]
    # nn.DataParallel: its worker threads, copy streams and NCCL check
    import importlib

    owners += [importlib.import_module(f"torch.nn.parallel.{n}") for n in ("parallel_apply", "_functions")]
    owners.append(importlib.import_module("torch.cuda.nccl"))
    return owners


def _snapshot():
    return {id(o): dict(o.__dict__) for o in _owners()}


def _assert_same(before, after):
    for o in _owners():
        b, a = before[id(o)], after[id(o)]
        assert set(b) == set(a), (o, set(a) ^ set(b))
        changed = [k for k in b if a[k] is not b[k]]
        assert not changed, (o, changed)


def test_exit_restores_every_patched_attribute_exactly():
    before = _snapshot()
    stack = torch.overrides._get_current_function_mode_stack()
    with simulated_gpus(2, memory="2GiB") as m:
        patched = list(m._patched)
        assert len(patched) > 20
        assert any(owner is torch.Tensor and name == "device" for owner, name in patched)
        t = torch.ones(2, device="cuda:1")
    _assert_same(before, _snapshot())
    for owner, name in patched:
        assert owner.__dict__.get(name) is before[id(owner)].get(name)
    assert torch.overrides._get_current_function_mode_stack() == stack
    assert not torch.cuda.is_available() or torch.cuda.device_count() != 2
    assert t.device.type == "cpu"


def test_exit_restores_after_an_error():
    before = _snapshot()
    with pytest.raises(ValueError):
        with simulated_gpus(2):
            torch.ones(1, device="cuda:1")
            raise ValueError("boom")
    _assert_same(before, _snapshot())
    with simulated_gpus(3) as m:  # a fresh machine: nothing left from the previous one
        assert m.allocated(1) == 0 and torch.cuda.device_count() == 3


def test_functions_bound_during_a_simulation_fall_back_afterwards():
    with simulated_gpus(3):
        bound_count = torch.cuda.device_count
        bound_available = torch.cuda.is_available
        assert bound_count() == 3
    assert bound_count() == torch.cuda.device_count()
    assert bound_available() == torch.cuda.is_available()


def test_nothing_leaks_into_the_next_simulation():
    with simulated_gpus(2) as m1:
        a = torch.ones(4, device="cuda:1")
    with simulated_gpus(2) as m2:
        assert not is_simulated(a) and a.device.type == "cpu"
        assert m2.allocated(1) == 0
        assert torch.cuda.current_device() == 0
    assert m1 is not m2


# ------------------------------------------------------------------------------------------------
# parity with a real GPU (run where one is present)
# ------------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu  # skipped without a real GPU (tests/conftest.py)


def _outcome(fn):
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what is compared
        return type(e).__name__, str(e).split("\n")[0]
    return "ok", str(out.device) if isinstance(out, torch.Tensor) else repr(out)


GPU = "cuda:0"
PARITY_SCENARIOS = {
    "cuda_plus_cpu": lambda: torch.ones(2, device="cuda:0") + torch.ones(2),
    "cpu_plus_cuda": lambda: torch.ones(2) + torch.ones(2, device="cuda:0"),
    "cpu_scalar_ok": lambda: torch.ones(2, device="cuda:0") * torch.tensor(3.0),
    "embedding_cpu_index": lambda: F.embedding(torch.tensor([0]), torch.ones(3, 2, device="cuda:0")),
    "linear_cpu_weight": lambda: F.linear(torch.ones(2, 4, device="cuda:0"), torch.ones(3, 4)),
    "linear_cpu_input_bias": lambda: F.linear(
        torch.ones(2, 4), torch.ones(3, 4, device="cuda:0"), torch.ones(3, device="cuda:0")
    ),
    "cat_cpu": lambda: torch.cat([torch.ones(2, device="cuda:0"), torch.ones(2)]),
    "cpu_index_ok": lambda: torch.arange(4.0, device="cuda:0")[torch.tensor([1, 3])],
    "to_same_is_self": lambda: (lambda t: t.to("cuda:0") is t)(torch.ones(1, device="cuda:0")),
    "numpy": lambda: torch.ones(1, device="cuda:0").numpy(),
    "index_put_cpu_values": lambda: _put(torch.zeros(3, 2, device=GPU), torch.tensor([0, 2]), torch.ones(2, 2)),
    "index_put_cpu_0dim_ok": lambda: _put(torch.zeros(3, device=GPU), torch.tensor([0, 2]), torch.tensor(5.0)),
    "mask_put_one_cpu_element_ok": lambda: _put(
        torch.zeros(3, device=GPU), torch.tensor([True, False, True], device=GPU), torch.tensor([7.0])
    ),
    "where_cpu_0dim_other_ok": lambda: torch.where(
        torch.tensor([True, False], device=GPU), torch.ones(2, device=GPU), torch.tensor(0.0)
    ),
    "fill_cuda_0dim_into_cpu_ok": lambda: torch.zeros(2).fill_(torch.tensor(3.0, device=GPU)),
    "masked_fill_cpu_mask": lambda: torch.ones(2, device=GPU).masked_fill(torch.tensor([True, False]), 0.0),
    "list_of_cuda_0dim_is_cpu": lambda: torch.tensor([torch.tensor(1.0, device=GPU)]),
    "slice_put_cpu_ok": lambda: _put(torch.zeros(3, 2, device=GPU), slice(0, 2), torch.ones(2, 2)),
    "new_zeros_to_cpu": lambda: torch.ones(2, device=GPU).new_zeros(3, device="cpu"),
    "new_full_from_cpu_to_cuda": lambda: torch.ones(2).new_full((2,), 1.0, device=GPU),
    "new_tensor_to_cpu": lambda: torch.ones(1, device=GPU).new_tensor([1.0], device="cpu"),
    "new_empty_keeps_device": lambda: torch.ones(1, device=GPU).new_empty(2),
    "cpu_indexed_by_cuda_0dim_int_ok": lambda: torch.arange(4.0)[torch.tensor(2, device=GPU)],
    "cpu_indexed_by_cuda_0dim_bool_ok": lambda: torch.arange(4.0)[torch.tensor(True, device=GPU)],
    "cpu_indexed_by_cuda_1dim_int": lambda: torch.arange(4.0)[torch.tensor([2], device=GPU)],
    "cpu_put_by_cuda_0dim_int_ok": lambda: _put(torch.zeros(3), torch.tensor(1, device=GPU), 2.0),
    "stream_context_current": lambda: _in_stream(),
}


def _in_stream():
    """Inside ``torch.cuda.stream(s)``: is ``s`` current, where does a bare "cuda" land; after: default."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        inside = torch.cuda.current_stream() == s
        t = torch.ones(1, device="cuda")
    return inside, torch.cuda.current_stream() == torch.cuda.default_stream(), str(t.device)


def _put(x, index, value):
    x[index] = value
    return x


@gpu
@pytest.mark.parametrize("name", sorted(PARITY_SCENARIOS))
def test_parity_with_real_cuda0(name):
    fn = PARITY_SCENARIOS[name]
    with torch.no_grad():
        real = _outcome(fn)
        with simulated_gpus(1, memory="8GiB"):
            simulated = _outcome(fn)
    assert simulated == real


@gpu
def test_parity_oom_message_shape():
    free, total = torch.cuda.mem_get_info(0)
    try:
        torch.empty(total * 2, dtype=torch.uint8, device="cuda:0")
    except torch.cuda.OutOfMemoryError as e:
        real = str(e)
    with simulated_gpus(1, memory=total):
        with pytest.raises(torch.cuda.OutOfMemoryError) as exc:
            torch.empty(total * 2, dtype=torch.uint8, device="cuda:0")
    shape = re.compile(r"CUDA out of memory\. Tried to allocate [\d.]+ [KMG]iB\. GPU 0 has a total capacity of ")
    assert shape.match(real) and shape.match(str(exc.value))
