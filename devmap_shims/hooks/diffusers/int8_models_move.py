"""Shim ``int8-models-move``: an 8-bit bitsandbytes diffusers model moves with ``.to()``, alone or in
``pipe.to()``, where the installed bitsandbytes can move 8-bit weights (0.48.0 and later).

Before 0.37.0 diffusers refuses: ``ModelMixin.to``/``.cuda`` raise "`.to` is not supported for
`8-bit` bitsandbytes models" and ``DiffusionPipeline.to`` logs "... has been loaded in
`bitsandbytes` 8bit and moving it to cuda:1 via `.to()` is not supported" and leaves the component
where it was, so ``pipe.to("cuda:1")`` keeps the transformer on ``cuda:0``. diffusers 0.37.0 lets
the move through when bitsandbytes >= 0.48.0. A plain ``torch.nn.Module.to`` is not enough for a
model that has run, though: each ``Linear8bitLt`` keeps its int8 weights and scales in ``state``
(``CB``/``SCB``), which a module-level move does not reach, and accelerate (before 1.13) put
alignment hooks on the one-GPU 8-bit model that keep sending inputs to the old GPU. So the shim's
move removes those hooks (only when none of them offloads weights), moves the model, and points
every ``CB`` at the moved int8 weights and every ``SCB`` onto their device.

* ``ModelMixin.to`` / ``.cuda`` with a device and no dtype on an 8-bit model: moved as above
  instead of raising. A dtype still raises as before (8-bit weights cannot be cast).
* ``DiffusionPipeline.to`` with a device: the 8-bit diffusers components are moved as above and the
  pipeline's "not supported" warning is not logged for them. 8-bit transformers components (text
  encoders) are transformers' own models and stay where they are.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    diffusers-8bit-move-restriction-lifted
        affected: diffusers >=0.31.0,<0.37.0; bitsandbytes >=0.48.0
        fixed in: diffusers 0.37.0
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

from devmap_shims.devices.accelerate_hooks import any_hooks, any_offloading, as_device, remove_hooks
from devmap_shims.devices.bnb_params import bnb_moves_8bit
from devmap_shims.devices.int8_state import align_int8_state, is_int8_linear
from devmap_shims.scenarios import BugObserved, ScenarioUnavailable, scenario
from devmap_shims.shims import LazyLogger, Shim, Target

BUG_ID = "diffusers-8bit-move-restriction-lifted"
#: what DiffusionPipeline.to logs for an 8-bit component it leaves behind
PIPELINE_WARNING = "8bit and moving it to"

logger = LazyLogger(__name__)


def is_8bit_model(module: Any) -> bool:
    """A diffusers model loaded in 8-bit by bitsandbytes."""
    return bool(getattr(module, "is_loaded_in_8bit", False)) and hasattr(module, "modules")


def _diffusers_model(module: Any) -> bool:
    """A diffusers ``ModelMixin``: transformers' 8-bit models set ``is_loaded_in_8bit`` too, and
    their own ``.to()`` decides whether they move."""
    import sys

    mixin = getattr(sys.modules.get("diffusers.models.modeling_utils"), "ModelMixin", None)
    return isinstance(mixin, type) and isinstance(module, mixin)


def movable(model: Any) -> bool:
    """An 8-bit model this shim may move: bitsandbytes can, and no accelerate hook offloads it."""
    return is_8bit_model(model) and bnb_moves_8bit() and not any_offloading(model)


def move_8bit_model(model: Any, device: Any, non_blocking: bool = False, memory_format: Any = None) -> Any:
    """Move an 8-bit model whole: alignment hooks off, weights moved, ``Linear8bitLt`` state re-pointed."""
    import torch

    if any_hooks(model):  # the model itself included
        remove_hooks(model)
    # memory_format (None: keep each tensor's) reaches the unquantized 4-D weights, a UNet's convolutions
    torch.nn.Module.to(model, device, non_blocking=non_blocking, memory_format=memory_format)
    for module in model.modules():
        if is_int8_linear(module):
            align_int8_state(module)
    return model


def _device_of_to_call(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Optional[Any], bool, Any]:
    """The device, ``non_blocking`` and ``memory_format`` of a ``Module.to(...)`` call that names a
    device and no dtype; else ``(None, False, None)``. (A ``memory_format`` only reaches 4-D and 5-D
    tensors: an 8-bit model's unquantized convolutions, never its int8 weights.)"""
    import torch

    try:
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    except (TypeError, ValueError, RuntimeError):
        return None, False, None
    return (device, bool(non_blocking), memory_format) if dtype is None else (None, False, None)


def move_model_to(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``ModelMixin.to``: an 8-bit model is moved instead of refused."""
    device, non_blocking, memory_format = (
        _device_of_to_call(args, kwargs) if is_8bit_model(instance) else (None, False, None)
    )
    if device is None or not movable(instance):
        return wrapped(*args, **kwargs)
    return move_8bit_model(instance, device, non_blocking, memory_format)


def move_model_cuda(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``ModelMixin.cuda``: an 8-bit model is moved instead of refused."""
    index = args[0] if args else kwargs.get("device")
    device = as_device("cuda" if index is None else index)
    if device is None or not movable(instance):
        return wrapped(*args, **kwargs)
    return move_8bit_model(instance, device)


def _pipeline_device(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Any]:
    """The device a ``DiffusionPipeline.to(...)`` call names (``pipe.to("cuda:1")``,
    ``pipe.to("cuda", torch.float16)``, ``pipe.to(device=...)``), or None."""
    import torch

    device = kwargs.get("device")
    if device is None:
        device = next((a for a in args if isinstance(a, (str, torch.device))
                       or (isinstance(a, int) and not isinstance(a, bool))), None)
    return as_device(device)


def _drop_warning_for(class_names: List[str]) -> Callable[[Any], bool]:
    """A logging filter that drops the pipeline's "8bit ... not supported" warning for these classes."""

    def keep(record: Any) -> bool:
        message = record.getMessage()
        return not (PIPELINE_WARNING in message and any(f"'{name}'" in message for name in class_names))

    return keep


def move_pipeline_to(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``DiffusionPipeline.to``, then its 8-bit diffusers components join the others."""
    device = _pipeline_device(args, kwargs)
    components = getattr(instance, "components", None)
    left: List[Any] = []
    if device is not None and isinstance(components, dict):
        left = [module for module in components.values() if _diffusers_model(module) and movable(module)]
    if not left:
        return wrapped(*args, **kwargs)
    import logging

    pipeline_logger = logging.getLogger("diffusers.pipelines.pipeline_utils")
    quiet = _drop_warning_for([type(module).__name__ for module in left])
    pipeline_logger.addFilter(quiet)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        pipeline_logger.removeFilter(quiet)
    for module in left:
        move_8bit_model(module, device)
    logger.debug("pipe.to(%s): moved the 8-bit components %s", device, ", ".join(type(m).__name__ for m in left))
    return result


SHIM = Shim(
    id="int8-models-move",
    fixes=(BUG_ID,),
    targets=(
        Target("diffusers.models.modeling_utils", "ModelMixin.to", wrapper=move_model_to),
        Target("diffusers.models.modeling_utils", "ModelMixin.cuda", wrapper=move_model_cuda),
        Target("diffusers.pipelines.pipeline_utils", "DiffusionPipeline.to", wrapper=move_pipeline_to),
    ),
    summary="move 8-bit diffusers models with .to() and pipe.to() where bitsandbytes can",
)


# -- scenario ---------------------------------------------------------------------------------------
@scenario(BUG_ID, "an 8-bit Flux transformer loaded on cuda:0, used, then pipe.to('cuda:1')",
          needs=("torch", "bitsandbytes", "diffusers", "transformers", "accelerate"))
def pipe_to_second_gpu_with_an_8bit_transformer() -> str:
    """Where the pipeline's components end up. Running the moved pipeline also needs the layers'
    int8 state to follow (bnb-int8-stats-stay-on-old-device, unfixed): tests/hooks/diffusers covers it."""
    import torch

    from devmap_shims.scenarios import flux
    from devmap_shims.testing import simulated_gpus

    if not bnb_moves_8bit():
        raise ScenarioUnavailable("bitsandbytes before 0.48 cannot move 8-bit weights; diffusers refuses by design")
    base = flux.prepare()
    path = flux.transformer_dir(base.transformer)
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = flux.load_8bit_transformer(path)  # on the current GPU, cuda:0
        pipe = flux.pipeline_with(base, transformer)
        pipe.to("cuda:0")
        flux.tiny_image(pipe)
        pipe.to("cuda:1")
        devices = {name: sorted({str(p.device) for p in module.parameters()})
                   for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    off = {name: found for name, found in devices.items() if found != ["cuda:1"]}
    if off:
        raise BugObserved(f"after pipe.to('cuda:1') these components are elsewhere: {off}")
    return f"8-bit transformer used on cuda:0; pipe.to('cuda:1'): {len(devices)} components on cuda:1"
