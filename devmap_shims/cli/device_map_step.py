"""The device-map step of ``from_pretrained``, run on a meta-device model without weights.

Used by ``devmap-shims plan``, the corpus tests and the benchmark. Every function imports torch /
transformers / accelerate inside its body: importing this module costs nothing.

Two stacks:

* transformers < 5: ``from_pretrained`` computes ``special_dtypes`` and the quantizer's target
  dtype, calls accelerate's ``get_balanced_memory``, the quantizer's ``adjust_max_memory``,
  ``model.tie_weights()`` and accelerate's ``infer_auto_device_map`` inline; :func:`device_map_step`
  replays that sequence.
* transformers >= 5: ``transformers.integrations.accelerate._get_device_map`` does it all; it is
  called as is.

With ``shim=True`` the same calls go through the wrappers of the ``device-map-balance`` shim
(:mod:`devmap_shims.hooks.accelerate.device_map_balance`), exactly as they do once it is installed.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

QUANTIZATIONS = ("none", "4bit", "8bit")
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


class PlanInputError(ValueError):
    """A model config that cannot be planned (not a causal LM, unknown architecture...)."""


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def original(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` without devmap_shims' own wrapper layer, if the shims are installed."""
    try:
        from devmap_shims.shims.wrapping import devmap_wrapper_type

        kind = devmap_wrapper_type()
    except Exception:  # engine not available: nothing of ours can be on top
        return func
    while type(func) is kind:
        func = func.__wrapped__
    return func


def _through(wrapper: Callable[..., Any], wrapped: Callable[..., Any], context: Any) -> Callable[..., Any]:
    """``wrapped`` called through one of the shim's wrappers, as the engine would call it."""
    from devmap_shims.shims.guard import bind_context

    repair = bind_context(wrapper, context)

    def call(*args: Any, **kwargs: Any) -> Any:
        return repair(wrapped, None, args, kwargs)

    return call


def _context() -> Any:
    """A fresh context of the device-map shim, not tied to an install (its state lives one step)."""
    from devmap_shims.hooks.accelerate.device_map_balance import SHIM
    from devmap_shims.shims import ShimContext

    return ShimContext(SHIM)


@dataclass
class MetaModel:
    """A model skeleton on the meta device, quantized modules already swapped in."""

    model: Any
    quantizer: Any
    dtype: Any
    quantization: str
    #: parameters of the unquantized skeleton (bitsandbytes packs two 4-bit weights in a byte)
    parameters: int = 0


def torch_dtype(name: str) -> Any:
    import torch

    value = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise PlanInputError(f"unknown dtype {name!r} (use e.g. bfloat16, float16, float32)")
    return value


def _needs_simulation() -> bool:
    """True on a machine without a GPU where the stack cannot compute placements by itself:
    torch 2.5/2.6 refuse ``torch.device(0)`` without an accelerator, and transformers < 4.45
    disables its bitsandbytes integration when CUDA is unavailable."""
    import importlib.util

    import torch

    if torch.cuda.is_available() or torch.version.cuda is None:
        return False
    try:
        torch.device(0)
    except Exception:
        return True
    try:
        from transformers.utils import is_bitsandbytes_available

        if importlib.util.find_spec("bitsandbytes") is not None and not is_bitsandbytes_available():
            return True
    except Exception:  # pragma: no cover - very old transformers
        pass
    return False


@contextlib.contextmanager
def gpu_context(gpu_sizes: Sequence[int] = (2**30,)) -> Iterator[None]:
    """Run the block on simulated GPUs of these sizes when the stack needs GPUs to be present
    to compute a placement (see :func:`_needs_simulation`), unless a simulation is running."""
    if not _needs_simulation():
        yield
        return
    try:
        from devmap_shims.testing.simulator import active_machine, simulated_gpus
    except Exception:  # pragma: no cover - simulator unavailable: let the library say why
        yield
        return
    if active_machine() is not None:
        yield
        return
    sizes = [int(s) for s in gpu_sizes] or [2**30]
    with simulated_gpus(len(sizes), memory=sizes):
        yield


def _gpu_sizes(max_memory: Optional[Dict[Any, Any]]) -> List[int]:
    if not max_memory:
        return [2**30]
    ids = [k for k in max_memory if isinstance(k, int) and not isinstance(k, bool)]
    if not ids:
        return [2**30]
    sizes = [2**30] * (max(ids) + 1)
    for k in ids:
        try:
            sizes[k] = max(int(max_memory[k]), 1)
        except (TypeError, ValueError):
            pass
    return sizes


def build_meta_model(config: Any, dtype: str = "bfloat16", quantization: str = "none") -> MetaModel:
    """``AutoModelForCausalLM`` skeleton for ``config`` on the meta device, then the bitsandbytes
    quantizer's module replacement, as ``from_pretrained(quantization_config=...)`` does."""
    if quantization != "none":
        # bitsandbytes picks its native library at import: import it before any simulated GPU
        # exists, or it looks for libcuda
        import bitsandbytes  # noqa: F401
    with gpu_context():
        return _build_meta_model(config, dtype, quantization)


