"""Shim ``quant-state-follows-weight``: ``Params4bit.to`` and ``QuantState.to`` move the whole 4-bit
quantization state with the weight, and a moved ``Params4bit`` keeps ``bnb_quantized``.

Both repairs run after the original: every tensor of the quant state (``code``, ``absmax``,
``offset``, the nested ``state2`` ones, and any a later release adds) ends up where the weight is;
the returned parameter keeps ``bnb_quantized``; a parameter that already carries a quant state is
never quantized again. ``Params4bit.to`` also runs inside ``torch.compile``d code, hence plain
function layers (``compile_reachable``). ``.cuda()`` goes through ``.to()`` on every affected
release. ``Params4bit.to`` moves its state with ``QuantState.to``: when that repair has just put
every tensor of the state on the device the returned parameter is on, the state is not read
again. A state aligned by ``Params4bit.to`` during a ``pipe.to()`` is noted under the storage
of the weight it went with (``devices.quant_state.align_and_note``), so the pipeline-to-sweep
shim does not read it again while the parameter holds that storage.
``Params4bit`` has no ``.cpu()`` of its own before 0.46, so ``module.cpu()`` leaves the state on
the GPU there: wrapping it would mean wrapping ``torch.Tensor.cpu`` for every tensor, so it is not
done (use ``module.to("cpu")``; :func:`devmap_shims.check_devices` finds such tensors).

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    bnb-quantstate-code-not-moved
        affected: bitsandbytes >=0.41.2,<0.45.3
        fixed in: bitsandbytes 0.45.3
    bnb-params4bit-to-drops-bnb_quantized
        affected: bitsandbytes >=0.43.0,<0.46.1
        fixed in: bitsandbytes 0.46.1
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.devices.quant_state import (
    align_and_note,
    align_state,
    aligned_in_weight_move,
    forget,
    note,
    quant_state_of,
    start_weight_move,
    state_tensors,
    stop_weight_move,
)
from devmap_shims.devices.tensors import device_type
from devmap_shims.scenarios import BugObserved, import_before_simulation, scenario
from devmap_shims.shims import Shim, Target

CODE_BUG = "bnb-quantstate-code-not-moved"
FLAG_BUG = "bnb-params4bit-to-drops-bnb_quantized"


# -- repairs ----------------------------------------------------------------------------------------
def repair_quant_state_to(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``QuantState.to(device)``, then move whatever it left behind (``code``) to ``device``."""
    result = wrapped(*args, **kwargs)
    if instance is None:
        return result
    forget(instance)  # noted for where it was: the sweep after a move checks it unless noted again
    device = args[0] if args else kwargs.get("device")
    if device is not None:
        target = _concrete_device(device)
        if target is not None:
            align_state(instance, target)
            aligned_in_weight_move(instance, target)  # a Params4bit.to in progress need not read it again
        else:
            for owner, attr, _name, tensor in list(state_tensors(instance)):
                moved = tensor.to(device)
                if moved is not tensor:
                    setattr(owner, attr, moved)
    return result


def _concrete_device(device: Any) -> Any:
    """``device`` as a torch.device that tensors on it report (an index for accelerators), else None
    (``"cuda"`` alone means the current device: moving there is left to ``.to()``)."""
    torch_device = device_type()
    target = device
    if not isinstance(target, torch_device):  # Params4bit.to passes the torch.device it parsed
        try:
            target = torch_device(device)
        except (RuntimeError, TypeError):
            return None
    if target.index is None and target.type not in ("cpu", "meta"):
        return None
    return target


