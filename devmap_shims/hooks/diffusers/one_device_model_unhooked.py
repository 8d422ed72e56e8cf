"""Shim ``one-device-model-unhooked``: a diffusers model loaded with a ``device_map`` that names one
GPU comes back without accelerate hooks, as diffusers 0.33 does.

diffusers 0.28-0.32 load every ``device_map`` with ``load_checkpoint_and_dispatch(...,
force_hooks=True)``, so a model mapped whole to one GPU (``{"": 0}``, or ``"auto"`` on a machine
where it fits one GPU) carries alignment hooks. ``DiffusionPipeline.to`` takes any such hook for
sequential CPU offload and raises "It seems like you have activated sequential model offloading by
calling `enable_sequential_cpu_offload`, but are now attempting to move the pipeline to GPU", and
``load_lora_weights`` strips the hooks and turns real sequential offload on. After
``ModelMixin.from_pretrained`` returns, when ``hf_device_map`` names one GPU, no hook offloads and
the installed bitsandbytes can move the model's quantized weights (if any), the wrapper removes the
hooks and the ``to``/``cuda`` guards; the weights are already on that GPU.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    diffusers-device-map-forces-hooks-single-gpu
        affected: diffusers >=0.28.0,<0.33.0
        fixed in: diffusers 0.33.0
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.devices.accelerate_hooks import any_hooks, any_offloading, one_gpu, remove_hooks
from devmap_shims.devices.bnb_params import bnb_movable
from devmap_shims.scenarios import BugObserved, scenario
from devmap_shims.shims import LazyLogger, Shim, Target

BUG_ID = "diffusers-device-map-forces-hooks-single-gpu"

logger = LazyLogger(__name__)


def unhook_one_device_model(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``ModelMixin.from_pretrained``, then the hooks forced on a one-GPU model are removed."""
    model = wrapped(*args, **kwargs)
    device_map = getattr(model, "hf_device_map", None)
    if (
        one_gpu(device_map) and hasattr(model, "modules") and any_hooks(model)
        and not any_offloading(model) and bnb_movable(model)
    ):
        remove_hooks(model)
        logger.debug("from_pretrained: removed the hooks of %s, loaded on %s alone",
                     type(model).__name__, next(iter(device_map.values())))
    return model


SHIM = Shim(
    id="one-device-model-unhooked",
    fixes=(BUG_ID,),
    targets=(Target("diffusers.models.modeling_utils", "ModelMixin.from_pretrained", wrapper=unhook_one_device_model),),
    summary="remove the hooks diffusers forces on a model whose device_map names one GPU",
)


# -- scenario ---------------------------------------------------------------------------------------
@scenario(BUG_ID, "a Flux transformer loaded with device_map={'': 0}, put in a pipeline, pipe.to('cuda') and run",
          needs=("torch", "diffusers", "transformers", "accelerate"))
def pipe_to_cuda_with_a_one_gpu_device_map() -> str:
    import torch

    from devmap_shims.scenarios import flux
    from devmap_shims.testing import simulated_gpus

    base = flux.prepare()  # ScenarioUnavailable where diffusers has no Flux pipeline
    path = flux.transformer_dir(base.transformer)
    with torch.no_grad():
        reference = flux.tiny_image(base)
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        from diffusers import FluxTransformer2DModel

        transformer = FluxTransformer2DModel.from_pretrained(path, device_map={"": 0})
        pipe = flux.pipeline_with(base, transformer)
        pipe.to("cuda")
        devices = sorted({str(p.device) for m in pipe.components.values() if isinstance(m, torch.nn.Module)
                          for p in m.parameters()})
        if devices != ["cuda:0"]:
            raise BugObserved(f"after pipe.to('cuda') the pipeline's weights are on {devices}")
        image = flux.tiny_image(pipe)
    if not torch.allclose(image, reference, atol=1e-4):
        raise BugObserved(f"the image on cuda:0 differs from the CPU's by {(image - reference).abs().max():.3g}")
    return "transformer loaded with device_map={'': 0}; pipe.to('cuda') and a run on cuda:0 give the CPU's image"
