"""Which CPU storages stand for memory on a simulated GPU, and which are pinned.

Tagging a storage records its simulated device in ``DEVICE_OF`` and charges its bytes to that
GPU; a storage is tagged once, when it is new, so views and in-place results keep their device.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Dict, Optional

import torch

from . import _sim_state as S

_storage_id = torch._C._storage_id
_Tensor = torch.Tensor
_real_is_cpu = torch._C.TensorBase.is_cpu.__get__
_grad_enabled = torch.is_grad_enabled


def tag(t: torch.Tensor, idx: int, skip: Optional[set] = None) -> None:
    """Record that the storage of ``t`` (if new) lives on simulated ``cuda:idx``."""
    try:
        sid = _storage_id(t)
    except (RuntimeError, TypeError):
        return
    if sid in S.DEVICE_OF or (skip and sid in skip):
        return
    if not _real_is_cpu(t):  # meta tensors and friends stay what they are
        return
    S.MACHINE._charge(t.untyped_storage(), sid, idx)
    S.DEVICE_OF[sid] = idx


def tag_storage(storage: Any, idx: int) -> None:
    """Record that ``storage`` (an untyped CPU storage) lives on simulated ``cuda:idx``."""
    sid = storage._cdata
    if sid not in S.DEVICE_OF:
        S.MACHINE._charge(storage, sid, idx)
        S.DEVICE_OF[sid] = idx


def tag_all(out: Any, idx: int, skip: Optional[set] = None) -> None:
    if isinstance(out, _Tensor):
        tag(out, idx, skip)
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, _Tensor):
                tag(o, idx, skip)
            elif isinstance(o, (tuple, list)):
                tag_all(o, idx, skip)


# ---------------------------------------------------------------------------------------------
# storages resized in place
# ---------------------------------------------------------------------------------------------
_RESIZE = torch.Tensor.resize_
_RESIZE_AS = (torch.Tensor.resize_as_, torch.resize_as_)


def resize_target(func: Any, args: Any, kwargs: Any) -> Optional[int]:
    """The bytes ``t.resize_(sizes)`` / ``t.resize_as_(other)`` needs its storage to hold, when that
    is more than it holds now (a tensor resized smaller keeps its storage); else None."""
    t = args[0] if args else None
    if not isinstance(t, _Tensor):
        return None
    if func in _RESIZE_AS:
        other = args[1] if len(args) > 1 else kwargs.get("the_template")
        sizes: Any = tuple(other.shape) if isinstance(other, _Tensor) else None
    else:
        sizes = args[1:] if len(args) > 1 else kwargs.get("size")
        if sizes is not None and len(sizes) == 1:
            try:
                sizes = (operator.index(sizes[0]),)  # an int, a numpy int, a 0-dim integer tensor
            except TypeError:
                sizes = tuple(sizes[0])  # t.resize_((2, 3)) or t.resize_(torch.Size(...))
    if sizes is None:
        return None
    numel = 1
    for n in sizes:
        numel *= int(n)
    needed = (t.storage_offset() + numel) * t.element_size()
    return needed if needed > t.untyped_storage().nbytes() else None


RESIZING = (_RESIZE, *_RESIZE_AS)


def precheck_resize(func: Any, args: Any, kwargs: Any) -> None:
    """Raise the OOM CUDA raises before ``func`` (one of :data:`RESIZING`) grows its tensor's storage."""
    needed = resize_target(func, args, kwargs)
    if needed is not None:
        S.MACHINE._precheck_resize(_storage_id(args[0]), needed)


def recharge(out: Any) -> None:
    """The tensors ``out`` (one, or a tuple or list) on simulated GPUs: their storages' bytes as they
    are now (``out=`` resizes its tensors as needed)."""
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, _Tensor):
            try:
                sid = _storage_id(t)
            except (RuntimeError, TypeError):
                continue
            if sid in S.DEVICE_OF:
                S.MACHINE._recharge(t.untyped_storage(), sid)


_real_storage_resize = torch.UntypedStorage.resize_


def storage_resize_(storage: Any, size: int) -> Any:
    """``UntypedStorage.resize_`` during a simulation: a storage on a simulated GPU is charged what
    it holds afterwards (``resize_(0)`` frees its bytes, as FSDP frees a flat parameter)."""
    machine = S.MACHINE
    sid = storage._cdata
    if machine is None or sid not in S.DEVICE_OF:
        return _real_storage_resize(storage, size)
    machine._precheck_resize(sid, int(size))
    out = _real_storage_resize(storage, size)
    machine._recharge(storage, sid)
    return out


def sim_copy(t: torch.Tensor, memory_format: Any = torch.preserve_format) -> torch.Tensor:
    """A fresh CPU copy of ``t`` (used where CUDA would copy across devices); one that records
    history sends its gradient back to ``t``'s device (:class:`._sim_autograd.DeviceCopy`)."""
    if t.requires_grad and _grad_enabled():
        from ._sim_autograd import DeviceCopy  # that module tags with this one's functions

        return DeviceCopy.apply(t, memory_format)
    return t.clone(memory_format=memory_format)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return _storage_id(a) == _storage_id(b)
    except (RuntimeError, TypeError):
        return False


# ---------------------------------------------------------------------------------------------
# pinned memory
# ---------------------------------------------------------------------------------------------
_PINNED: Dict[int, weakref.ref] = {}


def mark_pinned(t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        return
    st = t.untyped_storage()
    sid = torch._C._storage_id(t)
    _PINNED[sid] = weakref.ref(st, lambda _r, sid=sid: _PINNED.pop(sid, None))


def is_pinned(t: torch.Tensor) -> bool:
    try:
        return torch._C._storage_id(t) in _PINNED
    except (RuntimeError, TypeError):
        return False


def clear_pinned() -> None:
    _PINNED.clear()
