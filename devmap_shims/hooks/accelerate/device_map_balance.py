"""Shim ``device-map-balance``: ``device_map="auto" | "balanced" | "balanced_low_0"`` spreads the
model over every GPU instead of collapsing onto one, leaving GPUs empty or offloading needlessly.

Where each stack computes the map, and so where the shim hooks:

* accelerate (every version), used by transformers 4.x ``from_pretrained`` and by accelerate's own
  ``load_checkpoint_and_dispatch``: ``get_balanced_memory`` then (transformers applies the
  quantizer's ``adjust_max_memory``, x0.9 for bitsandbytes) ``infer_auto_device_map``. The first
  hook only remembers the budgets the caller gave, before balancing capped them; the second checks
  the map the library computed and replaces it when it is degenerate. The quantizer's adjustment
  is read back as the ratio between the budgets ``infer_auto_device_map`` received and the
  balanced caps.
* transformers >= 5 computes the map itself in ``transformers.integrations.accelerate``:
  ``_get_device_map`` receives the user's ``max_memory``, the strategy and the quantizer, so one
  hook there sees everything.

The map is judged with the module sizes and tied groups the library computed for it, read while
its map call runs on that thread (:mod:`devmap_shims.hooks.accelerate._map_inputs`). A map that
plainly meets every rule is kept from those sizes alone
(:func:`devmap_shims.planning.plainly_healthy`); only other maps have the model's layout walked.

The placement arithmetic is :mod:`devmap_shims.planning`. Healthy maps, ``sequential`` maps,
explicit dict maps and maps for fewer than two GPUs are returned unchanged (the very same object):
with one GPU there is nothing to spread, and the library's budget there keeps 10 % free on purpose
when no ``max_memory`` is given, which budgets read back from the user's would not.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    balanced-memory-large-unquantized-embedding-collapse
        affected: accelerate >=0.12.0
        fixed in: unfixed (last checked 2026-11-01)
"""

from __future__ import annotations

import copy
import threading
import weakref

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Mapping, Optional

from devmap_shims.calls import bind
from devmap_shims.hooks.accelerate._map_inputs import (
    SeenInputs,
    remember_map_inputs,
    remember_module_sizes,
    remember_tied_parameters,
)
from devmap_shims.scenarios import BugObserved, scenario
from devmap_shims.shims import LazyLogger, Shim, Target, with_context

BUG_ID = "balanced-memory-large-unquantized-embedding-collapse"
STRATEGIES = ("auto", "balanced", "balanced_low_0")

logger = LazyLogger(__name__)


class _BalancedCall:
    __slots__ = ("user_max_memory", "low_zero", "balanced")

    def __init__(self, user_max_memory: Optional[dict], low_zero: bool, balanced: dict) -> None:
        self.user_max_memory = user_max_memory
        self.low_zero = low_zero
        self.balanced = balanced


class PendingCalls:
    """The shim's state: per model, the ``get_balanced_memory`` call whose map is computed next,
    and per thread what the library computed during the map call in progress."""

    def __init__(self) -> None:
        self.calls: "weakref.WeakKeyDictionary[Any, _BalancedCall]" = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self.seen = SeenInputs()


