"""The path of every op without a handler of its own, factories included.

An op runs on the CPU tensors behind its operands, and the new storages it returns are tagged
with the operands' simulated device (their common device, after CUDA's checks when the operands
sit on different devices). Ops given ``device=`` (factories, ``*_like``, ``new_*``) run on the
CPU and their results are tagged with that device; factories without it make their result on the
default device even when a number or size they were given is a tensor on a simulated GPU (and a
size given as such a tensor to ``expand``/``view``/``reshape``/... is not an operand); sized
factories raise CUDA's out-of-memory error before allocating. Random ops on a simulated GPU draw
from that GPU's generator.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.utils._device as _device_module

from . import _sim_state as S
from ._sim_op_checks import check_mixed
from ._sim_devices import Target, parse_device
from ._sim_generators import default_generator, generator_device
from ._sim_operands import tensor_operands, torch_functions
from ._sim_storages import RESIZING, mark_pinned, precheck_resize, recharge, sim_copy, tag, tag_all

_storage_id = torch._C._storage_id
_Tensor = torch.Tensor
_CPU = torch.device("cpu")
_real_is_cpu = torch._C.TensorBase.is_cpu.__get__

SIZED_FACTORIES = set(torch_functions("empty", "zeros", "ones", "rand", "randn"))
# factories whose tensor arguments can only be numbers or sizes (0-dim tensors read with .item()):
# without device= their result is on the default device, whatever device those tensors are on
NUMBER_FACTORIES = set(
    torch_functions(
        "arange", "range", "full", "linspace", "logspace", "zeros", "ones", "empty", "empty_strided", "eye",
        "rand", "randn", "randint", "randperm", "scalar_tensor", "tril_indices", "triu_indices",
    )
)
# factories that read a list's elements as numbers: torch.tensor([t0, t1]) without device= is made
# on the default device whatever device the 0-dim tensors in the list are on
LIST_FACTORIES = set(torch_functions("tensor", "as_tensor"))
# methods whose arguments after ``self`` can only be sizes or dims: a 0-dim tensor there is read with
# .item() (``x.expand(-1, w)`` with ``w`` on a GPU), so only ``self`` counts for the device checks
SIZE_METHODS = set(
    torch_functions(
        "expand", "view", "reshape", "repeat", "tile", "broadcast_to", "unflatten", "permute",
        "new_empty", "new_zeros", "new_ones", "resize_as_",
    )
)
RANDOM_FACTORIES = set(torch_functions("randn", "rand", "randint", "randperm", "normal"))
# random ops on existing tensors that take a generator: they draw from the simulated device's generator
RANDOM_ON_TENSORS = set(
    torch_functions(
        "multinomial", "normal", "normal_", "uniform_", "bernoulli", "bernoulli_", "exponential_", "random_",
        "geometric_", "log_normal_", "cauchy_", "poisson", "binomial", "_standard_gamma", "_sample_dirichlet",
    )
)


def _take_a_generator(names: Sequence[str]) -> List[Any]:
    """The ``*_like`` factories that take ``generator=`` in the torch that runs (2.15 does, 2.9 does not)."""
    found = []
    for f in torch_functions(*names):
        try:
            f(torch.empty(1), *((2,) if f.__name__ == "randint_like" else ()), generator=torch.Generator())
        except TypeError:
            continue
        found.append(f)
    return found


RANDOM_ON_TENSORS.update(_take_a_generator(("rand_like", "randn_like", "randint_like")))


def _init_functions(names: Sequence[str]) -> List[Any]:
    """The ``torch.nn.init`` functions that hand themselves to ``__torch_function__`` whole (so the
    draw inside them is not seen) and take ``generator=``: ``nn.Linear``'s init among them."""
    import inspect

    found = []
    for name in names:
        f = getattr(torch.nn.init, name, None)
        try:
            if f is not None and "generator" in inspect.signature(f).parameters:
                found.append(f)
        except (TypeError, ValueError):
            continue
    return found


RANDOM_ON_TENSORS.update(_init_functions(("uniform_", "normal_", "kaiming_uniform_")))


