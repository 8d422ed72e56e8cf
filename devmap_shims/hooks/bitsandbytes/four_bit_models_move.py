"""Shim ``four-bit-models-move``: a 4-bit bitsandbytes transformers model moves with ``.to()`` and
``.cuda()`` on bitsandbytes 0.43.0-0.43.1, and arrives exactly as if it had been loaded there.

transformers refuses to move bitsandbytes models: before 4.45.0 every one ("`.to` is not supported
for `4-bit` or `8-bit` bitsandbytes models"), from 4.45.0 the 4-bit ones only while bitsandbytes is
older than 0.43.2 ("Calling `to()` is not supported for `4-bit` quantized models with the installed
version of bitsandbytes"). 0.43.2 (bitsandbytes#1279) made ``Params4bit.to`` keep ``quant_storage``
and ``Params4bit.from_prequantized`` record it; moving a 4-bit weight without re-quantizing it
already worked from 0.43.0 (``bnb_quantized``). Two targets:

* ``Params4bit.to``: the returned parameter keeps ``quant_storage`` (the packed data's dtype where
  ``from_prequantized`` left it unset, as 0.43.2 records it) and ``bnb_quantized``, a parameter that
  carries a quant state is never quantized again, and every tensor of the quant state (``code``
  included) ends up on the weight's device.
* ``PreTrainedModel.to`` / ``.cuda``: when transformers refuses a move of a 4-bit model (no 8-bit
  weights, no dtype asked for), the model is moved as transformers 4.45 moves it where it allows the
  move (``torch.nn.Module.to``), then every 4-bit weight's quant state is put on the weight's device.
  8-bit models and dtype casts are refused as before.

Before 0.43.0 ``Params4bit.to`` quantizes the packed data again on a move to the GPU
(bitsandbytes#937), so the shim leaves those releases alone. A model that accelerate dispatched
keeps its hooks; ``hooks-follow-moved-weights`` points them at the new device. Models loaded before
``install()`` keep the unwrapped ``to`` that accelerate's guard captured.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    bnb-4bit-to-requires-0.43.2
        affected: bitsandbytes <0.43.2
        fixed in: bitsandbytes 0.43.2
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Tuple

from devmap_shims.devices.bnb_params import bnb_kinds
from devmap_shims.devices.quant_state import align_state, quant_state_of, state_tensors
from devmap_shims.scenarios import BugObserved, import_before_simulation, scenario
from devmap_shims.shims import LazyLogger, Shim, Target

BUG_ID = "bnb-4bit-to-requires-0.43.2"
#: where Params4bit.to moves a quantized weight without quantizing it again (bnb_quantized)
MOVES_WITHOUT_REQUANTIZING = {"bitsandbytes": ">=0.43.0"}

logger = LazyLogger(__name__)


# -- Params4bit.to ----------------------------------------------------------------------------------
def keep_state_on_move(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``Params4bit.to(...)`` that keeps ``quant_storage`` and ``bnb_quantized`` and moves the whole state."""
    state = quant_state_of(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    namespace = instance.__dict__
    namespace["bnb_quantized"] = True  # packed data: a move to the GPU must not quantize it again
    result = wrapped(*args, **kwargs)
    if result is not instance and quant_state_of(result) is state:
        result.quant_storage = namespace.get("quant_storage", instance.dtype)
        result.bnb_quantized = True
    align_state(state, result.device)
    return result


# -- PreTrainedModel.to / .cuda ----------------------------------------------------------------------
def is_4bit_model(model: Any) -> bool:
    """A transformers model bitsandbytes loaded in 4-bit, holding no 8-bit weights."""
    return (
        getattr(model, "quantization_method", None) == "bitsandbytes"  # a str enum in transformers
        and bool(getattr(model, "is_loaded_in_4bit", False))
        and not getattr(model, "is_loaded_in_8bit", False)
        and bnb_kinds(model) == {"Params4bit"}
    )


def _casts(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether a ``Module.to(...)`` call asks for a dtype (or cannot be read)."""
    import torch

    try:
        return torch._C._nn._parse_to(*args, **kwargs)[1] is not None
    except (TypeError, ValueError, RuntimeError):
        return True


def align_quant_states(model: Any) -> int:
    """Put every 4-bit weight's quant state on the weight's device; returns how many tensors moved."""
    moved = 0
    for param in model.parameters():
        state = quant_state_of(param)
        if state is not None:
            moved += align_state(state, param.device)
    return moved


def _move(method: str, refused: Callable[[], Any], model: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    try:
        return refused()
    except ValueError:
        if not is_4bit_model(model) or (method == "to" and _casts(args, kwargs)):
            raise
    import sys

    base = sys.modules["transformers.modeling_utils"].PreTrainedModel
    result = getattr(super(base, model), method)(*args, **kwargs)
    strays = align_quant_states(model)
    logger.debug("%s.%s: moved the 4-bit model transformers refused to move (%d quant-state tensors followed)",
                 type(model).__name__, method, strays)
    return result


def move_4bit_model_to(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``PreTrainedModel.to``: a 4-bit model transformers refuses to move is moved."""
    return _move("to", lambda: wrapped(*args, **kwargs), instance, args, kwargs)


def move_4bit_model_cuda(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``PreTrainedModel.cuda``: a 4-bit model transformers refuses to move is moved."""
    return _move("cuda", lambda: wrapped(*args, **kwargs), instance, args, kwargs)


SHIM = Shim(
    id="four-bit-models-move",
    fixes=(BUG_ID,),
    targets=(
        Target("bitsandbytes.nn.modules", "Params4bit.to", when=MOVES_WITHOUT_REQUANTIZING, wrapper=keep_state_on_move),
        Target("transformers.modeling_utils", "PreTrainedModel.to", when=MOVES_WITHOUT_REQUANTIZING,
               wrapper=move_4bit_model_to),
        Target("transformers.modeling_utils", "PreTrainedModel.cuda", when=MOVES_WITHOUT_REQUANTIZING,
               wrapper=move_4bit_model_cuda),
    ),
    compile_reachable=True,
    summary="move 4-bit transformers models with .to()/.cuda() and keep every Params4bit's state on the move",
)


# -- scenario ---------------------------------------------------------------------------------------
def four_bit_state(model: Any) -> Dict[str, Any]:
    """Everything a forward of ``model`` reads, by name: each parameter and buffer (device, dtype,
    values on the CPU) and, for a 4-bit weight, its flags and each quant-state tensor."""
    found: Dict[str, Any] = {}
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            found[name] = (kind, str(tensor.device), tensor.dtype, tensor.detach().cpu().clone())
            state = quant_state_of(tensor)
            if state is None:
                continue
            attrs = tensor.__dict__
            found[f"{name}:flags"] = tuple(attrs.get(k) for k in ("bnb_quantized", "quant_storage", "blocksize",
                                                                  "compress_statistics", "quant_type"))
            found[f"{name}:state"] = (state.shape, state.dtype, state.blocksize, state.quant_type)
            for _owner, _attr, key, value in state_tensors(state):
                found[f"{name}.quant_state.{key}"] = ("state", str(value.device), value.dtype, value.detach().cpu().clone())
    return found


def differences(got: Dict[str, Any], expected: Dict[str, Any]) -> List[str]:
    """What differs between two :func:`four_bit_state` results, one line per entry."""
    import torch

    lines = [f"{name}: missing" for name in expected if name not in got]
    lines += [f"{name}: unexpected" for name in got if name not in expected]
    for name in sorted(set(got) & set(expected)):
        a, b = got[name], expected[name]
        if isinstance(a[-1], torch.Tensor):
            if a[:3] != b[:3] or not torch.equal(a[3], b[3]):
                lines.append(f"{name}: {a[1]} {a[2]} vs {b[1]} {b[2]}" + ("" if a[:3] != b[:3] else " (values differ)"))
        elif a != b:
            lines.append(f"{name}: {a} vs {b}")
    return lines


def prequantized_llama_dir() -> str:
    """A tiny Llama written as a pre-quantized 4-bit (NF4, nested statistics) checkpoint, once per process."""
    import os

    from devmap_shims.scenarios.checkpoints import once, scratch_dir

    def make() -> str:
        from devmap_shims.testing.models import tiny_causal_lm
        from devmap_shims.testing.nf4 import save_prequantized_transformers_model

        path = os.path.join(scratch_dir("llama-nf4"), "llama")
        save_prequantized_transformers_model(tiny_causal_lm("llama"), path)
        return path

    return once("llama-nf4", make, os.path.isdir)


@scenario(BUG_ID, "a 4-bit Llama loaded on cuda:0, then model.to('cpu') and model.to('cuda:0')",
          needs=("torch", "bitsandbytes", "transformers", "accelerate"))
def four_bit_model_round_trip() -> str:
    import_before_simulation("bitsandbytes")
    import torch
    from transformers import AutoModelForCausalLM

    from devmap_shims.testing import simulated_gpus

    path = prequantized_llama_dir()
    with simulated_gpus(1, memory="2GiB"), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, device_map={"": 0})
        try:
            model.to("cpu")
            model.to("cuda:0")
        except ValueError as exc:
            raise BugObserved(f"moving a 4-bit model: ValueError: {str(exc).splitlines()[0]}") from exc
        expected = four_bit_state(AutoModelForCausalLM.from_pretrained(path, device_map={"": 0}))
        wrong = differences(four_bit_state(model), expected)
        if wrong:
            raise BugObserved(f"after cuda:0 -> cpu -> cuda:0, {len(wrong)} entries differ from a fresh load: "
                              + "; ".join(wrong[:4]))
        states = sum(1 for name in expected if name.endswith(":state"))
        return f"cuda:0 -> cpu -> cuda:0: {len(expected)} entries ({states} 4-bit weights) equal a fresh load on cuda:0"
