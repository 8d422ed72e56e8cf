"""Shared state of the (at most one) active simulation.

A tensor is on simulated ``cuda:N`` when its storage is recorded in :data:`DEVICE_OF`
(storage key -> N). Views, ``.data``, ``detach()`` and ``Tensor._make_subclass`` (``Parameter``,
bitsandbytes ``Params4bit``) share the storage and therefore the device, as on real hardware.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import torch

from devmap_shims.versions import release_tuple

# Always (major, minor): release_tuple drops trailing zeros ("2.6.0" -> (2, 6), "3.0.0" -> (3,)),
# and the simulator compares against (major, minor) pairs such as (2, 8).
TORCH_VERSION = (release_tuple(torch.__version__) + (0,))[:2]

# storage key (torch._C._storage_id) -> simulated CUDA index
DEVICE_OF: Dict[int, int] = {}

# The running SimulatedMachine. Typed Any: importing _sim_machine here would close a cycle.
MACHINE: Any = None

# > 0 while the simulator's own mode handler runs an op on the real CPU tensors: then
# ``Tensor.device`` & co. report the real device, so torch's Python internals that build
# tensors "on the same device as the input" build them on the CPU.
class _Depth(threading.local):
    n = 0  # nesting of the mode's handler in this thread
    in_mode = False  # whether this thread runs under the simulation's mode
    backward = 0  # nesting of backward passes in this thread (see _sim_autograd)
    # (device, operands) of the op running while saved-tensor hooks are on: a hook called inside
    # it sees the op's new outputs on that device (see _sim_autograd.push_saved_tensors_hooks)
    op_outputs: Any = None
    # saved-tensor hook pairs pushed in this thread during the simulation and not yet popped (torch
    # keeps them per thread; nn.DataParallel's replicas checkpoint in threads of their own)
    saved_hooks = 0


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
