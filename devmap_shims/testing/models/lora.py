"""A tiny LoRA for a diffusers model, as a state dict built in code (no file, no Hub).

``pipe.load_lora_weights(tiny_lora_state_dict(pipe.transformer))`` loads it like a LoRA
downloaded for that model: the keys are in the PEFT format diffusers writes with
``save_lora_weights`` (``transformer.<module>.lora_A.weight`` / ``.lora_B.weight``), one pair per
``torch.nn.Linear`` whose name ends with one of ``targets`` (the attention projections by default).
``lora_B`` is not zero, unlike a freshly initialised LoRA, so loading it changes what the model
computes. Loading needs diffusers' PEFT backend (``pip install peft``).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

#: the attention projections of diffusers' attention blocks (Flux, SD3, SDXL's UNet ...)
ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


def lora_target_modules(model: torch.nn.Module, targets: Sequence[str] = ATTENTION_PROJECTIONS) -> list[str]:
    """Names of the ``torch.nn.Linear`` modules of ``model`` whose name is, or ends with, one of
    ``targets`` (``"to_q"`` matches ``transformer_blocks.0.attn.to_q``), in ``named_modules`` order."""
    return [
        name for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    ]


def tiny_lora_state_dict(
    model: torch.nn.Module,
    *,
    rank: int = 2,
    targets: Sequence[str] = ATTENTION_PROJECTIONS,
    prefix: str | None = "transformer",
    seed: int = 0,
    std: float = 0.5,
) -> Dict[str, torch.Tensor]:
    """A random rank-``rank`` LoRA for the ``targets`` projections of ``model`` (a diffusers
    transformer or UNet), as the state dict ``load_lora_weights`` takes.

    ``prefix`` is the pipeline component the LoRA is for (``"transformer"``, ``"unet"``), or None
    for ``model.load_lora_adapter(...)`` on the model itself. The weights are float32 CPU tensors
    drawn from ``seed`` with standard deviation ``std``: the same model and arguments give the same
    state dict. Raises ValueError when ``model`` has no Linear module matching ``targets``.
    """
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    names = lora_target_modules(model, targets)
    if not names:
        raise ValueError(f"{type(model).__name__} has no Linear module named like {list(targets)}")
    generator = torch.Generator("cpu").manual_seed(seed)
    modules = dict(model.named_modules())
    head = f"{prefix}." if prefix else ""
    state: Dict[str, torch.Tensor] = {}
    for name in names:
        linear: Any = modules[name]
        shape_a, shape_b = (rank, linear.in_features), (linear.out_features, rank)
        state[f"{head}{name}.lora_A.weight"] = torch.randn(shape_a, generator=generator) * std
        state[f"{head}{name}.lora_B.weight"] = torch.randn(shape_b, generator=generator) * std
    return state
