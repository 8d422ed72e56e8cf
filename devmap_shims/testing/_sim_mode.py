"""The TorchFunctionMode that runs every op of a simulation on the real CPU tensors.

For each torch function call it: finds the simulated device of every tensor operand, raises
CUDA's own device-mismatch error where CUDA would, rewrites ``device=`` arguments that name a
simulated GPU to the CPU, runs the op, and records the simulated device of the new storages the
op produced (charging their bytes to that GPU). Moves (``to``/``cuda``/``cpu``/``type_as``)
copy when the simulated device changes and return the tensor itself when it does not, as CUDA
does.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
import torch.utils._device as _device_module
from torch.overrides import TorchFunctionMode

from . import _sim_state as S

_storage_id = torch._C._storage_id
_TensorBase = torch._C.TensorBase
_Tensor = torch.Tensor
_CPU = torch.device("cpu")
_real_device_get = _TensorBase.device.__get__
_real_is_cpu = _TensorBase.is_cpu.__get__
_MISSING = object()

Target = Union[int, torch.device]  # int: simulated cuda index; torch.device: a real device


class SimulatedAutogradError(RuntimeError):
    """Raised when autograd is attempted on simulated GPUs (the simulator is inference-only)."""


# ---------------------------------------------------------------------------------------------
# device parsing
# ---------------------------------------------------------------------------------------------
_parse_cache: Dict[Any, Target] = {}


def invalid_ordinal(idx: int) -> RuntimeError:
    n = S.MACHINE.device_count if S.MACHINE is not None else 0
    return RuntimeError(
        "CUDA error: invalid device ordinal\n"
        f"(the simulated machine has {n} GPU{'s' if n != 1 else ''}; cuda:{idx} does not exist)"
    )


_CURRENT: Any = object()  # cache entry for a bare "cuda": follows torch.cuda.set_device()


def parse_device(dev: Any) -> Target:
    """An int for a simulated CUDA device, or the real torch.device for anything else."""
    try:
        hit = _parse_cache.get(dev)
    except TypeError:  # unhashable: let torch.device complain
        return torch.device(dev)
    if hit is None:
        hit = _parse_cache[dev] = _parse_uncached(dev)
    if hit is _CURRENT:
        return S.MACHINE.current_device
    if isinstance(hit, int) and not hit < S.MACHINE.device_count:
        raise invalid_ordinal(hit)
    return hit


def _parse_uncached(dev: Any) -> Target:
    if isinstance(dev, bool):
        raise TypeError(f"expected a device, got {dev!r}")
    if isinstance(dev, int):
        if dev < 0:
            raise RuntimeError("Device index must not be negative")
        return dev
    d = dev if isinstance(dev, torch.device) else torch.device(dev)
    if d.type != "cuda":
        return d
    return _CURRENT if d.index is None else d.index


def device_key(t: torch.Tensor) -> Union[int, torch.device]:
    """Simulated index of ``t``, or its real device."""
    try:
        idx = S.DEVICE_OF.get(_storage_id(t))
    except (RuntimeError, TypeError):
        idx = None
    if idx is not None:
        return idx
    return _real_device_get(t)


def fmt_device(key: Union[int, torch.device]) -> str:
    return f"cuda:{key}" if isinstance(key, int) else str(key)


# ---------------------------------------------------------------------------------------------
# tagging outputs
# ---------------------------------------------------------------------------------------------
def tag(t: torch.Tensor, idx: int, skip: Optional[set] = None) -> None:
    """Record that the storage of ``t`` (if new) lives on simulated ``cuda:idx``."""
    try:
        sid = _storage_id(t)
    except (RuntimeError, TypeError):
        return
    if sid in S.DEVICE_OF or (skip and sid in skip):
        return
    if not _real_is_cpu(t):  # meta tensors and friends stay what they are
        return
    S.MACHINE._charge(t.untyped_storage(), sid, idx)
    S.DEVICE_OF[sid] = idx


def tag_storage(storage: Any, idx: int) -> None:
    """Record that ``storage`` (an untyped CPU storage) lives on simulated ``cuda:idx``."""
    sid = storage._cdata
    if sid not in S.DEVICE_OF:
        S.MACHINE._charge(storage, sid, idx)
        S.DEVICE_OF[sid] = idx


def tag_all(out: Any, idx: int, skip: Optional[set] = None) -> None:
    if isinstance(out, _Tensor):
        tag(out, idx, skip)
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, _Tensor):
                tag(o, idx, skip)
            elif isinstance(o, (tuple, list)):
                tag_all(o, idx, skip)


def sim_copy(t: torch.Tensor, memory_format: Any = torch.preserve_format) -> torch.Tensor:
    """A fresh CPU copy of ``t`` (used where CUDA would copy across devices)."""
    return t.clone(memory_format=memory_format)


# ---------------------------------------------------------------------------------------------
# operand scan and CUDA's device checks
# ---------------------------------------------------------------------------------------------
def _collect(args: Sequence[Any], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    ts: List[torch.Tensor] = []
    out = kwargs.get("out")
    if out is not None:  # TensorIterator puts outputs first
        if isinstance(out, _Tensor):
            ts.append(out)
        elif isinstance(out, (tuple, list)):
            ts.extend(o for o in out if isinstance(o, _Tensor))
    for a in args:
        if isinstance(a, _Tensor):
            ts.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, _Tensor):
                    ts.append(b)
    for k, v in kwargs.items():
        if k == "out":
            continue
        if isinstance(v, _Tensor):
            ts.append(v)
        elif isinstance(v, (list, tuple)):
            for b in v:
                if isinstance(b, _Tensor):
                    ts.append(b)
    return ts


def ti_mismatch(common: Any, other: Any) -> RuntimeError:
    """TensorIterator's message (aten/src/ATen/TensorIterator.cpp compute_types)."""
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{fmt_device(common)} and {fmt_device(other)}!"
    )


