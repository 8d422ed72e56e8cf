"""Per-op handlers for the ops the generic path would get wrong, and the ops that need no handling.

Moves (``to``/``cuda``/``cpu``/``type``/``type_as``) copy when the simulated device changes and
return the tensor itself when it does not, as CUDA does; ``new_*`` and ``copy_`` keep self's
device; indexing accepts CPU index tensors, and an assignment through it checks its value as
``index_put_`` does (:mod:`._sim_values`, with ``where``, ``fill_`` and ``masked_fill``);
``numpy()`` and ``pin_memory()`` raise on tensors on simulated GPUs; ``backward()`` checks the
gradients it is given and ``Tensor.grad`` keeps gradients on their tensors' devices
(:mod:`._sim_autograd`); random ops that take no generator (dropout) draw from their GPU's
(:mod:`._sim_random`), and packed sequences keep their sizes on the CPU (:mod:`._sim_rnn`).
:data:`PASSTHROUGH` lists the metadata getters and queries that run untouched (the fast path).
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch

from devmap_shims.calls import argument_at

from . import _sim_state as S
from ._sim_autograd import check_backward_call, h_grad_get, h_grad_set
from ._sim_devices import device_key, fmt_device, off_cpu, parse_device
from ._sim_generic import dtype_itemsize, run_with_device
from ._sim_operands import torch_functions
from ._sim_random import RULES, h_no_generator
from ._sim_rnn import h_packed_sizes, h_rnn
from ._sim_storages import is_pinned, mark_pinned, same_storage, sim_copy, tag, tag_all
from ._sim_values import advanced, check_put_value, h_fill, h_masked_fill, h_where

_TensorBase = torch._C.TensorBase
_Tensor = torch.Tensor
_CPU = torch.device("cpu")


def _is_device_like(x: Any) -> bool:
    return isinstance(x, (str, torch.device)) or (isinstance(x, int) and not isinstance(x, bool))


def _h_to(func, args, kwargs):
    """Tensor.to: same simulated device returns self, another device returns a copy."""
    self = args[0]
    rest = list(args[1:])
    kw = dict(kwargs)
    src = S.sim_index(self)
    target: Any = None
    if rest and isinstance(rest[0], _Tensor):  # to(other, non_blocking=False, copy=False)
        other = rest.pop(0)
        target = device_key(other)
        rest.insert(0, other.dtype)
    elif "device" in kw:
        dev = kw.pop("device")
        target = None if dev is None else parse_device(dev)
    elif rest and _is_device_like(rest[0]):
        target = parse_device(rest.pop(0))
    if target is None:  # dtype / memory_format only
        out = func(self, *rest, **kw)
        if src is not None and out is not self:
            tag(out, src)
        return out
    mf = kw.get("memory_format", torch.preserve_format)
    if isinstance(target, int) and target != src:
        dtype = kw.get("dtype") or next((r for r in rest if isinstance(r, torch.dtype)), self.dtype)
        S.MACHINE._precheck(target, self.numel() * dtype_itemsize(dtype))
    out = func(self, _CPU if isinstance(target, int) else target, *rest, **kw)
    if isinstance(target, int):
        if out is self or same_storage(out, self):
            if src == target:
                return out
            out = sim_copy(out, mf)
        tag(out, target)
        return out
    if src is not None and (out is self or same_storage(out, self)):
        out = sim_copy(out, mf)
    return out


def _h_self_device(func, args, kwargs):
    """Ops whose result lives on self's device whatever the other operands (new_*, copy_), unless
    a ``new_*`` names its own ``device=``."""
    if kwargs.get("device") is not None:
        return run_with_device(func, args, kwargs, kwargs["device"])
    out = func(*args, **kwargs)
    idx = S.sim_index(args[0]) if args and isinstance(args[0], _Tensor) else None
    if idx is not None:
        tag_all(out, idx)
    return out


def _h_cuda(func, args, kwargs):
    self = args[0]
    dev = argument_at(args, kwargs, 1, "device")
    if dev is None:
        target = S.MACHINE.current_device
    else:
        target = parse_device(dev)
        if not isinstance(target, int):
            raise RuntimeError("Invalid device, must be cuda device")
    src = S.sim_index(self)
    if src == target:
        return self
    if self.is_meta:  # torch's own "Cannot copy out of meta tensor; no data!", as .to("cuda:N") gives
        return _Tensor.to(self, _CPU)
    S.MACHINE._precheck(target, self.numel() * self.element_size())
    out = sim_copy(self, kwargs.get("memory_format", torch.preserve_format))
    tag(out, target)
    return out


def _h_cpu(func, args, kwargs):
    self = args[0]
    if S.sim_index(self) is None:
        return func(*args, **kwargs)
    return sim_copy(self, kwargs.get("memory_format", torch.preserve_format))


def _h_type_as(func, args, kwargs):
    self, other = args[0], argument_at(args, kwargs, 1, "other")
    return _h_to(_Tensor.to, (self, other), {})


def _h_type(func, args, kwargs):
    self = args[0]
    dtype = argument_at(args, kwargs, 1, "dtype")
    src = S.sim_index(self)
    if dtype is None:
        name = func(self)
        return name.replace("torch.", "torch.cuda.", 1) if src is not None else name
    if isinstance(dtype, str) and ".cuda." in dtype:
        out = func(self, dtype.replace(".cuda.", ".", 1), *args[2:], **{k: v for k, v in kwargs.items() if k != "dtype"})
        target = src if src is not None else S.MACHINE.current_device
        if out is self or same_storage(out, self):
            if src == target:
                return out
            out = sim_copy(out)
        tag(out, target)
        return out
    out = func(*args, **kwargs)
    if src is not None:
        if isinstance(dtype, str) and ".cuda." not in dtype and dtype.startswith("torch."):
            return sim_copy(out) if same_storage(out, self) else out
        tag(out, src)
    return out


def _h_numpy(func, args, kwargs):
    idx = S.sim_index(args[0])
    if idx is not None:
        raise TypeError(
            f"can't convert cuda:{idx} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
            "host memory first."
        )
    return func(*args, **kwargs)


def _h_repr(func, args, kwargs):
    if S.sim_index(args[0]) is None:
        return func(*args, **kwargs)
    depth = S.DEPTH.n
    S.DEPTH.n = 0  # print the simulated device, as CUDA tensors do
    try:
        return func(*args, **kwargs)
    finally:
        S.DEPTH.n = depth


def _h_pin_memory(func, args, kwargs):
    self = args[0]
    idx = S.sim_index(self)
    if idx is not None:
        raise RuntimeError(f"cannot pin 'torch.cuda.{_type_name(self)}' only dense CPU tensors can be pinned")
    if is_pinned(self):
        return self
    out = self.clone()
    mark_pinned(out)
    return out


def _type_name(t: torch.Tensor) -> str:
    return t.type().split(".")[-1]


def _h_is_pinned(func, args, kwargs):
    if S.sim_index(args[0]) is not None:
        return False
    return is_pinned(args[0])


def _h_record_stream(func, args, kwargs):
    return None


def _scalar_index(index: torch.Tensor) -> bool:
    """A 0-dim integer or bool tensor, which indexing reads with ``.item()`` wherever it lives
    (``handleDimInMultiDimIndexing``, ATen/TensorIndexing.h)."""
    return index.dim() == 0 and not (index.is_floating_point() or index.is_complex())


def _h_index(func, args, kwargs):
    """Indexing: CPU index tensors are fine on CUDA; CUDA indices must be on the tensor's device,
    except a 0-dim integer or bool index, which torch reads as a number (``x[t.sum() - 1]``)."""
    self = args[0]
    index = args[1] if len(args) > 1 else None
    own = device_key(self)
    idxs = index if isinstance(index, (tuple, list)) else (index,)
    for i in idxs:
        if isinstance(i, _Tensor) and not _scalar_index(i):
            k = device_key(i)
            if k != own and off_cpu(k):
                raise RuntimeError(
                    f"indices should be either on cpu or on the same device as the indexed tensor ({fmt_device(own)})"
                )
    if func is _TensorBase.__setitem__ and len(args) > 2 and advanced(index, idxs):
        # x[mask] = v, x[idx] = v: advanced, so index_put_
        check_put_value(self, idxs, args[2], setitem=True)
    out = func(*args, **kwargs)
    if isinstance(own, int):
        tag_all(out, own)
    return out


def _h_index_put(func, args, kwargs):
    """``index_put_`` / ``index_put``: the value's device is checked as the kernel does."""
    indices = argument_at(args, kwargs, 1, "indices")
    check_put_value(args[0], indices if isinstance(indices, (tuple, list)) else (indices,),
                     argument_at(args, kwargs, 2, "values"), bool(argument_at(args, kwargs, 3, "accumulate")))
    return _h_self_device(func, args, kwargs)


