"""Tiny models on simulated GPUs produce exactly what they produce on the CPU.

Acceptance items 1 and 2 of the simulator: every causal LM, split across 2 and 4 simulated
GPUs by ``from_pretrained(path, device_map=...)`` (an explicit map that uses every GPU, and
``"auto"`` / ``"balanced"`` with a ``max_memory`` that forces a split) and by accelerate's
``dispatch_model``, generates the same greedy tokens as on the plain CPU; the tiny Flux
pipeline moved to ``cuda:1`` of a 2-GPU machine gives the CPU image.

No shim is installed here: these are the healthy paths, the baseline the bug scenarios
are measured against.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
if torch.version.cuda is None:
    pytest.skip(
        f"simulated GPUs need a CUDA build of torch; torch {torch.__version__} is the CPU-only build",
        allow_module_level=True,
    )

from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.testing.models import (  # noqa: E402
    ARCHS,
    flux_unavailable,
    greedy_generate,
    sample_input_ids,
    save_tiny_causal_lm,
    tiny_causal_lm,
    tiny_flux_pipeline,
    unsupported_archs,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Six layers: enough that accelerate's balanced placement under a tight max_memory spans
# all of 4 GPUs without offloading (with 4 layers and a tied head it leaves cuda:3 empty).
NUM_LAYERS = 6
NEW_TOKENS = 8
MEMORY = "2GiB"  # transformers 5.x pre-allocates (capacity - 1.2 GiB) at load: keep capacity above that

ARCH_PARAMS = [
    pytest.param(a, id=a, marks=pytest.mark.skipif(a in unsupported_archs(), reason=unsupported_archs().get(a, "")))
    for a in ARCHS
]


class Reference:
    """A saved tiny LM, its CPU greedy tokens and the module layout a device map addresses."""

    def __init__(self, arch: str, root) -> None:
        from transformers import AutoModelForCausalLM

        self.arch = arch
        self.path = save_tiny_causal_lm(arch, root / arch, num_layers=NUM_LAYERS)
        self.input_ids = sample_input_ids(batch=2, length=6)
        cpu_model = AutoModelForCausalLM.from_pretrained(self.path, local_files_only=True)
        self.tokens = greedy_generate(cpu_model, self.input_ids, NEW_TOKENS)
        self.tied = bool(cpu_model.config.tie_word_embeddings)
        self.base_children = [name for name, _ in cpu_model.model.named_children()]
        sizes = _module_sizes(cpu_model)
        self.total_bytes, self.layer_bytes = sizes[""], sizes["model.layers.0"]

    def explicit_map(self, n: int) -> dict:
        """Contiguous, balanced and using every GPU: layer i on GPU i*n//L, the head where it belongs.

        A tied head shares its weight with the embedding, so it goes with the embedding (as
        accelerate places it); an untied head goes with the final norm on the last GPU.
        """
        device_map = {}
        for child in self.base_children:
            if child == "layers":
                for i in range(NUM_LAYERS):
                    device_map[f"model.layers.{i}"] = i * n // NUM_LAYERS
            else:
                device_map[f"model.{child}"] = 0 if child == "embed_tokens" else n - 1
        device_map["lm_head"] = 0 if self.tied else n - 1
        return device_map

    def split_max_memory(self, n: int) -> dict:
        """A per-GPU cap that no GPU can hold the model under, yet all n together can."""
        return {i: self.total_bytes // n + self.layer_bytes for i in range(n)}


def _module_sizes(model):
    from accelerate.utils import compute_module_sizes

    return compute_module_sizes(model)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache: dict = {}
    root = tmp_path_factory.mktemp("tiny-lms")

    def get(arch: str) -> Reference:
        if arch not in cache:
            cache[arch] = Reference(arch, root)
        return cache[arch]

    return get


def _device_of(name: str, device_map: dict) -> torch.device:
    """The device ``device_map`` gives the parameter ``name`` (its longest module prefix)."""
    best = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
    return torch.device("cuda", device_map[best])


def _assert_placed(model, device_map: dict, n: int) -> None:
    gpus = set(device_map.values())
    assert gpus == set(range(n)), f"the map does not span all {n} GPUs: {device_map}"
    seen = set()
    for name, param in model.named_parameters():
        expected = _device_of(name, device_map)
        assert param.device == expected, f"{name} is on {param.device}, the map says {expected}"
        seen.add(param.device)
    assert seen == {torch.device("cuda", i) for i in range(n)}


def _generate_on_first_gpu(model, ids):
    first = next(model.parameters()).device
    assert first == torch.device("cuda", 0)
    return greedy_generate(model, ids.to(first), NEW_TOKENS)


# ----------------------------------------------------------------------------- from_pretrained


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_from_pretrained_explicit_map_generates_cpu_tokens(arch, n, references):
    from transformers import AutoModelForCausalLM

    ref = references(arch)
    device_map = ref.explicit_map(n)
    with simulated_gpus(n, memory=MEMORY) as machine:
        model = AutoModelForCausalLM.from_pretrained(ref.path, device_map=device_map, local_files_only=True)
        assert model.hf_device_map == device_map
        _assert_placed(model, device_map, n)
        assert all(machine.allocated(i) > 0 for i in range(n))
        tokens = _generate_on_first_gpu(model, ref.input_ids)
    assert torch.equal(tokens, ref.tokens), f"{arch} on {n} GPUs: {tokens.tolist()} != CPU {ref.tokens.tolist()}"


@pytest.mark.parametrize(("n", "strategy"), [(2, "balanced"), (4, "auto")])
@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_from_pretrained_balanced_split_generates_cpu_tokens(arch, n, strategy, references):
    from transformers import AutoModelForCausalLM

    ref = references(arch)
    max_memory = ref.split_max_memory(n)
    with simulated_gpus(n, memory=MEMORY):
        model = AutoModelForCausalLM.from_pretrained(
            ref.path, device_map=strategy, max_memory=max_memory, local_files_only=True
        )
        device_map = dict(model.hf_device_map)
        assert all(isinstance(d, int) for d in device_map.values()), f"offloaded: {device_map}"
        _assert_placed(model, device_map, n)
        tokens = _generate_on_first_gpu(model, ref.input_ids)
    assert torch.equal(tokens, ref.tokens), f"{arch} {strategy} on {n} GPUs: {device_map}"


# ----------------------------------------------------------------------------- dispatch_model


def _kv_cache_bug_applies() -> bool:
    """Whether the matrix says a plain dispatch_model drags the KV cache here (transformers < 4.42)."""
    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.versions import installed_versions

    matrix = load_matrix()
    return matrix.get(KV_CACHE_BUG).applies(installed_versions(matrix.distributions()))


KV_CACHE_BUG = "dispatch-without-skip-keys-moves-kv-cache"


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_dispatch_model_with_the_models_skip_keys_generates_cpu_tokens(arch, n, references):
    """dispatch_model as from_pretrained calls it (skip_keys=model._skip_keys_device_placement)."""
    from accelerate import dispatch_model

    ref = references(arch)
    model = tiny_causal_lm(arch, num_layers=NUM_LAYERS)  # the weights that were saved
    device_map = ref.explicit_map(n)
    with simulated_gpus(n, memory=MEMORY):
        model = dispatch_model(model, device_map=device_map, skip_keys=model._skip_keys_device_placement)
        _assert_placed(model, device_map, n)
        tokens = _generate_on_first_gpu(model, ref.input_ids)
    assert torch.equal(tokens, ref.tokens), f"{arch} dispatched on {n} GPUs"


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_plain_dispatch_model_generates_cpu_tokens_where_the_matrix_says_it_can(arch, references):
    """A bare dispatch_model(model, device_map): the CPU tokens, or, on the stacks of matrix row
    dispatch-without-skip-keys-moves-kv-cache, CUDA's device-mismatch error in the KV cache."""
    from accelerate import dispatch_model

    ref = references(arch)
    model = tiny_causal_lm(arch, num_layers=NUM_LAYERS)
    n = 2
    device_map = ref.explicit_map(n)
    with simulated_gpus(n, memory=MEMORY):
        model = dispatch_model(model, device_map=device_map)
        _assert_placed(model, device_map, n)
        if _kv_cache_bug_applies():
            with pytest.raises(RuntimeError, match=r"found at least two devices, cuda:\d and cuda:\d!"):
                _generate_on_first_gpu(model, ref.input_ids)
            return
        tokens = _generate_on_first_gpu(model, ref.input_ids)
    assert torch.equal(tokens, ref.tokens), f"{arch} dispatched on {n} GPUs without skip_keys"