def repair_params4bit_to(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``Params4bit.to(...)`` that never re-quantizes, keeps ``bnb_quantized`` and moves the whole state."""
    param = instance
    if param is not None and not getattr(param, "bnb_quantized", True) and quant_state_of(param) is not None:
        # Produced by an unrepaired .to() (FLAG_BUG): the data is packed already, so moving it to a
        # GPU must not quantize it a second time.
        param.bnb_quantized = True
    previous = start_weight_move()
    try:
        result = wrapped(*args, **kwargs)
    finally:
        aligned, device = stop_weight_move(previous)
    if result is not param and getattr(param, "bnb_quantized", False) and not getattr(result, "bnb_quantized", True):
        result.bnb_quantized = True
    state = quant_state_of(result)
    if state is not None:
        # noted for a sweep after the move in progress (pipe.to()), which then need not check it again
        if state is aligned and result.device == device:
            note(state, result)  # the QuantState.to repair inside this call put it all on that device
        else:
            align_and_note(state, result)
    return result


SHIM = Shim(
    id="quant-state-follows-weight",
    fixes=(CODE_BUG, FLAG_BUG),
    targets=(
        Target("bitsandbytes.functional", "QuantState.to", expect_params=("device",), wrapper=repair_quant_state_to),
        Target("bitsandbytes.nn.modules", "Params4bit.to", wrapper=repair_params4bit_to),
    ),
    compile_reachable=True,
    summary="move every 4-bit quant-state tensor with its weight and keep bnb_quantized across .to()",
)


# -- scenarios --------------------------------------------------------------------------------------
def _weight(seed: int) -> Any:
    import torch

    return torch.randn(64, 128, generator=torch.Generator().manual_seed(seed))


@scenario(CODE_BUG, "Params4bit loaded on cuda:0, moved with .to('cuda:1'): every quant-state tensor must follow",
          needs=("torch", "bitsandbytes"))
def params4bit_moved_to_second_gpu() -> str:
    import_before_simulation("bitsandbytes")
    import torch

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.nf4 import params4bit

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        moved = params4bit(_weight(0), "cuda:0", compress_statistics=True).to("cuda:1")
        tensors = {name: t for _owner, _attr, name, t in state_tensors(moved.quant_state)}
        left = {name: str(t.device) for name, t in tensors.items() if t.device != moved.device}
        if left:
            names = ", ".join(f"quant_state.{k} on {v}" for k, v in sorted(left.items()))
            raise BugObserved(f"after Params4bit.to('cuda:1') the weight is on {moved.device} but {names}")
        return f"weight and {len(tensors)} quant-state tensors on {moved.device}"


@scenario(CODE_BUG, "tiny Flux pipeline with a 4-bit transformer loaded on cuda:0, then pipe.to('cuda:1')",
          needs=("torch", "bitsandbytes", "diffusers", "transformers"))
def flux_4bit_pipe_to_second_gpu() -> str:
    from devmap_shims.scenarios import flux

    base = flux.prepare()
    import torch

    from devmap_shims.testing import simulated_gpus

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        pipe = flux.pipeline_with(base, flux.load_4bit_transformer())
        pipe.to("cuda:1")
        checked = flux.raise_if_strays(pipe, "after pipe.to('cuda:1')")
        return f"pipe.to('cuda:1'): all tensors on cuda:1, {checked} quant-state tensors checked"


@scenario(FLAG_BUG, "p = p.to('cuda:1'); p = p.to('cuda:0') on a 4-bit parameter: must not re-quantize the packed data",
          needs=("torch", "bitsandbytes"))
def params4bit_moved_twice() -> str:
    import_before_simulation("bitsandbytes")
    import torch

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.nf4 import params4bit

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        param = params4bit(_weight(1), "cuda:0")
        packed = param.data.cpu().clone()
        param = param.to("cuda:1")
        flag = "" if param.bnb_quantized else "bnb_quantized=False on the Params4bit returned by .to()"
        param = param.to("cuda:0")  # raises on the affected releases: quantizes the uint8 data again
        if flag:
            raise BugObserved(f"{flag} (the second move happened not to re-quantize)")
        if param.dtype != packed.dtype or not torch.equal(param.data.cpu(), packed):
            raise BugObserved("the packed 4-bit data changed after two moves")
        return "moved cuda:0 -> cuda:1 -> cuda:0: bnb_quantized kept, packed data bit-identical"
