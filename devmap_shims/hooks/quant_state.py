"""Keep a bitsandbytes 4-bit quantization state on the device of its weight.

Bugs:

* ``bnb-quantstate-code-not-moved`` (bitsandbytes-foundation/bitsandbytes#1527, fixed by #1528 in
  0.45.3): ``QuantState.to()`` moves ``absmax`` and the nested state but not ``code``, the 16-entry
  NF4/FP4 table. ``Params4bit.to()`` delegates to it, so after ``model.to("cuda:1")`` (or
  ``pipe.to("cuda:1")``, huggingface/diffusers#10798) a ``[16]`` tensor stays on ``cuda:0`` and
  ``gemv_4bit`` raises "Input tensors need to be on the same GPU".
* ``bnb-params4bit-to-drops-bnb_quantized`` (bitsandbytes-foundation/bitsandbytes#1664, fixed by
  #1665 in 0.46.1): the ``Params4bit`` returned by ``.to()`` has ``bnb_quantized=False``, so moving
  it again to a GPU quantizes the already packed uint8 data ("Blockwise quantization only supports
  16/32-bit floats, but got torch.uint8").

The repairs, applied after the original ran: every tensor of the quant state (``code``,
``absmax``, ``offset``, the nested ``state2.absmax`` / ``state2.code``, and any tensor a later
release adds) ends up where the weight is; the returned parameter keeps ``bnb_quantized``; a
parameter that already carries a quant state is never quantized again. ``Params4bit.to`` also runs
inside ``torch.compile``d code, so both targets get plain function replacements (research L10).

``.cuda()`` goes through ``.to()`` on every affected release. ``Params4bit`` has no ``.cpu()`` of
its own in bitsandbytes 0.43.1, 0.44.1 and 0.45.2 (0.50.2 has one that calls ``.to()``), so there
``module.cpu()`` moves only the packed data and leaves the whole quant state on the GPU; wrapping it
would mean wrapping ``torch.Tensor.cpu`` for every tensor, so it is not done: use
``module.to("cpu")``, or :func:`devmap_shims.check_devices` to find such tensors.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing and logging would cost install() its start-up budget
    from typing import Any, Callable, Dict, Iterator, Tuple

from devmap_shims.shims import Shim, Target

SHIM_ID = "quant-state-follows-weight"
CODE_BUG = "bnb-quantstate-code-not-moved"
FLAG_BUG = "bnb-params4bit-to-drops-bnb_quantized"

_HERE = "devmap_shims.hooks.quant_state"

SHIMS = (
    Shim(
        id=SHIM_ID,
        fixes=(CODE_BUG, FLAG_BUG),
        targets=(
            Target(
                "bitsandbytes.functional",
                "QuantState.to",
                expect_params=("device",),
                wrapper=f"{_HERE}:repair_quant_state_to",
            ),
            Target("bitsandbytes.nn.modules", "Params4bit.to", wrapper=f"{_HERE}:repair_params4bit_to"),
        ),
        compile_reachable=True,
        summary="move every 4-bit quant-state tensor with its weight and keep bnb_quantized across .to()",
    ),
)

# Nested quant states (``state2``) are one level deep in every bitsandbytes release; the limit
# only guards against a cycle in a future layout.
_MAX_DEPTH = 3


def _torch() -> Any:
    import torch

    return torch


def state_tensors(state: Any, prefix: str = "", _depth: int = 0) -> Iterator[Tuple[Any, str, str, Any]]:
    """``(owner, attribute, dotted name, tensor)`` for every tensor held by a bitsandbytes QuantState.

    Finds ``code``, ``absmax``, ``offset`` and the nested ``state2`` tensors by walking the state's
    attributes, so a tensor added by a later release is included too.
    """
    if _depth >= _MAX_DEPTH:
        return
    namespace = getattr(state, "__dict__", None)
    if not namespace:
        return
    torch = _torch()
    for attr, value in list(namespace.items()):
        if isinstance(value, torch.Tensor):
            yield state, attr, prefix + attr, value
        elif value is not None and _looks_like_quant_state(value):
            yield from state_tensors(value, f"{prefix}{attr}.", _depth + 1)


def _looks_like_quant_state(value: Any) -> bool:
    return type(value).__name__ == "QuantState"


_tensor_type: Any = None


def align_state(state: Any, device: Any, _depth: int = 0) -> int:
    """Move every tensor of ``state`` (nested states included) that is not on ``device`` there;
    returns how many moved. Called for every 4-bit weight of a model by the pipeline sweep, so it
    avoids generators and imports on its fast path (nothing to move)."""
    global _tensor_type
    if _tensor_type is None:
        import torch

        _tensor_type = torch.Tensor
    if not isinstance(device, _torch().device):
        device = _torch().device(device)
    namespace = getattr(state, "__dict__", None)
    if not namespace or _depth >= _MAX_DEPTH:
        return 0
    strays = None
    moved = 0
    for attr, value in namespace.items():
        if isinstance(value, _tensor_type):
            if value.device != device:
                strays = [attr] if strays is None else strays + [attr]
        elif value is not None and (type(value) is type(state) or _looks_like_quant_state(value)):
            moved += align_state(value, device, _depth + 1)
    if strays:
        for attr in strays:
            setattr(state, attr, namespace[attr].to(device))
        moved += len(strays)
    return moved


#: The tensors of a QuantState in every bitsandbytes release the bugs apply to (0.41.2-0.46.0).
KNOWN_LAYOUT = (("absmax", "code", "offset"), ("absmax", "code"))


def align_known_state(state: Any, device: Any) -> int:
    """:func:`align_state` for the QuantState layout of the affected releases (``absmax``, ``code``,
    ``offset``, ``state2.absmax``, ``state2.code``), by direct attribute access: about half the cost
    of the generic walk, which matters when a sweep visits every 4-bit layer of a large model."""
    moved = 0
    outer, inner = KNOWN_LAYOUT
    for owner, names in ((state, outer), (getattr(state, "state2", None), inner)):
        if owner is None:
            continue
        for attr in names:
            tensor = getattr(owner, attr, None)
            if tensor is not None and tensor.device != device:
                setattr(owner, attr, tensor.to(device))
                moved += 1
    return moved


def _device_argument(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    if args:
        return args[0]
    return kwargs.get("device")


def repair_quant_state_to(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``QuantState.to(device)``, then move whatever it left behind (``code``) to ``device``."""
    result = wrapped(*args, **kwargs)
    device = _device_argument(args, kwargs)
    if device is not None and instance is not None:
        target = _concrete_device(device)
        if target is not None:
            align_state(instance, target)  # compares first: a no-op .to() still costs a dispatch
        else:
            for owner, attr, _name, tensor in list(state_tensors(instance)):
                moved = tensor.to(device)
                if moved is not tensor:
                    setattr(owner, attr, moved)
    return result


