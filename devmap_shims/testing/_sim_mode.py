"""The TorchFunctionMode that runs every op of a simulation on the real CPU tensors.

For each torch function call it: finds the simulated device of every tensor operand, raises
CUDA's own device-mismatch error where CUDA would, rewrites ``device=`` arguments that name a
simulated GPU to the CPU, runs the op, and records the simulated device of the new storages the
op produced (charging their bytes to that GPU). Ops with a handler of their own
(:mod:`._sim_handlers`) take it; the rest take the generic path (:mod:`._sim_generic`).
"""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

from . import _sim_state as S
from ._sim_generic import generic
from ._sim_handlers import HANDLERS, PASSTHROUGH


class SimulationMode(TorchFunctionMode):
    """Runs ops on the CPU tensors behind simulated CUDA tensors (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if S.MACHINE is None:  # a thread still running after its simulation ended
            return func(*args, **kwargs)
        try:
            h = HANDLERS.get(func)
            passthrough = h is None and func in PASSTHROUGH
        except TypeError:  # unhashable callables
            h, passthrough = None, False
        if passthrough:
            return func(*args, **kwargs)
        depth = S.DEPTH
        depth.n += 1
        try:
            if h is not None:
                return h(func, args, kwargs)
            return generic(func, args, kwargs)
        finally:
            depth.n -= 1
