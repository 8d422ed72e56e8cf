"""Tiny offline models for tests, demos and user CI.

Every model here is built from a config written in code, with random weights drawn
from a fixed seed: no Hub access, no downloads, no tokenizer files fetched. They are
small enough that greedy ``generate`` of 32 tokens, or two Flux denoising steps,
take well under a second on a CPU, and big enough to have the module structure
that device-placement code sees in real checkpoints (embeddings, decoder layers,
tied heads, a Flux transformer + VAE + two text encoders).

Causal LMs::

    model = tiny_causal_lm("llama")                 # random, seed 0
    path = save_tiny_causal_lm("qwen2", tmp_path)   # safetensors, reloadable offline
    AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    tokens = greedy_generate(model, sample_input_ids(), max_new_tokens=16)

Flux::

    pipe = tiny_flux_pipeline()
    image = pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="pt").images

The weights are re-drawn from a generator of their own after the library's own
initialisation (see :func:`_reinit_weights`), so they do not depend on how a given
transformers or diffusers release initialises parameters, and they are scaled so
that greedy decoding produces varied tokens instead of one repeated token.
"""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "ARCHS",
    "UnsupportedArchError",
    "flux_unavailable",
    "greedy_generate",
    "sample_input_ids",
    "save_tiny_causal_lm",
    "save_tiny_flux_pipeline",
    "supported_archs",
    "tiny_causal_lm",
    "tiny_config",
    "tiny_flux_pipeline",
    "tiny_flux_transformer",
    "unsupported_archs",
]

#: Every causal-LM architecture the builders know, in a stable order.
ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma2", "mistral")

# arch -> (config class, model class) names in the top-level transformers namespace.
_ARCH_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

TINY_VOCAB = 256
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_FIRST_ORDINARY_ID = 3

_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}

# What makes each architecture itself: bias terms (Qwen2), q/k norms and explicit
# head_dim (Qwen3), logit soft-capping, sliding window and tied head (Gemma2),
# sliding window (Mistral). Tied embeddings follow each family's small checkpoints.
_ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 16, "tie_word_embeddings": True},
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 64,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    "mistral": {"sliding_window": 64, "tie_word_embeddings": False},
}


class UnsupportedArchError(RuntimeError):
    """The installed transformers has no model class for the requested architecture."""


# --------------------------------------------------------------------------- archs


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _arch_classes(arch: str) -> tuple[type, type]:
    """Config and model classes for ``arch``, or :class:`UnsupportedArchError` saying why not."""
    if arch not in _ARCH_CLASSES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    import transformers

    config_name, model_name = _ARCH_CLASSES[arch]
    try:
        return getattr(transformers, config_name), getattr(transformers, model_name)
    except AttributeError:
        raise UnsupportedArchError(
            f"{arch}: transformers {transformers.__version__} has no {model_name} "
            f"(it arrived in a later release); upgrade transformers to build this model"
        ) from None


def supported_archs() -> tuple[str, ...]:
    """The architectures of :data:`ARCHS` that the installed transformers can build."""
    return tuple(a for a in ARCHS if a not in unsupported_archs())


def unsupported_archs() -> dict[str, str]:
    """Architectures the installed transformers cannot build, each with the reason (for skips)."""
    missing: dict[str, str] = {}
    for arch in ARCHS:
        try:
            _arch_classes(arch)
        except UnsupportedArchError as exc:
            missing[arch] = str(exc)
    return missing


