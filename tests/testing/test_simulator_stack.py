"""The simulator under the real stack: accelerate's placement utilities and hooks, transformers
loading and generation, safetensors, bitsandbytes 4-bit parameters."""

from __future__ import annotations

import os
import re

import pytest

torch = pytest.importorskip("torch")
if torch.version.cuda is None:  # pragma: no cover
    pytest.skip("the simulator needs a CUDA build of torch", allow_module_level=True)
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from devmap_shims.testing import real_cpu_tensor, simulated_gpus  # noqa: E402
from devmap_shims.testing.models import two_gpu_split  # noqa: E402

TF_MAJOR = int(re.match(r"\d+", transformers.__version__).group())
GEN = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def cpu_tokens(tiny_llama_dir, prompt):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    out = model.generate(prompt, **GEN)
    assert len(set(out[0, prompt.shape[1]:].tolist())) > 1  # the comparison below means something
    return out


ACCELERATE_SKIPS_SMALL_GPU0 = tuple(int(x) for x in accelerate.__version__.split(".")[:2]) < (0, 30)
OLD_TRANSFORMERS = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (4, 45)

def test_dispatch_model_over_two_gpus_generates_the_cpu_tokens(tiny_llama_dir, prompt, cpu_tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with simulated_gpus(2) as m:
        # skip_keys as from_pretrained passes it: without it transformers < 4.42 drags the KV cache
        # to cuda:0 (matrix row dispatch-without-skip-keys-moves-kv-cache), which is not this test's point
        model = accelerate.dispatch_model(model, device_map=two_gpu_split(model), skip_keys=model._skip_keys_device_placement)
        assert model.model.layers[0].self_attn.q_proj.weight.device == torch.device("cuda:0")
        assert model.lm_head.weight.device == torch.device("cuda:1")
        assert m.allocated(0) > 0 and m.allocated(1) > 0
        out = model.generate(prompt.to("cuda:0"), **GEN)
        assert out.device == torch.device("cuda:0")
        assert torch.equal(real_cpu_tensor(out), cpu_tokens)


def test_from_pretrained_device_map_auto_spreads_and_generates(tiny_llama_dir, prompt, cpu_tokens):
    # transformers 5 warms the allocator up with min(model bytes, capacity - 1.2 GiB): keep GPUs > 1.2 GiB
    with simulated_gpus(2, memory="2GiB") as m:
        budget = {0: 400 * 1024, 1: "1GiB"}
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_llama_dir, device_map="auto", max_memory=budget
        )
        devices = {p.device for p in model.parameters()}
        if ACCELERATE_SKIPS_SMALL_GPU0:
            # accelerate 0.29 reserves room on GPU 0 for the largest layer first and skips it here
            assert devices == {torch.device("cuda:1")}, devices
        else:
            assert devices == {torch.device("cuda:0"), torch.device("cuda:1")}, devices
            assert 0 < m.allocated(0) <= 400 * 1024
        assert m.allocated(1) > 0
        out = model.generate(prompt.to(model.device), **GEN)
        assert torch.equal(real_cpu_tensor(out), cpu_tokens)


def test_from_pretrained_onto_one_gpu(tiny_llama_dir):
    with simulated_gpus(2, memory="2GiB") as m:
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, device_map="cuda:1")
        assert {p.device for p in model.parameters()} == {torch.device("cuda:1")}
        n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # transformers 4.40 keeps a second copy of the weights alive while loading onto the device
        slack = 2 * n_bytes if OLD_TRANSFORMERS else 64 * 512
        assert m.allocated(0) == 0 and n_bytes <= m.allocated(1) < n_bytes + slack


