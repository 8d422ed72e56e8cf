"""Repair degenerate device maps for ``device_map="auto" | "balanced" | "balanced_low_0"``.

Bug ``balanced-memory-large-unquantized-embedding-collapse`` (huggingface/transformers#34751,
bitsandbytes-foundation/bitsandbytes#1411, fix huggingface/accelerate#3244 never merged): the
balanced per-GPU cap is smaller than the largest unsplittable leaf (Gemma-2-27B's unquantized
2.2 GiB embedding next to 0.26 GiB 4-bit layers) and the greedy placer never returns to a GPU
it skipped, so a 4-bit model on 8 GPUs lands on one GPU. The same arithmetic leaves GPUs empty
or badly loaded in maps that do not fully collapse.

Where each stack computes the map, and so where the shim hooks:

* accelerate (every version), used by transformers 4.x ``from_pretrained`` and by accelerate's
  own ``load_checkpoint_and_dispatch``: ``get_balanced_memory`` then (transformers applies the
  quantizer's ``adjust_max_memory``, x0.9 for bitsandbytes) ``infer_auto_device_map``. The
  first hook only remembers the budgets the caller gave, before balancing capped them; the
  second checks the map the library computed and replaces it when it is degenerate. The
  quantizer's adjustment is read back as the ratio between the budgets ``infer_auto_device_map``
  received and the balanced caps.
* transformers >= 5 computes the map itself in ``transformers.integrations.accelerate``:
  ``_get_device_map`` receives the user's ``max_memory``, the strategy and the quantizer, so one
  hook there sees everything.

Maps that are healthy, ``sequential`` maps and explicit dict maps are returned unchanged (the
very same object).
"""

from __future__ import annotations

import copy
import threading
import weakref

from devmap_shims.hooks._lazy import LazyLogger
from devmap_shims.shims import Shim, Target

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing, inspect and logging would cost install() its start-up budget
    import inspect
    from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

BUG_ID = "balanced-memory-large-unquantized-embedding-collapse"
SHIM_ID = "device-map-balance"
STRATEGIES = ("auto", "balanced", "balanced_low_0")

logger = LazyLogger("devmap_shims.hooks.device_map")

_HERE = "devmap_shims.hooks.device_map"

SHIMS = (
    Shim(
        id=SHIM_ID,
        fixes=(BUG_ID,),
        targets=(
            Target(
                "accelerate.utils.modeling",
                "get_balanced_memory",
                expect_params=("model", "max_memory", "no_split_module_classes", "low_zero"),
                wrapper=f"{_HERE}:remember_balanced_memory",
            ),
            Target(
                "accelerate.utils.modeling",
                "infer_auto_device_map",
                expect_params=("model", "max_memory", "no_split_module_classes", "dtype", "special_dtypes"),
                wrapper=f"{_HERE}:repair_infer_auto_device_map",
            ),
            Target(
                "transformers.integrations.accelerate",
                "_get_device_map",
                when={"transformers": ">=5"},
                expect_params=("model", "device_map", "max_memory", "hf_quantizer"),
                wrapper=f"{_HERE}:repair_get_device_map",
            ),
        ),
        summary="spread device_map='auto'/'balanced' over every GPU instead of collapsing onto one",
    ),
)


# -- call-site plumbing ---------------------------------------------------------------------------

_SIGNATURES: Dict[Any, inspect.Signature] = {}