def adaption_mismatch(common: Any, other: Any, arg: str, method: str) -> RuntimeError:
    """The generated kernel wrappers' message (aten/src/ATen/core/adaption.cpp); reworded in torch 2.8."""
    if S.TORCH_VERSION >= (2, 8):
        return RuntimeError(
            f"Expected all tensors to be on the same device, but got {arg} is on {fmt_device(other)}, "
            f"different from other tensors on {fmt_device(common)} (when checking argument in method {method})"
        )
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{fmt_device(common)} and {fmt_device(other)}! "
        f"(when checking argument for argument {arg} in method {method})"
    )


def check_ti(ts: List[torch.Tensor], keys: List[Any], first_is_output: bool) -> Any:
    """Returns the common device; raises where TensorIterator would."""
    common: Any = _CPU
    for k in keys:
        if not (isinstance(k, torch.device) and k.type == "cpu"):
            common = k
            break
    for i, (t, k) in enumerate(zip(ts, keys)):
        if k == common:
            continue
        is_output = first_is_output and i == 0
        if isinstance(k, torch.device) and k.type == "cpu" and not is_output and t.dim() == 0:
            continue  # CPU scalars are allowed on CUDA kernels
        raise ti_mismatch(common, k)
    return common


def check_exact(named: Iterable[Tuple[str, Any]], method: str) -> Any:
    """check_and_update_common_device over (argument name, tensor) pairs in schema order."""
    common: Any = None
    for arg, t in named:
        if not isinstance(t, _Tensor):
            continue
        k = device_key(t)
        if common is None:
            common = k
        elif k != common:
            raise adaption_mismatch(common, k, arg, method)
    return common


def _arg(args: Sequence[Any], kwargs: Dict[str, Any], pos: int, *names: str) -> Any:
    if len(args) > pos:
        return args[pos]
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return None


def _exact_index_select(args, kwargs):
    return [("self", _arg(args, kwargs, 0, "input", "self")), ("index", _arg(args, kwargs, 2, "index"))], (
        "wrapper_CUDA__index_select"
    )


def _exact_torch_embedding(args, kwargs):  # torch.embedding(weight, indices, ...)
    return [("self", _arg(args, kwargs, 0, "weight")), ("index", _arg(args, kwargs, 1, "indices"))], (
        "wrapper_CUDA__index_select"
    )


def _exact_f_embedding(args, kwargs):  # F.embedding(input, weight, ...)
    return [("self", _arg(args, kwargs, 1, "weight")), ("index", _arg(args, kwargs, 0, "input"))], (
        "wrapper_CUDA__index_select"
    )


