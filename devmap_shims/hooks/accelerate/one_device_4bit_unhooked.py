"""Shim ``one-device-4bit-unhooked``: ``dispatch_model`` leaves a 4-bit bitsandbytes model mapped to
one GPU without accelerate hooks, as accelerate 1.2.0 does.

Before 1.2.0 ``dispatch_model`` attached ``AlignDevicesHook``s to every bitsandbytes model, even one
whose whole device map is a single GPU, because moving quantized weights used to lose their state.
With bitsandbytes >= 0.43.2 a 4-bit model moves whole, and the hooks only get in the way: diffusers'
``DiffusionPipeline.to`` takes a hooked component for a sequentially offloaded one and refuses to
move the pipeline. After ``dispatch_model`` returns, when the map names one GPU, ``force_hooks`` was
not asked for and the model is loaded in 4-bit (not 8-bit), the wrapper removes the hooks and the
``to``/``cuda`` guards accelerate put on the model; the weights are already on that GPU. 8-bit models,
and 4-bit ones with bitsandbytes < 0.43.2, keep their hooks, as they do on accelerate 1.2.0.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    accelerate-bnb-forced-hooks
        affected: accelerate <1.2.0; bitsandbytes >=0.43.2
        fixed in: accelerate 1.2.0
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.calls import argument
from devmap_shims.devices.accelerate_hooks import one_gpu, remove_hooks
from devmap_shims.devices.bnb_params import bnb_kinds, bnb_moves_4bit
from devmap_shims.scenarios import BugObserved, scenario
from devmap_shims.shims import LazyLogger, Shim, Target

BUG_ID = "accelerate-bnb-forced-hooks"

logger = LazyLogger(__name__)


def unhook_one_device_4bit(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``dispatch_model``, then the hooks it forced on a one-GPU 4-bit model are removed."""
    result = wrapped(*args, **kwargs)
    _, model = argument(wrapped, "model", args, kwargs)
    _, device_map = argument(wrapped, "device_map", args, kwargs)
    _, force_hooks = argument(wrapped, "force_hooks", args, kwargs)
    if (
        not force_hooks and one_gpu(device_map) and hasattr(model, "_hf_hook")
        and getattr(model, "quantization_method", "bitsandbytes") == "bitsandbytes" and bnb_kinds(model) == {"Params4bit"}
        and bnb_moves_4bit()
    ):
        remove_hooks(model)
        logger.debug("dispatch_model: removed the hooks of %s, a 4-bit model on %s alone",
                     type(model).__name__, next(iter(device_map.values())))
    return result


SHIM = Shim(
    id="one-device-4bit-unhooked",
    fixes=(BUG_ID,),
    targets=(
        Target("accelerate.big_modeling", "dispatch_model", expect_params=("model", "device_map", "force_hooks"),
               wrapper=unhook_one_device_4bit),
    ),
    summary="remove the hooks dispatch_model forces on a 4-bit model that sits on one GPU",
)


# -- scenario ---------------------------------------------------------------------------------------
@scenario(BUG_ID, "a Flux pipeline with a pre-quantized 4-bit CLIP text encoder loaded by transformers: pipe.to('cuda')",
          needs=("torch", "bitsandbytes", "diffusers", "transformers", "accelerate"))
def pipe_to_cuda_with_a_4bit_text_encoder() -> str:
    import torch

    from devmap_shims.scenarios import flux
    from devmap_shims.testing import simulated_gpus

    base = flux.prepare()  # ScenarioUnavailable where diffusers has no Flux pipeline
    from diffusers import FluxPipeline
    from transformers import CLIPTextModel

    path = flux.prequantized_text_encoder_dir(base.text_encoder)
    with simulated_gpus(2, memory="2GiB"):
        encoder = CLIPTextModel.from_pretrained(path)  # the quantizer maps it to the current GPU
        hooked = "with accelerate hooks" if hasattr(encoder, "_hf_hook") else "without hooks"
        pipe = FluxPipeline(**{**base.components, "text_encoder": encoder})
        pipe.to("cuda")
        devices = {name: str(next(module.parameters()).device) for name, module in pipe.components.items()
                   if isinstance(module, torch.nn.Module)}
        off = {name: device for name, device in devices.items() if device != "cuda:0"}
        if off:
            raise BugObserved(f"after pipe.to('cuda') these components are elsewhere: {off}")
        return f"4-bit text encoder {hooked}; pipe.to('cuda'): {len(devices)} components on cuda:0"
