"""Ops whose CUDA kernels check their operands' devices in a way of their own.

* :data:`OWN_MESSAGES`: ops that raise a message of their own before any generated device check:
  convolutions (a CUDA input with a weight or bias of another type), ``scaled_dot_product_attention``
  (query, key and value on different devices) and ``take_along_dim``.
* :data:`CPU_SCALARS`: TensorIterator ops that take no CPU scalar, or only in one argument:
  ``addcdiv``, ``mse_loss``, the losses that broadcast their target first (``l1_loss``...: a
  broadcast scalar is none) and ``addcmul``, which since pytorch/pytorch#143264 takes one as
  ``tensor2`` only.

Each entry raises the kernel's error or returns None, and the op's other checks still run
(:func:`._sim_op_checks.check_mixed`). Messages as printed by torch 2.11 on an NVIDIA H200; the
strings are in the binaries of every torch the project pins.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch
import torch.nn.functional as F

from devmap_shims.calls import argument_at

from . import _sim_state as S
from ._sim_device_checks import ti_mismatch
from ._sim_devices import device_key, fmt_device, off_cpu
from ._sim_operands import torch_functions

_Tensor = torch.Tensor


def _type_string(t: torch.Tensor) -> str:
    """``t.type()`` as CUDA torch prints it (``torch.cuda.HalfTensor`` on a simulated GPU)."""
    name = t.type()  # the real CPU tensor's: the simulation's mode is off inside its handler
    return name.replace("torch.", "torch.cuda.", 1) if isinstance(device_key(t), int) else name


def _conv(args, kwargs) -> None:
    """aten/src/ATen/native/Convolution.cpp ``check_input_same_type_as_parameters``, for a CUDA input."""
    x = argument_at(args, kwargs, 0, "input")
    if not isinstance(x, _Tensor) or not off_cpu(device_key(x)):
        return
    for name, pos in (("weight", 1), ("bias", 2)):
        p = argument_at(args, kwargs, pos, name)
        if isinstance(p, _Tensor) and _type_string(p) != _type_string(x):
            raise RuntimeError(
                f"Input type ({_type_string(x)}) and {name} type ({_type_string(p)}) should be the same"
            )


def _sdpa(args, kwargs) -> None:
    """aten/src/ATen/native/transformers/sdp_utils_cpp.h ``validate_sdpa_input``."""
    q, k, v = (argument_at(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
    if not all(isinstance(t, _Tensor) for t in (q, k, v)):
        return
    dq, dk, dv = (fmt_device(device_key(t)) for t in (q, k, v))
    if not dq == dk == dv:
        raise RuntimeError(
            "Expected query, key, and value to have the same device type, but got "
            f"query.device: {dq} key.device: {dk} and value.device: {dv} instead."
        )


def _take_along_dim(args, kwargs) -> None:
    """aten/src/ATen/native/TensorAdvancedIndexing.cpp ``take_along_dim``: ``checkDevice``."""
    x, indices = argument_at(args, kwargs, 0, "input", "self"), argument_at(args, kwargs, 1, "indices")
    if isinstance(x, _Tensor) and isinstance(indices, _Tensor):
        want, got = device_key(x), device_key(indices)
        if got != want:
            raise RuntimeError(
                f"Expected tensor to have {fmt_device(want)} Device, but got tensor with {fmt_device(got)} "
                "Device (while checking arguments for torch.take_along_dim():)"
            )


OWN_MESSAGES: Dict[Any, Callable] = {}
for _fs, _fn in (
    (torch_functions("conv1d", "conv2d", "conv3d"), _conv),
    (torch_functions("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"), _conv),
    ([F.scaled_dot_product_attention], _sdpa),
    (torch_functions("take_along_dim"), _take_along_dim),
):
    for _f in _fs:
        OWN_MESSAGES[_f] = _fn


# ---------------------------------------------------------------------------------------------
# CPU scalars: how many a TensorIterator op lets join CUDA tensors, and the kernel's own refusals
# ---------------------------------------------------------------------------------------------
def _cpu_scalar(t: Any) -> bool:
    return isinstance(t, _Tensor) and t.dim() == 0 and not off_cpu(device_key(t))


def _addcmul(args, kwargs, common: Any) -> None:
    """aten/src/ATen/native/cuda/PointwiseOpsKernel.cu ``addcmul_cuda_kernel``: a CPU scalar passes
    TensorIterator, then the kernel takes it as ``tensor2`` only."""
    if not off_cpu(common):
        return
    if _cpu_scalar(argument_at(args, kwargs, 0, "input", "self")):
        raise RuntimeError(
            "CPU Scalar support for self argument is not supported when calling addcmul on CUDA tensors."
        )
    if _cpu_scalar(argument_at(args, kwargs, 1, "tensor1")):
        raise RuntimeError(
            "CPU Scalar support for tensor1 argument is not supported when calling addcmul on CUDA "
            "tensors. However, CPU Scalar support for tensor2 is supported, please swap your tensor1 and "
            "tensor2 terms."
        )


def _broadcast_target(args, kwargs, common: Any) -> None:
    """``l1_loss``, ``smooth_l1_loss``, ``huber_loss`` broadcast input and target first: a 0-dim CPU
    one expanded to the other's shape is no scalar any more (of the same shape it stays one)."""
    x, y = argument_at(args, kwargs, 0, "input", "self"), argument_at(args, kwargs, 1, "target")
    if off_cpu(common) and isinstance(x, _Tensor) and isinstance(y, _Tensor) and x.shape != y.shape:
        if _cpu_scalar(x) or _cpu_scalar(y):
            raise ti_mismatch(common, torch.device("cpu"))


# func -> (CPU scalars TensorIterator lets in, the kernel's own check of them or None)
CPU_SCALARS: Dict[Any, Any] = {}
for _f in torch_functions("addcdiv", "addcdiv_", "mse_loss"):  # mse_loss: even two 0-dim operands
    CPU_SCALARS[_f] = (0, None)
for _f in torch_functions("l1_loss", "smooth_l1_loss", "huber_loss"):
    CPU_SCALARS[_f] = (1, _broadcast_target)
for _f in torch_functions("addcmul", "addcmul_"):
    # pytorch/pytorch#143264: in the wheels after 2.6 (2.6 refuses any, as addcdiv does)
    CPU_SCALARS[_f] = (1, _addcmul) if S.TORCH_VERSION >= (2, 7) else (0, None)
