"""Tiny offline models: build, determinism, non-degenerate output, offline save/reload."""

from __future__ import annotations

import os

# Nothing here may touch the Hub: set before transformers / diffusers read it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

transformers = pytest.importorskip("transformers")

from devmap_shims.testing.models import (  # noqa: E402
    ARCHS,
    TINY_VOCAB,
    UnsupportedArchError,
    flux_unavailable,
    greedy_generate,
    sample_input_ids,
    save_tiny_causal_lm,
    save_tiny_flux_pipeline,
    supported_archs,
    tiny_causal_lm,
    tiny_config,
    tiny_flux_pipeline,
    tiny_flux_transformer,
    unsupported_archs,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _arch_param(arch: str):
    reason = unsupported_archs().get(arch)
    return pytest.param(arch, id=arch, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


ARCH_PARAMS = [_arch_param(a) for a in ARCHS]


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ----------------------------------------------------------------------------- archs


def test_supported_and_unsupported_archs_partition_archs():
    supported, missing = supported_archs(), unsupported_archs()
    assert set(supported) | set(missing) == set(ARCHS)
    assert not set(supported) & set(missing)
    for arch, reason in missing.items():
        assert transformers.__version__ in reason and "ForCausalLM" in reason
        with pytest.raises(UnsupportedArchError, match=arch):
            tiny_causal_lm(arch)


def test_unknown_arch_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="llama"):
        tiny_config("gpt2")


# ----------------------------------------------------------------------------- causal LMs


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_tiny_config_is_tiny_and_takes_overrides(arch):
    config = tiny_config(arch, num_hidden_layers=4)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (64, 4, 2)
    assert config.vocab_size == TINY_VOCAB and config.num_hidden_layers == 4


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_build_is_seeded_and_leaves_global_rng_alone(arch):
    torch.manual_seed(1234)
    expected_next = torch.rand(3)
    torch.manual_seed(1234)
    a = tiny_causal_lm(arch)
    assert torch.equal(torch.rand(3), expected_next), "building a model consumed the caller's RNG"
    assert _state_equal(a, tiny_causal_lm(arch))
    assert not _state_equal(a, tiny_causal_lm(arch, seed=1))
    assert len(a.model.layers) == 2 and len(tiny_causal_lm(arch, num_layers=3).model.layers) == 3
    assert sum(p.numel() for p in a.parameters()) < 200_000
    assert not a.training


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_dtype_is_applied(arch):
    model = tiny_causal_lm(arch, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_greedy_generate_is_not_degenerate(arch):
    model = tiny_causal_lm(arch)
    tokens = greedy_generate(model, sample_input_ids(), max_new_tokens=16)
    assert tokens.shape == (1, 16)
    assert len(set(tokens[0].tolist())) >= 3, f"{arch} repeats itself: {tokens[0].tolist()}"


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_save_and_offline_reload_generate_the_same_tokens(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_causal_lm(arch)
    ids = sample_input_ids(batch=2, length=8)
    before = greedy_generate(model, ids, max_new_tokens=16)

    path = save_tiny_causal_lm(arch, tmp_path / arch)
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert type(reloaded) is type(model)
    assert _state_equal(model, reloaded)
    assert torch.equal(greedy_generate(reloaded, ids, max_new_tokens=16), before)


def test_sample_input_ids_are_seeded_ordinary_ids():
    ids = sample_input_ids(batch=3, length=5, vocab=64, seed=7)
    assert ids.shape == (3, 5) and ids.dtype == torch.long
    assert int(ids.min()) >= 3 and int(ids.max()) < 64  # 0..2 are pad, bos, eos
    assert torch.equal(ids, sample_input_ids(batch=3, length=5, vocab=64, seed=7))
    assert not torch.equal(ids, sample_input_ids(batch=3, length=5, vocab=64, seed=8))


# ----------------------------------------------------------------------------- Flux


def _needs_flux() -> None:
    """Skip (with the reason) where the installed diffusers has no Flux; checked at run time so that
    selecting only the LM tests does not import diffusers."""
    reason = flux_unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def flux_pipe():
    _needs_flux()
    pipe = tiny_flux_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def flux_reference(flux_pipe):
    """Two steps of the tiny pipeline, seed 0, as a [1, 3, 32, 32] image tensor."""
    return _run(flux_pipe)


def _run(pipe, seed: int = 0, output_type: str = "pt", **kw):
    return pipe(
        prompt="a photo of a cat",
        num_inference_steps=2,
        height=32,
        width=32,
        guidance_scale=3.5,
        output_type=output_type,
        generator=torch.Generator().manual_seed(seed),
        **kw,
    ).images


def test_flux_components_are_tiny_and_wired(flux_pipe):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    p = flux_pipe
    assert isinstance(p.transformer, FluxTransformer2DModel)
    assert isinstance(p.vae, AutoencoderKL)
    assert isinstance(p.scheduler, FlowMatchEulerDiscreteScheduler)
    assert isinstance(p.text_encoder, CLIPTextModel) and isinstance(p.text_encoder_2, T5EncoderModel)
    assert p.transformer.config.in_channels == 4 * p.vae.config.latent_channels
    assert p.transformer.config.joint_attention_dim == p.text_encoder_2.config.d_model
    assert p.transformer.config.pooled_projection_dim == p.text_encoder.config.hidden_size
    assert p.text_encoder.config.vocab_size == len(p.tokenizer)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        assert sum(x.numel() for x in getattr(p, name).parameters()) < 200_000, name


def test_flux_transformer_alone_has_the_pipeline_weights(flux_pipe):
    assert _state_equal(tiny_flux_transformer(), flux_pipe.transformer)
    assert not _state_equal(tiny_flux_transformer(seed=1), flux_pipe.transformer)
    assert {p.dtype for p in tiny_flux_transformer(dtype=torch.bfloat16).parameters()} == {torch.bfloat16}


def test_flux_tokenizers_are_local_and_round_trip(flux_pipe):
    clip, t5 = flux_pipe.tokenizer, flux_pipe.tokenizer_2
    ids = clip("a photo of a cat").input_ids
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id
    assert clip.decode(ids, skip_special_tokens=True).strip() == "a photo of a cat"
    ids = t5("a photo of a Cat!").input_ids
    assert ids[-1] == t5.eos_token_id and t5.unk_token_id not in ids
    assert t5.decode(ids, skip_special_tokens=True) == "a photo of a Cat!"


def test_flux_two_steps_are_deterministic_and_seed_dependent(flux_pipe, flux_reference):
    first = flux_reference
    assert first.shape == (1, 3, 32, 32)
    assert float(first.std()) > 0.05, "the image is flat: the random weights are degenerate"
    assert torch.equal(_run(flux_pipe), first)
    assert not torch.allclose(_run(flux_pipe, seed=1), first)
    latents = _run(flux_pipe, output_type="latent")
    assert latents.shape[0] == 1 and latents.shape[-1] == flux_pipe.transformer.config.in_channels


def test_flux_save_and_offline_reload_give_the_same_output(flux_pipe, flux_reference, tmp_path):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    expected = flux_reference
    path = save_tiny_flux_pipeline(tmp_path / "flux")
    assert (path / "model_index.json").is_file()
    reloaded = FluxPipeline.from_pretrained(path, local_files_only=True)
    reloaded.set_progress_bar_config(disable=True)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        assert _state_equal(getattr(flux_pipe, name), getattr(reloaded, name)), name
    # Weights are bit-identical, but memory-mapped safetensors storage is aligned differently
    # from fresh allocations and CPU matmul kernels pick other SIMD paths: float tolerance.
    torch.testing.assert_close(_run(reloaded), expected, rtol=0, atol=1e-5)
    # Components reload on their own (the path a quantization_config load takes).
    transformer = FluxTransformer2DModel.from_pretrained(path, subfolder="transformer", local_files_only=True)
    assert _state_equal(transformer, flux_pipe.transformer)


def test_flux_schnell_layout_runs_without_guidance():
    _needs_flux()
    pipe = tiny_flux_pipeline(guidance_embeds=False)
    pipe.set_progress_bar_config(disable=True)
    assert not pipe.transformer.config.guidance_embeds
    image = _run(pipe)
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()


def test_flux_builders_say_why_they_cannot_build():
    if flux_unavailable() is None:
        pytest.skip("this stack can build the Flux pipeline")
    with pytest.raises(ImportError, match="FluxPipeline|diffusers is not installed"):
        tiny_flux_pipeline()
