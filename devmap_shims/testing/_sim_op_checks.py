"""Which of CUDA's device checks each op takes, and :func:`check_mixed`, which runs them.

Ops whose generated kernel wrapper checks argument by argument name the argument in their error;
their argument lists, in schema order, with the wrapper's name, are in :data:`EXACT_CHECKS`
(verified against torch 2.11 on an NVIDIA H200; every wrapper name is in the binaries of each torch
the project pins). Ops with a message of their own or their own CPU-scalar rule are in
:mod:`._sim_kernel_checks`; the rest check the way TensorIterator does.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from devmap_shims.calls import argument_at

from ._sim_device_checks import check_exact, check_ti
from ._sim_devices import device_key, fmt_device
from ._sim_kernel_checks import CPU_SCALARS, OWN_MESSAGES
from ._sim_operands import torch_functions

_storage_id = torch._C._storage_id
_Tensor = torch.Tensor
_real_device_get = torch._C.TensorBase.device.__get__


# ---------------------------------------------------------------------------------------------
# argument-by-argument checks: (argument name, operand) pairs in schema order, and the method name
# ---------------------------------------------------------------------------------------------
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


def _exact_cat(args, kwargs):
    tensors = argument_at(args, kwargs, 0, "tensors")
    return [("tensors", t) for t in (tensors or ())], "wrapper_CUDA_cat"


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


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _indexed(base: str, third: Optional[str]):
    """``op(self, dim, index, <third>)``: gather, scatter, scatter_add, index_add..., with the wrapper
    named after the functional or in-place overload; None (TensorIterator's check) for ``out=`` and
    the legacy ``scatter(reduce=)``."""

    def spec(args, kwargs, func):
        if kwargs.get("out") is not None:
            return None
        if base == "scatter" and argument_at(args, kwargs, 4, "reduce") is not None:
            return None
        named = [
            ("self", argument_at(args, kwargs, 0, "input", "self")),
            ("index", argument_at(args, kwargs, 2, "index")),
        ]
        overload = ""
        if third is not None:
            other = argument_at(args, kwargs, 3, third)
            if base == "scatter":  # scatter.value reads a value= tensor with .item()
                overload = "_src" if isinstance(other, _Tensor) else "_value"
            named.append((third, other))
        name = base + ("_" if _in_place(func) else "")
        if base == "scatter_reduce":
            name += "_two"
        return named, f"wrapper_CUDA_{name}{overload}"

    return spec


def _exact_clamp(args, kwargs, func):
    """``clamp``/``clip`` with tensor bounds (``clamp.Tensor``); a number among the bounds selects
    ``clamp.Scalar``, which reads a 0-dim tensor bound with ``.item()``: only ``self`` is checked."""
    lo, hi = argument_at(args, kwargs, 1, "min"), argument_at(args, kwargs, 2, "max")
    if kwargs.get("out") is not None or not (isinstance(lo, _Tensor) or isinstance(hi, _Tensor)):
        return None
    method = "wrapper_CUDA_clamp_Tensor" if not _in_place(func) else "wrapper_CUDA_clamp__Tensor"
    x = argument_at(args, kwargs, 0, "input", "self")
    if any(b is not None and not isinstance(b, _Tensor) for b in (lo, hi)):
        return [("self", x)], method
    return [("self", x), ("min", lo), ("max", hi)], method


def _bound(which: str):
    def spec(args, kwargs, func):  # clamp_min(self, min) / clamp_max(self, max) with a tensor bound
        bound = argument_at(args, kwargs, 1, which)
        if kwargs.get("out") is not None or not isinstance(bound, _Tensor):
            return None
        method = f"wrapper_CUDA_clamp_{which}_{'_' if _in_place(func) else ''}Tensor"
        return [("self", argument_at(args, kwargs, 0, "input", "self")), (which, bound)], method

    return spec


def _exact_nll(args, kwargs, func):
    """``nll_loss`` and ``cross_entropy`` with class indices (log_softmax runs on the input first):
    ``nll_loss_forward`` for inputs of up to 2 dims, else ``nll_loss2d_forward``."""
    x, target = argument_at(args, kwargs, 0, "input", "self"), argument_at(args, kwargs, 1, "target")
    if not (isinstance(x, _Tensor) and isinstance(target, _Tensor)) or target.is_floating_point():
        return None
    two_d = func is torch._C._nn.nll_loss2d or x.dim() > 2
    named = [("self", x), ("target", target), ("weight", argument_at(args, kwargs, 2, "weight"))]
    return named, "wrapper_CUDA__nll_loss2d_forward" if two_d else "wrapper_CUDA_nll_loss_forward"


def _norm(method: str, weight_at: int):
    def spec(args, kwargs, func):  # native_layer_norm / native_group_norm(input, ..., weight, bias)
        return [
            ("input", argument_at(args, kwargs, 0, "input")),
            ("weight", argument_at(args, kwargs, weight_at, "weight")),
            ("bias", argument_at(args, kwargs, weight_at + 1, "bias")),
        ], method

    return spec


def _exact_searchsorted(args, kwargs, func):  # searchsorted.Tensor(sorted_sequence, self, *, ..., sorter)
    values = argument_at(args, kwargs, 1, "input", "self")
    if kwargs.get("out") is not None or not isinstance(values, _Tensor):
        return None
    seq = argument_at(args, kwargs, 0, "sorted_sequence")
    named = [("sorted_sequence", seq), ("self", values)]
    sorter = kwargs.get("sorter")
    if isinstance(sorter, _Tensor) and isinstance(seq, _Tensor) and device_key(sorter) != device_key(seq):
        check_exact(named, "wrapper_CUDA_Tensor_searchsorted")  # the wrapper's check comes first
        raise RuntimeError(  # aten/src/ATen/native/BucketizationUtils.h searchsorted_pre_check
            "torch.searchsorted(): sorter and boundary tensors should have same device type, but got sorter "
            f"tensor device type {fmt_device(device_key(sorter))} and input value tensor device type "
            f"{fmt_device(device_key(seq))}"
        )
    return named, "wrapper_CUDA_Tensor_searchsorted"


def _plain(method: str, *params: str, inputs_with_out: bool = False):
    """Tensors at the first positions, in schema order: ``"name"`` or ``"name=keyword"`` (the name the
    message gives, the keyword the call may use; ``self`` is also ``input``). With ``out=``: None
    (TensorIterator's check), or with ``inputs_with_out`` the inputs' check still (the ops the
    simulator checked this way first: mm, bmm, addmm, baddbmm, equal, bucketize, masked_scatter)."""

    def spec(args, kwargs, func):
        if kwargs.get("out") is not None and not inputs_with_out:
            return None
        named = []
        for i, param in enumerate(params):
            name, _, keyword = param.partition("=")
            keywords = (keyword,) if keyword else ("input", "self") if name == "self" else (name,)
            named.append((name, argument_at(args, kwargs, i, *keywords)))
        return named, method

    return spec


def _exact_diff(args, kwargs, func):  # diff(input, n, dim, prepend, append): cat([prepend, input, append])
    parts = (argument_at(args, kwargs, 3, "prepend"), argument_at(args, kwargs, 0, "input"),
             argument_at(args, kwargs, 4, "append"))
    return [("tensors", t) for t in parts], "wrapper_CUDA_cat"


def _exact_einsum(args, kwargs, func):
    """Two operands sharing a summed index: ``sumproduct_pair`` contracts them with ``bmm``; without
    one it multiplies them (TensorIterator's check)."""
    equation = argument_at(args, kwargs, 0, "equation")
    given = args[1:] if len(args) > 2 else argument_at(args, kwargs, 1, "operands")
    operands = list(given) if isinstance(given, (list, tuple)) else []
    if not isinstance(equation, str) or len(operands) != 2 or "." in equation:
        return None
    lhs, _, rhs = equation.replace(" ", "").partition("->")
    inputs = lhs.split(",")
    if len(inputs) != 2:
        return None
    if not _:  # implicit output: the indices that appear once, in alphabetical order
        rhs = "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
    if not any(c in inputs[1] and c not in rhs for c in inputs[0]):
        return None
    return [("self", operands[0]), ("mat2", operands[1])], "wrapper_CUDA_bmm"


EXACT_CHECKS: Dict[Any, Callable] = {}
for _fs, _fn in (
    (torch_functions("index_select"), _exact_index_select),
    (torch_functions("cat", "concat", "concatenate", "stack", "hstack", "vstack"), _exact_cat),
    (torch_functions("matmul", "__matmul__"), _exact_matmul),
    (torch_functions("__rmatmul__"), _exact_rmatmul),
    ([torch.embedding], _exact_torch_embedding),
    ([F.embedding], _exact_f_embedding),
    ([F.linear, torch._C._nn.linear], _exact_linear),
):
    for _f in _fs:
        EXACT_CHECKS[_f] = lambda args, kwargs, func, _fn=_fn: _fn(args, kwargs)
for _names, _spec in (
    (("mm",), _plain("wrapper_CUDA_mm", "self", "mat2", inputs_with_out=True)),
    (("bmm",), _plain("wrapper_CUDA_bmm", "self", "mat2", inputs_with_out=True)),
    (("addmm",), _plain("wrapper_CUDA_addmm", "self", "mat1", "mat2", inputs_with_out=True)),
    (("baddbmm",), _plain("wrapper_CUDA_baddbmm", "self", "batch1", "batch2", inputs_with_out=True)),
    (("equal",), _plain("wrapper_CUDA__equal", "self", "other", inputs_with_out=True)),
    # bucketize.Tensor(Tensor self, Tensor boundaries, *, ...)
    (("bucketize",), _plain("wrapper_CUDA_Tensor_bucketize", "self", "boundaries", inputs_with_out=True)),
    # masked_scatter (composite) expands the mask and calls masked_scatter_, whose wrapper checks all three
    (("masked_scatter", "masked_scatter_"),
     _plain("wrapper_CUDA__masked_scatter_", "self", "mask", "source", inputs_with_out=True)),
    (("gather",), _indexed("gather", None)),
    (("scatter", "scatter_"), _indexed("scatter", "src")),
    (("scatter_add", "scatter_add_"), _indexed("scatter_add", "src")),
    (("scatter_reduce", "scatter_reduce_"), _indexed("scatter_reduce", "src")),
    (("index_add", "index_add_"), _indexed("index_add", "source")),
    (("index_copy", "index_copy_"), _indexed("index_copy", "source")),
    (("clamp", "clamp_", "clip", "clip_"), _exact_clamp),
    (("clamp_min", "clamp_min_"), _bound("min")),
    (("clamp_max", "clamp_max_"), _bound("max")),
    (("nll_loss", "nll_loss_nd", "nll_loss2d", "cross_entropy", "cross_entropy_loss"), _exact_nll),
    (("layer_norm", "native_layer_norm"), _norm("wrapper_CUDA__native_layer_norm", 2)),
    (("group_norm",), _norm("wrapper_CUDA__native_group_norm", 2)),  # (input, num_groups, weight, bias)
    (("native_group_norm",), _norm("wrapper_CUDA__native_group_norm", 1)),  # (input, weight, bias, N...)
    (("searchsorted",), _exact_searchsorted),
    (("einsum",), _exact_einsum),
    (("index_reduce", "index_reduce_"), _indexed("index_reduce", "source")),
    (("masked_select",), _plain("wrapper_CUDA__masked_select", "self", "mask")),
    (("isin",), _plain("wrapper_CUDA_isin_Tensor_Tensor", "elements", "test_elements")),
    (("polar",), _plain("wrapper_CUDA_out_polar_out", "abs", "angle")),
    (("complex",), _plain("wrapper_CUDA_out_complex_out", "real", "imag")),
    (("normal",), _plain("wrapper_CUDA_Tensor_Tensor_normal", "mean", "std")),
    (("take",), _plain("wrapper_CUDA__take", "self", "index")),
    (("put", "put_"), _plain("wrapper_CUDA__put_", "self", "index", "source")),
    (("bincount",), _plain("wrapper_CUDA__bincount", "self", "weights")),
    (("dot",), _plain("wrapper_CUDA__dot", "self", "tensor")),
    (("prelu",), _plain("wrapper_CUDA___prelu_kernel", "self", "weight")),
    (("addmv",), _plain("wrapper_CUDA_addmv", "self", "mat", "vec")),
    (("addmv_",), _plain("wrapper_CUDA_addmv_", "self", "mat", "vec")),
    (("addr",), _plain("wrapper_CUDA__addr", "self", "vec1", "vec2")),
    (("cross",), _plain("wrapper_CUDA_linalg_cross", "self", "other")),
    (("tensordot",), _plain("wrapper_CUDA_mm", "self=a", "mat2=b")),  # both reshaped to 2-D, then mm
    (("repeat_interleave",), _plain("wrapper_CUDA__index_select", "self", "index=repeats")),  # index_select
    (("diff",), _exact_diff),
):
    for _f in torch_functions(*_names):
        EXACT_CHECKS[_f] = _spec
EXACT_CHECKS[torch.linalg.cross] = EXACT_CHECKS[torch.cross]


#: keywords that only take numbers (``addcdiv_(..., value=)``, ``add(..., alpha=)``, ``addmm(..., beta=)``):
#: torch's argument parser reads a 0-dim tensor given there with ``.item()``, so it is no operand
NUMBER_KEYWORDS = ("value", "alpha", "beta")


def check_mixed(
    func: Any, args: Sequence[Any], kwargs: Dict[str, Any], ts: List[torch.Tensor], keys: List[Any]
) -> Tuple[Any, Optional[set]]:
    """Operands on different devices: CUDA's checks; returns (common simulated index or None, untagged sids)."""
    real_keys = [k if k is not None else _real_device_get(t) for t, k in zip(ts, keys)]
    if all(k is None for k in keys):
        return None, None
    own = OWN_MESSAGES.get(func)
    if own is not None:
        own(args, kwargs)
    exact = EXACT_CHECKS.get(func)
    spec = exact(args, kwargs, func) if exact is not None else None
    if spec is not None:
        common = check_exact(*spec)
    else:  # TensorIterator: outputs first (in-place self, out=)
        first_is_output = _in_place(func) or kwargs.get("out") is not None
        numbers = [id(v) for k, v in kwargs.items() if k in NUMBER_KEYWORDS and isinstance(v, _Tensor)]
        pairs = [(t, k) for t, k in zip(ts, real_keys) if id(t) not in numbers]
        inputs = len(pairs) - first_is_output
        # one kernel with two inputs (binary and comparison ops) takes one CPU scalar; the rest is a
        # composite function or a kernel of its own, whose count is CPU_SCALARS' or unknown (any)
        scalars, kernel = CPU_SCALARS.get(func, (1 if inputs <= 2 else len(pairs), None))
        common = check_ti([t for t, _ in pairs], [k for _, k in pairs], first_is_output, scalars)
        if kernel is not None:
            kernel(args, kwargs, common)
    skip = {
        sid for t, k in zip(ts, keys) if k is None for sid in (_storage_id_or_none(t),) if sid is not None
    }
    return (common if isinstance(common, int) else None), skip or None


def _storage_id_or_none(t: Any) -> Any:
    """The storage key of ``t``; None for tensors without a storage (vmap's batched tensors)."""
    try:
        return _storage_id(t)
    except (RuntimeError, TypeError):  # NotImplementedError: "Cannot access storage of BatchedTensorImpl"
        return None
