"""``torch.Tensor`` and ``torch.device``, imported on first use (the shims' modules must not import
torch, and the sweeps that call these run once per weight of a model)."""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any

_TORCH: Any = None


def _torch() -> Any:
    global _TORCH
    if _TORCH is None:
        import torch

        _TORCH = torch
    return _TORCH


def tensor_type() -> Any:
    """``torch.Tensor`` (torch is imported by the first call)."""
    return _torch().Tensor


def device_type() -> Any:
    """``torch.device`` (torch is imported by the first call)."""
    return _torch().device


def storage_id() -> Any:
    """``torch._C._storage_id`` (the address of a tensor's storage, the same for every tensor that
    shares it; raises for a tensor without one), or None where this torch lacks it."""
    return getattr(_torch()._C, "_storage_id", None)
