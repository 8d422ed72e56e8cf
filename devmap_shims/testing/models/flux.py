"""A tiny random FLUX.1 pipeline (diffusers ``FluxPipeline``), built offline.

Transformer (1 double + 1 single block), VAE (4 latent channels), CLIP and T5 text encoders with
tokenizers made locally, and FLUX.1-dev's scheduler; each component has seeded random weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .seeding import reinit_weights, seeded

# Component sizes. The transformer's width is heads * head_dim = 32; the rotary axes
# must add up to head_dim. The VAE has two blocks (one 2x downsampling) and 4 latent
# channels, which Flux packs 2x2 into 16 transformer input channels. A 32x32 image is a
# 16x16 latent, that is 64 packed image tokens, on every diffusers release.
FLUX_LATENT_CHANNELS = 4
_CLIP_HIDDEN = 32
_T5_D_MODEL = 32


def build_tiny_flux_transformer(guidance_embeds: bool) -> Any:
    """The tiny ``FluxTransformer2DModel`` as diffusers initialises it.

    For the weights of :func:`tiny_flux_pipeline`, build it under :func:`~.seeding.seeded` with
    :func:`flux_component_seed` and redraw them with :func:`~.seeding.reinit_weights`, as
    :func:`tiny_flux_transformer` does.
    """
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


_FLUX_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")


def flux_component_seed(seed: int, component: str) -> int:
    """Weight seed of one pipeline component (``"transformer"``, ``"vae"``, ``"text_encoder"``,
    ``"text_encoder_2"``) of the pipeline built with ``seed``: each component has its own stream."""
    return seed * 1000 + _FLUX_COMPONENTS.index(component)


def tiny_flux_transformer(
    seed: int = 0, dtype: torch.dtype = torch.float32, *, guidance_embeds: bool = True
) -> Any:
    """The ``FluxTransformer2DModel`` of :func:`tiny_flux_pipeline` with the same ``seed`` (same weights)."""
    _require_flux()
    component_seed = flux_component_seed(seed, "transformer")
    with seeded(component_seed):
        module = build_tiny_flux_transformer(guidance_embeds)
    reinit_weights(module, component_seed, embedding_std=1.0)
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

    from ._flux_tokenizers import tiny_clip_tokenizer, tiny_t5_tokenizer

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
        component_seed = flux_component_seed(seed, name)
        with seeded(component_seed):
            module = build()
        reinit_weights(module, component_seed, embedding_std=1.0)
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
