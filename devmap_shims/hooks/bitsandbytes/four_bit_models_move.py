"""Shim ``four-bit-models-move``: a 4-bit bitsandbytes transformers model moves with ``.to()`` and
``.cuda()`` (bitsandbytes 0.43.0-0.43.1; ``.cuda()`` on transformers 4.45-4.52), and arrives exactly
as if it had been loaded there.

transformers refuses to move bitsandbytes models: before 4.45.0 every one ("`.to` is not supported
for `4-bit` or `8-bit` bitsandbytes models"), from 4.45.0 the 4-bit ones only while bitsandbytes is
older than 0.43.2 ("Calling `to()` is not supported for `4-bit` quantized models with the installed
version of bitsandbytes"). From 0.43.0 on a quantized ``Params4bit`` moves without being quantized
again (``bnb_quantized``), and a module move keeps its ``Params4bit`` objects, so what 0.43.2
(bitsandbytes#1279) changed, the ``quant_storage`` of the parameter ``Params4bit.to`` returns, does
not reach a model move. What does is ``quant_state.code``, which ``QuantState.to`` leaves behind
before 0.45.3.

When ``PreTrainedModel.to`` / ``.cuda`` refuse to move a 4-bit model (no 8-bit weights, no dtype
asked for), the wrapper moves it as transformers 4.45 does where it allows the move (the
``torch.nn.Module`` method), then puts every 4-bit weight's quant state on the weight's device and
marks the weight quantized. 8-bit models and dtype casts are refused as before. transformers
4.45.0 to 4.52.x do not refuse ``.cuda()`` on a 4-bit model with bitsandbytes >= 0.43.2 but return
None without moving it (``return super().cuda()`` sits in the branch for unquantized models); there
the wrapper makes the same move and returns the model. Before 0.43.0
``Params4bit.to`` quantizes the packed data again on a move to the GPU (bitsandbytes#937), so the
shim leaves those releases alone. A model that accelerate dispatched keeps its hooks;
``hooks-follow-moved-weights`` points them at the new device. Models loaded before ``install()``
keep the unwrapped ``to`` that accelerate's guard captured.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    bnb-4bit-to-requires-0.43.2
        affected: bitsandbytes <0.43.2
        fixed in: bitsandbytes 0.43.2
    transformers-4bit-cuda-noop
        affected: transformers >=4.45.0,<4.53.0; bitsandbytes >=0.43.2
        fixed in: transformers 4.53.0
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Tuple

from devmap_shims.devices.bnb_params import bnb_kinds
from devmap_shims.devices.quant_state import align_state, quant_state_of, state_tensors
from devmap_shims.scenarios import BugObserved, import_before_simulation, scenario
from devmap_shims.shims import LazyLogger, Shim, Target, library_call

BUG_ID = "bnb-4bit-to-requires-0.43.2"
CUDA_BUG = "transformers-4bit-cuda-noop"
#: where Params4bit.to moves a quantized weight without quantizing it again (bnb_quantized)
MOVES_WITHOUT_REQUANTIZING = {"bitsandbytes": ">=0.43.0"}

logger = LazyLogger(__name__)


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


def quant_states(model: Any) -> List[Tuple[Any, Any]]:
    """``(weight, quant state)`` of every 4-bit weight of ``model``."""
    found = []
    for param in model.parameters():
        state = quant_state_of(param)
        if state is not None:
            found.append((param, state))
    return found


def _move(method: str, wrapped: Callable[..., Any], model: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The library's ``method``; where it refuses a 4-bit model, the ``torch.nn.Module`` move instead."""
    try:
        result = wrapped(*args, **kwargs)
    except ValueError:
        if not is_4bit_model(model) or (method == "to" and _casts(args, kwargs)):
            raise
        return _module_move(method, model, args, kwargs, "refused to move")
    if result is None and method == "cuda" and is_4bit_model(model):  # 4.45-4.52: fell off the end
        return _module_move(method, model, args, kwargs, "returned None from .cuda() for")
    return result


def _module_move(method: str, model: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], what: str) -> Any:
    """``torch.nn.Module``'s ``method`` on the 4-bit ``model``, its weights marked quantized and
    every quant-state tensor on its weight's device."""
    import sys

    base = sys.modules["transformers.modeling_utils"].PreTrainedModel
    for param, _state in quant_states(model):
        param.__dict__["bnb_quantized"] = True  # packed data: the move must not quantize it again
    # torch's own move, as transformers' fixed releases call it: its errors (no memory left, an
    # argument torch's method does not take) are the user's, not the repair's
    result = library_call(getattr(super(base, model), method), *args, **kwargs)
    strays = 0
    for param, state in quant_states(model):  # read again: a move may have replaced the parameters
        param.__dict__["bnb_quantized"] = True
        strays += align_state(state, param.device)
    logger.debug("%s.%s: moved the 4-bit model transformers %s (%d quant-state tensors followed)",
                 type(model).__name__, method, what, strays)
    return result


def move_4bit_model_to(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``PreTrainedModel.to``: a 4-bit model transformers refuses to move is moved."""
    return _move("to", wrapped, instance, args, kwargs)


def move_4bit_model_cuda(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``PreTrainedModel.cuda``: a 4-bit model transformers refuses to move is moved."""
    return _move("cuda", wrapped, instance, args, kwargs)


SHIM = Shim(
    id="four-bit-models-move",
    fixes=(BUG_ID, CUDA_BUG),
    targets=(
        Target("transformers.modeling_utils", "PreTrainedModel.to", when=MOVES_WITHOUT_REQUANTIZING,
               wrapper=move_4bit_model_to),
        Target("transformers.modeling_utils", "PreTrainedModel.cuda", when=MOVES_WITHOUT_REQUANTIZING,
               wrapper=move_4bit_model_cuda),
    ),
    summary="move 4-bit transformers models that transformers refuses to move, with their whole quant state",
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


@scenario(CUDA_BUG, "a 4-bit Llama loaded on cuda:0, then model = model.cuda(1)",
          needs=("torch", "bitsandbytes", "transformers", "accelerate"))
def four_bit_model_cuda_to_second_gpu() -> str:
    import_before_simulation("bitsandbytes")
    import torch
    from transformers import AutoModelForCausalLM

    from devmap_shims.scenarios import ScenarioUnavailable
    from devmap_shims.testing import simulated_gpus

    path = prequantized_llama_dir()
    with simulated_gpus(2, memory="2GiB"), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, device_map={"": 0})
        try:
            moved = model.cuda(1)
        except ValueError as exc:  # transformers < 4.45 (or bitsandbytes < 0.43.2): bnb-4bit-to-requires-0.43.2
            raise ScenarioUnavailable(f"transformers refuses .cuda() on 4-bit models here: {str(exc).splitlines()[0]}") from exc
        if moved is not model:
            where = sorted({str(p.device) for p in model.parameters()})
            raise BugObserved(f"model.cuda(1) returned {moved!r}; the model's parameters are on {', '.join(where)}")
        wrong = differences(four_bit_state(model), four_bit_state(AutoModelForCausalLM.from_pretrained(path, device_map={"": 1})))
        if wrong:
            raise BugObserved(f"after model.cuda(1), {len(wrong)} entries differ from a fresh load on cuda:1: " + "; ".join(wrong[:4]))
        return "model.cuda(1) returned the model, equal to a fresh load on cuda:1"
