"""Where a bitsandbytes 8-bit linear layer keeps its int8 weights and scales.

``Linear8bitLt`` starts with them on its weight (``weight.CB``/``weight.SCB``, set when it was
quantized) and moves them to ``state.CB``/``state.SCB`` on its first forward, after which
``weight.data`` *is* ``state.CB``. ``torch.nn.Module.to`` on a parent module replaces only
``weight.data``, so those four attributes keep pointing at the old device.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Iterator, Tuple

#: the attributes holding the int8 weights and their scales, on the weight and on the layer's state
INT8_ATTRIBUTES = ("CB", "SCB")


def is_int8_linear(module: Any) -> bool:
    """A module whose weight is a bitsandbytes ``Int8Params`` holding int8 data."""
    weight = getattr(module, "weight", None)
    return type(weight).__name__ == "Int8Params" and str(getattr(weight, "dtype", "")) == "torch.int8"


def int8_state_off_device(module: Any) -> bool:
    """Whether any of the module's ``CB``/``SCB`` is not on its weight's device."""
    weight = module.weight
    for holder in (weight, getattr(module, "state", None)):
        for name in INT8_ATTRIBUTES:
            tensor = getattr(holder, name, None)
            if tensor is not None and tensor.device != weight.device:
                return True
    return False


def layer_state_tensors(module: Any) -> Iterator[Tuple[str, Any]]:
    """``(attribute, tensor)`` for the int8 weights and scales on a ``Linear8bitLt``'s ``state`` (its
    ``MatmulLtState``, filled by the first forward); nothing for a module without one."""
    state = module.__dict__.get("state")
    if type(state).__name__ != "MatmulLtState":
        return
    for name in INT8_ATTRIBUTES:
        tensor = getattr(state, name, None)
        if tensor is not None:
            yield name, tensor


def align_int8_state(module: Any) -> int:
    """Point ``CB`` at the weight's int8 data and move ``SCB`` to its device, on the weight and on
    the layer's ``state``; returns how many attributes changed."""
    weight = module.weight
    changed = 0
    for holder in (weight, getattr(module, "state", None)):
        cb = getattr(holder, "CB", None)
        if cb is not None and cb.device != weight.device:
            if cb.shape == weight.data.shape and cb.dtype == weight.data.dtype:
                holder.CB = weight.data
            else:
                holder.CB = cb.to(weight.device)
            changed += 1
        scb = getattr(holder, "SCB", None)
        if scb is not None and scb.device != weight.device:
            holder.SCB = scb.to(weight.device)
            changed += 1
    return changed