def test_everything_on_one_small_gpu_is_a_real_oom(tiny_llama_dir):
    """What makes a collapsed device_map observable: the whole model on a GPU too small for it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with simulated_gpus(2, memory=[n_bytes // 2, n_bytes * 2]):
        with pytest.raises(torch.cuda.OutOfMemoryError, match="GPU 0 has a total capacity"):
            accelerate.dispatch_model(model, device_map={"": 0})


def test_get_max_memory_reports_the_simulated_capacities():
    from accelerate.utils import get_max_memory

    with simulated_gpus(3, memory=["1GiB", "2GiB", "3GiB"]) as m:
        mm = get_max_memory()
        # accelerate probes each GPU with torch.tensor([0], device=i) (one 512-byte block) first;
        # 0.29 keeps only the last probe alive while it asks, later versions every one
        if ACCELERATE_SKIPS_SMALL_GPU0:
            assert [mm[i] for i in range(3)] == [m.capacity(0), m.capacity(1), m.capacity(2) - 512]
        else:
            assert [mm[i] for i in range(3)] == [m.capacity(i) - 512 for i in range(3)]
        assert mm[2] == 3 * 2**30 - 512 and "cpu" in mm
        assert get_max_memory({0: "100MB", 1: "1GiB"}) == {0: 10**8, 1: 2**30}


def test_infer_auto_device_map_uses_the_simulated_gpus(tiny_llama_dir):
    from accelerate import infer_auto_device_map, init_empty_weights

    config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    with simulated_gpus(2, memory="1GiB"):
        dm = infer_auto_device_map(model, max_memory={0: 400 * 1024, 1: 10**9, "cpu": 10**9})
    assert set(dm.values()) == {0, 1}, dm


def test_set_module_tensor_to_device_and_send_to_device():
    from accelerate.utils import send_to_device, set_module_tensor_to_device

    with simulated_gpus(2):
        lin = torch.nn.Linear(3, 3)
        set_module_tensor_to_device(lin, "weight", "cuda:1", value=torch.ones(3, 3))
        assert lin.weight.device == torch.device("cuda:1") and isinstance(lin.weight, torch.nn.Parameter)
        set_module_tensor_to_device(lin, "bias", 1)
        assert lin.bias.device.index == 1
        batch = send_to_device({"ids": torch.ones(2, dtype=torch.long), "more": [torch.zeros(1)]}, "cuda:1")
        assert batch["ids"].device.index == 1 and batch["more"][0].device.index == 1


def test_safetensors_load_onto_a_simulated_gpu(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = os.fspath(tmp_path / "w.safetensors")
    save_file({"a": torch.arange(6.0).reshape(2, 3)}, path)
    with simulated_gpus(2) as m:
        loaded = load_file(path, device="cuda:1")["a"]
        assert loaded.device == torch.device("cuda:1") and m.allocated(1) >= 24
        with safe_open(path, framework="pt", device="cuda:0") as f:
            t = f.get_tensor("a")
        assert t.device == torch.device("cuda:0")
        assert torch.equal(real_cpu_tensor(t), torch.arange(6.0).reshape(2, 3))


# ------------------------------------------------------------------------------------------------
# bitsandbytes
# ------------------------------------------------------------------------------------------------
def _bnb_with_cpu_kernels():
    bnb = pytest.importorskip("bitsandbytes")
    major_minor = tuple(int(x) for x in re.findall(r"\d+", bnb.__version__)[:2])
    if major_minor < (0, 46):
        pytest.skip("bitsandbytes < 0.46 has no CPU 4-bit kernels")
    return bnb


def test_prequantized_params4bit_moves_on_any_bitsandbytes():
    """Old bitsandbytes has no CPU kernels: parameters built from pre-quantized data still move."""
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import QuantState

    packed = torch.randint(0, 255, (8 * 64 // 2, 1), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    state = QuantState(
        absmax=torch.rand(8), shape=torch.Size([8, 64]), code=torch.linspace(-1, 1, 16), blocksize=64,
        quant_type="nf4", dtype=torch.float16,
    )
    with simulated_gpus(2):
        p = bnb.nn.Params4bit(
            data=packed, requires_grad=False, quant_state=state, blocksize=64, quant_type="nf4", bnb_quantized=True
        )
        moved = p.to("cuda:1")
        assert isinstance(moved, bnb.nn.Params4bit) and moved.device == torch.device("cuda:1")
        assert moved.quant_state.absmax.device == torch.device("cuda:1")
        assert torch.equal(real_cpu_tensor(moved), packed)


def test_params4bit_moves_to_a_simulated_gpu_intact():
    bnb = _bnb_with_cpu_kernels()
    torch.manual_seed(0)
    w = torch.randn(32, 64, dtype=torch.float16)
    with simulated_gpus(2):
        p = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4").to("cuda:1")
        assert isinstance(p, bnb.nn.Params4bit) and p.bnb_quantized
        assert p.device == torch.device("cuda:1") and p.quant_state.absmax.device == torch.device("cuda:1")
        moved = p.to("cuda:0")
        assert isinstance(moved, bnb.nn.Params4bit) and moved.device.index == 0
        assert moved.quant_state.absmax.device.index == 0 and moved.quant_state is not None


def test_linear4bit_forward_on_a_simulated_gpu_matches_cpu():
    bnb = _bnb_with_cpu_kernels()
    torch.manual_seed(0)
    ref_linear = torch.nn.Linear(64, 32).half()
    x = torch.randn(3, 64, dtype=torch.float16)

    def quantized(device):
        layer = bnb.nn.Linear4bit(64, 32, compute_dtype=torch.float16, quant_type="nf4")
        layer.load_state_dict(ref_linear.state_dict())
        return layer.to(device)

    with torch.no_grad():
        expected = quantized("cpu")(x)
        with simulated_gpus(2):
            layer = quantized("cuda:0")
            assert layer.weight.device.index == 0 and layer.weight.bnb_quantized
            out = layer(x.to("cuda:0"))
            assert out.device == torch.device("cuda:0")
            got = real_cpu_tensor(out)
    assert torch.equal(got, expected)


def test_diffusers_accelerator_probe_answers_cuda_inside_and_cpu_after():
    """diffusers caches which accelerator it found (0.35-0.40 ``get_device``, 0.41+ through
    ``TorchDeviceBackend``): a probe made before the simulation must not hide its GPUs, nor one
    made inside it leave ``cuda`` behind."""
    torch_utils = pytest.importorskip("diffusers.utils.torch_utils")
    get_device = getattr(torch_utils, "get_device", None)
    if get_device is None:
        pytest.skip("this diffusers has no get_device")
    assert get_device() == "cpu"
    with simulated_gpus(1):
        assert get_device() == "cuda"
    assert get_device() == "cpu"
