"""Shim ``lora-keeps-alignment-hooks``: ``load_lora_weights`` leaves a component's accelerate hooks in
place when they only align devices, instead of turning sequential CPU offload on.

Before loading a LoRA, diffusers asks which components are CPU-offloaded
(``_func_optionally_disable_offloading`` from 0.32.2, before that the classmethod
``_optionally_disable_offloading`` of the LoRA, UNet and PEFT loader mixins). It counts any
component whose top hook is an ``AlignDevicesHook`` as sequentially offloaded, strips its hooks, and
calls ``enable_sequential_cpu_offload()`` once the LoRA is in. A component split over several GPUs
with a ``device_map``, or a bitsandbytes model whose hooks accelerate forces, carries such hooks
without offloading anything: after ``load_lora_weights`` its weights sit on ``meta`` and stream from
the CPU at every forward, many times slower, with one INFO line as the only sign ("Accelerate hooks
detected. Since you have called `load_lora_weights()`, the previous hooks will be first removed...").

The wrapper hides, for the duration of that check, the top hook of each component whose hooks only
align devices (no hook in it has ``offload=True``, none is a model-offload ``CpuOffload``): diffusers
then neither strips them nor turns offload on for them, and the wrapper puts them back untouched. Components
that really are offloaded (sequentially, or with model CPU offload) are seen and handled by
diffusers as before. The copies imported by name (``diffusers.loaders.peft``,
``diffusers.loaders.unet``) are rebound to the wrapped function. diffusers 0.21 checks inline in
``load_lora_weights`` or in code it calls (``LoraLoaderMixin`` and the five SDXL pipelines that have
their own): there the hooks are hidden for the whole call. Not covered: ``load_textual_inversion``, and without peft the
inline check of ``UNet2DConditionLoadersMixin.load_attn_procs`` (0.22-0.28).

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    diffusers-lora-align-hooks-as-seq-offload
        affected: diffusers >=0.21.0
        fixed in: unfixed (last checked 2026-11-24)
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Tuple

from devmap_shims.devices.accelerate_hooks import any_offloading, hooks_of
from devmap_shims.scenarios import BugObserved, ScenarioUnavailable, scenario
from devmap_shims.shims import LazyLogger, Shim, Target

BUG_ID = "diffusers-lora-align-hooks-as-seq-offload"

logger = LazyLogger(__name__)


def _pipeline_argument(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return kwargs["_pipeline"] if "_pipeline" in kwargs else (args[0] if args else None)


def alignment_only_components(pipeline: Any) -> List[Tuple[str, Any]]:
    """``[(name, component)]`` of the pipeline's components whose top accelerate hook is an
    ``AlignDevicesHook`` while no hook anywhere in them offloads: the ones diffusers would take for
    sequential CPU offload. Empty when the pipeline itself is device-mapped (diffusers then skips
    its check) or is not a pipeline."""
    if pipeline is None or getattr(pipeline, "hf_device_map", None) is not None:
        return []
    components = getattr(pipeline, "components", None)
    if not isinstance(components, dict):
        return []
    try:
        from accelerate.hooks import AlignDevicesHook
    except ImportError:
        return []
    found = []
    for name, component in components.items():
        if not callable(getattr(component, "modules", None)) or "_hf_hook" not in vars(component):
            continue
        if any(isinstance(hook, AlignDevicesHook) for hook in hooks_of(component)) and not any_offloading(component):
            found.append((name, component))
    return found


def _hiding_alignment_hooks(pipeline: Any, call: Callable[[], Any]) -> Any:
    """``call()`` with the top hook of the pipeline's alignment-only components out of sight, put
    back afterwards whatever happens."""
    hidden = [(name, component, vars(component).pop("_hf_hook"))
              for name, component in alignment_only_components(pipeline)]
    if not hidden:
        return call()
    try:
        return call()
    finally:
        for _, component, hook in hidden:
            vars(component).setdefault("_hf_hook", hook)
        logger.debug("load_lora_weights: kept the alignment hooks of %s (nothing offloaded), no sequential "
                     "CPU offload", ", ".join(name for name, _, _ in hidden))


def keep_alignment_hooks(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """diffusers' offload check before loading a LoRA (``_pipeline`` is its argument), blind to the
    hooks that only align devices."""
    return _hiding_alignment_hooks(_pipeline_argument(args, kwargs), lambda: wrapped(*args, **kwargs))


def keep_alignment_hooks_while_loading(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """diffusers 0.21's ``load_lora_weights``, which checks inline: the hooks that only align devices
    are out of its sight for the whole call (nothing runs a forward while a LoRA is loaded)."""
    return _hiding_alignment_hooks(instance, lambda: wrapped(*args, **kwargs))


_CHECK = "_optionally_disable_offloading"
_LOAD = "load_lora_weights"
_SDXL = "diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl"
_SDXL_CONTROLNET = "diffusers.pipelines.controlnet.pipeline_controlnet"


def _load_target(module: str, owner: str) -> Target:
    return Target(module, f"{owner}.{_LOAD}", when={"diffusers": ">=0.21.0,<0.22.0"},
                  expect_params=("pretrained_model_name_or_path_or_dict",), wrapper=keep_alignment_hooks_while_loading)


def _check_target(module: str, owner: str, when: str | None = None) -> Target:
    return Target(module, f"{owner}.{_CHECK}", when={"diffusers": when} if when else None, expect_params=("_pipeline",))


# From 0.32.2 the classmethods call the module function, wrapped itself; LoraBaseMixin's stays
# wrapped there too (the second wrapper finds nothing left to hide).
SHIM = Shim(
    id="lora-keeps-alignment-hooks",
    fixes=(BUG_ID,),
    targets=(
        Target("diffusers.loaders.lora_base", "_func_optionally_disable_offloading", when={"diffusers": ">=0.32.2"},
               expect_params=("_pipeline",)),
        _check_target("diffusers.loaders.lora_base", "LoraBaseMixin"),
        _check_target("diffusers.loaders.peft", "PeftAdapterMixin", ">=0.32.0,<0.32.2"),
        _check_target("diffusers.loaders.unet", "UNet2DConditionLoadersMixin", ">=0.29.0,<0.32.2"),
        _check_target("diffusers.loaders.lora", "LoraLoaderMixin", "<0.30.0"),
        _check_target("diffusers.loaders.lora", "SD3LoraLoaderMixin", ">=0.29.0,<0.30.0"),
        _check_target("diffusers.loaders", "LoraLoaderMixin", ">=0.22.0,<0.24.0"),
        _load_target("diffusers.loaders", "LoraLoaderMixin"),
        _load_target(_SDXL, "StableDiffusionXLPipeline"),
        _load_target(f"{_SDXL}_img2img", "StableDiffusionXLImg2ImgPipeline"),
        _load_target(f"{_SDXL}_inpaint", "StableDiffusionXLInpaintPipeline"),
        _load_target(f"{_SDXL_CONTROLNET}_sd_xl", "StableDiffusionXLControlNetPipeline"),
        _load_target(f"{_SDXL_CONTROLNET}_inpaint_sd_xl", "StableDiffusionXLControlNetInpaintPipeline"),
    ),
    wrapper=keep_alignment_hooks,
    summary="load_lora_weights keeps alignment-only accelerate hooks instead of turning sequential CPU offload on",
)


# -- scenario ---------------------------------------------------------------------------------------
#: the tiny Flux transformer split over two GPUs: the double-stream block on cuda:0, the rest on cuda:1
SPLIT_MAP = {
    "pos_embed": 0, "time_text_embed": 0, "context_embedder": 0, "x_embedder": 0, "transformer_blocks": 0,
    "single_transformer_blocks": 1, "norm_out": 1, "proj_out": 1,
}


@scenario(BUG_ID, "a Flux transformer split over two GPUs with a device_map, then pipe.load_lora_weights(...) and a run",
          needs=("torch", "diffusers", "transformers", "accelerate", "peft"))
def lora_on_a_transformer_split_over_two_gpus() -> str:
    import torch

    from devmap_shims.scenarios import flux
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import tiny_lora_state_dict

    base = flux.prepare()  # ScenarioUnavailable where diffusers has no Flux pipeline
    from diffusers import FluxTransformer2DModel
    from diffusers.utils import USE_PEFT_BACKEND

    if not USE_PEFT_BACKEND:
        raise ScenarioUnavailable("diffusers loads LoRAs into Flux only with its PEFT backend (peft too old)")
    path = flux.transformer_dir(base.transformer)
    lora = tiny_lora_state_dict(base.transformer)
    with torch.no_grad():
        plain = flux.tiny_image(base)
        on_cpu = flux.pipeline_with(base, FluxTransformer2DModel.from_pretrained(path))
        on_cpu.load_lora_weights(dict(lora))
        reference = flux.tiny_image(on_cpu)
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = FluxTransformer2DModel.from_pretrained(path, device_map=SPLIT_MAP)
        pipe = flux.pipeline_with(base, transformer)
        for name in ("text_encoder", "text_encoder_2", "vae"):
            getattr(pipe, name).to("cuda:0")
        pipe.load_lora_weights(dict(lora))
        offloading = sum(1 for m in pipe.transformer.modules() for h in hooks_of(m) if getattr(h, "offload", False))
        devices = sorted({str(p.device) for p in pipe.transformer.parameters()})
        if offloading or devices != ["cuda:0", "cuda:1"]:
            raise BugObserved(
                f"after load_lora_weights the transformer split over cuda:0 and cuda:1 is sequentially CPU-offloaded: "
                f"{offloading} hook(s) offload, its weights are on {devices}"
            )
        image = flux.tiny_image(pipe)
    if torch.allclose(image, plain, atol=1e-4):
        raise BugObserved("the split transformer's image is the one without the LoRA")
    if not torch.allclose(image, reference, atol=1e-4):
        raise BugObserved(f"the split transformer's LoRA image differs from the CPU's by {(image - reference).abs().max():.3g}")
    return "transformer split over cuda:0 and cuda:1 keeps its placement through load_lora_weights; image has the LoRA"