def _h_backward(func, args, kwargs):
    """backward()/autograd.grad(): the gradients given must sit on their tensors' devices; the
    pass itself runs in the simulated engine (:mod:`._sim_autograd`)."""
    check_backward_call(func, args, kwargs)
    return func(*args, **kwargs)


def _h_parse_to(func, args, kwargs):
    """``torch._C._nn._parse_to`` (nn.Module.to, Params4bit.to): ints mean CUDA ordinals."""
    args = list(args)
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        parse_device(args[0])
        args[0] = torch.device("cuda", args[0])
    if isinstance(kwargs.get("device"), int):
        kwargs = dict(kwargs)
        parse_device(kwargs["device"])
        kwargs["device"] = torch.device("cuda", kwargs["device"])
    if args and isinstance(args[0], _Tensor):
        other = args[0]
        idx = S.sim_index(other)
        if idx is not None:
            device, dtype, non_blocking, fmt = func(*args, **kwargs)
            return S.CUDA_DEVICES[idx], dtype, non_blocking, fmt
    return func(*args, **kwargs)


def _h_deepcopy(func, args, kwargs):
    self = args[0]
    idx = S.sim_index(self)
    out = func(*args, **kwargs)
    if idx is not None:
        tag(out, idx)
    return out


def _handlers() -> Dict[Any, Callable]:
    h: Dict[Any, Callable] = {}

    def put(fn: Callable, *fs: Any) -> None:
        for f in fs:
            if f is not None:
                h[f] = fn

    put(_h_to, _TensorBase.to)
    put(_h_cuda, _TensorBase.cuda)
    put(_h_cpu, _TensorBase.cpu)
    put(_h_type_as, _TensorBase.type_as)
    put(_h_type, _TensorBase.type)
    put(
        _h_self_device,
        *[_TensorBase.__dict__.get(n) for n in (
            "copy_", "new_tensor", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
            "expand_as", "view_as", "reshape_as", "set_",
        )],
    )
    put(_h_index_put, _TensorBase.index_put_, _TensorBase.index_put)
    put(h_where, torch.where, _TensorBase.where)
    put(h_fill, _TensorBase.fill_)
    put(h_masked_fill, _TensorBase.masked_fill, _TensorBase.masked_fill_, torch.masked_fill)
    put(_h_numpy, _TensorBase.numpy, getattr(_Tensor, "__array__", None))
    put(_h_repr, _Tensor.__repr__, _Tensor.__str__ if "__str__" in _Tensor.__dict__ else None, _Tensor.__format__)
    put(_h_pin_memory, _TensorBase.pin_memory)
    put(_h_is_pinned, _TensorBase.is_pinned)
    put(_h_record_stream, _TensorBase.record_stream)
    put(_h_index, _TensorBase.__getitem__, _TensorBase.__setitem__)
    put(_h_backward, _Tensor.backward, torch.autograd.backward, torch.autograd.grad)
    put(_h_parse_to, torch._C._nn._parse_to)
    put(_h_deepcopy, _Tensor.__deepcopy__)
    put(h_no_generator, *RULES)
    put(h_rnn, *torch_functions("lstm", "gru", "rnn_tanh", "rnn_relu"))
    put(h_packed_sizes, *torch_functions("_pack_padded_sequence", "_pad_packed_sequence"))
    put(h_grad_get, _TensorBase.grad.__get__)
    put(h_grad_set, _TensorBase.grad.__set__)
    return h