def _exact_mm(args, kwargs):
    return [("self", _arg(args, kwargs, 0, "input", "self")), ("mat2", _arg(args, kwargs, 1, "mat2"))], (
        "wrapper_CUDA_mm"
    )


def _exact_bmm(args, kwargs):
    return [("self", _arg(args, kwargs, 0, "input", "self")), ("mat2", _arg(args, kwargs, 1, "mat2"))], (
        "wrapper_CUDA_bmm"
    )


def _exact_addmm(args, kwargs):
    return [
        ("self", _arg(args, kwargs, 0, "input", "self")),
        ("mat1", _arg(args, kwargs, 1, "mat1")),
        ("mat2", _arg(args, kwargs, 2, "mat2")),
    ], "wrapper_CUDA_addmm"


def _exact_baddbmm(args, kwargs):
    return [
        ("self", _arg(args, kwargs, 0, "input", "self")),
        ("batch1", _arg(args, kwargs, 1, "batch1")),
        ("batch2", _arg(args, kwargs, 2, "batch2")),
    ], "wrapper_CUDA_baddbmm"


def _exact_cat(args, kwargs):
    tensors = _arg(args, kwargs, 0, "tensors")
    return [("tensors", t) for t in (tensors or ())], "wrapper_CUDA_cat"


def _exact_equal(args, kwargs):
    return [("self", _arg(args, kwargs, 0, "input", "self")), ("other", _arg(args, kwargs, 1, "other"))], (
        "wrapper_CUDA__equal"
    )


def _matmul_named(a: Any, b: Any):
    if not (isinstance(a, _Tensor) and isinstance(b, _Tensor)):
        return None
    da, db = a.dim(), b.dim()
    if db == 2 and da >= 2:  # mm, folding the batch dimensions of a
        return [("self", a), ("mat2", b)], "wrapper_CUDA_mm"
    if da >= 3 and db >= 3:
        return [("self", a), ("mat2", b)], "wrapper_CUDA_bmm"
    return None


def _exact_matmul(args, kwargs):
    return _matmul_named(_arg(args, kwargs, 0, "input", "self"), _arg(args, kwargs, 1, "other"))


def _exact_rmatmul(args, kwargs):
    return _matmul_named(_arg(args, kwargs, 1, "other"), _arg(args, kwargs, 0, "self"))


def _exact_linear(args, kwargs):
    x = _arg(args, kwargs, 0, "input")
    w = _arg(args, kwargs, 1, "weight")
    b = _arg(args, kwargs, 2, "bias")
    if not (isinstance(x, _Tensor) and isinstance(w, _Tensor)):
        return None
    if isinstance(b, _Tensor):
        if x.dim() == 2 or (x.dim() == 3 and x.is_contiguous()):
            return [("self", b), ("mat1", x), ("mat2", w)], "wrapper_CUDA_addmm"
        named = _matmul_named(x, w)
        if named is not None:  # matmul first, then TensorIterator's output.add_(bias)
            common = check_exact(*named)
            keys = [common, device_key(b)]
            check_ti([x, b], keys, first_is_output=True)
        return None
    return _matmul_named(x, w)


def _names(*names: str) -> List[Any]:
    found = []
    for owner in (torch, _TensorBase, _Tensor, F, torch._C._nn, torch._C._VariableFunctions):
        for n in names:
            f = getattr(owner, n, None)
            if f is not None and f not in found:
                found.append(f)
    return found


SIZED_FACTORIES = set(_names("empty", "zeros", "ones", "rand", "randn"))
RANDOM_FACTORIES = set(_names("randn", "rand", "randint", "randperm", "normal"))
# random ops on existing tensors that take a generator: they draw from the simulated device's generator
RANDOM_ON_TENSORS = set(
    _names(
        "multinomial", "normal_", "uniform_", "bernoulli", "bernoulli_", "exponential_", "random_",
        "geometric_", "log_normal_", "cauchy_",
    )
)

_EXACT: Dict[Any, Callable] = {}
for _fs, _fn in (
    (_names("index_select"), _exact_index_select),
    (_names("mm"), _exact_mm),
    (_names("bmm"), _exact_bmm),
    (_names("addmm"), _exact_addmm),
    (_names("baddbmm"), _exact_baddbmm),
    (_names("cat", "concat", "concatenate", "stack", "hstack", "vstack"), _exact_cat),
    (_names("equal"), _exact_equal),
    (_names("matmul", "__matmul__"), _exact_matmul),
    (_names("__rmatmul__"), _exact_rmatmul),
    ([torch.embedding], _exact_torch_embedding),
    ([F.embedding], _exact_f_embedding),
    ([F.linear, torch._C._nn.linear], _exact_linear),
):
    for _f in _fs:
        _EXACT[_f] = _fn


