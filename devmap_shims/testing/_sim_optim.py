"""Optimizers on the simulated GPUs: ``torch._C._group_tensors_by_device_and_dtype`` (what
foreach/fused optimizers and ``clip_grad_norm_`` group their tensors by) groups by simulated
device, and raises torch's own error when an optimizer state sits on another GPU than its
parameter."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from . import _sim_state as S
from ._sim_devices import device_key

_real_group = torch._C._group_tensors_by_device_and_dtype


def _same_index_error() -> RuntimeError:
    """torch's own "Tensors of the same index must be on the same device..." error, in the
    wording of the installed release (aten/src/ATen/native/ForeachUtils.h): the real grouping is
    given a pair it refuses."""
    try:
        _real_group([[torch.empty(0)], [torch.empty(0, dtype=torch.int8)]], False)
    except RuntimeError as exc:
        return RuntimeError(str(exc).split("\n")[0])
    raise AssertionError("torch accepted tensors of the same index with different dtypes")


def _allowed_beside(first: Any, t: torch.Tensor) -> bool:
    """Whether ``t`` may sit at the index of a tensor on ``first`` (different devices): only
    float32/64 CPU tensors (optimizers' ``step`` counts) may sit beside CUDA tensors."""
    k = device_key(t)
    if k == first:
        return True
    return isinstance(k, torch.device) and k.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def group_tensors_by_device_and_dtype(tensorlistlist: Any, with_indices: bool = False) -> Any:
    """``torch._C._group_tensors_by_device_and_dtype`` by simulated device: the real grouping
    runs per simulated device and its keys name that device."""
    if S.MACHINE is None or not tensorlistlist:
        return _real_group(tensorlistlist, with_indices)
    first = tensorlistlist[0]
    keys = [device_key(t) for t in first]
    if not any(isinstance(k, int) for k in keys):
        return _real_group(tensorlistlist, with_indices)
    for j, k in enumerate(keys):
        for lst in tensorlistlist[1:]:
            if lst and lst[j] is not None and not _allowed_beside(k, lst[j]):
                raise _same_index_error()
    parts: Dict[Any, List[int]] = {}
    for j, k in enumerate(keys):
        parts.setdefault(k, []).append(j)
    out: Dict[Any, Any] = {}
    for k, idxs in parts.items():
        sub = [[lst[j] for j in idxs] if lst else [] for lst in tensorlistlist]
        for (dev, dtype), (lists, sub_idxs) in _real_group(sub, True).items():
            device = S.CUDA_DEVICES[k] if isinstance(k, int) else dev
            out[(device, dtype)] = (lists, [idxs[i] for i in sub_idxs] if with_indices else [])
    return out


def install_grouping(patcher: Any) -> None:
    if torch._C.__dict__.get("_group_tensors_by_device_and_dtype") is _real_group:
        patcher.set(torch._C, "_group_tensors_by_device_and_dtype", group_tensors_by_device_and_dtype)