HANDLERS = _handlers()

_PASSTHROUGH_GETTERS = (
    "shape", "dtype", "ndim", "requires_grad", "is_leaf", "grad_fn", "layout", "is_sparse",
    "is_quantized", "is_meta", "is_mkldnn", "is_nested", "names", "_version", "output_nr",
    "device", "is_cuda", "is_cpu", "itemsize", "nbytes", "data", "_base",
)
_PASSTHROUGH_METHODS = (
    "size", "dim", "numel", "nelement", "stride", "is_contiguous", "element_size", "data_ptr",
    "storage_offset", "__len__", "is_floating_point", "is_complex", "is_signed", "requires_grad_",
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "untyped_storage",
    "get_device", "detach", "detach_", "is_inference", "has_names", "_is_view", "is_set_to",
    "__hash__", "dim_order", "_typed_storage", "storage", "__reduce_ex__", "__setstate__",
)
_PASSTHROUGH_FUNCTIONS = (
    "_has_compatible_shallow_copy_type", "is_same_size", "is_tensor", "is_storage", "result_type",
    "can_cast", "promote_types", "broadcast_shapes", "is_floating_point", "is_complex", "numel",
    "is_nonzero", "is_inference",
    # only expands (views of each operand, on its own device): no device check in CUDA torch either
    "broadcast_tensors",
)


def _passthrough() -> set:
    p = set()
    for name in _PASSTHROUGH_GETTERS:
        d = _TensorBase.__dict__.get(name) or _Tensor.__dict__.get(name)
        if d is not None and hasattr(d, "__get__"):
            p.add(d.__get__)
            if hasattr(d, "__set__"):
                p.add(d.__set__)
    for name in _PASSTHROUGH_METHODS:
        for owner in (_TensorBase, _Tensor):
            f = owner.__dict__.get(name)
            if f is not None:
                p.add(f)
    p.update(torch_functions(*_PASSTHROUGH_FUNCTIONS))
    return p


PASSTHROUGH = _passthrough()
