"""Custom autograd Functions (``torch.autograd.Function``) on the simulated GPUs.

The backward pass hands a Function's ``backward`` gradients the C++ engine made: CPU tensors the
simulation never saw, so ``grad.device`` read ``cpu`` there where CUDA gives the device of the
forward output they belong to (``nn.DataParallel``'s own Functions check it; bitsandbytes' and
peft's read it). ``Function.apply`` notes on the node it makes the simulated device of each output,
and the node's ``apply`` in the backward pass puts each gradient that arrives untracked there.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _sim_state as S
from ._sim_storages import tag

_Tensor = torch.Tensor
_real_is_cpu = torch._C.TensorBase.is_cpu.__get__
_Function = torch.autograd.function.Function
_Backward = torch.autograd.function.BackwardCFunction
_real_apply = _Function.__dict__["apply"]
_real_backward_apply = _Backward.__dict__["apply"]
_NOTE = "_devmap_sim_output_devices"


def _apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
    out = _real_apply.__get__(None, cls)(*args, **kwargs)
    if S.MACHINE is not None:
        outputs = out if isinstance(out, tuple) else (out,)
        devices = [S.sim_index(o) if isinstance(o, _Tensor) else None for o in outputs]
        node = next((o.grad_fn for o in outputs if isinstance(o, _Tensor) and o.grad_fn is not None), None)
        if node is not None and any(d is not None for d in devices) and isinstance(node, _Backward):
            try:
                setattr(node, _NOTE, devices)
            except AttributeError:  # a node without a __dict__: its gradients stay as the engine made them
                pass
    return out


def _backward_apply(self: Any, *args: Any) -> Any:
    devices = getattr(self, _NOTE, None)
    if devices and S.MACHINE is not None:
        for grad, idx in zip(args, devices):
            if idx is not None and isinstance(grad, _Tensor) and S.sim_index(grad) is None:
                if _real_is_cpu(grad):
                    tag(grad, idx)
    return _real_backward_apply(self, *args)


def install(patcher: Any) -> None:
    patcher.set(_Function, "apply", classmethod(_apply))
    patcher.set(_Backward, "apply", _backward_apply)