def _build_meta_model(config: Any, dtype: str, quantization: str) -> MetaModel:
    from transformers import AutoModelForCausalLM

    if quantization not in QUANTIZATIONS:
        raise PlanInputError(f"unknown quantization {quantization!r} (use one of {', '.join(QUANTIZATIONS)})")
    dt = torch_dtype(dtype)
    dtype_kw = "dtype" if transformers_major() >= 5 else "torch_dtype"
    try:
        with _meta_init():
            model = AutoModelForCausalLM.from_config(config, **{dtype_kw: dt})
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise PlanInputError(
                f"{type(config).__name__} ({getattr(config, 'model_type', '?')}) is not a causal language model "
                "configuration; `devmap-shims plan` plans AutoModelForCausalLM checkpoints"
            ) from None
        raise
    parameters = _parameter_count(model)
    quantizer = None
    if quantization != "none":
        quantizer = _bnb_quantizer(config, model, dt, quantization)
    return MetaModel(model, quantizer, dt, quantization, parameters)


def _parameter_count(model: Any) -> int:
    """Parameters of the skeleton, a tied output embedding counted once (``from_config`` on the
    meta device may not have tied it yet)."""
    count = sum(p.numel() for p in model.parameters())
    try:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        default = getattr(model.config, "tie_word_embeddings", False)
        tied = bool(getattr(config, "tie_word_embeddings", default))
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if tied and out is not None and inp is not None and out.weight is not inp.weight \
                and out.weight.shape == inp.weight.shape:
            count -= out.weight.numel()
    except Exception:  # a model without embeddings accessors: count what is there
        pass
    return int(count)


@contextlib.contextmanager
def _meta_init() -> Iterator[None]:
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights(), torch.device("meta"):
        yield


def _bnb_quantizer(config: Any, model: Any, dt: Any, quantization: str) -> Any:
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer

    qconfig = BitsAndBytesConfig(load_in_4bit=quantization == "4bit", load_in_8bit=quantization == "8bit")
    config.quantization_config = qconfig
    quantizer = AutoHfQuantizer.from_config(qconfig, pre_quantized=False)
    if transformers_major() >= 5:
        with _meta_init():
            quantizer.preprocess_model(model=model, dtype=dt, device_map="auto", checkpoint_files=None, use_kernels=False)
    else:
        if hasattr(quantizer, "update_torch_dtype"):
            quantizer.update_torch_dtype(dt)
        quantizer.preprocess_model(model=model, device_map="auto", keep_in_fp32_modules=_keep_in_fp32(model, dt, quantizer))
        model.config._pre_quantization_dtype = dt
    return quantizer


def _keep_in_fp32(model: Any, dt: Any, quantizer: Any) -> list:
    import torch

    keep = getattr(type(model), "_keep_in_fp32_modules", None)
    if keep is not None and (dt == torch.float16 or hasattr(quantizer, "use_keep_in_fp32_modules")):
        return list(keep)
    return []


