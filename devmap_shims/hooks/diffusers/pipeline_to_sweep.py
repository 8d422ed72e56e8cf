"""Shim ``pipeline-to-sweep``: after a diffusers ``pipe.to()`` / ``model.to()``, quantization state
left on the load GPU joins its weights; a one-GPU ``device_map`` is honoured for quantized loads.

* ``DiffusionPipeline.to`` and ``ModelMixin.to`` / ``.cuda``: after the original move, every
  component is swept for bitsandbytes parameters whose quant-state tensors are not on the
  parameter's device, and those tensors are moved (an INFO line when a sweep moved some). A model
  ``.to`` inside a pipeline ``.to`` leaves the sweep to the pipeline. States that the
  quant-state-follows-weight shim aligned during the move, with the weight storage their
  parameter still holds, are not read again (the move records them:
  ``devices.quant_state.start_recording``).
* ``ModelMixin.from_pretrained`` with a one-GPU ``device_map`` (``{"": "cuda:1"}``, ``"cuda:1"``,
  ``1``, ``torch.device("cuda", 1)``) for a bitsandbytes-quantized load, which these diffusers
  releases refuse: the map is dropped and the load runs with that GPU as the current device, so
  everything, quant state included, lands there (what diffusers >= 0.33 does with such a map).

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    diffusers-quantized-load-on-current-device
        affected: diffusers >=0.31.0,<0.33.0; bitsandbytes >=0.41.2,<0.45.3
        fixed in: diffusers 0.33.0
"""

from __future__ import annotations

import threading

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, Tuple

    from devmap_shims.devices.quant_state import Record

from devmap_shims.devices.quant_state import align_known_state, noted, start_recording, stop_recording
from devmap_shims.devices.tensors import device_type
from devmap_shims.scenarios import BugObserved, scenario
from devmap_shims.shims import LazyLogger, Shim, Target, with_context

BUG_ID = "diffusers-quantized-load-on-current-device"

logger = LazyLogger(__name__)


# -- the sweep ------------------------------------------------------------------------------------
def sweep_module(module: Any, record: Optional[Record] = None) -> int:
    """Move every quant-state tensor of ``module`` onto its parameter's device; returns how many moved.

    Parameters on ``meta`` are skipped (their data lives elsewhere, e.g. offloaded by accelerate).
    A module-level ``quant_state`` that is not the weight's own follows the weight, also where the
    weight has none (bitsandbytes hands the module's to it at the next forward). A state that
    ``record`` (the move's, see :func:`devmap_shims.devices.quant_state.start_recording`) notes
    under the storage its parameter holds now was checked tensor by tensor during the move, and
    is not read again (one storage lookup instead of six ``.device`` reads).

    The sweep runs after every move of a pipeline whose transformer has hundreds of 4-bit layers,
    so the walk does the least per module: ``_modules`` / ``_parameters`` are read directly
    instead of ``named_modules()``, in the same order (the order the move allocated the tensors
    in, which on a large tree is friendlier to the CPU's caches than the reverse); only modules
    with children are remembered as seen (a leaf met twice is checked twice); a parameter is
    looked at only if its ``__dict__`` holds a ``quant_state``; each tensor's ``.device`` is read
    once and compared with ``torch.device`` objects, never through ``device.type`` (a new string
    per read); and the whole walk runs with tensor subclasses' ``__torch_function__`` off, so
    reading the ``.device`` of a ``Params4bit`` (bitsandbytes >= 0.46 overrides
    ``__torch_function__``) costs what it costs on a plain tensor rather than a Python dispatch.
    Torch function modes stay on.

    The walk comes after the move rather than inside it: checking each ``Linear4bit`` right
    after its own ``Module._apply`` (a layer over a method bitsandbytes inherits from torch) leaves
    the walk only the containers, but on the simulated GPUs each check there costs 2.3-2.4 us and
    the layer 1.1-1.5 us more per call, so the move took 3.6-4.4 us per layer longer than with
    this walk (``bench_pipeline_to.py``'s trees, 1x and 8x).
    """
    meta = device_type()("meta")  # a tensor on meta reports exactly this device
    moved = 0
    stack = [module]
    seen = set()
    with _subclass_dispatch_off():
        while stack:
            sub = stack.pop()
            if sub is None:
                continue
            children = sub._modules
            if children:  # a container shared or in a cycle is entered once; a shared leaf is
                key = id(sub)  # checked again, which moves nothing the second time
                if key in seen:
                    continue
                seen.add(key)
                # reversed onto the stack: visited in module order, as they were allocated
                stack.extend(reversed(children.values()))
            params = sub._parameters
            if not params:
                continue
            weight_state = weight = None
            for name, param in params.items():
                if param is None:
                    continue
                namespace = getattr(param, "__dict__", None)
                state = namespace.get("quant_state") if namespace else None
                if state is None:
                    continue
                if record and noted(record, state, param):  # aligned for this storage during the move
                    if name == "weight":
                        weight_state, weight = state, param
                    continue
                device = param.device
                if device == meta:
                    continue
                if name == "weight":
                    weight_state, weight = state, param
                moved += align_known_state(state, device)
            if weight is None:
                # a weight without a state of its own: bitsandbytes gives it the module's at the next
                # forward (fix_4bit_weight_quant_state_from_module; a state lost to FSDP, or to
                # ``layer.weight = Parameter(...)``), so the module's state follows that weight
                weight = params.get("weight")
                if weight is None:
                    continue
            module_state = sub.__dict__.get("quant_state")
            if module_state is not None and module_state is not weight_state:
                device = weight.device
                if device != meta:
                    moved += align_known_state(module_state, device)
    return moved