def _strip_pin(kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
    if kwargs.get("pin_memory"):
        kwargs = dict(kwargs)
        kwargs["pin_memory"] = False
        return kwargs, True
    return kwargs, False


def _check_generator(kwargs: Dict[str, Any], target: Target) -> None:
    g = kwargs.get("generator")
    if g is None:
        return
    gdev = generator_device(g)
    want = "cuda" if isinstance(target, int) else target.type
    if gdev != want:
        raise RuntimeError(f"Expected a '{want}' device type for generator but found '{gdev}'")


@functools.lru_cache(maxsize=None)
def dtype_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _factory_nbytes(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> int:
    """Bytes a sized factory (empty/zeros/ones/rand/randn) will allocate, 0 when unknown."""
    if func not in SIZED_FACTORIES:
        return 0
    size = kwargs.get("size")
    if size is None:
        if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
            size = args[0]
        else:
            size = args
    numel = 1
    for d in size:
        if not isinstance(d, int):
            return 0
        numel *= d
    return numel * dtype_itemsize(kwargs.get("dtype") or torch.get_default_dtype())


def run_with_device(func: Any, args: Sequence[Any], kwargs: Dict[str, Any], dev: Any) -> Any:
    """Ops called with ``device=``: factories, ``*_like``, ``new_*``, ``as_tensor``..."""
    target = parse_device(dev)
    kwargs, pinned = _strip_pin(kwargs)
    if "generator" in kwargs and kwargs["generator"] is not None:
        _check_generator(kwargs, target)
    ts = tensor_operands(args, kwargs)
    if isinstance(target, int):
        kwargs = dict(kwargs)
        kwargs["device"] = _CPU
        nbytes = _factory_nbytes(func, args, kwargs)
        if nbytes:
            S.MACHINE._precheck(target, nbytes)
        if func in RANDOM_FACTORIES and kwargs.get("generator") is None:
            kwargs["generator"] = default_generator(target)
        out = func(*args, **kwargs)
        return _retarget(out, ts, target)
    if dev is not target:
        kwargs = dict(kwargs)
        kwargs["device"] = target
    out = func(*args, **kwargs)
    if ts and isinstance(out, _Tensor) and S.sim_index(out) is not None:
        out = sim_copy(out)  # e.g. torch.as_tensor(t_on_cuda, device="cpu") must copy
    if pinned:
        mark_pinned(out)
    return out


def _retarget(out: Any, inputs: List[torch.Tensor], target: int) -> Any:
    """Tag outputs on ``target``; an output aliasing an input on another device becomes a copy."""
    if isinstance(out, _Tensor):
        if inputs:
            sid = _storage_id(out)
            for t in inputs:
                if _storage_id(t) == sid:
                    if S.DEVICE_OF.get(sid) == target:
                        return out
                    out = sim_copy(out)
                    break
        tag(out, target)
    elif isinstance(out, (list, tuple)):
        tag_all(out, target)
    return out


def engine_made(ts: List[torch.Tensor], keys: List[Any]) -> Tuple[Any, Any, bool]:
    """During a backward pass: CPU tensors that no op tagged (gradients the C++ engine made) join
    the one simulated device of the other operands. Returns (common, untagged sids, still mixed)."""
    tagged = {k for k in keys if k is not None}
    if len(tagged) != 1:
        return None, None, True
    skip = set()
    for t, k in zip(ts, keys):
        if k is None:
            if not _real_is_cpu(t):
                return None, None, True
            skip.add(_storage_id(t))
    return tagged.pop(), skip, False


def run_announcing(
    func: Any, args: Sequence[Any], kwargs: Dict[str, Any], common: int, ts: List[Any],
    sizes_on_cpu: bool = False,
) -> Any:
    """``func(*args, **kwargs)`` with saved-tensor hooks on: a tensor the op saves that is none of
    its operands ``ts`` is one of its outputs, and the hooks see it on ``common`` (with
    ``sizes_on_cpu``, a packed sequence's op: a new 1-D int64 tensor is its sizes, on the CPU)."""
    depth = S.DEPTH
    before = depth.op_outputs
    depth.op_outputs = (common, ts, sizes_on_cpu)
    try:
        return func(*args, **kwargs)
    finally:
        depth.op_outputs = before


def _data_is_a_list(args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
    """``torch.tensor`` / ``as_tensor`` given a list or tuple (read as numbers), not a tensor."""
    return isinstance(args[0] if args else kwargs.get("data"), (list, tuple))


def generic(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """Run ``func`` on the CPU tensors and tag its results (see the module docstring)."""
    default = _device_module.CURRENT_DEVICE
    if default is not None and kwargs.get("device") is None and func in _device_module._device_constructors():
        # torch.set_default_device / `with torch.device(...)`: its mode may sit below this one
        kwargs = dict(kwargs)
        kwargs["device"] = default
    if kwargs:
        dev = kwargs.get("device", None)
        if dev is not None:
            return run_with_device(func, args, kwargs, dev)
        ts = tensor_operands(args, kwargs)
    else:  # tensor_operands without kwargs, inlined: every op of a model passes here
        ts = []
        for a in args:
            if isinstance(a, _Tensor):
                ts.append(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, _Tensor):
                        ts.append(b)
    if ts and (func in NUMBER_FACTORIES or (func in LIST_FACTORIES and _data_is_a_list(args, kwargs))):
        ts = []  # torch.arange(0, 1, 1 / n) with n on a GPU is made on the CPU, as CUDA torch makes it
    if not ts:
        if kwargs.get("generator") is not None:
            _check_generator(kwargs, _CPU)
        if kwargs.get("pin_memory"):
            return run_with_device(func, args, kwargs, _CPU)
        if kwargs.get("out") is not None:  # torch.zeros(n, out=t): t grows where it is
            result = func(*args, **kwargs)
            recharge(kwargs["out"])
            return result
        return func(*args, **kwargs)

    device_of = S.DEVICE_OF
    keys: List[Any] = []
    for t in ts:
        try:
            keys.append(device_of.get(_storage_id(t)))
        except (RuntimeError, TypeError):
            keys.append(None)
    common = keys[0]
    mixed = False
    for k in keys:
        if k != common:
            mixed = True
            break
    skip = None
    if mixed and func in SIZE_METHODS and args and args[0] is ts[0]:
        ts, keys, mixed = ts[:1], keys[:1], False
    if mixed and S.DEPTH.backward:
        common, skip, mixed = engine_made(ts, keys)
    if mixed:
        common, skip = check_mixed(func, args, kwargs, ts, keys)
    if common is None:  # nothing on a simulated GPU (or a real non-CPU device leads): run as is
        if func in RANDOM_ON_TENSORS and kwargs.get("generator") is not None and _real_is_cpu(ts[0]):
            _check_generator(kwargs, _CPU)  # a simulated GPU's generator for a CPU tensor
        return func(*args, **kwargs)

    if func in RANDOM_ON_TENSORS:
        if kwargs.get("generator") is None:
            kwargs = dict(kwargs)
            kwargs["generator"] = default_generator(common)
        else:
            _check_generator(kwargs, common)
    resizing = func in RESIZING
    if resizing:
        precheck_resize(func, args, kwargs)
    if S.DEPTH.saved_hooks:  # saved-tensor hooks see the op's new outputs on its device
        out = run_announcing(func, args, kwargs, common, ts)
    else:
        out = func(*args, **kwargs)
    if resizing or (kwargs and kwargs.get("out") is not None):  # a storage grown in place
        recharge(args[0] if resizing else kwargs["out"])
    if isinstance(out, _Tensor):
        try:
            sid = _storage_id(out)
        except (RuntimeError, TypeError):
            return out
        if sid not in device_of and not (skip and sid in skip) and _real_is_cpu(out):
            S.MACHINE._charge(out.untyped_storage(), sid, common)
            device_of[sid] = common
        return out
    if isinstance(out, (tuple, list)):
        tag_all(out, common, skip)
    return out