def _concrete_device(device: Any) -> Any:
    """``device`` as a torch.device that tensors on it report (an index for accelerators), else None
    (``"cuda"`` alone means the current device: moving there is left to ``.to()``)."""
    torch = _torch()
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        return None
    if target.index is None and target.type not in ("cpu", "meta"):
        return None
    return target


def _holds_packed_data(param: Any) -> bool:
    """A Params4bit with a quant state holds packed data, whatever its ``bnb_quantized`` flag says."""
    namespace = getattr(param, "__dict__", None) or {}
    return namespace.get("quant_state") is not None


def repair_params4bit_to(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``Params4bit.to(...)`` that never re-quantizes, keeps ``bnb_quantized`` and moves the whole state."""
    param = instance
    if param is not None and not getattr(param, "bnb_quantized", True) and _holds_packed_data(param):
        # Produced by an unrepaired .to() (bnb-params4bit-to-drops-bnb_quantized): the data is packed
        # already, so moving it to a GPU must not quantize it a second time.
        param.bnb_quantized = True
    result = wrapped(*args, **kwargs)
    if result is not param and getattr(param, "bnb_quantized", False) and not getattr(result, "bnb_quantized", True):
        result.bnb_quantized = True
    state = (getattr(result, "__dict__", None) or {}).get("quant_state")
    if state is not None:
        align_state(state, result.device)
    return result


__all__ = [
    "CODE_BUG",
    "FLAG_BUG",
    "SHIMS",
    "SHIM_ID",
    "KNOWN_LAYOUT",
    "align_known_state",
    "align_state",
    "repair_params4bit_to",
    "repair_quant_state_to",
    "state_tensors",
]
