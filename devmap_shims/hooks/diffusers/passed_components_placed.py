"""Shim ``passed-components-placed``: a component passed to ``DiffusionPipeline.from_pretrained``
together with ``device_map="balanced"`` is placed where ``pipe.hf_device_map`` says, as the
components the pipeline loads itself are.

The balanced planner (``pipeline_loading_utils._get_final_device_map``) counts the passed
component and gives it a GPU, but the loading loop (step "7.3") takes the passed object as it is:
it stays on the CPU (or on the GPU it was quantized on) and, unlike the loaded components, has no
accelerate hook to bring its inputs over, so the pipeline call fails with "Expected all tensors to
be on the same device". After ``from_pretrained`` returns, for each component passed by keyword
that the map puts on a GPU, the wrapper does what diffusers' ``load_sub_model`` does for the
components it loads: ``dispatch_model(component, device_map={"": gpu}, force_hooks=True)``, which
moves the weights and adds the hook that aligns the inputs (a plain ``.to(gpu)`` is not enough: the
pipeline runs on the execution device of another component).

* unquantized torch module without accelerate hooks: dispatched as above;
* bitsandbytes-quantized: moved with its own ``.to(gpu)`` and then dispatched, only where the
  installed bitsandbytes can move its weights (4-bit 0.43.2, 8-bit 0.48.0) and the library lets
  the move through; otherwise it stays and a warning names it;
* a component that already carries accelerate hooks running it on the planned GPU (dispatched by
  the user) is left alone; one whose hooks run it elsewhere, or quantized by another method, stays
  where it is and a warning names the component, the planned device and what to do.

Nothing changes without ``device_map``, for string maps, for components the map puts on the CPU
and for components that were not passed.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    diffusers-balanced-passed-component-unplaced
        affected: diffusers >=0.28.0
        fixed in: unfixed (last checked 2026-11-24)
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, Tuple

from devmap_shims.devices.accelerate_hooks import any_hooks, as_device, execution_device
from devmap_shims.devices.bnb_params import bnb_kinds, bnb_movable
from devmap_shims.scenarios import BugObserved, ScenarioUnavailable, scenario
from devmap_shims.shims import LazyLogger, Shim, Target, with_context

BUG_ID = "diffusers-balanced-passed-component-unplaced"

logger = LazyLogger(__name__)


def planned_gpu(device_map: Any, name: str) -> Any:
    """The value ``device_map`` (a pipeline's ``hf_device_map`` dict) gives component ``name`` when
    it names a GPU (``0``, ``"cuda:1"``), else None (absent, cpu, disk, a string map)."""
    if not isinstance(device_map, dict) or name not in device_map:
        return None
    value = device_map[name]
    device = as_device(value)
    if device is None or device.type in ("cpu", "meta"):
        return None
    return value


def _other_quantization(module: Any) -> Optional[str]:
    """The quantization method of a module quantized by something other than bitsandbytes, or None."""
    quantizer = getattr(module, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if method is None and getattr(module, "is_quantized", False) is True:
        method = "an unknown method"
    method = getattr(method, "value", method)
    return None if method in (None, "bitsandbytes") else str(method)


def _dispatch(module: Any, gpu: Any) -> None:
    """``module`` on ``gpu`` with the hook diffusers' ``load_sub_model`` gives the components it loads."""
    from accelerate import dispatch_model

    kwargs: Dict[str, Any] = {"device_map": {"": gpu}, "force_hooks": True}
    skip_keys = getattr(module, "_skip_keys", None)
    if skip_keys is not None:
        kwargs["skip_keys"] = skip_keys
    dispatch_model(module, **kwargs)


def place(context: Any, name: str, module: Any, gpu: Any, device_map: Any) -> str:
    """Place the passed component ``name`` on ``gpu`` where it safely can; returns what was done
    (``"placed"``, ``"already"`` or ``"left"``), warning when it is left."""
    import torch

    if not isinstance(module, torch.nn.Module):
        return "already"
    target = as_device(gpu)

    def leave(why: str, todo: str) -> str:
        context.warn(
            f"DiffusionPipeline.from_pretrained(device_map={device_map!r}): pipe.hf_device_map puts the "
            f"passed component {name!r} ({type(module).__name__}) on {target}, but it was left where it is "
            f"because {why}. {todo}"
        )
        return "left"

    if any_hooks(module):
        runs_on = execution_device(module)
        if runs_on is not None and runs_on == target:
            return "already"
        return leave(
            f"it carries accelerate hooks that run it on {runs_on or 'the devices of its own device_map'}",
            f"Load it without a device_map (or with device_map={{'': {gpu!r}}}) before passing it, "
            "or leave it out and let the pipeline load it.",
        )
    other = _other_quantization(module)
    if other is not None:
        return leave(
            f"it is quantized with {other}, which this shim does not move",
            f"Load it with device_map={{'': {gpu!r}}} before passing it.",
        )
    kinds = bnb_kinds(module)
    if kinds:
        if not bnb_movable(module):
            return leave(
                f"the installed bitsandbytes cannot move its {'/'.join(sorted(kinds))} weights",
                f"Quantize it on that GPU (device_map={{'': {gpu!r}}}), or upgrade bitsandbytes "
                "(4-bit weights move from 0.43.2, 8-bit from 0.48.0).",
            )
        try:
            module.to(target)
        except (ValueError, RuntimeError, TypeError) as exc:  # the library refusing the move
            from devmap_shims.shims.guard import out_of_memory

            if out_of_memory(exc):  # part of it may have moved: the caller's, as from a fixed release
                raise
            return leave(
                f"its .to({str(target)!r}) raised {type(exc).__name__}: {exc}",
                f"Quantize it on that GPU (device_map={{'': {gpu!r}}}) before passing it.",
            )
    _dispatch(module, gpu)
    logger.debug("from_pretrained: placed the passed component %s on %s as hf_device_map says", name, target)
    return "placed"


@with_context
def place_passed_components(context: Any, wrapped: Callable[..., Any], instance: Any,
                            args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``DiffusionPipeline.from_pretrained``, then the components passed by keyword go where the
    pipeline's ``hf_device_map`` puts them."""
    pipe = wrapped(*args, **kwargs)
    device_map = kwargs.get("device_map")
    if device_map is None:
        return pipe
    planned = getattr(pipe, "hf_device_map", None)
    components = getattr(pipe, "components", None)
    if not isinstance(planned, dict) or not isinstance(components, dict):
        return pipe
    for name, value in kwargs.items():
        if value is None or components.get(name) is not value:
            continue
        gpu = planned_gpu(planned, name)
        if gpu is not None:
            place(context, name, value, gpu, device_map)
    return pipe


SHIM = Shim(
    id="passed-components-placed",
    fixes=(BUG_ID,),
    targets=(Target("diffusers.pipelines.pipeline_utils", "DiffusionPipeline.from_pretrained",
                    wrapper=place_passed_components),),
    summary="place the components passed to DiffusionPipeline.from_pretrained where its device_map puts them",
)


# -- scenario ---------------------------------------------------------------------------------------
def _saved_flux_pipeline() -> str:
    """A tiny Flux pipeline saved once per process (the same weights as ``tiny_flux_pipeline()``)."""
    import os

    from devmap_shims.scenarios.checkpoints import once, scratch_dir

    def make() -> str:
        from devmap_shims.testing.models.flux import save_tiny_flux_pipeline

        return str(save_tiny_flux_pipeline(os.path.join(scratch_dir("flux-pipeline"), "pipeline")))

    return once("flux-pipeline", make, os.path.isdir)


@scenario(BUG_ID, "a saved tiny Flux pipeline reloaded with transformer=<a CPU transformer>, "
          "device_map='balanced' on two GPUs, then run",
          needs=("torch", "diffusers", "transformers", "accelerate"))
def balanced_pipeline_with_a_passed_transformer() -> str:
    import torch

    from devmap_shims.scenarios import import_before_simulation
    from devmap_shims.testing import simulated_gpus

    import_before_simulation("diffusers", "transformers", "accelerate")
    from diffusers.pipelines import pipeline_utils

    if "balanced" not in getattr(pipeline_utils, "SUPPORTED_DEVICE_MAP", ()):
        raise ScenarioUnavailable("this diffusers has no pipeline-level device_map (added in 0.28.0)")
    try:
        from diffusers import FluxPipeline
    except ImportError as exc:  # diffusers < 0.30
        raise ScenarioUnavailable(f"this diffusers has no Flux pipeline ({exc})") from exc
    from devmap_shims.scenarios.flux import tiny_image
    from devmap_shims.testing.models import tiny_flux_pipeline

    path = _saved_flux_pipeline()
    base = tiny_flux_pipeline()  # the saved weights, on the CPU
    with torch.no_grad():
        reference = tiny_image(base)
    transformer = base.transformer
    # 4GiB: transformers 5 warms its allocator with up to (GPU size - 1.2GiB)
    with simulated_gpus(2, memory="4GiB"), torch.no_grad():
        pipe = FluxPipeline.from_pretrained(path, transformer=transformer, device_map="balanced")
        planned = pipe.hf_device_map["transformer"]
        found = sorted({str(p.device) for p in pipe.transformer.parameters()})
        if pipe.transformer is not transformer or found != [str(as_device(planned))]:
            raise BugObserved(f"pipe.hf_device_map puts the passed transformer on {planned}, "
                              f"its weights are on {found}")
        image = tiny_image(pipe)
    if not torch.allclose(image, reference, atol=1e-4):
        gap = (image - reference).abs().max()
        raise BugObserved(f"the balanced pipeline's image differs from the CPU's by {gap:.3g}")
    return (f"hf_device_map {dict(pipe.hf_device_map)}: the passed transformer runs on cuda:{planned}, "
            "the image equals the CPU's")
