"""Simulated ``torch.cuda`` / ``torch.accelerator`` API: devices, memory, RNG state, streams.

Also the ``torch.device`` stand-in for torch builds where ``torch.device(0)`` asks the driver, and
``torch.backends.cudnn.is_acceptable``'s.
Everything here answers from the active :class:`SimulatedMachine`; nothing reaches the CUDA
driver.
"""

from __future__ import annotations

import collections
from typing import Any, Dict, List, Tuple

import torch

from . import _sim_state as S
from ._sim_devices import index_of
from ._sim_generators import DEFAULT_GENERATORS, default_generator, make_generator
from ._sim_machine import format_size
from ._sim_storages import clear_pinned
from ._sim_streams import (
    SimulatedEvent,
    SimulatedStream,
    SimulatedStreamContext,
    clear_streams,
    current_stream,
    default_stream,
    set_stream,
    stream,
)

_RealDevice = type(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# torch.device stand-in
# ---------------------------------------------------------------------------------------------
class _DeviceMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _RealDevice)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _RealDevice)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], int) and not isinstance(args[0], bool):
            return _RealDevice("cuda", args[0])
        return _RealDevice(*args, **kwargs)


class DeviceStandIn(metaclass=_DeviceMeta):
    """Takes the place of ``torch.device`` on torch builds where ``torch.device(0)`` asks the
    driver (2.5, 2.6): an int means ``cuda:int``; instance checks accept every real device."""


# ---------------------------------------------------------------------------------------------
# torch.cuda functions
# ---------------------------------------------------------------------------------------------
def is_available() -> bool:
    return True


def device_count() -> int:
    return S.MACHINE.device_count


def current_device() -> int:
    return S.MACHINE.current_device


def set_device(device: Any) -> None:
    idx = index_of(device, optional=False)
    if idx >= 0:
        S.MACHINE._set_current(idx)


def exchange_device(device: int) -> int:
    if device < 0:
        return -1
    prev = S.MACHINE.current_device
    S.MACHINE._set_current(device)
    return prev


def get_device_name(device: Any = None) -> str:
    return S.MACHINE.properties(index_of(device)).name


def get_device_properties(device: Any = None) -> Any:
    return S.MACHINE.properties(index_of(device))


def get_device_capability(device: Any = None) -> Tuple[int, int]:
    p = S.MACHINE.properties(index_of(device))
    return (p.major, p.minor)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return S.MACHINE.properties(S.MACHINE.current_device).major >= 8


def mem_get_info(device: Any = None) -> Tuple[int, int]:
    idx = index_of(device)
    return (S.MACHINE.free(idx), S.MACHINE.capacity(idx))


def memory_allocated(device: Any = None) -> int:
    return S.MACHINE.allocated(index_of(device))


def max_memory_allocated(device: Any = None) -> int:
    return S.MACHINE.max_allocated(index_of(device))


def reset_peak_memory_stats(device: Any = None) -> None:
    S.MACHINE.reset_peak(index_of(device))


def memory_stats(device: Any = None) -> "collections.OrderedDict[str, Any]":
    idx = index_of(device)
    m = S.MACHINE
    cur, peak = m.allocated(idx), m.max_allocated(idx)
    stats: Dict[str, Any] = {}
    for kind in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
        for pool in ("all", "large_pool", "small_pool"):
            full = pool == "all"
            stats[f"{kind}.{pool}.current"] = cur if full else 0
            stats[f"{kind}.{pool}.peak"] = peak if full else 0
    stats["num_alloc_retries"] = 0
    stats["num_ooms"] = m.num_ooms(idx)
    stats["num_device_alloc"] = m.num_allocations(idx)
    stats["num_device_free"] = 0
    return collections.OrderedDict(sorted(stats.items()))


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    idx = index_of(device)
    m = S.MACHINE
    return (
        f"Simulated GPU {idx} ({m.properties(idx).name}): allocated {format_size(m.allocated(idx))}, "
        f"peak {format_size(m.max_allocated(idx))}, capacity {format_size(m.capacity(idx))}\n"
    )


def noop(*args: Any, **kwargs: Any) -> None:
    return None


def true(*args: Any, **kwargs: Any) -> bool:
    return True


def false(*args: Any, **kwargs: Any) -> bool:
    return False


_real_cudnn_is_acceptable = torch.backends.cudnn.is_acceptable


def cudnn_is_acceptable(tensor: Any) -> bool:
    """``torch.backends.cudnn.is_acceptable`` during a simulation: never for a tensor on a simulated
    GPU, as on a build without cuDNN (``nn.LSTM``/``GRU``/``RNN`` would flatten their weights with
    a cuDNN kernel, which the CPU does not have; they run torch's own RNN instead)."""
    if S.sim_index(tensor) is not None:
        return False
    return _real_cudnn_is_acceptable(tensor)


