"""Shared state of the (at most one) active simulation.

A tensor is on simulated ``cuda:N`` when its storage is recorded in :data:`DEVICE_OF`
(storage key -> N). Views, ``.data``, ``detach()`` and ``Tensor._make_subclass`` (``Parameter``,
bitsandbytes ``Params4bit``) share the storage and therefore the device, as on real hardware.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Dict, Optional

import torch

if TYPE_CHECKING:
    from ._sim_machine import SimulatedMachine


def _release_tuple(version: str) -> tuple:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


TORCH_VERSION = _release_tuple(torch.__version__)

# storage key (torch._C._storage_id) -> simulated CUDA index
DEVICE_OF: Dict[int, int] = {}

MACHINE: Optional["SimulatedMachine"] = None

# > 0 while the simulator's own mode handler runs an op on the real CPU tensors: then
# ``Tensor.device`` & co. report the real device, so torch's Python internals that build
# tensors "on the same device as the input" build them on the CPU.
class _Depth(threading.local):
    n = 0  # nesting of the mode's handler in this thread
    in_mode = False  # whether this thread runs under the simulation's mode


DEPTH = _Depth()

# One real torch.device per simulated index, built once per simulation.
CUDA_DEVICES: list = []

_storage_id = torch._C._storage_id


def sim_index(t: torch.Tensor) -> Optional[int]:
    """The simulated CUDA index of ``t``, or None when it is not on a simulated GPU."""
    try:
        return DEVICE_OF.get(_storage_id(t))
    except (RuntimeError, TypeError):  # sparse / storage-less tensors
        return None
