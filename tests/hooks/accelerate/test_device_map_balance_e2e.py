"""End to end: ``from_pretrained(device_map="auto")`` on simulated GPUs collapses a small model with
a large unsplittable embedding onto one GPU; with the device-map-balance shim installed it loads
across every GPU and generates exactly the tokens the same model generates on the CPU.

The model is a tiny Qwen2 (tied embeddings, like Gemma-2) whose embedding table is most of its
weight, the shape of Gemma-2-27B in 4-bit. On transformers >= 5 the model is loaded in bitsandbytes
4-bit (bitsandbytes >= 0.46 runs 4-bit on the CPU, so on the simulated GPUs). bitsandbytes < 0.46
quantizes with CUDA kernels only, so on older stacks the model loads unquantized, sized so that
accelerate's balancing collapses it all the same.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

import devmap_shims  # noqa: E402
from devmap_shims.hooks.accelerate import device_map_balance as hook  # noqa: E402
from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.testing.models import greedy_generate, sample_input_ids, save_tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.slow

V5 = int(transformers.__version__.split(".")[0]) >= 5
VOCAB = 8192
GPUS = 4
# transformers' allocator warm-up assumes at least 1.2 GiB per GPU
GPU_MEMORY = "2GiB"


def _bnb_runs_on_cpu() -> bool:
    try:
        from importlib.metadata import version

        from packaging.version import Version

        return Version(version("bitsandbytes")) >= Version("0.46")
    except Exception:
        return False


QUANTIZED = V5 and _bnb_runs_on_cpu()


def load_kwargs():
    if QUANTIZED:
        return {"quantization_config": transformers.BitsAndBytesConfig(load_in_4bit=True)}
    return {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-big-vocab")
    # 4 MiB fp32 embedding; 8 layers of 0.3 MiB in 4-bit, or 0.6 MiB in fp32 (narrower MLP)
    intermediate = 512 if QUANTIZED else 256
    save_tiny_causal_lm(
        "qwen2", path, num_layers=8, vocab_size=VOCAB, hidden_size=128, intermediate_size=intermediate,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return path


@pytest.fixture(scope="module")
def cpu_tokens(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map="cpu", **load_kwargs())
    return greedy_generate(model, sample_input_ids(vocab=VOCAB), max_new_tokens=8)


def param_devices(model):
    return {p.device for p in model.parameters()}


@pytest.fixture
def no_shims():
    devmap_shims.uninstall()
    yield
    devmap_shims.uninstall()


def test_without_the_shim_gpus_are_left_idle(checkpoint, no_shims):
    """One GPU holds everything on transformers >= 4.45; transformers 4.40 + accelerate 0.29
    skips GPU 0 instead (its main-device reserve is the embedding) and spreads over the rest."""
    with simulated_gpus(GPUS, memory=GPU_MEMORY):
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map="auto", **load_kwargs())
        devices = param_devices(model)
    assert all(d.type == "cuda" for d in devices), devices
    assert len(devices) < GPUS, devices
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 45):
        assert len(devices) == 1, devices


def test_with_the_shim_it_spreads_and_generates_the_cpu_tokens(checkpoint, cpu_tokens, no_shims, caplog):
    caplog.set_level(logging.INFO, logger=hook.__name__)
    assert devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    with simulated_gpus(GPUS, memory=GPU_MEMORY) as machine:
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map="auto", **load_kwargs())
        devices = param_devices(model)
        assert devices == {torch.device("cuda", i) for i in range(GPUS)}
        assert model.hf_device_map["model.embed_tokens"] == 0
        ids = sample_input_ids(vocab=VOCAB).to("cuda:0")
        tokens = greedy_generate(model, ids, max_new_tokens=8)
        assert all(machine.max_allocated(i) > 0 for i in range(GPUS))
    assert torch.equal(tokens, cpu_tokens)
    repaired = [r for r in caplog.records if r.levelno == logging.INFO and hook.BUG_ID in r.getMessage()]
    assert len(repaired) == 1
