"""A tiny random Qwen2-VL (vision tower + causal LM) and an image prompt for it.

Built from a config written in code (text: hidden 64, 2 layers, vocabulary 256; vision: 2 blocks
of width 32, patch 14), with seeded random weights, so a vision-language model can be split over
simulated GPUs without any download::

    model = tiny_qwen2_vl()                              # random, seed 0, eval mode, on the CPU
    path = save_tiny_qwen2_vl(tmp_path)                  # safetensors, reloadable offline
    inputs = qwen2_vl_image_prompt()                     # input_ids, attention_mask, pixel_values, image_grid_thw, ...
    device_map = vision_text_split(model)                # vision tower on GPU 0, the rest on GPU 1
    Qwen2VLForConditionalGeneration.from_pretrained(path, device_map=device_map)

The layout of the model changed across transformers releases (``visual`` and ``model`` at the top
until 4.51, ``model.visual`` and ``model.language_model`` from 4.52); :func:`vision_text_split`
reads it from the model it is given.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .causal_lm import _COMMON, UnsupportedArchError, _save_kwargs
from .seeding import reinit_weights, seeded

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PretrainedConfig, PreTrainedModel

#: Special ids of the tiny Qwen2-VL (inside its 256-token vocabulary, above the ordinary ids).
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 250, 251, 252, 253

PATCH, TEMPORAL_PATCH, MERGE = 14, 2, 2

#: the tiny causal LMs' text settings, with Qwen2-VL's multimodal rotary embedding and an untied head
_TEXT: dict[str, Any] = {
    **_COMMON,
    # head_dim 16: the three rotary sections (time, height, width) share its 8 frequencies
    "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [2, 3, 3]},
    "tie_word_embeddings": False,
}

_VISION: dict[str, Any] = {
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": 64,  # the merger's output: the text model's width
    "num_heads": 2,
    "mlp_ratio": 2,
    "in_channels": 3,
    "in_chans": 3,
    "patch_size": PATCH,
    "spatial_merge_size": MERGE,
    "temporal_patch_size": TEMPORAL_PATCH,
}

_SPECIAL = {
    "image_token_id": IMAGE_TOKEN_ID,
    "video_token_id": VIDEO_TOKEN_ID,
    "vision_start_token_id": VISION_START_ID,
    "vision_end_token_id": VISION_END_ID,
}


def _qwen2_vl_classes() -> tuple[type, type]:
    import transformers

    config_cls = getattr(transformers, "Qwen2VLConfig", None)
    model_cls = getattr(transformers, "Qwen2VLForConditionalGeneration", None)
    if config_cls is None or model_cls is None:
        raise UnsupportedArchError(f"transformers {transformers.__version__} has no Qwen2-VL (added in 4.45)")
    return config_cls, model_cls


def tiny_qwen2_vl_config(**overrides: Any) -> PretrainedConfig:
    """The tiny Qwen2-VL config; ``overrides`` are text-model attributes (``num_hidden_layers=4``...).

    Releases that keep the text model's attributes in a ``text_config`` get them there (and at the
    top level, where older code still reads them).
    """
    config_cls, _ = _qwen2_vl_classes()
    text = {**_TEXT, **overrides}
    sub_configs = getattr(config_cls, "sub_configs", None) or {}
    if "text_config" in sub_configs:
        config = config_cls(text_config=dict(text), vision_config=dict(_VISION), **_SPECIAL)
    else:
        config = config_cls(vision_config=dict(_VISION), **text, **_SPECIAL)
    return config


def tiny_qwen2_vl(*, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> PreTrainedModel:
    """A tiny random ``Qwen2VLForConditionalGeneration`` on the CPU, in eval mode.

    The same ``seed`` and overrides give the same weights on every transformers release that has
    the model. Raises :class:`UnsupportedArchError` where the installed transformers has no Qwen2-VL.
    """
    _, model_cls = _qwen2_vl_classes()
    config = tiny_qwen2_vl_config(**overrides)
    with seeded(seed):
        model = model_cls(config)
    reinit_weights(model, seed * 101 + 17, embedding_std=1.0)
    model.to(dtype)
    model.eval()
    return model


def save_tiny_qwen2_vl(path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Build :func:`tiny_qwen2_vl` ``(**kwargs)`` and save it (safetensors) to ``path``."""
    path = Path(path)
    model = tiny_qwen2_vl(**kwargs)
    model.save_pretrained(path, **_save_kwargs(model.save_pretrained))
    return path


def qwen2_vl_image_prompt(batch: int = 1, grid: tuple[int, int] = (4, 4), seed: int = 0) -> dict[str, torch.Tensor]:
    """A text-image-text prompt for the tiny Qwen2-VL, as its processor would give it, on the CPU.

    One image of ``grid`` = (height, width) patches per row (both even): ``pixel_values`` holds the
    flattened patches, ``image_grid_thw`` their grid, and ``input_ids`` one image token per merged
    2x2 patch group between the vision start and end tokens; where the installed model takes them
    (transformers 5), ``mm_token_type_ids`` mark the image tokens. Raises
    :class:`UnsupportedArchError` where the installed transformers has no Qwen2-VL.
    """
    height, width = grid
    if height % MERGE or width % MERGE:
        raise ValueError(f"the grid must be a multiple of {MERGE} in both directions, got {grid}")
    gen = torch.Generator().manual_seed(seed)
    patches = height * width
    image_tokens = patches // (MERGE * MERGE)
    pixel_values = torch.randn(batch * patches, 3 * TEMPORAL_PATCH * PATCH * PATCH, generator=gen)
    rows = []
    for _ in range(batch):
        before = torch.randint(3, 200, (3,), generator=gen).tolist()
        after = torch.randint(3, 200, (3,), generator=gen).tolist()
        rows.append(before + [VISION_START_ID] + [IMAGE_TOKEN_ID] * image_tokens + [VISION_END_ID] + after)
    input_ids = torch.tensor(rows, dtype=torch.long)
    prompt = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
        "image_grid_thw": torch.tensor([[1, height, width]] * batch, dtype=torch.long),
    }
    _, model_cls = _qwen2_vl_classes()
    if "mm_token_type_ids" in inspect.signature(model_cls.forward).parameters:
        # transformers 5 places the multimodal rotary positions by token type (0 text, 1 image)
        prompt["mm_token_type_ids"] = (input_ids == IMAGE_TOKEN_ID).long()
    return prompt


def vision_text_split(model: torch.nn.Module, vision_gpu: int = 0, text_gpu: int = 1) -> dict[str, int]:
    """A device map with the vision tower (``visual``) alone on ``vision_gpu`` and every other
    module (token embeddings, decoder, head) on ``text_gpu``, as ``device_map="auto"`` gives a VLM
    whose vision tower fills the first GPU."""
    names = dict(model.named_modules())
    vision = next((name for name in ("visual", "model.visual") if name in names), None)
    if vision is None:
        raise ValueError(f"{type(model).__name__} has no vision tower named visual or model.visual")
    device_map: dict[str, int] = {vision: vision_gpu}
    module, prefix = model, ""
    for part in vision.split("."):
        for name, _ in module.named_children():
            if name != part:
                device_map[prefix + name] = text_gpu
        for name, _ in module.named_parameters(recurse=False):
            device_map[prefix + name] = text_gpu
        module, prefix = getattr(module, part), f"{prefix}{part}."
    return device_map
