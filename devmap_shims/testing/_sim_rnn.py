"""The RNN ops and packed sequences on the simulated GPUs.

``pack_padded_sequence`` takes its lengths on the CPU, and the packed data's batch sizes stay there
through the RNNs and ``pad_packed_sequence``: CUDA requires it. Such a call runs on its data's GPU
with the sizes on the CPU, where the generic path would take it for a mixed-device call; sizes on a
GPU are refused with ATen's words. The RNNs' dropout between layers draws from the GPU's generator
(:mod:`._sim_random`). (cuDNN is never acceptable for a simulated tensor:
:func:`._sim_cuda.cudnn_is_acceptable`.)"""

from __future__ import annotations

from typing import Any, Optional

import torch

from devmap_shims.calls import argument_at

from . import _sim_state as S
from ._sim_generators import default_generator, drawing_from
from ._sim_generic import generic, run_announcing
from ._sim_operands import tensor_operands
from ._sim_random import h_no_generator
from ._sim_storages import tag_all

_Tensor = torch.Tensor


def _packed_on(args: Any, kwargs: Any) -> Optional[int]:
    """The simulated GPU of a packed-sequence call (``_pack_padded_sequence(input, lengths, ...)``,
    ``_pad_packed_sequence(data, batch_sizes, ...)``, the RNNs' ``(data, batch_sizes, hx, ...)``),
    whose lengths or batch sizes are the CPU int64 tensor CUDA requires them to be, with every
    other operand on that GPU; else None (the generic path checks the call as any other)."""
    if len(args) < 2 or not isinstance(args[0], _Tensor) or not isinstance(args[1], _Tensor):
        return None
    idx, sizes = S.sim_index(args[0]), args[1]
    if idx is None or S.sim_index(sizes) is not None or sizes.dtype != torch.int64 or sizes.is_meta:
        return None
    others = [t for t in tensor_operands(args, kwargs) if t is not sizes]
    return idx if all(S.sim_index(t) == idx for t in others) else None


def _run_packed(func: Any, args: Any, kwargs: Any, idx: int, on_gpu: Any) -> Any:
    """The packed-sequence op on the CPU tensors behind the simulation; its outputs at ``on_gpu``
    (None: all) on the GPU, the sizes it returns on the CPU, as CUDA gives them."""
    if S.DEPTH.saved_hooks:  # the hooks see what the op saves on its GPU, the sizes on the CPU
        out = run_announcing(func, args, kwargs, idx, tensor_operands(args, kwargs), sizes_on_cpu=True)
    else:
        out = func(*args, **kwargs)
    for i, o in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
        if on_gpu is None or i in on_gpu:
            tag_all(o, idx)
    return out


def _sizes_on_the_cpu(args: Any, kwargs: Any) -> None:
    """aten/src/ATen/native/PackedSequence.cpp ``checkLongTensor``: the lengths (batch sizes) of
    ``_pack_padded_sequence`` (``_pad_packed_sequence``) must be a 1D CPU int64 tensor, for CUDA data
    too; the CPU checks the rest itself."""
    sizes = argument_at(args, kwargs, 1, "lengths", "batch_sizes")
    idx = S.sim_index(sizes) if isinstance(sizes, _Tensor) else None
    if idx is not None:
        scalar_type = sizes.type()[len("torch."):-len("Tensor")]  # the real CPU tensor's: LongTensor
        raise RuntimeError(
            "'lengths' argument should be a 1D CPU int64 tensor, but got "
            f"{sizes.dim()}D cuda:{idx} {scalar_type} tensor"
        )


def h_packed_sizes(func: Any, args: Any, kwargs: Any) -> Any:
    """``_pack_padded_sequence`` and ``_pad_packed_sequence``."""
    _sizes_on_the_cpu(args, kwargs)
    idx = _packed_on(args, kwargs)
    if idx is None:
        return generic(func, args, kwargs)
    return _run_packed(func, args, kwargs, idx, (0,))  # the data on the GPU, the sizes on the CPU


def h_rnn(func: Any, args: Any, kwargs: Any) -> Any:
    """``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``: their dropout draws from the GPU's generator;
    a packed input's batch sizes stay on the CPU."""
    idx = _packed_on(args, kwargs)
    if idx is None:
        return h_no_generator(func, args, kwargs)
    return drawing_from(default_generator(idx), _run_packed, func, args, kwargs, idx, None)
