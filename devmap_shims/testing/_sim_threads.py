"""Work that crosses threads or GPUs during a simulation: ``ThreadPoolExecutor`` workers and
``nn.DataParallel``.

Torch function modes are thread-local, so a thread started during a simulation runs outside it.
Work submitted to a ``concurrent.futures.ThreadPoolExecutor`` runs inside it (transformers >= 5
materialises checkpoint tensors that way), and so do the worker threads of
``torch.nn.parallel.parallel_apply`` (``nn.DataParallel``, and so ``transformers.Trainer`` on more
than one GPU without a launcher).

DataParallel's collectives (``torch/nn/parallel/comm.py``) call kernels of their own
(``torch._C._broadcast``, ``_broadcast_coalesced``, ``_scatter``, ``_gather``), which need a
driver: during a simulation they are copies between the simulated GPUs, with the results torch
documents (the first device keeps the tensors a broadcast starts from; a scatter gives as many
chunks as ``Tensor.chunk`` does). NCCL is not simulated: ``torch.cuda.nccl.is_available`` says no, so
``comm.reduce_add`` adds on the destination as torch does without NCCL.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import threading
from typing import Any, List, Optional, Sequence

import torch

from . import _sim_state as S
from ._sim_mode import SimulationMode


def in_simulation(fn: Any) -> Any:
    """Run ``fn`` (in a worker thread) under the simulation's mode: modes are thread-local."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if S.MACHINE is None or S.DEPTH.in_mode:
            return fn(*args, **kwargs)
        S.DEPTH.in_mode = True
        try:
            with SimulationMode():
                return fn(*args, **kwargs)
        finally:
            S.DEPTH.in_mode = False

    return run


_real_submit = concurrent.futures.ThreadPoolExecutor.submit


def _submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    return _real_submit(self, in_simulation(fn), *args, **kwargs)


class _Threading:
    """``threading`` as ``torch.nn.parallel.parallel_apply`` sees it during a simulation: the threads
    it starts run in the simulation."""

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)

    @staticmethod
    def Thread(*args: Any, target: Any = None, **kwargs: Any) -> threading.Thread:
        return threading.Thread(*args, target=None if target is None else in_simulation(target), **kwargs)


def _gpu(index: int) -> torch.device:
    return torch.device("cuda", index)


def _broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> List[torch.Tensor]:
    return [tensor if i == 0 and tensor.get_device() == d else tensor.to(_gpu(d))
            for i, d in enumerate(devices)]


def _broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int], buffer_size: int = 0
                         ) -> Any:
    # the first device keeps the tensors themselves, as torch/csrc/cuda/comm.cpp does
    return [list(tensors) if i == 0 else [t.to(_gpu(d)) for t in tensors] for i, d in enumerate(devices)]


def _scatter(
    tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Optional[Sequence[int]] = None, dim: int = 0,
    streams: Any = None,
) -> List[torch.Tensor]:
    if chunk_sizes is not None:
        chunks = tensor.split(list(chunk_sizes), dim)
    else:
        chunks = tensor.chunk(len(devices), dim)
    return [chunk.to(_gpu(d)) for chunk, d in zip(chunks, devices)]


def _gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination: Optional[int] = None) -> torch.Tensor:
    """The result made once on the destination and each input copied into its slice, as CUDA's
    ``_gather`` does (no copy of a whole input on the destination first)."""
    if destination == -1:
        target = torch.device("cpu")
    else:
        target = _gpu(torch.cuda.current_device() if destination is None else destination)
    first = tensors[0]
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    result = torch.empty(shape, dtype=first.dtype, device=target)
    start = 0
    for t in tensors:
        result.narrow(dim, start, t.shape[dim]).copy_(t)
        start += t.shape[dim]
    return result


def _no_nccl(tensors: Any) -> bool:
    return False


def _copy_stream(device: Any) -> Any:
    """``torch.nn.parallel._functions._get_stream``: a simulated stream of that GPU to copy a CPU
    input on (torch builds a ``torch.Stream`` or the device module's ``Stream`` there, and keeps it
    in a list of its own, which would outlive the simulation)."""
    index = device if isinstance(device, int) else device.index
    if index is None or (not isinstance(device, int) and device.type == "cpu"):
        return None
    return torch.cuda.Stream(index)


def install(patcher: Any) -> None:
    patcher.set(concurrent.futures.ThreadPoolExecutor, "submit", _submit)
    # torch.nn.parallel.parallel_apply is the function: the module is only in sys.modules
    apply_module = importlib.import_module("torch.nn.parallel.parallel_apply")
    if isinstance(apply_module.__dict__.get("threading"), type(threading)):
        patcher.set(apply_module, "threading", _Threading())
    for name, value in (("_broadcast", _broadcast), ("_broadcast_coalesced", _broadcast_coalesced),
                        ("_scatter", _scatter), ("_gather", _gather)):
        if name in torch._C.__dict__:
            patcher.set(torch._C, name, value)
    functions = importlib.import_module("torch.nn.parallel._functions")
    if "_get_stream" in functions.__dict__:
        patcher.set(functions, "_get_stream", _copy_stream)
    nccl = importlib.import_module("torch.cuda.nccl")
    if "is_available" in nccl.__dict__:
        patcher.set(nccl, "is_available", _no_nccl)