def manual_seed(seed: int) -> None:
    default_generator(S.MACHINE.current_device).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for g in DEFAULT_GENERATORS:
        g.manual_seed(int(seed))


def seed() -> None:
    default_generator(S.MACHINE.current_device).seed()


def seed_all() -> None:
    s = DEFAULT_GENERATORS[0].seed() if DEFAULT_GENERATORS else 0
    for g in DEFAULT_GENERATORS[1:]:
        g.manual_seed(s)


def initial_seed() -> int:
    return default_generator(S.MACHINE.current_device).initial_seed()


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return default_generator(index_of(device)).get_state()


def get_rng_state_all() -> List[torch.Tensor]:
    return [g.get_state() for g in DEFAULT_GENERATORS]


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    default_generator(index_of(device)).set_state(new_state)


def set_rng_state_all(new_states: Any) -> None:
    for g, s in zip(DEFAULT_GENERATORS, new_states):
        g.set_state(s)


class SimulatedDeviceIndex:
    """``torch.accelerator.device_index`` on the simulated machine."""

    def __init__(self, device: Any, /) -> None:
        self.idx = -1 if device is None else index_of(device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        if self.idx >= 0:
            self.prev_idx = exchange_device(self.idx)

    def __exit__(self, *exc: Any) -> None:
        if self.prev_idx >= 0:
            exchange_device(self.prev_idx)


def get_memory_info(device: Any = None, /) -> Tuple[int, int]:
    return mem_get_info(device)


def start() -> None:
    n = S.MACHINE.device_count
    DEFAULT_GENERATORS[:] = [make_generator(i) for i in range(n)]
    clear_streams()
    clear_pinned()


def stop() -> None:
    DEFAULT_GENERATORS.clear()
    clear_streams()
    clear_pinned()


def cuda_namespace() -> Dict[str, Any]:
    """Attribute name -> stand-in, for torch.cuda and the submodules that define them."""
    return {
        "is_available": is_available,
        "device_count": device_count,
        "current_device": current_device,
        "set_device": set_device,
        "_exchange_device": exchange_device,
        "_maybe_exchange_device": exchange_device,
        "get_device_name": get_device_name,
        "get_device_properties": get_device_properties,
        "get_device_capability": get_device_capability,
        "is_bf16_supported": is_bf16_supported,
        "can_device_access_peer": true,
        "is_current_stream_capturing": false,  # optimizers' CUDA-graph check before each step
        "mem_get_info": mem_get_info,
        "memory_allocated": memory_allocated,
        "max_memory_allocated": max_memory_allocated,
        "memory_reserved": memory_allocated,
        "max_memory_reserved": max_memory_allocated,
        "memory_cached": memory_allocated,
        "max_memory_cached": max_memory_allocated,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_max_memory_allocated": reset_peak_memory_stats,
        "reset_max_memory_cached": reset_peak_memory_stats,
        "reset_accumulated_memory_stats": noop,
        "memory_stats": memory_stats,
        "memory_summary": memory_summary,
        "set_per_process_memory_fraction": noop,
        "synchronize": noop,
        "empty_cache": noop,
        "ipc_collect": noop,
        "is_initialized": true,
        # read by torch.utils.checkpoint: once CUDA is initialized it saves the inputs' GPUs'
        # generator states and restores them for the recomputation (dropout's masks)
        "_initialized": True,
        "init": noop,
        "_lazy_init": noop,
        "Stream": SimulatedStream,
        "Event": SimulatedEvent,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "stream": stream,
        "set_stream": set_stream,
        "StreamContext": SimulatedStreamContext,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed_all,
        "seed": seed,
        "seed_all": seed_all,
        "initial_seed": initial_seed,
        "get_rng_state": get_rng_state,
        "get_rng_state_all": get_rng_state_all,
        "set_rng_state": set_rng_state,
        "set_rng_state_all": set_rng_state_all,
        "default_generators": tuple(DEFAULT_GENERATORS),
    }


def current_accelerator(check_available: bool = False) -> torch.device:
    return _RealDevice("cuda")


def accelerator_namespace() -> Dict[str, Any]:
    return {
        "current_accelerator": current_accelerator,
        "is_available": is_available,
        "device_count": device_count,
        "current_device_index": current_device,
        "current_device_idx": current_device,
        "set_device_index": set_device,
        "set_device_idx": set_device,
        "synchronize": noop,
        "device_index": SimulatedDeviceIndex,
        "current_stream": current_stream,
        "set_stream": set_stream,
        "empty_cache": noop,
        "memory_stats": memory_stats,
        "memory_allocated": memory_allocated,
        "max_memory_allocated": max_memory_allocated,
        "memory_reserved": memory_allocated,
        "max_memory_reserved": max_memory_allocated,
        "reset_accumulated_memory_stats": noop,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "get_memory_info": get_memory_info,
    }
