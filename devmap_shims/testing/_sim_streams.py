"""Inert CUDA streams and events: work runs synchronously on the CPU, so every wait is satisfied."""

from __future__ import annotations

import inspect
from typing import Any, Dict, Tuple

import torch

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
    """An inert CUDA event (``elapsed_time`` is 0.0)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._recorded = False

    def record(self, stream: Any = None) -> None:
        self._recorded = True

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0

    def __repr__(self) -> str:
        return "<torch.cuda.Event (simulated)>"


_STREAMS: Dict[int, SimulatedStream] = {}


def current_stream(device: Any = None) -> SimulatedStream:
    idx = index_of(device)
    s = _STREAMS.get(idx)
    if s is None:
        s = _STREAMS[idx] = SimulatedStream(idx)
    return s


class SimulatedStreamContext:
    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        return None


def stream(stream: Any) -> SimulatedStreamContext:
    return SimulatedStreamContext(stream)


def set_stream(stream: Any) -> None:
    pass


def clear_streams() -> None:
    _STREAMS.clear()
