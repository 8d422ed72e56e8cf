"""Inert CUDA streams and events: work runs synchronously on the CPU, so every wait is satisfied."""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any, Dict, Tuple

import torch

from . import _sim_state as S
from ._sim_devices import index_of


def _abstract_bases() -> Tuple[Tuple[type, ...], Tuple[type, ...]]:
    """torch 2.4's abstract stream and event bases: its Dynamo refuses a ``torch.cuda.Stream`` /
    ``Event`` that does not derive from them (later releases derive them from ``torch.Stream``
    and deprecate them)."""
    try:
        from torch._streambase import _EventBase, _StreamBase
    except ImportError:
        return (), ()
    if inspect.isabstract(_StreamBase) and inspect.isabstract(_EventBase):
        return (_StreamBase,), (_EventBase,)
    return (), ()


_STREAM_BASES, _EVENT_BASES = _abstract_bases()


class SimulatedStream(*_STREAM_BASES):  # type: ignore[misc]
    """An inert CUDA stream: work is synchronous on the CPU, so every wait is already satisfied."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self._index = index_of(device)
        self.priority = priority
        self.stream_id = id(self)
        self.cuda_stream = 0
        self.device_index = self._index
        self.device_type = 1  # DeviceType::CUDA

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._index)

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "SimulatedEvent":
        event = event if event is not None else SimulatedEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:  # torch.Stream's, asked by optimizers (CUDA graphs)
        return False

    def __eq__(self, other: Any) -> bool:
        return self is other

    __hash__ = object.__hash__

    def __enter__(self) -> "SimulatedStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:{self._index} cuda_stream=0x0 (simulated)>"


class SimulatedEvent(*_EVENT_BASES):  # type: ignore[misc]
    """A CUDA event on a simulated GPU, where every kernel has run by the time the next line does:
    ``record`` notes the time, so ``elapsed_time`` between two recorded timing events is the wall
    time between their records in milliseconds (negative for an end recorded first, as CUDA's),
    the time the simulated work took on the CPU; otherwise it raises as CUDA's does
    (aten/src/ATen/cuda/CUDAEvent.h ``elapsed_time``)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._recorded = False
        self._time = 0.0

    def record(self, stream: Any = None) -> None:
        self._recorded = True
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Any) -> float:
        timing = self.enable_timing and getattr(end_event, "enable_timing", False)
        recorded = self._recorded and getattr(end_event, "_recorded", False)
        if S.TORCH_VERSION >= (2, 8):  # pytorch/pytorch#151404: both checked first, as ValueError
            if not timing:
                raise ValueError("Both events must be created with argument 'enable_timing=True'.")
            if not recorded:
                raise ValueError("Both events must be recorded before calculating elapsed time.")
        if not recorded:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not timing:  # cudaEventElapsedTime refuses an event made with cudaEventDisableTiming
            raise RuntimeError("CUDA error: invalid resource handle")
        return (getattr(end_event, "_time", self._time) - self._time) * 1000.0

    def __repr__(self) -> str:
        return "<torch.cuda.Event (simulated)>"


_DEFAULT: Dict[int, SimulatedStream] = {}  # each GPU's default stream


class _PerThread(threading.local):
    """Each GPU's current stream where one was set, per thread as in CUDA; ``epoch`` tells a
    thread's streams from an earlier simulation's (:func:`clear_streams`)."""

    epoch = -1
    streams: Dict[int, SimulatedStream] = {}


_PER_THREAD = _PerThread()
_EPOCH = [0]


def _current() -> Dict[int, SimulatedStream]:
    local = _PER_THREAD
    if local.epoch != _EPOCH[0]:
        local.epoch, local.streams = _EPOCH[0], {}
    return local.streams


def default_stream(device: Any = None) -> SimulatedStream:
    idx = index_of(device)
    s = _DEFAULT.get(idx)
    if s is None:
        s = _DEFAULT[idx] = SimulatedStream(idx)
    return s


def current_stream(device: Any = None) -> SimulatedStream:
    idx = index_of(device)
    s = _current().get(idx)
    return default_stream(idx) if s is None else s


def set_stream(stream: Any) -> None:
    """As ``torch.cuda.set_stream``: the stream's GPU becomes the current device, and the stream
    that GPU's current stream."""
    if stream is None:
        return
    S.MACHINE._set_current(stream.device_index)
    _current()[stream.device_index] = stream


class SimulatedStreamContext:
    """As ``torch.cuda.StreamContext``: on entry the stream's GPU and the stream become current, on
    exit the device and the streams that were current come back."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._previous: Any = None

    def __enter__(self) -> Any:
        target = self.stream
        if target is None:
            return target
        source = current_stream()
        moved = source.device_index != target.device_index
        elsewhere = current_stream(target.device_index) if moved else None
        self._previous = (source, elsewhere)
        set_stream(target)
        return target

    def __exit__(self, *exc: Any) -> None:
        if self.stream is None or self._previous is None:
            return None
        source, elsewhere = self._previous
        if elsewhere is not None:
            set_stream(elsewhere)
        set_stream(source)
        return None


def stream(stream: Any) -> SimulatedStreamContext:
    return SimulatedStreamContext(stream)


def clear_streams() -> None:
    _DEFAULT.clear()
    _EPOCH[0] += 1