class _QuietDevices(logging.Filter):
    """Hide accelerate's "Device N is not available" warning: the GPUs are described, not present."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is not available, available devices are" not in record.getMessage()


@contextlib.contextmanager
def quiet_missing_devices() -> Iterator[None]:
    names = ("accelerate.utils.modeling", "transformers.integrations.accelerate")
    flt = _QuietDevices()
    loggers = [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addFilter(flt)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)


def device_map_step(meta: MetaModel, strategy: str, max_memory: Optional[Dict[Any, Any]], shim: bool) -> Dict[str, Any]:
    """The map ``from_pretrained(device_map=strategy, max_memory=max_memory)`` computes for this
    skeleton on the installed stack (bitsandbytes' own environment check is not run: there are no
    real GPUs to check)."""
    if strategy not in STRATEGIES:
        raise PlanInputError(f"unknown device_map strategy {strategy!r} (use one of {', '.join(STRATEGIES)})")
    mm = dict(max_memory) if max_memory is not None else None
    with quiet_missing_devices(), gpu_context(_gpu_sizes(mm)):
        if transformers_major() >= 5:
            return _step_v5(meta, strategy, mm, shim)
        return _step_v4(meta, strategy, mm, shim)


def _step_v5(meta: MetaModel, strategy: str, max_memory: Optional[dict], shim: bool) -> Dict[str, Any]:
    from transformers.integrations import accelerate as tia

    from devmap_shims.hooks.accelerate import device_map_balance as hook

    fn = original(tia._get_device_map)
    if not shim:
        with no_environment_check(meta.quantizer):
            return fn(meta.model, strategy, max_memory, meta.quantizer)
    context = _context()
    fn = _through(hook.repair_get_device_map, fn, context)
    with contextlib.ExitStack() as seen:
        seen.enter_context(no_environment_check(meta.quantizer))
        if hasattr(tia, "_init_infer_auto_device_map"):
            seen.enter_context(_seen_by(context, tia, "_init_infer_auto_device_map", hook.remember_map_inputs))
        return fn(meta.model, strategy, max_memory, meta.quantizer)


@contextlib.contextmanager
def _seen_by(context: Any, module: Any, name: str, wrapper: Callable[..., Any]) -> Iterator[None]:
    """``module.name`` goes through the shim's ``wrapper`` for the block, as it does once the shim
    is installed (the shim reads what the library computed there instead of computing it again)."""
    before = getattr(module, name)
    setattr(module, name, _through(wrapper, original(before), context))
    try:
        yield
    finally:
        setattr(module, name, before)


@contextlib.contextmanager
def no_environment_check(quantizer: Any) -> Iterator[None]:
    if quantizer is None:
        yield
        return
    quantizer.validate_environment = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del quantizer.validate_environment


def _step_v4(meta: MetaModel, strategy: str, max_memory: Optional[dict], shim: bool) -> Dict[str, Any]:
    import inspect

    import accelerate.utils.modeling as am

    from devmap_shims.hooks.accelerate import device_map_balance as hook

    model, quantizer, dt = meta.model, meta.quantizer, meta.dtype
    get_balanced_memory = original(am.get_balanced_memory)
    infer_auto_device_map = original(am.infer_auto_device_map)
    takes_special_dtypes = "special_dtypes" in inspect.signature(infer_auto_device_map).parameters
    seen = contextlib.ExitStack()
    if shim:
        context = _context()
        get_balanced_memory = _through(hook.remember_balanced_memory, get_balanced_memory, context)
        infer_auto_device_map = _through(hook.repair_infer_auto_device_map, infer_auto_device_map, context)
        if hasattr(am, "_init_infer_auto_device_map"):  # accelerate >= 1.2
            seen.enter_context(_seen_by(context, am, "_init_infer_auto_device_map", hook.remember_map_inputs))
        else:
            seen.enter_context(_seen_by(context, am, "compute_module_sizes", hook.remember_module_sizes))
            seen.enter_context(_seen_by(context, am, "find_tied_parameters", hook.remember_tied_parameters))
    special_dtypes: Dict[str, Any] = {}
    if quantizer is not None:
        special_dtypes.update(quantizer.get_special_dtypes_update(model, dt))
    keep = _keep_in_fp32(model, dt, quantizer) if quantizer is not None else []
    if keep:
        import torch

        special_dtypes.update({n: torch.float32 for n, _ in model.named_parameters() if any(m in n for m in keep)})
    target_dtype = quantizer.adjust_target_dtype(dt) if quantizer is not None else dt
    no_split = model._get_no_split_modules(strategy)
    kwargs: Dict[str, Any] = {"no_split_module_classes": no_split}
    if takes_special_dtypes:
        kwargs["special_dtypes"] = special_dtypes
    if strategy != "sequential":
        budgets = get_balanced_memory(
            model, dtype=target_dtype, low_zero=strategy == "balanced_low_0", max_memory=max_memory, **kwargs
        )
    else:
        budgets = am.get_max_memory(max_memory)
    if quantizer is not None:
        budgets = quantizer.adjust_max_memory(budgets)
    kwargs["max_memory"] = budgets
    model.tie_weights()
    with seen:
        return infer_auto_device_map(model, dtype=target_dtype, **kwargs)


# -- what the planning arithmetic sees, for reports -------------------------------------------------


def layout_and_budgets(meta: MetaModel, strategy: str, max_memory: Optional[Dict[Any, Any]]) -> tuple:
    """(layout, budgets) the shim judges this model's map with: the stack's own module sizes and
    the user's budgets after the quantizer's adjustment."""
    from devmap_shims.hooks.accelerate import device_map_balance as hook

    mm = dict(max_memory) if max_memory is not None else None
    with quiet_missing_devices(), gpu_context(_gpu_sizes(mm)):
        if transformers_major() >= 5:
            from transformers.integrations import accelerate as tia

            budgets = tia.get_max_memory(mm)
            if meta.quantizer is not None:
                budgets = meta.quantizer.adjust_max_memory(budgets)
            return hook.transformers_layout(meta.model, meta.quantizer), budgets
        import accelerate.utils.modeling as am

        budgets = am.get_max_memory(mm)
        if meta.quantizer is not None:
            budgets = meta.quantizer.adjust_max_memory(budgets)
        params: Dict[str, Any] = {"no_split_module_classes": meta.model._get_no_split_modules(strategy)}
        if meta.quantizer is not None:
            params["dtype"] = meta.quantizer.adjust_target_dtype(meta.dtype)
            params["special_dtypes"] = meta.quantizer.get_special_dtypes_update(meta.model, meta.dtype)
        else:
            params["dtype"] = meta.dtype
        meta.model.tie_weights()
        return hook.accelerate_layout(meta.model, params), budgets
