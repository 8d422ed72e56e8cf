"""Autograd on the simulated GPUs: training steps run, and gradients live where CUDA puts them.

The forward pass records history like any other op (the results are tagged with their device).
The backward pass runs in torch's C++ engine, which the mode never sees: the gradients it makes
are new CPU storages that no op tagged. So the engine entry point (``Variable._execution_engine``)
is wrapped by :class:`SimulatedEngine`, which

* before the pass: raises the engine's own error when a gradient handed to ``backward()`` /
  ``autograd.grad()`` sits on another device than its tensor (CUDA's ``validate_outputs``);
* during the pass: keeps the simulation on (Python backward code - custom ``Function.backward``
  such as bitsandbytes' 4-bit matmul, hooks, activation-checkpointing recomputation through
  accelerate's hooks - sees simulated devices), treating tensors that the engine made (untagged
  CPU tensors) as being on the device of the simulated operands they meet;
* after it: records each gradient on the device of its tensor (``p.grad`` of a parameter on
  ``cuda:N`` is on ``cuda:N``, charged to that GPU), copying it there where a gradient that
  Python backward code made on another simulated device reached it unchanged (CUDA's
  ``ToCopyBackward`` would have copied it).

``Tensor.grad`` assignment raises torch's own messages for a gradient on another device; what
optimizers group their tensors by is :mod:`._sim_optim`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from devmap_shims.calls import argument_at

from . import _sim_state as S
from ._sim_devices import device_key, fmt_device
from ._sim_storages import tag

_TensorBase = torch._C.TensorBase
_Tensor = torch.Tensor
_CPU = torch.device("cpu")
_real_is_cpu = _TensorBase.is_cpu.__get__
_grad_get = _TensorBase.grad.__get__
_grad_set = _TensorBase.grad.__set__
_len_stack = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_pop_stack = torch._C._pop_torch_function_stack
_push_stack = torch._C._push_on_torch_function_stack


class SimulatedAutogradError(RuntimeError):
    """Kept for code that catches it: autograd runs on the simulated GPUs, and nothing raises
    this any more."""


# ---------------------------------------------------------------------------------------------
# the mode during the backward pass
# ---------------------------------------------------------------------------------------------
def _mode_type() -> type:
    from ._sim_mode import SimulationMode  # the mode's module imports this one

    return SimulationMode


def _has_simulation_mode() -> bool:
    mode_type = _mode_type()
    return any(isinstance(_stack_at(i), mode_type) for i in range(_len_stack()))


@contextlib.contextmanager
def _simulated_view() -> Iterator[None]:
    """Run under the simulation's mode with the tensors reporting their simulated devices: code
    that torch calls from inside an op or from the engine (the mode's handler has taken the mode
    off and raised the depth) sees what code outside sees."""
    depth = S.DEPTH
    saved_n = depth.n
    pushed = not _has_simulation_mode()
    if pushed:
        _push_stack(_mode_type()())
    depth.n = 0
    try:
        yield
    finally:
        depth.n = saved_n
        if pushed:
            _pop_stack()


@contextlib.contextmanager
def _simulation_on() -> Iterator[None]:
    """A backward pass: the simulated view, with engine-made gradients joining any device."""
    with _simulated_view():
        S.DEPTH.backward += 1
        try:
            yield
        finally:
            S.DEPTH.backward -= 1


@contextlib.contextmanager
def _simulation_off() -> Iterator[None]:
    """Plain CPU work of the simulator itself (copies it tags by hand)."""
    mode_type = _mode_type()
    popped: List[Any] = []
    while _len_stack() and any(isinstance(_stack_at(i), mode_type) for i in range(_len_stack())):
        popped.append(_pop_stack())
    S.DEPTH.n += 1
    try:
        yield
    finally:
        S.DEPTH.n -= 1
        for mode in reversed(popped):
            _push_stack(mode)


# ---------------------------------------------------------------------------------------------
# copies across devices
# ---------------------------------------------------------------------------------------------
class DeviceCopy(torch.autograd.Function):
    """A copy to another simulated device that records history: its backward puts the gradient
    back on the source device, as CUDA's ``ToCopyBackward`` does (a plain ``clone`` would pass a
    gradient that Python backward code made on the target device through unchanged). An
    engine-made gradient (untagged) passes as it is: it joins any device."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, memory_format: Any) -> torch.Tensor:
        ctx.source = S.sim_index(t)
        return t.clone(memory_format=memory_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None]:
        have = S.sim_index(grad) if isinstance(grad, _Tensor) else None
        if have is None or have == ctx.source:
            return grad, None
        with _simulation_off():
            moved = grad.clone()
        if ctx.source is not None:
            tag(moved, ctx.source)
        return moved, None


