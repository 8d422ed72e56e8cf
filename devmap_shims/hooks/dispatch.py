"""Give accelerate's dispatch the ``skip_keys`` that ``from_pretrained`` would have given it.

Bug ``dispatch-without-skip-keys-moves-kv-cache`` (QwenLM/Qwen3#327, huggingface/transformers#28051,
#30593, huggingface/accelerate#3135, #2520): ``dispatch_model`` puts an ``AlignDevicesHook`` on the
root module that sends every keyword argument to the main GPU except those named in ``skip_keys``.
``from_pretrained(device_map=...)`` passes ``skip_keys=model._skip_keys_device_placement``
(``"past_key_values"`` for decoder models, transformers >= 4.30); a hand-written
``init_empty_weights`` -> ``infer_auto_device_map`` -> ``load_checkpoint_and_dispatch`` does not.
On transformers < 4.42, where ``generate`` hands the model a legacy tuple cache, the whole cache
is then moved to ``cuda:0`` at the second decoding step and the first layer on ``cuda:1`` fails in
``torch.cat`` (``Expected all tensors to be on the same device, but found at least two devices,
cuda:0 and cuda:1! (when checking argument for argument tensors in method wrapper_CUDA_cat)``).

The repair, on ``accelerate.big_modeling.dispatch_model`` and ``load_checkpoint_and_dispatch``:
when the caller gave no ``skip_keys`` (None) and the model declares
``_skip_keys_device_placement``, pass it, exactly as ``from_pretrained`` does. An explicit
``skip_keys`` (even an empty list) is the caller's choice and is kept.

Bug ``accelerate-skip-keys-not-propagated`` (huggingface/accelerate#3088, fixed in 1.0.0): on
accelerate >= 0.20, < 1.0 the hooks that ``dispatch_model`` attaches to the children of a module
named in the device map are built without ``skip_keys``. After the dispatch returns, the repair
gives every accelerate hook in the model that has none the ``skip_keys`` of the dispatch, which is
what accelerate 1.0 builds. On accelerate >= 1.0 every hook already has them and nothing changes.
"""

from __future__ import annotations

from devmap_shims.hooks._lazy import LazyLogger
from devmap_shims.shims import Shim, Target

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing would cost install() its start-up budget
    from typing import Any, Callable, Dict, List, Tuple

SHIM_ID = "dispatch-skip-keys"
BUG_IDS = ("dispatch-without-skip-keys-moves-kv-cache", "accelerate-skip-keys-not-propagated")
_HERE = "devmap_shims.hooks.dispatch"

logger = LazyLogger("devmap_shims.hooks.dispatch")

SHIMS = (
    Shim(
        id=SHIM_ID,
        fixes=BUG_IDS,
        targets=(
            Target(
                "accelerate.big_modeling",
                "dispatch_model",
                expect_params=("model", "device_map", "skip_keys"),
                wrapper=f"{_HERE}:dispatch_with_skip_keys",
            ),
            Target(
                "accelerate.big_modeling",
                "load_checkpoint_and_dispatch",
                expect_params=("model", "checkpoint", "device_map", "skip_keys"),
                wrapper=f"{_HERE}:dispatch_with_skip_keys",
            ),
        ),
        summary="pass the model's _skip_keys_device_placement to dispatch_model / load_checkpoint_and_dispatch "
        "and to every child hook, as from_pretrained does",
    ),
)

_POSITIONS: Dict[Any, Dict[str, int]] = {}


def _positions(func: Callable[..., Any]) -> Dict[str, int]:
    """Positional index of each parameter of ``func`` (cached per code object)."""
    key = getattr(func, "__code__", None) or func
    found = _POSITIONS.get(key)
    if found is None:
        import inspect

        found = {}
        for index, param in enumerate(inspect.signature(func).parameters.values()):
            if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                found[param.name] = index
        _POSITIONS[key] = found
    return found


def _argument(name: str, positions: Dict[str, int], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[bool, Any]:
    if name in kwargs:
        return True, kwargs[name]
    index = positions.get(name)
    if index is not None and index < len(args):
        return True, args[index]
    return False, None


def model_skip_keys(model: Any) -> Any:
    """What ``from_pretrained`` passes: the model's ``_skip_keys_device_placement`` as it is (a string,
    or a list, or the set transformers 5 builds), or None when the model declares none."""
    keys = getattr(model, "_skip_keys_device_placement", None)
    if isinstance(keys, str):
        return keys or None
    if isinstance(keys, (list, tuple, set, frozenset)) and keys and all(isinstance(k, str) for k in keys):
        return keys
    return None


def dispatch_with_skip_keys(
    wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """Wrapper for ``dispatch_model`` and ``load_checkpoint_and_dispatch``."""
    positions = _positions(wrapped)
    _, model = _argument("model", positions, args, kwargs)
    given, skip_keys = _argument("skip_keys", positions, args, kwargs)
    if skip_keys is None:
        declared = model_skip_keys(model)
        if declared is not None:
            skip_keys = declared
            index = positions.get("skip_keys")
            if given and "skip_keys" not in kwargs and index is not None:
                args = args[:index] + (declared,) + args[index + 1 :]
            else:
                kwargs = dict(kwargs, skip_keys=declared)
            logger.debug(
                "devmap_shims: %s passes skip_keys=%r (%s._skip_keys_device_placement) to %s",
                SHIM_ID, declared, type(model).__name__, getattr(wrapped, "__name__", "dispatch"),
            )
    result = wrapped(*args, **kwargs)
    if skip_keys:
        propagate_skip_keys(result if result is not None else model, skip_keys)
    return result


def _align_hooks(module: Any) -> List[Any]:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    hooks = getattr(hook, "hooks", None)  # SequentialHook
    return [h for h in (hooks if hooks is not None else (hook,)) if hasattr(h, "skip_keys")]


def propagate_skip_keys(model: Any, skip_keys: Any) -> int:
    """Give every accelerate hook in ``model`` without ``skip_keys`` these ones; returns how many.

    accelerate >= 1.0 builds them this way (huggingface/accelerate#3088); older versions leave the
    hooks on children of mapped modules without any.
    """
    modules = getattr(model, "modules", None)
    if not callable(modules):
        return 0
    changed = 0
    for module in modules():
        for hook in _align_hooks(module):
            if hook.skip_keys is None:
                hook.skip_keys = skip_keys
                changed += 1
    if changed:
        logger.debug("devmap_shims: %s gave skip_keys=%r to %d child hook(s)", SHIM_ID, skip_keys, changed)
    return changed
