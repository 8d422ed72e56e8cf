"""CUDA's two same-device checks, raising CUDA's own error messages.

Most ops check their operands the way TensorIterator does (:func:`check_ti`: one CPU scalar may
join CUDA tensors in the ops that allow it). Ops whose generated kernel wrapper checks argument by
argument (``index_select``, ``mm``, ``cat``, ``gather``...) word the error differently and name the
argument (:func:`check_exact`); which op takes which check is in :mod:`._sim_op_checks`. The
messages follow the torch release that runs (they were reworded in torch 2.8).
"""

from __future__ import annotations

from typing import Any, Iterable, List, Tuple

import torch

from . import _sim_state as S
from ._sim_devices import device_key, fmt_device

_Tensor = torch.Tensor
_CPU = torch.device("cpu")


def ti_mismatch(common: Any, other: Any) -> RuntimeError:
    """TensorIterator's message (aten/src/ATen/TensorIterator.cpp compute_types)."""
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{fmt_device(common)} and {fmt_device(other)}!"
    )


def adaption_mismatch(common: Any, other: Any, arg: str, method: str) -> RuntimeError:
    """The generated kernel wrappers' message (aten/src/ATen/core/adaption.cpp); reworded in torch 2.8."""
    if S.TORCH_VERSION >= (2, 8):
        return RuntimeError(
            f"Expected all tensors to be on the same device, but got {arg} is on {fmt_device(other)}, "
            f"different from other tensors on {fmt_device(common)} (when checking argument in method {method})"
        )
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{fmt_device(common)} and {fmt_device(other)}! "
        f"(when checking argument for argument {arg} in method {method})"
    )


def check_ti(ts: List[torch.Tensor], keys: List[Any], first_is_output: bool, cpu_scalars: int = 1) -> Any:
    """Returns the common device; raises where TensorIterator would. The common device is the first
    one off the CPU; a 0-dim CPU input may join it in ops that allow CPU scalars (``cpu_scalars``:
    1 in binary and comparison ops, 0 where the kernel allows none), never an output."""
    common: Any = _CPU
    for k in keys:
        if not (isinstance(k, torch.device) and k.type == "cpu"):
            common = k
            break
    seen = 0
    for i, (t, k) in enumerate(zip(ts, keys)):
        if k == common:
            continue
        is_output = first_is_output and i == 0
        if isinstance(k, torch.device) and k.type == "cpu" and not is_output and t.dim() == 0 and cpu_scalars:
            if seen < cpu_scalars:
                seen += 1
                continue
            raise RuntimeError("Trying to pass too many CPU scalars to non-CPU kernel!")
        raise ti_mismatch(common, k)
    return common


def check_exact(named: Iterable[Tuple[str, Any]], method: str) -> Any:
    """check_and_update_common_device over (argument name, tensor) pairs in schema order."""
    common: Any = None
    for arg, t in named:
        if not isinstance(t, _Tensor):
            continue
        k = device_key(t)
        if common is None:
            common = k
        elif k != common:
            raise adaption_mismatch(common, k, arg, method)
    return common