# ---------------------------------------------------------------------------------------------
# gradients handed to backward()
# ---------------------------------------------------------------------------------------------
def _as_tuple(x: Any) -> Tuple[Any, ...]:
    if x is None:
        return ()
    if isinstance(x, (_Tensor,)) or not isinstance(x, (tuple, list)):
        return (x,)
    return tuple(x)


def check_root_gradients(roots: Any, grads: Any) -> None:
    """The engine's check of the gradients given for the roots (torch/csrc/autograd/engine.cpp
    ``validate_outputs``): a gradient on another device than its tensor raises, except a 0-dim
    one (the engine moves it). Shape errors are left to torch, which reports them first. Inside a
    backward pass (activation checkpointing runs one), a gradient the engine made counts as being
    on its tensor's device."""
    engine_made_ok = S.DEPTH.backward > 0
    for i, (t, g) in enumerate(zip(_as_tuple(roots), _as_tuple(grads))):
        if not (isinstance(t, _Tensor) and isinstance(g, _Tensor)) or g.dim() == 0 or g.shape != t.shape:
            continue
        expected, got = device_key(t), device_key(g)
        if expected != got and not (engine_made_ok and S.sim_index(g) is None and _real_is_cpu(g)):
            raise RuntimeError(
                f"invalid gradient at index {i} - expected device {fmt_device(expected)} but got {fmt_device(got)}"
            )


