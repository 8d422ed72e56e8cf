"""After a diffusers ``pipe.to()`` / ``model.to()``, bring quantization state to its weights.

Bug ``diffusers-quantized-load-on-current-device`` (huggingface/diffusers#10798, fixed in diffusers
0.33.0 by huggingface/diffusers#10604): diffusers 0.31-0.32 quantize bitsandbytes components on
``torch.cuda.current_device()`` (cuda:0), so their quant state is created there; with bitsandbytes
< 0.45.3 a later ``pipe.to("cuda:1")`` leaves the NF4 ``code`` table behind
(bnb-quantstate-code-not-moved) and inference fails with "Input tensors need to be on the same GPU".
Those diffusers releases also refuse ``device_map`` for quantized models (NotImplementedError), so a
user cannot ask for the load to happen on cuda:1 in the first place.

Repairs:

* ``DiffusionPipeline.to`` and ``ModelMixin.to`` / ``.cuda``: after the original move, every
  component is swept for bitsandbytes parameters whose quant-state tensors are not on the
  parameter's device, and those tensors are moved (one INFO line per pipeline sweep on the logger
  ``devmap_shims.hooks.pipeline_to``, naming the bug and how many tensors moved). A model ``.to``
  inside a pipeline ``.to`` leaves the sweep to the pipeline.
* ``ModelMixin.from_pretrained`` with a single-GPU ``device_map`` (``{"": "cuda:1"}``, ``"cuda:1"``,
  ``1``, ``torch.device("cuda", 1)``) for a bitsandbytes-quantized load: the map is dropped and the
  load runs with that GPU as the current device, so diffusers quantizes there and every tensor,
  quant state included, ends up on it (what diffusers >= 0.33 does with such a map).
"""

from __future__ import annotations

import threading
TYPE_CHECKING = False
if TYPE_CHECKING:  # typing and logging would cost install() its start-up budget
    from typing import Any, Callable, Dict, Optional, Tuple

from devmap_shims.hooks._lazy import LazyLogger
from devmap_shims.shims import Shim, Target

BUG_ID = "diffusers-quantized-load-on-current-device"
SHIM_ID = "pipeline-to-sweep"

logger = LazyLogger("devmap_shims.hooks.pipeline_to")

_HERE = "devmap_shims.hooks.pipeline_to"

SHIMS = (
    Shim(
        id=SHIM_ID,
        fixes=(BUG_ID,),
        targets=(
            Target(
                "diffusers.pipelines.pipeline_utils",
                "DiffusionPipeline.to",
                wrapper=f"{_HERE}:repair_pipeline_to",
            ),
            Target("diffusers.models.modeling_utils", "ModelMixin.to", wrapper=f"{_HERE}:repair_model_to"),
            Target("diffusers.models.modeling_utils", "ModelMixin.cuda", wrapper=f"{_HERE}:repair_model_to"),
            Target(
                "diffusers.models.modeling_utils",
                "ModelMixin.from_pretrained",
                expect_params=("pretrained_model_name_or_path",),
                wrapper=f"{_HERE}:repair_from_pretrained",
            ),
        ),
        summary="after pipe.to()/model.to() move quant state left on the load GPU; honour a one-GPU device_map "
        "for quantized loads",
    ),
)

_local = threading.local()


def _depth() -> int:
    return getattr(_local, "depth", 0)


class _Moving:
    """Marks a pipeline move in progress on this thread (model moves inside it do not sweep)."""

    def __enter__(self) -> None:
        _local.depth = _depth() + 1

    def __exit__(self, *exc: Any) -> None:
        _local.depth = _depth() - 1


# -- the sweep ------------------------------------------------------------------------------------
def sweep_module(module: Any) -> int:
    """Move every quant-state tensor of ``module`` onto its parameter's device; returns how many moved.

    Parameters on ``meta`` are skipped (their data lives elsewhere, e.g. offloaded by accelerate).
    The walk reads ``_modules`` / ``_parameters`` directly instead of ``named_modules()``, and
    checks the QuantState layout of the affected bitsandbytes releases: the sweep runs after every
    move of a pipeline whose transformer has hundreds of 4-bit layers.
    """
    from devmap_shims.hooks.quant_state import align_known_state

    moved = 0
    stack = [module]
    seen = set()
    while stack:
        sub = stack.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        children = sub._modules
        if children:
            stack.extend(child for child in children.values() if child is not None)
        params = sub._parameters
        if not params:
            continue
        weight_state = weight_device = None
        for name, param in params.items():
            if param is None:
                continue
            namespace = getattr(param, "__dict__", None)
            state = namespace.get("quant_state") if namespace else None
            if state is None:
                continue
            device = param.device
            if name == "weight":
                weight_state, weight_device = state, device
            if device.type != "meta":
                moved += align_known_state(state, device)
        module_state = sub.__dict__.get("quant_state")
        if (
            module_state is not None
            and module_state is not weight_state
            and weight_device is not None
            and weight_device.type != "meta"
        ):
            moved += align_known_state(module_state, weight_device)
    return moved


