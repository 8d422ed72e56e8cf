"""Ops that take a value from another device where CUDA's kernels allow it, and refuse it where
they do not.

* ``x[idx] = v`` (advanced indexing) and ``index_put_``: the value must be on ``x``'s device,
  except a 0-dim one, and one CPU element under a mask on ``x``'s device (``_index_put_impl_``).
* ``where``: a 0-dim operand moves to the result's device (``where_self_out``).
* ``fill_`` and ``masked_fill``: a 0-dim value fills by its value (``value.item()``);
  ``masked_fill``'s mask must be on self's device, with the CUDA kernel's own message.
"""

from __future__ import annotations

from typing import Any

import torch

from devmap_shims.calls import argument_at, with_arguments_at

from ._sim_device_checks import ti_mismatch
from ._sim_devices import device_key, fmt_device, off_cpu
from ._sim_generic import generic
from ._sim_storages import sim_copy, tag

_TensorBase = torch._C.TensorBase
_Tensor = torch.Tensor
_MASK_DTYPES = (torch.bool, torch.uint8)


def advanced(index: Any, parts: Any) -> bool:
    """Whether ``x[index] = v`` runs ``index_put_``: a list, or a tensor that is not a 0-dim
    integer one (``x[torch.tensor(1)]`` selects with ``item()`` and copies, as ``x[1]`` does)."""
    if isinstance(index, list):
        return True
    return any(
        isinstance(i, list) or (isinstance(i, _Tensor) and (i.dim() > 0 or i.dtype in _MASK_DTYPES))
        for i in parts
    )


def check_put_value(
    self: torch.Tensor, indices: Any, value: Any, accumulate: bool = False, setitem: bool = False
) -> None:
    """``index_put_``'s value must be on self's device, except a 0-dim one (copied over) and a
    one-element CPU value under one mask on self's device (filled in by ``masked_fill_`` with
    ``value.item()``, never when accumulating): aten/src/ATen/native/TensorAdvancedIndexing.cpp
    ``_index_put_impl_``, then the TensorIterator of ``make_index_put_iterator``, or on CUDA with
    ``accumulate=True`` the check before ``index_put_with_sort``. ``x[idx] = v`` (``setitem``) first
    drops ``v``'s leading 1-dims (ATen/TensorIndexing.h ``slicePrefix1sSize``): a one-element value
    of any shape arrives 0-dim."""
    if not isinstance(value, _Tensor) or value.dim() == 0:
        return
    if setitem and all(d == 1 for d in value.shape):
        return
    own, other = device_key(self), device_key(value)
    if other == own:
        return
    tensors = [i for i in indices if isinstance(i, _Tensor)]
    if accumulate:
        if isinstance(own, int):
            raise RuntimeError(
                f"expected device {fmt_device(own)} but got device {fmt_device(other)} for value tensor"
            )
    elif (value.numel() == 1 and not off_cpu(other) and len(tensors) == 1
            and tensors[0].dtype in _MASK_DTYPES and device_key(tensors[0]) == own):
        return
    raise ti_mismatch(own, other) if off_cpu(own) else ti_mismatch(other, own)  # the first off the CPU


def _zero_dim_to(value: Any, key: Any) -> Any:
    """``value`` copied to device ``key`` when it is a 0-dim tensor elsewhere (what CUDA's kernels do
    with a 0-dim operand: ``where`` moves it, ``fill_`` and ``masked_fill`` read ``value.item()``)."""
    if not isinstance(value, _Tensor) or value.dim() != 0 or device_key(value) == key:
        return value
    out = sim_copy(value)
    if isinstance(key, int):
        tag(out, key)
    return out


def h_where(func, args, kwargs):
    """``where(condition, input, other)``: the result goes to ``out``'s device, else to the first
    non-CPU device of the three, and a 0-dim operand elsewhere is moved there
    (aten/src/ATen/native/TensorCompare.cpp ``where`` and ``where_self_out``)."""
    names = ("input", "condition", "other") if func is _TensorBase.where else ("condition", "input", "other")
    values = [argument_at(args, kwargs, i, name) for i, name in enumerate(names)]
    if any(v is None for v in values):  # where(condition): nonzero
        return generic(func, args, kwargs)
    out = kwargs.get("out")
    if isinstance(out, _Tensor):
        out_key = device_key(out)
    else:  # the first of condition, input and other that is off the CPU
        ordered = (values[1], values[0], values[2]) if func is _TensorBase.where else values
        keys = [device_key(v) for v in ordered if isinstance(v, _Tensor)]
        out_key = next((k for k in keys if off_cpu(k)), None)
    if out_key is None or not off_cpu(out_key):
        return generic(func, args, kwargs)
    args, kwargs = with_arguments_at(args, kwargs, names, [_zero_dim_to(v, out_key) for v in values])
    return generic(func, args, kwargs)


def h_fill(func, args, kwargs):
    """``fill_(value)``: a 0-dim value on any device fills by its value (ATen Fill.cpp)."""
    value = _zero_dim_to(argument_at(args, kwargs, 1, "value"), device_key(args[0]))
    args, kwargs = with_arguments_at(args, kwargs, ("self", "value"), (args[0], value))
    return generic(func, args, kwargs)


def h_masked_fill(func, args, kwargs):
    """``masked_fill(mask, value)``: the mask must be on self's device when either is on a GPU, with
    the CUDA kernel's own message (the op's generated device check is off); a 0-dim value fills by
    its value, from any device into a CUDA tensor, and only from the CPU into a CPU one."""
    names = ("self" if func is not torch.masked_fill else "input", "mask", "value")
    self, mask, value = (argument_at(args, kwargs, i, name) for i, name in enumerate(names))
    if isinstance(value, _Tensor) and value.dim() > 0:
        return func(*args, **kwargs)  # torch's own error: "only supports a 0-dimensional value tensor"
    own = device_key(self)
    if isinstance(mask, _Tensor) and device_key(mask) != own and (off_cpu(own) or off_cpu(device_key(mask))):
        raise RuntimeError(
            "expected self and mask to be on the same device, but got mask on "
            f"{fmt_device(device_key(mask))} and self on {fmt_device(own)}"
        )
    if not off_cpu(own) and isinstance(value, _Tensor) and off_cpu(device_key(value)):
        raise RuntimeError("masked_fill_: Expected inputs to be on same device")
    args, kwargs = with_arguments_at(args, kwargs, names, (self, mask, _zero_dim_to(value, own)))
    return generic(func, args, kwargs)
