"""The parts of a torch function call the simulator looks at.

:func:`tensor_operands` lists a call's tensors in the order CUDA's device checks visit them;
:func:`torch_functions` finds the callables one op name stands for (``torch.mm``,
``Tensor.mm``, the ``torch._C`` bindings), which the handler and check tables are keyed by.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch
import torch.nn.functional as F

_TensorBase = torch._C.TensorBase
_Tensor = torch.Tensor


def tensor_operands(args: Sequence[Any], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    """Tensors among the arguments and one level into list/tuple arguments, ``out=`` first."""
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


def torch_functions(*names: str) -> List[Any]:
    """Every distinct callable named one of ``names`` in torch, Tensor, F and the C bindings."""
    found = []
    for owner in (torch, _TensorBase, _Tensor, F, torch._C._nn, torch._C._VariableFunctions):
        for n in names:
            f = getattr(owner, n, None)
            if f is not None and f not in found:
                found.append(f)
    return found
