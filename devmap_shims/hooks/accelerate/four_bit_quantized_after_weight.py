"""Shim ``four-bit-quantized-after-weight``: ``set_module_tensor_to_device`` quantizes a bitsandbytes
``Linear4bit`` only once its weight has arrived, as accelerate 0.31.0 does.

Loading a 4-bit model tensor by tensor (``load_checkpoint_in_model``, and so
``load_and_quantize_model`` with ``BnbQuantizationConfig(load_in_4bit=True)``) sets each tensor with
``set_module_tensor_to_device``. A safetensors checkpoint lists ``bias`` before ``weight``; on the
affected releases setting the bias of a ``Linear4bit`` on a GPU quantizes the layer's weight
(``module.weight.cuda(index)``) while that weight is still on the meta device, which fails. When the
call sets a tensor other than the weight of a ``Linear4bit`` whose unquantized weight is on meta,
and the target device is a GPU, the wrapper marks the weight as not to be quantized for the
duration of the call (its ``quant_state`` is what the library checks) and restores it afterwards;
the weight is quantized when its own value is set, as on fixed releases. Every other call goes
through unchanged.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    accelerate-4bit-meta-bias
        affected: accelerate >=0.20.0,<0.31.0; bitsandbytes (any version)
        fixed in: accelerate 0.31.0
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, Tuple

from devmap_shims.calls import argument
from devmap_shims.scenarios import BugObserved, import_before_simulation, scenario
from devmap_shims.shims import Shim, Target

BUG_ID = "accelerate-4bit-meta-bias"


class _AwaitingWeight:
    """Stands in for the quant state of a 4-bit weight still on meta while another tensor of its
    layer is set: the library quantizes only a weight whose ``quant_state`` is None."""

    def __repr__(self) -> str:
        return "<4-bit weight awaiting its value>"


AWAITING_WEIGHT = _AwaitingWeight()


def waiting_weight(module: Any, tensor_name: Any, device: Any) -> Optional[Any]:
    """The meta, unquantized weight of the ``Linear4bit`` that ``tensor_name`` (dotted, from
    ``module``) belongs to, when ``tensor_name`` is not that weight and ``device`` is a GPU; else None."""
    if module is None or not isinstance(tensor_name, str) or device is None:
        return None
    *path, name = tensor_name.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None  # the library says which attribute is missing
    if type(owner).__name__ != "Linear4bit" or name == "weight":  # accelerate matches the class name
        return None
    weight = getattr(owner, "_parameters", {}).get("weight")
    if weight is None or getattr(weight, "quant_state", None) is not None or str(weight.device) != "meta":
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        # a GPU index, as accelerate reads it (torch.device(1) raises on some torch releases
        # when no accelerator is visible)
        return weight if device >= 0 else None
    import torch

    try:
        if torch.device(device).type != "cuda":
            return None
    except (RuntimeError, TypeError):
        return None
    return weight


def quantize_after_weight(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``set_module_tensor_to_device`` that leaves a 4-bit weight still on meta unquantized."""
    _, module = argument(wrapped, "module", args, kwargs)
    _, tensor_name = argument(wrapped, "tensor_name", args, kwargs)
    _, device = argument(wrapped, "device", args, kwargs)
    weight = waiting_weight(module, tensor_name, device)
    if weight is None:
        return wrapped(*args, **kwargs)
    weight.quant_state = AWAITING_WEIGHT
    try:
        return wrapped(*args, **kwargs)
    finally:
        if getattr(weight, "quant_state", None) is AWAITING_WEIGHT:
            weight.quant_state = None


SHIM = Shim(
    id="four-bit-quantized-after-weight",
    fixes=(BUG_ID,),
    targets=(
        Target(
            "accelerate.utils.modeling",
            "set_module_tensor_to_device",
            expect_params=("module", "tensor_name", "device"),
            wrapper=quantize_after_weight,
        ),
    ),
    summary="set a 4-bit layer's bias without quantizing its weight while that weight is still on meta",
)


# -- scenario ---------------------------------------------------------------------------------------
@scenario(BUG_ID, "a 4-bit model made with init_empty_weights and replace_with_bnb_layers: "
          "set_module_tensor_to_device(model, '0.bias', 0, value=...) before the weight, as a safetensors load does",
          needs=("torch", "accelerate", "bitsandbytes"))
def bias_set_before_weight() -> str:
    # load_checkpoint_in_model (and load_and_quantize_model through it) makes exactly this call for
    # the first key of a safetensors file; the weight's own quantization that follows needs
    # bitsandbytes' CUDA kernel before 0.46, which no simulated GPU has, so the scenario stops here.
    import_before_simulation("bitsandbytes")
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import BnbQuantizationConfig, set_module_tensor_to_device
    from accelerate.utils.bnb import replace_with_bnb_layers

    from devmap_shims.testing import simulated_gpus

    bias = torch.randn(64, generator=torch.Generator().manual_seed(0))
    with simulated_gpus(2, memory="1GiB"):
        with init_empty_weights():
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
            model = replace_with_bnb_layers(model, BnbQuantizationConfig(load_in_4bit=True))
        layer = model[0]
        if type(layer).__name__ != "Linear4bit":
            raise AssertionError(f"replace_with_bnb_layers made {type(layer).__name__}, not Linear4bit")
        try:
            set_module_tensor_to_device(model, "0.bias", 0, value=bias)
        except NotImplementedError as exc:
            raise BugObserved(f"setting the bias quantized the Linear4bit's weight while it was on meta: {exc}") from exc
        weight = layer.weight
        if layer.bias.device != torch.device("cuda:0") or not torch.equal(layer.bias.detach().cpu(), bias):
            raise BugObserved(f"the bias was set on {layer.bias.device}, not on cuda:0 with the given value")
        if str(weight.device) != "meta" or weight.quant_state is not None:
            raise BugObserved(f"the weight was changed before its value arrived: {weight.device}, "
                              f"quant_state {weight.quant_state!r}")
        return "bias set on cuda:0; the Linear4bit's weight waits on meta, unquantized, for its own value"