def check_backward_call(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
    """Check the gradients of a ``Tensor.backward`` / ``autograd.backward`` / ``autograd.grad`` call."""
    if func is _Tensor.backward:
        check_root_gradients(args[0], argument_at(args, kwargs, 1, "gradient"))
    elif func is torch.autograd.grad:
        check_root_gradients(argument_at(args, kwargs, 0, "outputs"), argument_at(args, kwargs, 2, "grad_outputs"))
    else:
        grads = argument_at(args, kwargs, 1, "grad_tensors")
        if grads is None:
            grads = kwargs.get("grad_variables")
        check_root_gradients(argument_at(args, kwargs, 0, "tensors"), grads)


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------
def _accumulating_leaves(roots: Sequence[Any]) -> List[torch.Tensor]:
    """The tensors whose ``.grad`` a backward pass from ``roots`` accumulates into (the
    ``variable`` of every AccumulateGrad node reachable from the roots)."""
    leaves: List[torch.Tensor] = []
    stack: List[Any] = []
    for r in roots:
        if isinstance(r, _Tensor):
            fn = r.grad_fn
            if fn is None:
                if r.requires_grad:
                    leaves.append(r)
            else:
                stack.append(fn)
        else:  # torch.autograd.graph.GradientEdge
            node = getattr(r, "node", None)
            if node is not None:
                stack.append(node)
    seen = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            leaves.append(variable)
            continue
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return leaves


def _settled(t: torch.Tensor, g: torch.Tensor) -> Optional[torch.Tensor]:
    """Record gradient ``g`` of ``t`` on ``t``'s device; a copy there when Python backward code
    made ``g`` on another simulated device (returned), else None."""
    want = S.sim_index(t)
    have = S.sim_index(g)
    if have == want:
        return None
    if have is None:
        if _real_is_cpu(g):
            tag(g, want)
        return None
    with _simulation_off():
        moved = g.clone()
    if want is not None:
        tag(moved, want)
    return moved


def settle_grad(t: torch.Tensor) -> None:
    """Put ``t.grad`` on ``t``'s device (see :func:`_settled`)."""
    g = _grad_get(t)
    if isinstance(g, _Tensor):
        moved = _settled(t, g)
        if moved is not None:
            with _simulation_off():
                _grad_set(t, moved)


_RUN_BACKWARD_NAMES = ("tensors", "grad_tensors", "keep_graph", "create_graph", "inputs", "allow_unreachable",
                       "accumulate_grad")


class SimulatedEngine:
    """Stands in for ``torch.autograd.Variable._execution_engine`` during a simulation (see the
    module docstring); everything but ``run_backward`` goes to the real engine."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        if S.MACHINE is None or not S.DEPTH.in_mode:  # another thread, or after the simulation
            return self._engine.run_backward(*args, **kwargs)
        roots = _as_tuple(argument_at(args, kwargs, 0, "tensors"))
        if S.DEPTH.n == 0:  # called directly (the handler of Tensor.backward & co. checked its call)
            check_root_gradients(roots, argument_at(args, kwargs, 1, "grad_tensors"))
        inputs = _as_tuple(argument_at(args, kwargs, 4, "inputs"))
        accumulate = argument_at(args, kwargs, 6, "accumulate_grad")
        accumulate = True if accumulate is None else accumulate
        receivers: Sequence[Any] = ()
        if accumulate:
            receivers = inputs if inputs else _accumulating_leaves(roots)
        with _simulation_on():
            out = self._engine.run_backward(*args, **kwargs)
        for t in receivers:
            if isinstance(t, _Tensor):
                settle_grad(t)
        if not accumulate and isinstance(out, tuple):
            fixed = list(out)
            for i, (t, g) in enumerate(zip(inputs, out)):
                if isinstance(t, _Tensor) and isinstance(g, _Tensor):
                    moved = _settled(t, g)
                    if moved is not None:
                        fixed[i] = moved
            out = tuple(fixed)
        return out


_real_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_real_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


def _tag_new_output(x: Any) -> None:
    """Inside an op, a tensor it saves that is none of its operands is one of its outputs, which
    the op's handler will record on the op's device once it returns: record it now."""
    pending = S.DEPTH.op_outputs
    if pending is None or not isinstance(x, _Tensor) or S.sim_index(x) is not None or not _real_is_cpu(x):
        return
    common, operands, sizes_on_cpu = pending
    if sizes_on_cpu and x.dtype == torch.int64 and x.dim() == 1:
        return  # a packed sequence's lengths or batch sizes: on the CPU for CUDA data too
    sid = torch._C._storage_id(x)
    for t in operands:
        try:
            if torch._C._storage_id(t) == sid:
                return
        except (RuntimeError, TypeError):
            continue
    tag(x, common)


def _in_simulated_view(hook: Any, packs: bool) -> Any:
    def run(x: Any) -> Any:
        if S.MACHINE is None or not S.DEPTH.in_mode:
            return hook(x)
        if packs:
            _tag_new_output(x)
        with _simulated_view():
            return hook(x)

    return run


def push_saved_tensors_hooks(pack_hook: Any, unpack_hook: Any) -> None:
    """``saved_tensors_hooks`` (non-reentrant activation checkpointing, ``save_on_cpu``): the pack
    hook runs inside an op, the unpack hook in the engine; both see the simulated devices (an
    op's output it saves already on the op's device), so the metadata checkpointing records in
    the forward pass matches what it recomputes."""
    _real_push_hooks(_in_simulated_view(pack_hook, True), _in_simulated_view(unpack_hook, False))
    S.DEPTH.saved_hooks += 1


def pop_saved_tensors_hooks() -> None:
    _real_pop_hooks()
    S.DEPTH.saved_hooks = max(S.DEPTH.saved_hooks - 1, 0)


def install_engine(patcher: Any) -> None:
    from torch.autograd.variable import Variable

    engine = Variable.__dict__.get("_execution_engine")
    if engine is not None and not isinstance(engine, SimulatedEngine):
        patcher.set(Variable, "_execution_engine", SimulatedEngine(engine))
    hooks = torch._C._autograd
    if hooks.__dict__.get("_push_saved_tensors_default_hooks") is _real_push_hooks:
        patcher.set(hooks, "_push_saved_tensors_default_hooks", push_saved_tensors_hooks)
        patcher.set(hooks, "_pop_saved_tensors_default_hooks", pop_saved_tensors_hooks)


# ---------------------------------------------------------------------------------------------
# Tensor.grad
# ---------------------------------------------------------------------------------------------
def _device_type(key: Any) -> str:
    return "cuda" if isinstance(key, int) else key.type


def _index(key: Any) -> int:
    """``Tensor.get_device()`` of a tensor on ``key``: the CUDA ordinal, -1 on the CPU."""
    return key if isinstance(key, int) else -1


def _check_assigned_grad(var: torch.Tensor, grad: torch.Tensor) -> None:
    """THPVariable_set_grad's device checks (torch/csrc/autograd/python_variable.cpp), on the
    simulated devices (its dtype, layout and size checks run in torch itself)."""
    want, have = device_key(var), device_key(grad)
    if want == have:
        return
    if _device_type(want) != _device_type(have):
        raise RuntimeError(
            f"attempting to assign a gradient with device type '{_device_type(have)}' to a tensor with device "
            f"type '{_device_type(want)}'. Please ensure that the gradient and the tensor are on the same device"
        )
    raise RuntimeError(
        f"attempting to assign a gradient located on device with index '{_index(have)}' to a tensor located on "
        f"device with index '{_index(want)}'. Please ensure that the gradient and the tensor are on the same device"
    )


def h_grad_set(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    var, grad = args[0], args[1]
    if not isinstance(grad, _Tensor) or grad.dtype != var.dtype:
        return func(*args, **kwargs)  # torch's own checks (None, non-tensors, dtype) come first
    _check_assigned_grad(var, grad)
    return func(*args, **kwargs)


def h_grad_get(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``Tensor.grad``: a gradient that no backward pass recorded (a non-leaf's retained
    gradient) is on its tensor's device."""
    g = func(*args, **kwargs)
    if isinstance(g, _Tensor):
        idx = S.sim_index(args[0])
        if idx is not None and S.sim_index(g) is None and _real_is_cpu(g):
            tag(g, idx)
    return g
