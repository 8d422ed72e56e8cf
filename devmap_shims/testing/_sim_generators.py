"""Random generators of the simulated GPUs: CPU generators that report ``cuda:N``.

Random ops on simulated GPUs draw from them, those that take no generator included, so seeding
``torch.cuda`` reproduces a run.
"""

from __future__ import annotations

import threading
from typing import Any, List

import torch

from . import _sim_state as S
from ._sim_devices import parse_device

_RealGenerator = torch._C.Generator


class SimulatedCudaGenerator(_RealGenerator):
    """A CPU generator that reports ``cuda:N``: random ops on simulated GPUs draw from it."""

    _sim_index = 0

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        if S.MACHINE is not None and self._sim_index < len(S.CUDA_DEVICES):
            return S.CUDA_DEVICES[self._sim_index]
        return torch.device("cuda", self._sim_index)


def make_generator(idx: int) -> SimulatedCudaGenerator:
    g = SimulatedCudaGenerator()
    g._sim_index = idx
    return g


def generator_device(g: Any) -> str:
    if isinstance(g, SimulatedCudaGenerator):
        return "cuda"
    return g.device.type


# torch.cuda.default_generators of the running simulation, one per simulated GPU
DEFAULT_GENERATORS: List[SimulatedCudaGenerator] = []


def default_generator(idx: int) -> SimulatedCudaGenerator:
    return DEFAULT_GENERATORS[idx]


#: One swap at a time: nn.DataParallel's replicas draw in threads of their own, each from its GPU's
#: generator, through the one CPU generator.
_SWAP = threading.RLock()


def drawing_from(g: _RealGenerator, run: Any, *args: Any) -> Any:
    """``run(*args)`` with the CPU's default generator holding ``g``'s state; after it ``g`` takes
    the state the run left and the CPU's generator gets its own back. Ops whose signatures take no
    generator (dropout, rrelu) draw from the CPU's default one: run so, they draw from ``g``.
    Swaps in other threads of the simulation wait; a thread outside it that draws from the CPU's
    generator meanwhile would draw from ``g``'s sequence."""
    cpu = torch.default_generator
    with _SWAP:
        own = cpu.get_state()
        cpu.set_state(g.get_state())
        try:
            return run(*args)
        finally:
            g.set_state(cpu.get_state())
            cpu.set_state(own)


class _GeneratorMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _RealGenerator)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _RealGenerator)

    def __call__(cls, device: Any = "cpu") -> Any:
        target = parse_device(device) if device is not None else torch.device("cpu")
        if isinstance(target, int):
            return make_generator(target)
        return _RealGenerator(device=target)


class GeneratorStandIn(metaclass=_GeneratorMeta):
    """Takes the place of ``torch.Generator`` during a simulation: ``torch.Generator("cuda:1")``
    gives a :class:`SimulatedCudaGenerator`; any other device gives a real generator. Instance
    checks against it accept every real generator."""

    def __getattr__(self, name: str) -> Any:  # pragma: no cover - never instantiated
        raise AttributeError(name)