def sweep_pipeline(pipeline: Any) -> Tuple[int, int]:
    """:func:`sweep_module` over every torch module among ``pipeline.components``: ``(moved, modules)``."""
    import torch

    moved = modules = 0
    for component in (getattr(pipeline, "components", None) or {}).values():
        if isinstance(component, torch.nn.Module):
            modules += 1
            moved += sweep_module(component)
    return moved, modules


def _describe_call(owner: Any, method: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{type(owner).__name__}.{method}({', '.join(shown)})"


# -- wrappers ---------------------------------------------------------------------------------------
def repair_pipeline_to(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``DiffusionPipeline.to``, then one sweep over its components."""
    with _Moving():
        result = wrapped(*args, **kwargs)
    if _depth() == 0 and instance is not None:
        moved, modules = sweep_pipeline(instance)
        logger.info(
            "devmap_shims: %s after %s: moved %d quantization-state tensor(s) of %d component(s) onto their "
            "weights' devices (shim %s)",
            BUG_ID,
            _describe_call(instance, "to", args, kwargs),
            moved,
            modules,
            SHIM_ID,
        )
    return result


def repair_model_to(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``ModelMixin.to`` / ``.cuda``, then a sweep of the model unless a pipeline move sweeps later."""
    result = wrapped(*args, **kwargs)
    if _depth() == 0 and instance is not None:
        moved = sweep_module(instance)
        if moved:
            logger.info(
                "devmap_shims: %s after %s: moved %d quantization-state tensor(s) onto their weights' devices "
                "(shim %s)",
                BUG_ID,
                _describe_call(instance, getattr(wrapped, "__name__", "to"), args, kwargs),
                moved,
                SHIM_ID,
            )
    return result


# -- loads ----------------------------------------------------------------------------------------
def single_cuda_index(device_map: Any) -> Optional[int]:
    """The GPU index of a device map that puts the whole model on one CUDA device, else None."""
    import torch

    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            return None
        device_map = device_map[""]
    if isinstance(device_map, bool):
        return None
    if isinstance(device_map, int):
        return device_map if device_map >= 0 else None
    if isinstance(device_map, (str, torch.device)):
        try:
            device = torch.device(device_map)
        except (RuntimeError, TypeError):
            return None  # "auto", "balanced" ...
        if device.type != "cuda":
            return None
        return device.index if device.index is not None else torch.cuda.current_device()
    return None


_HUB_KWARGS = (
    "cache_dir",
    "force_download",
    "proxies",
    "local_files_only",
    "token",
    "use_auth_token",
    "revision",
    "subfolder",
)


def _is_bnb_quantized_load(cls: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    config = kwargs.get("quantization_config")
    if config is None:
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if source is None:
            return False
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        try:
            loaded = cls.load_config(source, **hub)
        except Exception:  # the original call will report a missing or broken config itself
            return False
        if isinstance(loaded, tuple):
            loaded = loaded[0]
        config = loaded.get("quantization_config") if isinstance(loaded, dict) else None
    if config is None:
        return False
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return "bitsandbytes" in str(getattr(method, "value", method))


def repair_from_pretrained(
    wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """``ModelMixin.from_pretrained`` that loads a bitsandbytes model onto the GPU its one-GPU map names."""
    index = single_cuda_index(kwargs.get("device_map"))
    if index is None or not _is_bnb_quantized_load(instance, args, kwargs):
        return wrapped(*args, **kwargs)
    import torch

    if index >= torch.cuda.device_count():
        return wrapped(*args, **kwargs)  # let diffusers report the bad map
    kwargs = {k: v for k, v in kwargs.items() if k != "device_map"}
    logger.info(
        "devmap_shims: %s: loading %s on cuda:%d as the current device instead of passing device_map, which "
        "this diffusers refuses for quantized models (shim %s)",
        BUG_ID,
        getattr(instance, "__name__", "model"),
        index,
        SHIM_ID,
    )
    with torch.cuda.device(index):
        model = wrapped(*args, **kwargs)
    sweep_module(model)
    return model


__all__ = [
    "BUG_ID",
    "SHIMS",
    "SHIM_ID",
    "repair_from_pretrained",
    "repair_model_to",
    "repair_pipeline_to",
    "single_cuda_index",
    "sweep_module",
    "sweep_pipeline",
]