def _subclass_dispatch_off() -> Any:
    """``torch._C.DisableTorchFunctionSubclass()`` (torch >= 2.0), else a context that does nothing."""
    import torch

    context = getattr(torch._C, "DisableTorchFunctionSubclass", None)
    if context is None:  # pragma: no cover - torch < 2.0
        import contextlib

        return contextlib.nullcontext()
    return context()


def sweep_pipeline(pipeline: Any, record: Optional[Record] = None) -> Tuple[int, int]:
    """:func:`sweep_module` over every torch module among ``pipeline.components``: ``(moved, modules)``."""
    import torch

    moved = modules = 0
    for component in (getattr(pipeline, "components", None) or {}).values():
        if isinstance(component, torch.nn.Module):
            modules += 1
            moved += sweep_module(component, record)
    return moved, modules


def _describe_call(owner: Any, method: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{type(owner).__name__}.{method}({', '.join(shown)})"


# -- wrappers ---------------------------------------------------------------------------------------
class _Moves(threading.local):
    """Per thread: how many pipeline moves are in progress (model moves inside them do not sweep)."""

    depth = 0


@with_context
def repair_pipeline_to(context: Any, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``DiffusionPipeline.to``, then one sweep over its components (states the move aligned and
    recorded are not read again)."""
    moves = context.state
    moves.depth += 1
    record = start_recording()  # None inside an outer move: that move's record is the one open
    try:
        try:
            result = wrapped(*args, **kwargs)
        finally:
            moves.depth -= 1
        if moves.depth or instance is None:
            return result
        moved, modules = sweep_pipeline(instance, record)
    finally:
        stop_recording(record)
    if moved:
        logger.info(
            "%s after %s: moved %d quantization-state tensor(s) of %d component(s) onto their "
            "weights' devices (shim %s)",
            BUG_ID, _describe_call(instance, "to", args, kwargs), moved, modules, SHIM.id,
        )
    return result


@with_context
def repair_model_to(context: Any, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``ModelMixin.to`` / ``.cuda``, then a sweep of the model unless a pipeline move sweeps later."""
    if context.state.depth or instance is None:
        return wrapped(*args, **kwargs)
    record = start_recording()
    try:
        result = wrapped(*args, **kwargs)
        moved = sweep_module(instance, record)
    finally:
        stop_recording(record)
    if moved:
        logger.info(
            "%s after %s: moved %d quantization-state tensor(s) onto their weights' devices (shim %s)",
            BUG_ID, _describe_call(instance, getattr(wrapped, "__name__", "to"), args, kwargs), moved, SHIM.id,
        )
    return result


def single_cuda_index(device_map: Any) -> Optional[int]:
    """The GPU index of a device map that puts the whole model on one CUDA device, else None
    (``"cuda"``: the current device)."""
    return _cuda_index(single_cuda_device(device_map))


def _cuda_index(device: Any) -> Optional[int]:
    """The index of ``device`` (a CUDA ``torch.device`` or None), the current GPU's for ``"cuda"``."""
    if device is None:
        return None
    if device.index is not None:
        return device.index
    import torch

    return torch.cuda.current_device()


def single_cuda_device(device_map: Any) -> Any:
    """The ``torch.device`` of a device map that puts the whole model on one CUDA device (its index
    None for ``"cuda"``), else None; nothing asks CUDA anything."""
    import torch

    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            return None
        device_map = device_map[""]
    if isinstance(device_map, bool):
        return None
    if isinstance(device_map, int):
        return torch.device("cuda", device_map) if device_map >= 0 else None
    if isinstance(device_map, (str, torch.device)):
        try:
            device = torch.device(device_map)
        except (RuntimeError, TypeError):
            return None  # "auto", "balanced" ...
        return device if device.type == "cuda" else None
    return None


_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "use_auth_token", "revision", "subfolder")


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


def repair_from_pretrained(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``ModelMixin.from_pretrained`` that loads a bitsandbytes model onto the GPU its one-GPU map names."""
    # the quantization is asked about first: device_map="cuda" for any other load must not
    # start CUDA here (a machine without a driver, a process that forks workers later)
    device = single_cuda_device(kwargs.get("device_map"))
    if device is None or not _is_bnb_quantized_load(instance, args, kwargs):
        return wrapped(*args, **kwargs)
    import torch

    index = _cuda_index(device)
    if index >= torch.cuda.device_count():
        return wrapped(*args, **kwargs)  # let diffusers report the bad map
    kwargs = {k: v for k, v in kwargs.items() if k != "device_map"}
    logger.info(
        "%s: loading %s on cuda:%d as the current device instead of passing device_map, which "
        "this diffusers refuses for quantized models (shim %s)",
        BUG_ID, getattr(instance, "__name__", "model"), index, SHIM.id,
    )
    with torch.cuda.device(index):
        model = wrapped(*args, **kwargs)
    sweep_module(model)
    return model


SHIM = Shim(
    id="pipeline-to-sweep",
    fixes=(BUG_ID,),
    targets=(
        Target("diffusers.pipelines.pipeline_utils", "DiffusionPipeline.to", wrapper=repair_pipeline_to),
        Target("diffusers.models.modeling_utils", "ModelMixin.to", wrapper=repair_model_to),
        Target("diffusers.models.modeling_utils", "ModelMixin.cuda", wrapper=repair_model_to),
        Target(
            "diffusers.models.modeling_utils",
            "ModelMixin.from_pretrained",
            expect_params=("pretrained_model_name_or_path",),
            wrapper=repair_from_pretrained,
        ),
    ),
    state=_Moves,
    summary="after pipe.to()/model.to() move quant state left on the load GPU; honour a one-GPU device_map "
    "for quantized loads",
)


# -- scenarios --------------------------------------------------------------------------------------
_FLUX_NEEDS = ("torch", "bitsandbytes", "diffusers", "transformers")


@scenario(BUG_ID, "4-bit Flux transformer loaded while cuda:0 is current, pipeline moved with pipe.to('cuda:1')",
          needs=_FLUX_NEEDS)
def flux_4bit_loaded_on_current_device_then_moved() -> str:
    from devmap_shims.scenarios import flux

    base = flux.prepare()
    import torch

    from devmap_shims.testing import simulated_gpus

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = flux.load_4bit_transformer()  # no device_map: diffusers picks the current device
        pipe = flux.pipeline_with(base, transformer)
        pipe.to("cuda:1")
        checked = flux.raise_if_strays(pipe, "after pipe.to('cuda:1')")
        return f"loaded on the current GPU, pipe.to('cuda:1'): {checked} quant-state tensors on cuda:1"


@scenario(BUG_ID, "4-bit Flux transformer loaded with device_map={'': 'cuda:1'} while cuda:0 is current",
          needs=_FLUX_NEEDS)
def flux_4bit_loaded_with_one_gpu_device_map() -> str:
    from devmap_shims.scenarios import flux

    flux.prepare()
    import torch

    from devmap_shims.testing import simulated_gpus

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = flux.load_4bit_transformer(device_map={"": "cuda:1"})
        devices = sorted({str(p.device) for p in transformer.parameters()})
        if devices != ["cuda:1"]:
            raise BugObserved(f"device_map={{'': 'cuda:1'}} loaded parameters on {', '.join(devices)}")
        checked = flux.raise_if_strays(transformer, "after loading with device_map={'': 'cuda:1'}")
        return f"loaded with device_map={{'': 'cuda:1'}}: every parameter and {checked} quant-state tensors on cuda:1"