# -- accelerate: get_balanced_memory + infer_auto_device_map --------------------------------------
@with_context
def remember_balanced_memory(context: Any, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Call accelerate's ``get_balanced_memory`` unchanged, remembering the budgets it capped."""
    try:
        params = bind(wrapped, args, kwargs)
        model = params["model"]
        user = params.get("max_memory")
        user_copy = copy.copy(user) if isinstance(user, dict) else None
        low_zero = bool(params.get("low_zero"))
    except Exception:  # an unusual call: let the original answer (and raise) as it would
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    if isinstance(result, dict):
        pending = context.state
        with pending.lock:
            try:
                pending.calls[model] = _BalancedCall(user_copy, low_zero, dict(result))
            except TypeError:  # model not weak-referenceable
                pass
    return result


@with_context
def repair_infer_auto_device_map(context: Any, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Call accelerate's ``infer_auto_device_map``; when it follows a ``get_balanced_memory`` call
    on the same model and the map is degenerate, return a balanced map instead."""
    try:
        params = bind(wrapped, args, kwargs)
    except TypeError:  # arguments the library refuses: let it say so
        return wrapped(*args, **kwargs)
    model = params.get("model")
    pending = context.state
    with pending.lock:
        call = pending.calls.pop(model, None) if model is not None else None
    if call is None:
        return wrapped(*args, **kwargs)  # not a balanced strategy (sequential, or a direct call)
    seen = pending.seen
    outer = seen.model is not None  # a map call inside another (transformers >= 5 calling accelerate)
    if not outer:
        seen.start(model)
    try:
        result = wrapped(*args, **kwargs)
        if not isinstance(result, dict):
            return result
        budgets = budgets_from_balanced_call(call, params.get("max_memory"))
        if budgets is None:
            return result
        sizes = seen.sizes_for(model=model, dtype=params.get("dtype"), special_dtypes=params.get("special_dtypes"))
        tied = params.get("tied_parameters") or seen.tied  # None when accelerate did not look
        return maybe_repair(
            lambda: accelerate_layout(model, params, sizes, tied), result, budgets, call.low_zero,
            bool(params.get("clean_result", True)), sizes,
        )
    finally:
        if not outer:
            seen.stop()


def _resolve_accelerate_max_memory(max_memory: Optional[dict]) -> Dict[Any, int]:
    from accelerate.utils.modeling import get_max_memory

    return get_max_memory(copy.copy(max_memory) if max_memory is not None else None)


def budgets_from_balanced_call(call: _BalancedCall, passed: Optional[dict]) -> Optional[Dict[Any, float]]:
    """The user's budgets scaled by whatever the caller did to the balanced caps in between
    (transformers: the quantizer's ``adjust_max_memory``, one factor for every device). None when
    the caller's change is anything else, a raise or one device lowered (then it is not ours to
    second-guess: the map must keep to the caps it was given)."""
    if passed is None:
        return None
    received = _resolve_accelerate_max_memory(passed)
    if set(received) != set(call.balanced):
        logger.debug("device map left alone: max_memory changed between get_balanced_memory and infer_auto_device_map")
        return None
    factors = {k: received[k] / call.balanced[k] for k in received if call.balanced[k] > 0}
    if any(f <= 0 or f > 1.0 + 1e-6 for f in factors.values()):
        logger.debug("device map left alone: budgets were raised after get_balanced_memory")
        return None
    default = max(factors.values(), default=1.0)
    if factors and min(factors.values()) < default * (1 - 1e-6):
        logger.debug("device map left alone: max_memory was changed per device between get_balanced_memory "
                     "and infer_auto_device_map")
        return None
    user = _resolve_accelerate_max_memory(call.user_max_memory)
    return {k: user.get(k, received[k]) * factors.get(k, default) for k in received}


def accelerate_layout(model: Any, params: Mapping[str, Any], sizes: Any = None, tied: Any = None) -> Any:
    """The :class:`~devmap_shims.planning.Layout` accelerate sees for ``model``, from the arguments
    of its ``infer_auto_device_map`` call (``dtype``, ``special_dtypes``, ``no_split_module_classes``,
    ``tied_parameters``). ``sizes`` and ``tied`` are what accelerate computed for that call, when
    the shim saw it; computed here otherwise."""
    from accelerate.utils.modeling import compute_module_sizes, find_tied_parameters

    from devmap_shims.planning import layout_from_module

    if sizes is None:
        sizes = compute_module_sizes(model, dtype=params.get("dtype"), special_dtypes=params.get("special_dtypes"))
    no_split = params.get("no_split_module_classes") or ()
    if isinstance(no_split, str):
        no_split = [no_split]
    if tied is None:  # [] is an answer: no tied weights
        tied = params.get("tied_parameters") or find_tied_parameters(model)
    return layout_from_module(model, sizes, no_split, tied)


# -- transformers >= 5: _get_device_map ------------------------------------------------------------
@with_context
def repair_get_device_map(context: Any, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Call transformers' ``_get_device_map``; for the balanced strategies, replace a degenerate
    map by a balanced one computed from the user's budgets and the quantizer's adjustment."""
    try:
        params = bind(wrapped, args, kwargs)
    except TypeError:  # arguments the library refuses: let it say so
        return wrapped(*args, **kwargs)
    strategy = params.get("device_map")
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        return wrapped(*args, **kwargs)
    user = params.get("max_memory")
    user_copy = copy.copy(user) if isinstance(user, dict) else user
    model, quantizer = params["model"], params.get("hf_quantizer")
    seen = context.state.seen
    seen.start(model)
    try:
        result = wrapped(*args, **kwargs)
        if not isinstance(result, dict):
            return result
        if getattr(model, "_no_placement_params", None):
            logger.debug("device map left alone: %s escapes parameters from placement", type(model).__name__)
            return result
        from transformers.integrations import accelerate as tia

        budgets = tia.get_max_memory(user_copy)
        if quantizer is not None:
            budgets = quantizer.adjust_max_memory(budgets)
        sizes, tied = seen.sizes_for(model=model, hf_quantizer=quantizer), seen.tied
        return maybe_repair(
            lambda: transformers_layout(model, quantizer, sizes, tied), result, budgets,
            strategy == "balanced_low_0", True, sizes,
        )
    finally:
        seen.stop()


def transformers_layout(model: Any, quantizer: Any, sizes: Any = None, tied: Any = None) -> Any:
    """The :class:`~devmap_shims.planning.Layout` transformers >= 5 sees for ``model``; ``sizes``
    and ``tied`` are the module sizes and tied groups its ``infer_auto_device_map`` computed, when
    the shim saw them (computed here the same way otherwise)."""
    from transformers.integrations import accelerate as tia

    from devmap_shims.planning import layout_from_module

    if sizes is None:
        try:
            sizes, _ = tia.compute_module_sizes(model, quantizer, only_modules=False)
        except TypeError:
            sizes, _ = tia.compute_module_sizes(model, quantizer)
    if tied is None:
        tied_keys = dict(getattr(model, "all_tied_weights_keys", None) or {})
        tied = [
            sorted([k for k, v in tied_keys.items() if v == target] + [target]) for target in set(tied_keys.values())
        ]
    no_split = getattr(model, "_no_split_modules", None) or ()
    return layout_from_module(model, sizes, no_split, tied)


def maybe_repair(
    layout: Callable[[], Any], result: dict, budgets: Mapping[Any, float], low_zero: bool, clean: bool,
    sizes: Optional[Mapping[str, float]] = None,
) -> dict:
    """``result`` itself when the planner keeps it, else the repaired map (same mapping type).

    ``layout`` builds the model's :class:`~devmap_shims.planning.Layout`; it is called only when
    the library's own ``sizes`` (when known) leave the map's health in doubt."""
    from devmap_shims.planning import plainly_healthy, repair
    from devmap_shims.planning.assess import gpu_ids

    if len(gpu_ids(budgets)) < 2:  # nothing to spread; and on one GPU the library keeps 10 % free on
        logger.debug("device map kept: fewer than two GPUs")  # purpose when max_memory is not given
        return result
    if sizes is not None and plainly_healthy(result, sizes, budgets, low_zero):
        logger.debug("device map kept: map is healthy")
        return result
    outcome = repair(layout(), result, budgets, low_zero=low_zero, clean=clean)
    if not outcome.repaired:
        logger.debug("device map kept: %s", outcome.reason)
        return result
    logger.info("repaired device map (bug %s): %s", BUG_ID, outcome.reason)
    return type(result)(outcome.device_map) if type(result) is not dict else outcome.device_map


SHIM = Shim(
    id="device-map-balance",
    fixes=(BUG_ID,),
    targets=(
        Target(
            "accelerate.utils.modeling",
            "get_balanced_memory",
            expect_params=("model", "max_memory", "no_split_module_classes", "low_zero"),
            wrapper=remember_balanced_memory,
        ),
        Target(
            "accelerate.utils.modeling",
            "infer_auto_device_map",
            expect_params=("model", "max_memory", "no_split_module_classes", "dtype", "special_dtypes"),
            wrapper=repair_infer_auto_device_map,
        ),
        Target(
            "accelerate.utils.modeling",
            "_init_infer_auto_device_map",
            when={"accelerate": ">=1.2.0"},
            expect_params=("model", "max_memory", "no_split_module_classes", "dtype", "special_dtypes"),
            wrapper=remember_map_inputs,
        ),
        Target(
            "accelerate.utils.modeling",
            "compute_module_sizes",
            when={"accelerate": "<1.2.0"},
            expect_params=("model", "dtype", "special_dtypes"),
            wrapper=remember_module_sizes,
        ),
        Target(
            "accelerate.utils.modeling",
            "find_tied_parameters",
            when={"accelerate": "<1.2.0"},
            expect_params=("model",),
            wrapper=remember_tied_parameters,
        ),
        Target(
            "transformers.integrations.accelerate",
            "_get_device_map",
            when={"transformers": ">=5"},
            expect_params=("model", "device_map", "max_memory", "hf_quantizer"),
            wrapper=repair_get_device_map,
        ),
        Target(
            "transformers.integrations.accelerate",
            "_init_infer_auto_device_map",
            when={"transformers": ">=5"},
            expect_params=("model", "max_memory", "no_split_module_classes", "tied_parameters", "hf_quantizer"),
            wrapper=remember_map_inputs,
        ),
    ),
    state=PendingCalls,
    summary="spread device_map='auto'/'balanced' over every GPU instead of collapsing onto one",
)


# -- scenario ---------------------------------------------------------------------------------------
# A tiny Qwen2 (tied embeddings, like Gemma-2) whose embedding table is most of its weight, the shape
# of Gemma-2-27B in 4-bit, on four simulated 2 GiB GPUs. Where bitsandbytes runs 4-bit on the CPU
# (>= 0.46, with transformers 5) it loads in 4-bit, as in huggingface/transformers#34751; older
# bitsandbytes quantizes with CUDA kernels only, so there it loads unquantized, sized so that
# accelerate's balancing collapses it all the same.
VOCAB = 8192
GPUS = 4
GPU_MEMORY = "2GiB"  # transformers' allocator warm-up assumes at least 1.2 GiB per GPU


def _quantized() -> bool:
    from devmap_shims.versions import installed_version, version_in

    transformers, bnb = installed_version("transformers"), installed_version("bitsandbytes")
    return bool(transformers and bnb and version_in(transformers, ">=5") and version_in(bnb, ">=0.46"))


def _load_kwargs() -> Dict[str, Any]:
    if _quantized():
        import transformers

        return {"quantization_config": transformers.BitsAndBytesConfig(load_in_4bit=True)}
    return {}


def _checkpoint_and_reference() -> Any:
    """The tiny checkpoint and its greedy tokens on the CPU, made once per process."""
    from devmap_shims.scenarios.checkpoints import once

    def make() -> Any:
        import os

        import transformers

        from devmap_shims.scenarios.checkpoints import scratch_dir
        from devmap_shims.testing.models import greedy_generate, sample_input_ids, save_tiny_causal_lm

        path = os.path.join(scratch_dir("big-vocab"), "model")
        save_tiny_causal_lm(
            "qwen2", path, num_layers=8, vocab_size=VOCAB, hidden_size=128,
            intermediate_size=512 if _quantized() else 256, num_attention_heads=4, num_key_value_heads=2,
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **_load_kwargs())
        return path, greedy_generate(model, sample_input_ids(vocab=VOCAB), max_new_tokens=8)

    return once("big-vocab", make)


@scenario(BUG_ID, "from_pretrained(device_map='auto') of a model whose embedding dwarfs its layers, on 4 GPUs",
          needs=("torch", "transformers", "accelerate"))
def big_embedding_auto_map_on_four_gpus() -> str:
    import transformers

    from devmap_shims.scenarios.checkpoints import same_tokens
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import greedy_generate, sample_input_ids

    path, reference = _checkpoint_and_reference()
    with simulated_gpus(GPUS, memory=GPU_MEMORY):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="auto", **_load_kwargs())
        devices = sorted({str(p.device) for p in model.parameters()})
        if len(devices) == 1:
            raise BugObserved(f"collapsed: every module on {devices[0]} of {GPUS} GPUs")
        if len(devices) < GPUS:  # accelerate 0.29 skips GPU 0 instead of collapsing
            raise BugObserved(f"left GPUs idle: modules only on {', '.join(devices)} of {GPUS} GPUs")
        embed = model.get_input_embeddings().weight.device
        tokens = greedy_generate(model, sample_input_ids(vocab=VOCAB).to(embed), max_new_tokens=8)
    return same_tokens(tokens, reference, f"spread over {', '.join(devices)}")
