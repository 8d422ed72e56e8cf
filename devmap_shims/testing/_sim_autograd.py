"""The simulator is for inference: ops that would record autograd history on a simulated GPU raise."""

from __future__ import annotations

from typing import Any

import torch

_TensorBase = torch._C.TensorBase
_Tensor = torch.Tensor


class SimulatedAutogradError(RuntimeError):
    """Raised when autograd is attempted on simulated GPUs (the simulator is inference-only)."""


# Copying or re-flagging a parameter that requires grad is not training, though a clone of one has a
# grad_fn: loading and moving code does it with grad enabled.
NO_GRAD_CHECK = {
    f for f in (_TensorBase.clone, _TensorBase.detach, _TensorBase.requires_grad_, _Tensor.__deepcopy__) if f
}


def autograd_error(func: Any, idx: int) -> SimulatedAutogradError:
    name = getattr(func, "__name__", repr(func))
    return SimulatedAutogradError(
        f"devmap_shims.testing simulates GPUs for inference only: {name}() on cuda:{idx} would record "
        "autograd history (an input requires grad). Run the code under torch.no_grad() or "
        "torch.inference_mode(), or call .requires_grad_(False) on the parameters."
    )


def backward_error(idx: int) -> SimulatedAutogradError:
    return SimulatedAutogradError(
        f"devmap_shims.testing simulates GPUs for inference only: backward() through a tensor on "
        f"cuda:{idx} is not supported. Use torch.no_grad() / torch.inference_mode()."
    )


def _records_history(t: Any) -> bool:
    # leaves (parameters initialised in place, detached copies) are fine; results with a grad_fn are not
    return isinstance(t, _Tensor) and t.requires_grad and t.grad_fn is not None


def check_grad(func: Any, out: Any, idx: int) -> None:
    """Raise :class:`SimulatedAutogradError` when ``out`` (a result on ``cuda:idx``) records history."""
    if isinstance(out, (tuple, list)):
        if any(_records_history(o) for o in out):
            raise autograd_error(func, idx)
    elif _records_history(out):
        raise autograd_error(func, idx)
