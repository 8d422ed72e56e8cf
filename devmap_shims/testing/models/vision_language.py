"""Tiny random Idefics3 / SmolVLM image-text models and inputs to run them.

Both are a SigLIP-style vision tower, a pixel-shuffle connector and a Llama text model
(``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``), built from a config
written in code with seeded random weights::

    model = tiny_vision_language_model("idefics3")
    inputs = sample_vision_language_inputs(model.config)   # input_ids, attention_mask, pixel_values
    logits = model(**inputs).logits

An image is 32x32 pixels in 8x8 patches: 16 patches, 4 image tokens after the connector's
pixel shuffle (scale factor 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .causal_lm import TINY_VOCAB, UnsupportedArchError, classes_named, sample_input_ids
from .seeding import reinit_weights, seeded

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PretrainedConfig, PreTrainedModel

#: The image-text architectures the builder knows, in a stable order.
VISION_LANGUAGE_ARCHS: tuple[str, ...] = ("idefics3", "smolvlm")

_CLASSES: dict[str, tuple[str, str]] = {
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration"),
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration"),
}

IMAGE_SIZE = 32
PATCH_SIZE = 8
SCALE_FACTOR = 2
IMAGE_TOKEN_ID = TINY_VOCAB - 1  # the last id of the tiny vocabulary stands for an image position

_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
}
_TEXT: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
}


def _classes(arch: str) -> tuple[type, type]:
    return classes_named(_CLASSES, arch)


def unsupported_vision_language_archs() -> dict[str, str]:
    """The architectures the installed transformers cannot build, each with the reason (for skips)."""
    missing: dict[str, str] = {}
    for arch in VISION_LANGUAGE_ARCHS:
        try:
            _classes(arch)
        except UnsupportedArchError as exc:
            missing[arch] = str(exc)
    return missing


def tiny_vision_language_config(arch: str = "idefics3", **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``arch``: 32x32 images in 8x8 patches, a one-layer vision tower (hidden 32)
    and a one-layer Llama (hidden 64, vocabulary 256). ``overrides`` are top-level config attributes."""
    config_cls, _ = _classes(arch)
    kwargs = {
        "vision_config": dict(_VISION),
        "text_config": dict(_TEXT),
        "scale_factor": SCALE_FACTOR,
        "image_token_id": IMAGE_TOKEN_ID,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        **overrides,
    }
    return config_cls(**kwargs)


def image_tokens_per_image(config: Any) -> int:
    """How many image tokens one image becomes (patches per image over the pixel-shuffle factor squared)."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches // (config.scale_factor**2)


def tiny_vision_language_model(
    arch: str = "idefics3", *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides: Any
) -> PreTrainedModel:
    """A tiny random ``*ForConditionalGeneration`` of ``arch`` on the CPU, in eval mode.

    The same ``arch``, ``seed`` and overrides give bit-identical weights. Raises
    :class:`UnsupportedArchError` when the installed transformers lacks ``arch``.
    """
    _, model_cls = _classes(arch)
    config = tiny_vision_language_config(arch, **config_overrides)
    with seeded(seed):
        model = model_cls(config)
    reinit_weights(model, seed * 101 + 50 + VISION_LANGUAGE_ARCHS.index(arch))
    model.to(dtype)
    model.eval()
    return model


def sample_vision_language_inputs(
    config: Any, *, images: int = 1, text_length: int = 6, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """``input_ids`` (one row: ``text_length`` ordinary tokens, then the image tokens of ``images``
    images), ``attention_mask`` and ``pixel_values`` of shape ``[1, images, 3, 32, 32]``, on the CPU."""
    text = sample_input_ids(1, text_length, vocab=IMAGE_TOKEN_ID, seed=seed)  # ordinary ids below the image token
    image = torch.full((1, images * image_tokens_per_image(config)), config.image_token_id, dtype=torch.long)
    input_ids = torch.cat([text, image], dim=1)
    gen = torch.Generator().manual_seed(seed + 1)
    size = config.vision_config.image_size
    pixel_values = torch.randn((1, images, config.vision_config.num_channels, size, size), generator=gen).to(dtype)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "pixel_values": pixel_values}


__all__ = [
    "IMAGE_TOKEN_ID",
    "VISION_LANGUAGE_ARCHS",
    "image_tokens_per_image",
    "sample_vision_language_inputs",
    "tiny_vision_language_config",
    "tiny_vision_language_model",
    "unsupported_vision_language_archs",
]
