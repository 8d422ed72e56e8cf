"""CUDA's same-device checks, raising CUDA's own error messages.

Most ops check their operands the way TensorIterator does (:func:`check_ti`: CPU scalars may
join CUDA tensors). Ops whose generated kernel wrapper checks argument by argument
(``index_select``, ``mm``, ``cat``, ``masked_scatter``...) word the error differently and name the argument; their
argument lists, in schema order, are in :data:`EXACT_CHECKS`. The messages follow the torch
release that runs (they were reworded in torch 2.8).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from devmap_shims.calls import argument_at

from . import _sim_state as S
from ._sim_devices import device_key, fmt_device
from ._sim_operands import torch_functions

_storage_id = torch._C._storage_id
_Tensor = torch.Tensor
_CPU = torch.device("cpu")
_real_device_get = torch._C.TensorBase.device.__get__


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


# ---------------------------------------------------------------------------------------------
# argument-by-argument checks: (argument name, operand) pairs in schema order, and the method name
# ---------------------------------------------------------------------------------------------
def _self_and(args, kwargs, name: str, method: str):
    """``(self, name)`` of a two-operand method such as ``mm(self, mat2)``."""
    return [
        ("self", argument_at(args, kwargs, 0, "input", "self")),
        (name, argument_at(args, kwargs, 1, name)),
    ], method


def _exact_index_select(args, kwargs):
    return [
        ("self", argument_at(args, kwargs, 0, "input", "self")),
        ("index", argument_at(args, kwargs, 2, "index")),
    ], "wrapper_CUDA__index_select"


def _exact_torch_embedding(args, kwargs):  # torch.embedding(weight, indices, ...)
    return [
        ("self", argument_at(args, kwargs, 0, "weight")),
        ("index", argument_at(args, kwargs, 1, "indices")),
    ], "wrapper_CUDA__index_select"


def _exact_f_embedding(args, kwargs):  # F.embedding(input, weight, ...)
    return [
        ("self", argument_at(args, kwargs, 1, "weight")),
        ("index", argument_at(args, kwargs, 0, "input")),
    ], "wrapper_CUDA__index_select"


def _exact_mm(args, kwargs):
    return _self_and(args, kwargs, "mat2", "wrapper_CUDA_mm")


def _exact_bmm(args, kwargs):
    return _self_and(args, kwargs, "mat2", "wrapper_CUDA_bmm")


def _exact_addmm(args, kwargs):
    return [
        ("self", argument_at(args, kwargs, 0, "input", "self")),
        ("mat1", argument_at(args, kwargs, 1, "mat1")),
        ("mat2", argument_at(args, kwargs, 2, "mat2")),
    ], "wrapper_CUDA_addmm"


def _exact_baddbmm(args, kwargs):
    return [
        ("self", argument_at(args, kwargs, 0, "input", "self")),
        ("batch1", argument_at(args, kwargs, 1, "batch1")),
        ("batch2", argument_at(args, kwargs, 2, "batch2")),
    ], "wrapper_CUDA_baddbmm"


def _exact_cat(args, kwargs):
    tensors = argument_at(args, kwargs, 0, "tensors")
    return [("tensors", t) for t in (tensors or ())], "wrapper_CUDA_cat"


def _exact_equal(args, kwargs):
    return _self_and(args, kwargs, "other", "wrapper_CUDA__equal")


def _exact_bucketize(args, kwargs):  # bucketize.Tensor(Tensor self, Tensor boundaries, *, ...)
    return [
        ("self", argument_at(args, kwargs, 0, "input", "self")),
        ("boundaries", argument_at(args, kwargs, 1, "boundaries")),
    ], "wrapper_CUDA_Tensor_bucketize"


def _exact_masked_scatter(args, kwargs):
    # masked_scatter (composite) expands the mask and calls masked_scatter_, whose wrapper checks all three
    return [
        ("self", argument_at(args, kwargs, 0, "input", "self")),
        ("mask", argument_at(args, kwargs, 1, "mask")),
        ("source", argument_at(args, kwargs, 2, "source")),
    ], "wrapper_CUDA__masked_scatter_"


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
    return _matmul_named(argument_at(args, kwargs, 0, "input", "self"), argument_at(args, kwargs, 1, "other"))


def _exact_rmatmul(args, kwargs):
    return _matmul_named(argument_at(args, kwargs, 1, "other"), argument_at(args, kwargs, 0, "self"))


def _exact_linear(args, kwargs):
    x = argument_at(args, kwargs, 0, "input")
    w = argument_at(args, kwargs, 1, "weight")
    b = argument_at(args, kwargs, 2, "bias")
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


EXACT_CHECKS: Dict[Any, Callable] = {}
for _fs, _fn in (
    (torch_functions("index_select"), _exact_index_select),
    (torch_functions("mm"), _exact_mm),
    (torch_functions("bmm"), _exact_bmm),
    (torch_functions("addmm"), _exact_addmm),
    (torch_functions("baddbmm"), _exact_baddbmm),
    (torch_functions("cat", "concat", "concatenate", "stack", "hstack", "vstack"), _exact_cat),
    (torch_functions("equal"), _exact_equal),
    (torch_functions("bucketize"), _exact_bucketize),
    (torch_functions("masked_scatter", "masked_scatter_"), _exact_masked_scatter),
    (torch_functions("matmul", "__matmul__"), _exact_matmul),
    (torch_functions("__rmatmul__"), _exact_rmatmul),
    ([torch.embedding], _exact_torch_embedding),
    ([F.embedding], _exact_f_embedding),
    ([F.linear, torch._C._nn.linear], _exact_linear),
):
    for _f in _fs:
        EXACT_CHECKS[_f] = _fn


def check_mixed(
    func: Any, args: Sequence[Any], kwargs: Dict[str, Any], ts: List[torch.Tensor], keys: List[Any]
) -> Tuple[Any, Optional[set]]:
    """Operands on different devices: CUDA's checks; returns (common simulated index or None, untagged sids)."""
    real_keys = [k if k is not None else _real_device_get(t) for t, k in zip(ts, keys)]
    if all(k is None for k in keys):
        return None, None
    exact = EXACT_CHECKS.get(func)
    spec = exact(args, kwargs) if exact is not None else None
    if spec is not None:
        common = check_exact(*spec)
    else:
        name = getattr(func, "__name__", "")
        first_is_output = name.endswith("_") and not name.endswith("__")
        common = check_ti(ts, real_keys, first_is_output)
    skip = {sid for t, k in zip(ts, keys) if k is None for sid in (_storage_id_or_none(t),) if sid is not None}
    return (common if isinstance(common, int) else None), skip or None


def _storage_id_or_none(t: Any) -> Any:
    """The storage key of ``t``; None for tensors without a storage (vmap's batched tensors)."""
    try:
        return _storage_id(t)
    except (RuntimeError, TypeError):  # NotImplementedError: "Cannot access storage of BatchedTensorImpl"
        return None