# --------------------------------------------------------------------------- configs


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``arch`` (hidden 64, 4 heads, 2 KV heads, vocab 256, 2 layers).

    ``overrides`` are config attributes (``num_hidden_layers=4``, ``tie_word_embeddings=False``...).
    """
    config_cls, _ = _arch_classes(arch)
    kwargs = {**_COMMON, **_ARCH_OVERRIDES[arch], **overrides}
    return config_cls(**kwargs)


# --------------------------------------------------------------------------- weights


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator for a block and give the caller's RNG state back afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _reinit_weights(module: torch.nn.Module, seed: int, *, embedding_std: float = 1.0) -> None:
    """Redraw every matrix / conv kernel of ``module`` from its own seeded generator.

    Matrices get ``N(0, 1/fan_in)`` (activations keep unit scale through the layers),
    embedding tables ``N(0, embedding_std**2)``; biases get a small spread so that
    they matter; normalisation weights keep their initial values. Parameters are
    visited by name, once each (tied weights are one parameter), so the result depends
    only on ``seed`` and the module structure, not on the library's own initialiser.
    """
    gen = torch.Generator().manual_seed(seed)
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    norms = {
        id(p)
        for m in module.modules()
        if "norm" in type(m).__name__.lower()
        for p in m.parameters(recurse=False)
    }
    with torch.no_grad():
        for name, param in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if id(param) in norms or param.ndim == 0:
                continue
            if id(param) in embeddings:
                std = embedding_std
            elif param.ndim >= 2:
                std = (param[0].numel()) ** -0.5
            else:
                std = 0.02
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.copy_(values.to(param.dtype))


# --------------------------------------------------------------------------- causal LMs


def _arch_seed(arch: str, seed: int) -> int:
    """Weight seed per (arch, seed): Llama and Mistral share a layout but not their weights."""
    return seed * 101 + ARCHS.index(arch)


def _randomize_final_norm(model: torch.nn.Module, seed: int, *, gemma_offset: bool) -> None:
    """Give the last RMSNorm zero-mean random gains.

    With a tied head, logits are ``E @ (g * norm(h))`` and ``h`` is dominated by the current
    token's own embedding, so with ``g == 1`` the current token always scores highest and
    greedy decoding repeats it forever. Zero-mean gains remove that self-preference; the
    next token becomes a varied function of the context, as in an untied model.
    Gemma's RMSNorm multiplies by ``1 + weight``, hence the offset.
    """
    norm = getattr(model.base_model, "norm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        return
    gen = torch.Generator().manual_seed(seed + 7)
    gains = torch.randn(norm.weight.shape, generator=gen, dtype=torch.float32)
    with torch.no_grad():
        norm.weight.copy_((gains - 1.0 if gemma_offset else gains).to(norm.weight.dtype))


def tiny_causal_lm(
    arch: str,
    *,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A tiny random ``*ForCausalLM`` of ``arch`` on the CPU, in eval mode.

    The same ``arch``, ``num_layers``, ``seed`` and overrides give bit-identical weights.
    Raises :class:`UnsupportedArchError` when the installed transformers lacks ``arch``.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, num_hidden_layers=num_layers, **config_overrides)
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(config)
    weight_seed = _arch_seed(arch, seed)
    # A tied table is also the output head: keep it small next to the layers' outputs so
    # the current token does not dominate its own logits (fewer greedy fixed points).
    # Gemma scales its input embeddings by sqrt(hidden_size); draw them smaller by as much.
    embedding_std = 0.25 if config.tie_word_embeddings else 1.0
    if arch == "gemma2":
        embedding_std *= config.hidden_size**-0.5
    _reinit_weights(model, weight_seed, embedding_std=embedding_std)
    _randomize_final_norm(model, weight_seed, gemma_offset=arch == "gemma2")
    model.to(dtype)
    model.eval()
    return model


def _save_kwargs(save_pretrained: Any) -> dict[str, Any]:
    """Ask for safetensors where ``save_pretrained`` still has the switch (4.x); 5.x always uses it."""
    params = inspect.signature(save_pretrained).parameters
    return {"safe_serialization": True} if "safe_serialization" in params else {}


def save_tiny_causal_lm(arch: str, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Build :func:`tiny_causal_lm` ``(arch, **kwargs)`` and save it (safetensors) to ``path``.

    ``AutoModelForCausalLM.from_pretrained(path, device_map=...)`` then loads it offline.
    Returns ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    model = tiny_causal_lm(arch, **kwargs)
    model.save_pretrained(path, **_save_kwargs(model.save_pretrained))
    return path


def sample_input_ids(
    batch: int = 1, length: int = 8, vocab: int = TINY_VOCAB, seed: int = 0
) -> torch.Tensor:
    """``[batch, length]`` int64 token ids on the CPU, drawn from ordinary (non-special) ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(_FIRST_ORDINARY_ID, vocab, (batch, length), generator=gen, dtype=torch.long)


def greedy_generate(model: Any, input_ids: torch.Tensor, max_new_tokens: int = 16) -> torch.Tensor:
    """Exactly ``max_new_tokens`` greedy tokens per row (EOS suppressed), returned on the CPU.

    ``input_ids`` go in as given (put them on the model's first device yourself when
    the scenario needs it); only the new tokens come back.
    """
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=PAD_ID,
        )
    return out[:, input_ids.shape[1] :].cpu()


# embedding + first layer on cuda:0, the rest (and the untied head) on cuda:1
_TWO_GPU_SPLIT = {
    "model.embed_tokens": 0,
    "model.layers.0": 0,
    "model.layers.1": 1,
    "model.norm": 1,
    "model.rotary_emb": 1,
    "lm_head": 1,
}


def two_gpu_split(model: torch.nn.Module) -> dict[str, int]:
    """A device map splitting a tiny two-layer Llama-style model over two GPUs (embedding and first
    layer on 0, the rest on 1), with only the modules ``model`` has: ``model.rotary_emb`` appeared
    in transformers 4.45."""
    names = {name for name, _ in model.named_modules()}
    return {key: gpu for key, gpu in _TWO_GPU_SPLIT.items() if key in names}


# --------------------------------------------------------------------------- Flux

# Component sizes. The transformer's width is heads * head_dim = 32; the rotary axes
# must add up to head_dim. The VAE has two blocks (one 2x downsampling) and 4 latent
# channels, which Flux packs 2x2 into 16 transformer input channels. A 32x32 image is a
# 16x16 latent, that is 64 packed image tokens, on every diffusers release.
FLUX_LATENT_CHANNELS = 4
_CLIP_HIDDEN = 32
_T5_D_MODEL = 32