# ---------------------------------------------------------------------------------------------
# the generic path
# ---------------------------------------------------------------------------------------------
_NO_GRAD_CHECK: set = set()


def _autograd_error(func: Any, idx: int) -> SimulatedAutogradError:
    name = getattr(func, "__name__", repr(func))
    return SimulatedAutogradError(
        f"devmap_shims.testing simulates GPUs for inference only: {name}() on cuda:{idx} would record "
        "autograd history (an input requires grad). Run the code under torch.no_grad() or "
        "torch.inference_mode(), or call .requires_grad_(False) on the parameters."
    )


def _records_history(t: Any) -> bool:
    # leaves (parameters initialised in place, detached copies) are fine; results with a grad_fn are not
    return isinstance(t, _Tensor) and t.requires_grad and t.grad_fn is not None


def _check_grad(func: Any, out: Any, idx: int) -> None:
    if isinstance(out, (tuple, list)):
        if any(_records_history(o) for o in out):
            raise _autograd_error(func, idx)
    elif _records_history(out):
        raise _autograd_error(func, idx)


def _strip_pin(kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
    if kwargs.get("pin_memory"):
        kwargs = dict(kwargs)
        kwargs["pin_memory"] = False
        return kwargs, True
    return kwargs, False


def _check_generator(kwargs: Dict[str, Any], target: Target) -> None:
    from ._sim_cuda import generator_device

    g = kwargs.get("generator")
    if g is None:
        return
    gdev = generator_device(g)
    want = "cuda" if isinstance(target, int) else target.type
    if gdev != want:
        raise RuntimeError(f"Expected a '{want}' device type for generator but found '{gdev}'")


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: torch.dtype) -> int:
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
    return numel * _itemsize(kwargs.get("dtype") or torch.get_default_dtype())


def run_with_device(func: Any, args: Sequence[Any], kwargs: Dict[str, Any], dev: Any) -> Any:
    """Ops called with ``device=``: factories, ``*_like``, ``new_*``, ``as_tensor``..."""
    target = parse_device(dev)
    kwargs, pinned = _strip_pin(kwargs)
    if "generator" in kwargs and kwargs["generator"] is not None:
        _check_generator(kwargs, target)
    ts = _collect(args, kwargs)
    if isinstance(target, int):
        kwargs = dict(kwargs)
        kwargs["device"] = _CPU
        nbytes = _factory_nbytes(func, args, kwargs)
        if nbytes:
            S.MACHINE._precheck(target, nbytes)
        if func in RANDOM_FACTORIES and kwargs.get("generator") is None:
            from ._sim_cuda import default_generator

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
        from ._sim_cuda import mark_pinned

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


