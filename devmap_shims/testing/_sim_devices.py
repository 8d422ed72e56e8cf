"""Device arguments and device names during a simulation.

A device is either an ``int`` (a simulated ``cuda:N``) or the real :class:`torch.device` of
anything else (``cpu``, ``meta``).
"""

from __future__ import annotations

from typing import Any, Dict, Union

import torch

from . import _sim_state as S

Target = Union[int, torch.device]  # int: simulated cuda index; torch.device: a real device

_storage_id = torch._C._storage_id
_real_device_get = torch._C.TensorBase.device.__get__

_parse_cache: Dict[Any, Target] = {}
_CURRENT: Any = object()  # cache entry for a bare "cuda": follows torch.cuda.set_device()


def invalid_ordinal(idx: int) -> RuntimeError:
    n = S.MACHINE.device_count if S.MACHINE is not None else 0
    return RuntimeError(
        "CUDA error: invalid device ordinal\n"
        f"(the simulated machine has {n} GPU{'s' if n != 1 else ''}; cuda:{idx} does not exist)"
    )


def parse_device(dev: Any) -> Target:
    """An int for a simulated CUDA device, or the real torch.device for anything else."""
    try:
        hit = _parse_cache.get(dev)
    except TypeError:  # unhashable: let torch.device complain
        return torch.device(dev)
    if hit is None:
        hit = _parse_cache[dev] = _parse_uncached(dev)
    if hit is _CURRENT:
        return S.MACHINE.current_device
    if isinstance(hit, int) and not hit < S.MACHINE.device_count:
        raise invalid_ordinal(hit)
    return hit


def _parse_uncached(dev: Any) -> Target:
    if isinstance(dev, bool):
        raise TypeError(f"expected a device, got {dev!r}")
    if isinstance(dev, int):
        if dev < 0:
            raise RuntimeError("Device index must not be negative")
        return dev
    d = dev if isinstance(dev, torch.device) else torch.device(dev)
    if d.type != "cuda":
        return d
    return _CURRENT if d.index is None else d.index


def index_of(device: Any = None, optional: bool = True) -> int:
    """torch.cuda's device argument (None, int, "cuda:1", torch.device) -> simulated index. A
    device without an index is the current one where ``optional`` (torch/_utils.py
    ``_get_device_index``), else a ValueError with torch's message (``set_device("cuda")``)."""
    bare = (isinstance(device, str) and device.strip() == "cuda") or (
        isinstance(device, torch.device) and device.type == "cuda" and device.index is None)
    if (bare or device is None) and not optional:
        shown = None if device is None else torch.device(device)
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{shown}")
    if device is None or bare:
        return S.MACHINE.current_device
    target = parse_device(device)
    if not isinstance(target, int):
        raise ValueError(f"Expected a cuda device, but got: {target}")
    return target


def clear_parse_cache() -> None:
    _parse_cache.clear()


def device_key(t: torch.Tensor) -> Target:
    """Simulated index of ``t``, or its real device."""
    try:
        idx = S.DEVICE_OF.get(_storage_id(t))
    except (RuntimeError, TypeError):
        idx = None
    if idx is not None:
        return idx
    return _real_device_get(t)


def off_cpu(key: Target) -> bool:
    """A simulated GPU, or a real device other than the CPU (``meta``)."""
    return isinstance(key, int) or key.type != "cpu"


def fmt_device(key: Target) -> str:
    return f"cuda:{key}" if isinstance(key, int) else str(key)