# ----------------------------------------------------------------------------- Flux


def _flux_run(pipe, output_type: str = "pt"):
    return pipe(
        prompt="a photo of a cat",
        num_inference_steps=2,
        height=32,
        width=32,
        guidance_scale=3.5,
        output_type=output_type,
        generator=torch.Generator().manual_seed(0),
    ).images


@pytest.fixture(scope="module")
def flux_cpu():
    reason = flux_unavailable()
    if reason is not None:
        pytest.skip(reason)
    pipe = tiny_flux_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe, _flux_run(pipe), _flux_run(pipe, "latent")


def _flux_modules(pipe):
    return {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


def test_flux_pipeline_on_cuda1_matches_cpu(flux_cpu):
    _, expected, _ = flux_cpu
    pipe = tiny_flux_pipeline()  # a fresh copy: moving is in place
    pipe.set_progress_bar_config(disable=True)
    with simulated_gpus(2, memory=MEMORY) as machine:
        pipe.to("cuda:1")
        for name, module in _flux_modules(pipe).items():
            assert {p.device for p in module.parameters()} == {torch.device("cuda", 1)}, name
        image = _flux_run(pipe)
        assert image.device == torch.device("cuda", 1)
        assert machine.max_allocated(0) == 0, "something was put on cuda:0"
        image = image.cpu()
    torch.testing.assert_close(image, expected, rtol=0, atol=1e-5)


@pytest.mark.simulated_gpus(n=2, memory=MEMORY)
def test_flux_latents_on_cuda1_match_cpu_under_the_pytest_marker(flux_cpu, simulated_gpus):
    _, _, expected = flux_cpu
    assert torch.cuda.device_count() == 2
    pipe = tiny_flux_pipeline().to("cuda:1")
    pipe.set_progress_bar_config(disable=True)
    latents = _flux_run(pipe, "latent")
    assert latents.device == torch.device("cuda", 1)
    assert simulated_gpus.max_allocated(0) == 0
    torch.testing.assert_close(latents.cpu(), expected, rtol=0, atol=1e-5)


def _bnb_has_cpu_kernels() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        return Version(version("bitsandbytes")).release >= (0, 46)
    except PackageNotFoundError:
        return False


@pytest.mark.skipif(
    not _bnb_has_cpu_kernels(),
    reason="4-bit quantization on simulated GPUs needs bitsandbytes >= 0.46 (CPU kernels); "
    "older releases quantize only through their CUDA library",
)
def test_flux_transformer_reloads_in_4bit_and_runs_on_either_gpu(tmp_path):
    if flux_unavailable() is not None:
        pytest.skip(flux_unavailable())
    from diffusers import BitsAndBytesConfig, FluxPipeline, FluxTransformer2DModel

    from devmap_shims.testing.models import save_tiny_flux_pipeline

    path = save_tiny_flux_pipeline(tmp_path / "flux")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    with simulated_gpus(2, memory=MEMORY):
        transformer = FluxTransformer2DModel.from_pretrained(
            path, subfolder="transformer", quantization_config=quant, torch_dtype=torch.float32,
            local_files_only=True,
        )
        to_q = transformer.transformer_blocks[0].attn.to_q
        assert type(to_q).__name__ == "Linear4bit" and to_q.weight.device == torch.device("cuda", 0)
        pipe = FluxPipeline.from_pretrained(path, transformer=transformer, local_files_only=True).to("cuda:0")
        pipe.set_progress_bar_config(disable=True)
        on_0 = _flux_run(pipe).cpu()
        pipe.to("cuda:1")
        state = to_q.weight.quant_state
        assert {to_q.weight.device, state.absmax.device, state.code.device} == {torch.device("cuda", 1)}
        on_1 = _flux_run(pipe)
        assert on_1.device == torch.device("cuda", 1)
        on_1 = on_1.cpu()
    assert torch.isfinite(on_0).all() and float(on_0.std()) > 0.05
    torch.testing.assert_close(on_1, on_0, rtol=0, atol=1e-5)