def generic(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    default = _device_module.CURRENT_DEVICE
    if default is not None and kwargs.get("device") is None and func in _device_module._device_constructors():
        # torch.set_default_device / `with torch.device(...)`: its mode may sit below this one
        kwargs = dict(kwargs)
        kwargs["device"] = default
    if kwargs:
        dev = kwargs.get("device", None)
        if dev is not None:
            return run_with_device(func, args, kwargs, dev)
        ts = _collect(args, kwargs)
    else:
        ts = []
        for a in args:
            if isinstance(a, _Tensor):
                ts.append(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, _Tensor):
                        ts.append(b)
    if not ts:
        if kwargs.get("generator") is not None:
            _check_generator(kwargs, _CPU)
        if kwargs.get("pin_memory"):
            return run_with_device(func, args, kwargs, _CPU)
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
    if mixed:
        common, skip = _check_mixed(func, args, kwargs, ts, keys)
    if common is None:  # nothing on a simulated GPU (or a real non-CPU device leads): run as is
        return func(*args, **kwargs)

    if func in RANDOM_ON_TENSORS and kwargs.get("generator") is None:
        from ._sim_cuda import default_generator

        kwargs = dict(kwargs)
        kwargs["generator"] = default_generator(common)
    out = func(*args, **kwargs)
    if isinstance(out, _Tensor):
        if out.requires_grad and out.grad_fn is not None and torch.is_grad_enabled() and func not in _NO_GRAD_CHECK:
            raise _autograd_error(func, common)
        try:
            sid = _storage_id(out)
        except (RuntimeError, TypeError):
            return out
        if sid not in device_of and not (skip and sid in skip) and _real_is_cpu(out):
            S.MACHINE._charge(out.untyped_storage(), sid, common)
            device_of[sid] = common
        return out
    if isinstance(out, (tuple, list)):
        if torch.is_grad_enabled() and func not in _NO_GRAD_CHECK:
            _check_grad(func, out, common)
        tag_all(out, common, skip)
    return out


def _check_mixed(
    func: Any, args: Sequence[Any], kwargs: Dict[str, Any], ts: List[torch.Tensor], keys: List[Any]
) -> Tuple[Any, Optional[set]]:
    """Operands on different devices: CUDA's checks; returns (common simulated index or None, untagged sids)."""
    real_keys = [k if k is not None else _real_device_get(t) for t, k in zip(ts, keys)]
    if all(k is None for k in keys):
        return None, None
    exact = _EXACT.get(func)
    spec = exact(args, kwargs) if exact is not None else None
    if spec is not None:
        common = check_exact(*spec)
    else:
        name = getattr(func, "__name__", "")
        first_is_output = name.endswith("_") and not name.endswith("__")
        common = check_ti(ts, real_keys, first_is_output)
    skip = {_storage_id(t) for t, k in zip(ts, keys) if k is None} or None
    return (common if isinstance(common, int) else None), skip


# ---------------------------------------------------------------------------------------------
# special handlers
# ---------------------------------------------------------------------------------------------
def _is_device_like(x: Any) -> bool:
    return isinstance(x, (str, torch.device)) or (isinstance(x, int) and not isinstance(x, bool))


def _h_to(func, args, kwargs):
    """Tensor.to: same simulated device returns self, another device returns a copy."""
    self = args[0]
    rest = list(args[1:])
    kw = dict(kwargs)
    src = S.sim_index(self)
    target: Any = None
    if rest and isinstance(rest[0], _Tensor):  # to(other, non_blocking=False, copy=False)
        other = rest.pop(0)
        target = device_key(other)
        rest.insert(0, other.dtype)
    elif "device" in kw:
        dev = kw.pop("device")
        target = None if dev is None else parse_device(dev)
    elif rest and _is_device_like(rest[0]):
        target = parse_device(rest.pop(0))
    if target is None:  # dtype / memory_format only
        out = func(self, *rest, **kw)
        if src is not None and out is not self:
            tag(out, src)
        return out
    mf = kw.get("memory_format", torch.preserve_format)
    if isinstance(target, int) and target != src:
        dtype = kw.get("dtype") or next((r for r in rest if isinstance(r, torch.dtype)), self.dtype)
        S.MACHINE._precheck(target, self.numel() * _itemsize(dtype))
    out = func(self, _CPU if isinstance(target, int) else target, *rest, **kw)
    if isinstance(target, int):
        if out is self or _same_storage(out, self):
            if src == target:
                return out
            out = sim_copy(out, mf)
        tag(out, target)
        return out
    if src is not None and (out is self or _same_storage(out, self)):
        out = sim_copy(out, mf)
    return out


def _h_self_device(func, args, kwargs):
    """Ops whose result lives on self's device whatever the other operands (new_*, copy_)."""
    out = func(*args, **kwargs)
    idx = S.sim_index(args[0]) if args and isinstance(args[0], _Tensor) else None
    if idx is not None:
        tag_all(out, idx)
    return out


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return _storage_id(a) == _storage_id(b)
    except (RuntimeError, TypeError):
        return False


def _h_cuda(func, args, kwargs):
    self = args[0]
    dev = _arg(args, kwargs, 1, "device")
    if dev is None:
        target = S.MACHINE.current_device
    else:
        target = parse_device(dev)
        if not isinstance(target, int):
            raise RuntimeError("Invalid device, must be cuda device")
    src = S.sim_index(self)
    if src == target:
        return self
    S.MACHINE._precheck(target, self.numel() * self.element_size())
    out = sim_copy(self, kwargs.get("memory_format", torch.preserve_format))
    tag(out, target)
    return out


def _h_cpu(func, args, kwargs):
    self = args[0]
    if S.sim_index(self) is None:
        return func(*args, **kwargs)
    return sim_copy(self, kwargs.get("memory_format", torch.preserve_format))


def _h_type_as(func, args, kwargs):
    self, other = args[0], _arg(args, kwargs, 1, "other")
    return _h_to(_Tensor.to, (self, other), {})


def _h_type(func, args, kwargs):
    self = args[0]
    dtype = _arg(args, kwargs, 1, "dtype")
    src = S.sim_index(self)
    if dtype is None:
        name = func(self)
        return name.replace("torch.", "torch.cuda.", 1) if src is not None else name
    if isinstance(dtype, str) and ".cuda." in dtype:
        out = func(self, dtype.replace(".cuda.", ".", 1), *args[2:], **{k: v for k, v in kwargs.items() if k != "dtype"})
        target = src if src is not None else S.MACHINE.current_device
        if out is self or _same_storage(out, self):
            if src == target:
                return out
            out = sim_copy(out)
        tag(out, target)
        return out
    out = func(*args, **kwargs)
    if src is not None:
        if isinstance(dtype, str) and ".cuda." not in dtype and dtype.startswith("torch."):
            return sim_copy(out) if _same_storage(out, self) else out
        tag(out, src)
    return out


def _h_numpy(func, args, kwargs):
    idx = S.sim_index(args[0])
    if idx is not None:
        raise TypeError(
            f"can't convert cuda:{idx} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
            "host memory first."
        )
    return func(*args, **kwargs)


def _h_repr(func, args, kwargs):
    if S.sim_index(args[0]) is None:
        return func(*args, **kwargs)
    depth = S.DEPTH.n
    S.DEPTH.n = 0  # print the simulated device, as CUDA tensors do
    try:
        return func(*args, **kwargs)
    finally:
        S.DEPTH.n = depth


def _h_pin_memory(func, args, kwargs):
    from ._sim_cuda import mark_pinned

    self = args[0]
    idx = S.sim_index(self)
    if idx is not None:
        raise RuntimeError(f"cannot pin 'torch.cuda.{_type_name(self)}' only dense CPU tensors can be pinned")
    from ._sim_cuda import is_pinned

    if is_pinned(self):
        return self
    out = self.clone()
    mark_pinned(out)
    return out


def _type_name(t: torch.Tensor) -> str:
    return t.type().split(".")[-1]


def _h_is_pinned(func, args, kwargs):
    from ._sim_cuda import is_pinned

    if S.sim_index(args[0]) is not None:
        return False
    return is_pinned(args[0])


def _h_record_stream(func, args, kwargs):
    return None


def _h_index(func, args, kwargs):
    """Indexing: CPU index tensors are fine on CUDA; CUDA indices must be on the tensor's device."""
    self = args[0]
    index = args[1] if len(args) > 1 else None
    own = device_key(self)
    idxs = index if isinstance(index, (tuple, list)) else (index,)
    for i in idxs:
        if isinstance(i, _Tensor):
            k = device_key(i)
            if k != own and not (isinstance(k, torch.device) and k.type == "cpu"):
                raise RuntimeError(
                    f"indices should be either on cpu or on the same device as the indexed tensor ({fmt_device(own)})"
                )
    out = func(*args, **kwargs)
    if isinstance(own, int):
        if func is _TensorBase.__getitem__ and torch.is_grad_enabled():
            _check_grad(func, out, own)
        tag_all(out, own)
    return out


def _h_backward(func, args, kwargs):
    for t in _collect(args, kwargs):
        idx = S.sim_index(t)
        if idx is not None:
            raise SimulatedAutogradError(
                f"devmap_shims.testing simulates GPUs for inference only: backward() through a tensor on "
                f"cuda:{idx} is not supported. Use torch.no_grad() / torch.inference_mode()."
            )
    return func(*args, **kwargs)


def _h_parse_to(func, args, kwargs):
    """``torch._C._nn._parse_to`` (nn.Module.to, Params4bit.to): ints mean CUDA ordinals."""
    args = list(args)
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        parse_device(args[0])
        args[0] = torch.device("cuda", args[0])
    if isinstance(kwargs.get("device"), int):
        kwargs = dict(kwargs)
        parse_device(kwargs["device"])
        kwargs["device"] = torch.device("cuda", kwargs["device"])
    if args and isinstance(args[0], _Tensor):
        other = args[0]
        idx = S.sim_index(other)
        if idx is not None:
            device, dtype, non_blocking, fmt = func(*args, **kwargs)
            return S.CUDA_DEVICES[idx], dtype, non_blocking, fmt
    return func(*args, **kwargs)


def _h_deepcopy(func, args, kwargs):
    self = args[0]
    idx = S.sim_index(self)
    out = func(*args, **kwargs)
    if idx is not None:
        tag(out, idx)
    return out


def _handlers() -> Dict[Any, Callable]:
    h: Dict[Any, Callable] = {}

    def put(fn: Callable, *fs: Any) -> None:
        for f in fs:
            if f is not None:
                h[f] = fn

    put(_h_to, _TensorBase.to)
    put(_h_cuda, _TensorBase.cuda)
    put(_h_cpu, _TensorBase.cpu)
    put(_h_type_as, _TensorBase.type_as)
    put(_h_type, _TensorBase.type)
    put(
        _h_self_device,
        *[_TensorBase.__dict__.get(n) for n in (
            "copy_", "new_tensor", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
            "expand_as", "view_as", "reshape_as", "index_put_", "index_put", "set_",
        )],
    )
    put(_h_numpy, _TensorBase.numpy, getattr(_Tensor, "__array__", None))
    put(_h_repr, _Tensor.__repr__, _Tensor.__str__ if "__str__" in _Tensor.__dict__ else None, _Tensor.__format__)
    put(_h_pin_memory, _TensorBase.pin_memory)
    put(_h_is_pinned, _TensorBase.is_pinned)
    put(_h_record_stream, _TensorBase.record_stream)
    put(_h_index, _TensorBase.__getitem__, _TensorBase.__setitem__)
    put(_h_backward, _Tensor.backward, torch.autograd.backward, torch.autograd.grad)
    put(_h_parse_to, torch._C._nn._parse_to)
    put(_h_deepcopy, _Tensor.__deepcopy__)
    return h


HANDLERS = _handlers()

_PASSTHROUGH_GETTERS = (
    "shape", "dtype", "ndim", "requires_grad", "is_leaf", "grad_fn", "layout", "is_sparse",
    "is_quantized", "is_meta", "is_mkldnn", "is_nested", "names", "_version", "output_nr",
    "device", "is_cuda", "is_cpu", "itemsize", "nbytes", "data", "_base", "grad",
)
_PASSTHROUGH_METHODS = (
    "size", "dim", "numel", "nelement", "stride", "is_contiguous", "element_size", "data_ptr",
    "storage_offset", "__len__", "is_floating_point", "is_complex", "is_signed", "requires_grad_",
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "untyped_storage",
    "get_device", "detach", "detach_", "is_inference", "has_names", "_is_view", "is_set_to",
    "__hash__", "dim_order", "_typed_storage", "storage", "__reduce_ex__", "__setstate__",
)


_PASSTHROUGH_FUNCTIONS = (
    "_has_compatible_shallow_copy_type", "is_same_size", "is_tensor", "is_storage", "result_type",
    "can_cast", "promote_types", "broadcast_shapes", "is_floating_point", "is_complex", "numel",
    "is_nonzero", "is_inference",
)


def _passthrough() -> set:
    p = set()
    for name in _PASSTHROUGH_GETTERS:
        d = _TensorBase.__dict__.get(name) or _Tensor.__dict__.get(name)
        if d is not None and hasattr(d, "__get__"):
            p.add(d.__get__)
            if hasattr(d, "__set__"):
                p.add(d.__set__)
    for name in _PASSTHROUGH_METHODS:
        for owner in (_TensorBase, _Tensor):
            f = owner.__dict__.get(name)
            if f is not None:
                p.add(f)
    p.update(_names(*_PASSTHROUGH_FUNCTIONS))
    return p


PASSTHROUGH = _passthrough()
_NO_GRAD_CHECK.update(
    f for f in (_TensorBase.clone, _TensorBase.detach, _TensorBase.requires_grad_, _Tensor.__deepcopy__) if f
)


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
