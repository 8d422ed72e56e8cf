"""Library caches of which accelerator the machine has, cleared when a simulation starts and ends.

diffusers asks once and remembers (``get_device``, behind ``enable_sequential_cpu_offload``: cached
in 0.35-0.40, through ``TorchDeviceBackend._detect_device_type`` from 0.41); an answer cached outside
a simulation would say ``cpu`` inside it, and one cached inside would say ``cuda`` after it.
"""

from __future__ import annotations

import sys
from typing import Any

#: ``(module, attribute path)``: library functions that cache which accelerator the machine has
_CACHED_PROBES = (
    ("diffusers.utils.torch_utils", "get_device"),
    ("diffusers.utils.torch_utils", "TorchDeviceBackend._detect_device_type"),
)


def forget_cached_probes() -> None:
    """Clear the caches of :data:`_CACHED_PROBES` that are loaded (a module not imported yet has
    nothing cached; a release without the function or without a cache is left alone)."""
    for module_name, path in _CACHED_PROBES:
        probe: Any = sys.modules.get(module_name)
        for name in path.split("."):
            probe = getattr(probe, name, None)
        clear = getattr(probe, "cache_clear", None)
        if callable(clear):
            clear()