def _bind(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """Arguments by parameter name, defaults filled in."""
    key = getattr(func, "__wrapped__", func)
    sig = _SIGNATURES.get(key)
    if sig is None:
        import inspect

        sig = _SIGNATURES[key] = inspect.signature(func)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


class _BalancedCall:
    __slots__ = ("user_max_memory", "low_zero", "balanced")

    def __init__(self, user_max_memory: Optional[dict], low_zero: bool, balanced: dict) -> None:
        self.user_max_memory = user_max_memory
        self.low_zero = low_zero
        self.balanced = balanced


_pending: "weakref.WeakKeyDictionary[Any, _BalancedCall]" = weakref.WeakKeyDictionary()
_pending_lock = threading.Lock()


# -- accelerate: get_balanced_memory + infer_auto_device_map --------------------------------------


def remember_balanced_memory(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Call accelerate's ``get_balanced_memory`` unchanged, remembering the budgets it capped."""
    try:
        params = _bind(wrapped, args, kwargs)
        model = params["model"]
        user = params.get("max_memory")
        user_copy = copy.copy(user) if isinstance(user, dict) else None
        low_zero = bool(params.get("low_zero"))
    except Exception:  # an unusual call: let the original answer (and raise) as it would
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    if isinstance(result, dict):
        with _pending_lock:
            try:
                _pending[model] = _BalancedCall(user_copy, low_zero, dict(result))
            except TypeError:  # model not weak-referenceable
                pass
    return result


def repair_infer_auto_device_map(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Call accelerate's ``infer_auto_device_map``; when it follows a ``get_balanced_memory`` call
    on the same model and the map is degenerate, return a balanced map instead."""
    result = wrapped(*args, **kwargs)
    params = _bind(wrapped, args, kwargs)
    model = params["model"]
    with _pending_lock:
        call = _pending.pop(model, None)
    if call is None or not isinstance(result, dict):
        return result  # not a balanced strategy (sequential, or a direct call): leave it alone
    budgets = _budgets_from_balanced_call(call, params.get("max_memory"))
    if budgets is None:
        return result
    layout = _accelerate_layout(model, params)
    return _maybe_repair(layout, result, budgets, call.low_zero, bool(params.get("clean_result", True)))


def _resolve_accelerate_max_memory(max_memory: Optional[dict]) -> Dict[Any, int]:
    from accelerate.utils.modeling import get_max_memory

    return get_max_memory(copy.copy(max_memory) if max_memory is not None else None)


def _budgets_from_balanced_call(call: _BalancedCall, passed: Optional[dict]) -> Optional[Dict[Any, float]]:
    """The user's budgets scaled by whatever the caller did to the balanced caps in between
    (transformers: the quantizer's ``adjust_max_memory``). None when the caller's change is not
    a per-device scaling down (then it is not ours to second-guess)."""
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
    user = _resolve_accelerate_max_memory(call.user_max_memory)
    return {k: user.get(k, received[k]) * factors.get(k, default) for k in received}


def _accelerate_layout(model: Any, params: Mapping[str, Any]) -> Any:
    from accelerate.utils.modeling import compute_module_sizes, find_tied_parameters

    from devmap_shims.planning import layout_from_module

    sizes = compute_module_sizes(model, dtype=params.get("dtype"), special_dtypes=params.get("special_dtypes"))
    no_split = params.get("no_split_module_classes") or ()
    if isinstance(no_split, str):
        no_split = [no_split]
    tied = params.get("tied_parameters") or find_tied_parameters(model)
    return layout_from_module(model, sizes, no_split, tied)


# -- transformers >= 5: _get_device_map ------------------------------------------------------------


def repair_get_device_map(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Call transformers' ``_get_device_map``; for the balanced strategies, replace a degenerate
    map by a balanced one computed from the user's budgets and the quantizer's adjustment."""
    params = _bind(wrapped, args, kwargs)
    strategy = params.get("device_map")
    user = params.get("max_memory")
    user_copy = copy.copy(user) if isinstance(user, dict) else user
    result = wrapped(*args, **kwargs)
    if not isinstance(strategy, str) or strategy not in STRATEGIES or not isinstance(result, dict):
        return result
    model, quantizer = params["model"], params.get("hf_quantizer")
    if getattr(model, "_no_placement_params", None):
        logger.debug("device map left alone: %s escapes parameters from placement", type(model).__name__)
        return result
    from transformers.integrations import accelerate as tia

    budgets = tia.get_max_memory(user_copy)
    if quantizer is not None:
        budgets = quantizer.adjust_max_memory(budgets)
    layout = _transformers_layout(model, quantizer)
    return _maybe_repair(layout, result, budgets, strategy == "balanced_low_0", True)


def _transformers_layout(model: Any, quantizer: Any) -> Any:
    from transformers.integrations import accelerate as tia

    from devmap_shims.planning import layout_from_module

    try:
        sizes, _ = tia.compute_module_sizes(model, quantizer, only_modules=False)
    except TypeError:
        sizes, _ = tia.compute_module_sizes(model, quantizer)
    tied_keys = dict(getattr(model, "all_tied_weights_keys", None) or {})
    groups = [
        sorted([k for k, v in tied_keys.items() if v == target] + [target]) for target in set(tied_keys.values())
    ]
    no_split = getattr(model, "_no_split_modules", None) or ()
    return layout_from_module(model, sizes, no_split, groups)


# -- shared -------------------------------------------------------------------------------------


def _maybe_repair(layout: Any, result: dict, budgets: Mapping[Any, float], low_zero: bool, clean: bool) -> dict:
    from devmap_shims.planning import repair

    outcome = repair(layout, result, budgets, low_zero=low_zero, clean=clean)
    if not outcome.repaired:
        logger.debug("device map kept: %s", outcome.reason)
        return result
    logger.info("devmap_shims: repaired device map (bug %s): %s", BUG_ID, outcome.reason)
    repaired = type(result)(outcome.device_map) if type(result) is not dict else outcome.device_map
    return repaired


def plan_outcome(layout: Any, result: dict, budgets: Mapping[Any, float], low_zero: bool) -> Any:
    """The repair decision without logging (for ``devmap-shims plan`` and reports)."""
    from devmap_shims.planning import repair

    return repair(layout, result, budgets, low_zero=low_zero)


__all__: List[str] = [
    "BUG_ID",
    "SHIMS",
    "SHIM_ID",
    "remember_balanced_memory",
    "repair_get_device_map",
    "repair_infer_auto_device_map",
]