def _tiny_flux_transformer(guidance_embeds: bool) -> Any:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=FLUX_LATENT_CHANNELS * 4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_T5_D_MODEL,
        pooled_projection_dim=_CLIP_HIDDEN,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 4, 8),
    )


def _tiny_vae() -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=FLUX_LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=1.5035,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _tiny_clip_text_encoder(tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_CLIP_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=_CLIP_HIDDEN,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config)


def _tiny_t5_encoder(tokenizer: Any) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=max(tokenizer.get_vocab().values()) + 1,
        d_model=_T5_D_MODEL,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        is_encoder_decoder=False,
        use_cache=False,
    )
    return T5EncoderModel(config)


def _flux_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1-dev's scheduler settings (resolution-dependent shift).
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module.to(dtype)`` unless it is already float32 and float32 is asked for (diffusers warns on
    every ``to(dtype)`` of a model that has no keep-in-fp32 modules)."""
    current = {p.dtype for p in module.parameters()}
    return module if current == {dtype} else module.to(dtype)


def flux_unavailable() -> str | None:
    """Why the tiny Flux pipeline cannot be built with the installed libraries, or ``None`` if it can."""
    try:
        import diffusers
    except ImportError:
        return "diffusers is not installed"
    try:
        from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: F401
    except ImportError:
        return (
            f"diffusers {diffusers.__version__} has no FluxPipeline / FluxTransformer2DModel "
            "(they arrived in diffusers 0.30); upgrade diffusers to build the tiny Flux pipeline"
        )
    return None


def _require_flux() -> None:
    reason = flux_unavailable()
    if reason is not None:
        raise ImportError(reason)


def _flux_seed(seed: int, component: str) -> int:
    """Weight seed of one pipeline component (each component has its own stream)."""
    return seed * 1000 + _FLUX_COMPONENTS.index(component)


_FLUX_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")


def tiny_flux_transformer(
    seed: int = 0, dtype: torch.dtype = torch.float32, *, guidance_embeds: bool = True
) -> Any:
    """The ``FluxTransformer2DModel`` of :func:`tiny_flux_pipeline` with the same ``seed`` (same weights)."""
    _require_flux()
    component_seed = _flux_seed(seed, "transformer")
    with _seeded(component_seed):
        module = _tiny_flux_transformer(guidance_embeds)
    _reinit_weights(module, component_seed, embedding_std=1.0)
    return _cast(module, dtype).eval()


def tiny_flux_pipeline(
    seed: int = 0, dtype: torch.dtype = torch.float32, *, guidance_embeds: bool = True
) -> Any:
    """A tiny random ``diffusers.FluxPipeline`` on the CPU (FLUX.1-dev layout, about 0.1M parameters).

    Components: ``FluxTransformer2DModel`` (1 double + 1 single block), ``AutoencoderKL``
    (4 latent channels), ``FlowMatchEulerDiscreteScheduler``, ``CLIPTextModel`` +
    ``CLIPTokenizer`` and ``T5EncoderModel`` + ``T5TokenizerFast`` with tokenizers made
    locally. ``guidance_embeds=False`` gives the FLUX.1-schnell layout (no guidance input).
    """
    _require_flux()
    from diffusers import FluxPipeline

    from ._tokenizers import tiny_clip_tokenizer, tiny_t5_tokenizer

    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    parts: dict[str, torch.nn.Module] = {
        "transformer": tiny_flux_transformer(seed, dtype, guidance_embeds=guidance_embeds)
    }
    builders = {
        "vae": _tiny_vae,
        "text_encoder": lambda: _tiny_clip_text_encoder(tokenizer),
        "text_encoder_2": lambda: _tiny_t5_encoder(tokenizer_2),
    }
    for name, build in builders.items():
        component_seed = _flux_seed(seed, name)
        with _seeded(component_seed):
            module = build()
        _reinit_weights(module, component_seed, embedding_std=1.0)
        parts[name] = _cast(module, dtype).eval()
    return FluxPipeline(
        scheduler=_flux_scheduler(), tokenizer=tokenizer, tokenizer_2=tokenizer_2, **parts
    )


def save_tiny_flux_pipeline(path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Build :func:`tiny_flux_pipeline` ``(**kwargs)`` and save it (safetensors) to ``path``.

    ``FluxPipeline.from_pretrained(path)`` then loads it offline, and each component folder
    (``transformer``, ``vae``, ``text_encoder``...) reloads on its own, for instance with
    ``FluxTransformer2DModel.from_pretrained(path, subfolder="transformer",
    quantization_config=...)``. Returns ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    pipe = tiny_flux_pipeline(**kwargs)
    pipe.save_pretrained(path, safe_serialization=True)
    return path
