"""Testing helpers: a simulated multi-GPU CUDA machine on the CPU and its pytest plugin.

``from devmap_shims.testing import simulated_gpus`` imports torch; importing this package alone
(as pytest does for the plugin) does not.
"""

from __future__ import annotations

from typing import Any

_SIMULATOR_NAMES = (
    "SimulatedAutogradError",
    "SimulatedDeviceProperties",
    "SimulatedMachine",
    "active_machine",
    "format_size",
    "is_simulated",
    "parse_memory",
    "real_cpu_tensor",
    "simulated_gpus",
)

__all__ = list(_SIMULATOR_NAMES)


def __getattr__(name: str) -> Any:
    if name in _SIMULATOR_NAMES:
        from . import simulator

        return getattr(simulator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
