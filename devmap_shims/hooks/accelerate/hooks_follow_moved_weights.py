"""Shim ``hooks-follow-moved-weights``: after ``model.to("cuda:0")`` on a model that accelerate split
over several GPUs, every block runs on the device its weights were moved to.

``dispatch_model`` puts an ``AlignDevicesHook`` on each block that moves the block's inputs to the
GPU it was placed on (its ``execution_device``), and replaces the model's ``to``/``cuda`` with
guards that only log "You shouldn't move a model that is dispatched using accelerate hooks." (and
refuse when weights are offloaded). After such a move the hooks keep sending inputs to the old
GPUs, so the next forward fails with "Expected all tensors to be on the same device".

After ``dispatch_model`` returns, the wrapper wraps those guards once more: after accelerate's guard
has moved the model, when every parameter and buffer is on one device, each hook that does not
offload gets that device as its ``execution_device``. The hooks stay (the root hook still returns
outputs on the inputs' device) and so does ``hf_device_map``, which still describes the split. The
work happens once per move, nothing is added to a forward. Models dispatched before ``install()``
keep accelerate's plain guards; after ``uninstall()`` the guards put on earlier pass calls through.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    accelerate-dispatched-to-keeps-hooks
        affected: accelerate >=0.29.3
        fixed in: unfixed (last checked 2026-11-24)
"""

from __future__ import annotations

import functools
import itertools
import weakref

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.calls import argument
from devmap_shims.devices.accelerate_hooks import GUARDED_METHODS, as_device, hooks_of, is_offloading
from devmap_shims.scenarios import BugObserved, import_before_simulation, scenario
from devmap_shims.shims import LazyLogger, Shim, Target, later_call, with_context

BUG_ID = "accelerate-dispatched-to-keeps-hooks"

logger = LazyLogger(__name__)


def retarget_hooks(model: Any) -> int:
    """When all of ``model``'s parameters and buffers are on one device, point every hook that does
    not offload at it; returns how many hooks changed."""
    devices = {t.device for t in itertools.chain(model.parameters(), model.buffers())}
    if len(devices) != 1:
        return 0
    device = devices.pop()
    if device.type == "meta":
        return 0
    changed = 0
    for module in model.modules():
        for hook in hooks_of(module):
            current = getattr(hook, "execution_device", None)
            if current is None or is_offloading(hook) or not hasattr(hook, "io_same_device"):
                continue  # not an AlignDevicesHook, or one that loads offloaded weights
            if as_device(current) != device:
                hook.execution_device = device
                changed += 1
    return changed


def _following(guard: Callable[..., Any], model: Any, name: str, alive: Any) -> Callable[..., Any]:
    where = f"{type(model).__name__}.{name} (the guard accelerate's dispatch_model put on the model)"

    @functools.wraps(guard)
    def move(*args: Any, **kwargs: Any) -> Any:
        result = guard(*args, **kwargs)
        context = alive()
        if context is not None:  # else uninstalled: accelerate's guard alone
            changed = later_call(context, where, retarget_hooks, model)
            if changed:
                logger.debug("%s moved: %d accelerate hooks now run it where its weights are", type(model).__name__, changed)
        return result

    move.__devmap_follows__ = True  # type: ignore[attr-defined]
    return move


@with_context
def follow_moves(context: Any, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``dispatch_model``, then the ``to``/``cuda`` guards it put on the model also move the hooks."""
    result = wrapped(*args, **kwargs)
    _, model = argument(wrapped, "model", args, kwargs)
    namespace = getattr(model, "__dict__", None)
    if isinstance(namespace, dict):
        alive = weakref.ref(context)
        for name in GUARDED_METHODS:
            guard = namespace.get(name)
            if callable(guard) and hasattr(guard, "__wrapped__") and not getattr(guard, "__devmap_follows__", False):
                namespace[name] = _following(guard, model, name, alive)
    return result


SHIM = Shim(
    id="hooks-follow-moved-weights",
    fixes=(BUG_ID,),
    targets=(
        Target("accelerate.big_modeling", "dispatch_model", expect_params=("model",), wrapper=follow_moves),
    ),
    summary="after model.to() on a dispatched model, point accelerate's hooks at where the weights went",
)


# -- scenario ---------------------------------------------------------------------------------------
NEW_TOKENS = 8


@scenario(BUG_ID, "a tiny Llama split over cuda:0 and cuda:1 by device_map, then model.to('cuda:0') and generate",
          needs=("torch", "transformers", "accelerate"))
def split_model_moved_to_one_gpu() -> str:
    import_before_simulation("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from devmap_shims.scenarios.checkpoints import same_tokens, tiny_checkpoint
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import greedy_generate, sample_input_ids, two_gpu_split

    path = tiny_checkpoint("llama", "fp32")
    ids = sample_input_ids()
    device_map = two_gpu_split(AutoModelForCausalLM.from_pretrained(path))
    with simulated_gpus(2, memory="2GiB"), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map)
        reference = greedy_generate(model, ids.to("cuda:0"), NEW_TOKENS)
        model.to("cuda:0")
        devices = sorted({str(p.device) for p in model.parameters()})
        if devices != ["cuda:0"]:
            raise BugObserved(f"model.to('cuda:0') left parameters on {devices}")
        tokens = greedy_generate(model, ids.to("cuda:0"), NEW_TOKENS)
    return same_tokens(tokens, reference, "after model.to('cuda:0'), against the split model")
