"""Shim ``generate-input-device``: ``generate()``'s tensor inputs go to the device of the model's
input embeddings, and the result comes back on the caller's device.

Every top-level tensor argument of ``generate`` (``input_ids``, ``attention_mask``,
``inputs_embeds``, ``pixel_values``, ... and tensors passed through ``**kwargs``; never the
cache, ``past_key_values`` or, as transformers >= 5.24 names it, ``cache``) goes to the device
of ``model.get_input_embeddings()`` (for an offloaded embedding, its hook's execution device),
non-blocking when the destination is a GPU, with one DEBUG line. When the main input was moved,
the tensors of the result go back to the caller's device, so code that worked before sees the
same devices. Anything that is not a tensor (a ``BatchEncoding``, nested lists, caches) is left
alone, and a model without input embeddings is not touched at all. ``GenerationMixin.generate``
is wrapped, and so is every model class of the installed transformers that overrides it
(:mod:`._generate_overrides`, listed once the shim arms).

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    generate-input-device-type-warning
        affected: transformers >=4.24.0,<5.13.0
        fixed in: transformers 5.13.0
    transformers-generate-mask-device
        affected: transformers >=4.38.0
        fixed in: unfixed (last checked 2026-11-24)
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Tuple

import weakref

from devmap_shims.devices.embeddings import input_embedding_device
from devmap_shims.devices.tensors import tensor_type
from devmap_shims.scenarios import scenario
from devmap_shims.shims import LazyLogger, Shim, Target, with_context

BUG_ID = "generate-input-device-type-warning"
MASK_BUG = "transformers-generate-mask-device"

logger = LazyLogger(__name__)

#: Keyword arguments never moved: a cache split over GPUs must stay where each layer put it.
#: transformers 5.24 renamed ``past_key_values`` to ``cache`` (arguments and outputs; the old
#: argument name still works there, with a FutureWarning).
NEVER_MOVED = frozenset({"past_key_values", "cache"})
#: The argument whose device the caller gets the result back on (first one present wins).
MAIN_INPUTS = (
    "inputs",
    "input_ids",
    "inputs_embeds",
    "input_features",
    "input_values",
    "pixel_values",
    "decoder_input_ids",
)


def _misplaced(args: Tuple[Any, ...], kwargs: Dict[str, Any], target: Any) -> bool:
    tensor = tensor_type()
    for value in args:
        if isinstance(value, tensor) and value.device != target:
            return True
    for name, value in kwargs.items():
        if isinstance(value, tensor) and value.device != target and name not in NEVER_MOVED:
            return True
    return False


def _main_input(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    tensor = tensor_type()
    for value in args:
        if isinstance(value, tensor):
            return value
    for name in MAIN_INPUTS:
        value = kwargs.get(name)
        if isinstance(value, tensor):
            return value
    return None


@with_context
def align_generate_inputs_once_known(context: Any, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                                     kwargs: Dict[str, Any]) -> Any:
    """The shim's wrapper: :func:`align_generate_inputs`, remembering each model's input embeddings."""
    return align_generate_inputs(wrapped, instance, args, kwargs, known=context.state)


def align_generate_inputs(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                          known: Any = None) -> Any:
    """Wrapper for ``generate``: align the inputs, call, give the result back on the caller's device."""
    target = input_embedding_device(instance, known)
    if target is None or not _misplaced(args, kwargs, target):
        return wrapped(*args, **kwargs)
    main = _main_input(args, kwargs)
    caller_device = main.device if main is not None and main.device != target else None
    non_blocking = target.type == "cuda"
    tensor = tensor_type()
    moved: List[str] = []

    def move(name: str, value: Any) -> Any:
        if isinstance(value, tensor) and value.device != target and name not in NEVER_MOVED:
            moved.append(f"{name} ({value.device})")
            return value.to(target, non_blocking=non_blocking)
        return value

    new_args = tuple(move(f"positional argument {i}", value) for i, value in enumerate(args))
    new_kwargs = {name: move(name, value) for name, value in kwargs.items()}
    logger.debug(
        "%s moved %s to %s, the device of %s's input embeddings, before generate()",
        SHIM.id, ", ".join(moved), target, type(instance).__name__,
    )
    result = wrapped(*new_args, **new_kwargs)
    if caller_device is None:
        return result
    return to_device(result, caller_device)


def to_device(result: Any, device: Any, depth: int = 0) -> Any:
    """``result``'s tensors on ``device``: a tensor, or a ModelOutput / tuple holding tensors.

    Caches are left where they are (``past_key_values`` and ``cache`` keys, and any object that is
    not a tensor, tuple, list or mapping). Copies to the CPU are blocking, so the caller can read
    them at once.
    """
    if isinstance(result, tensor_type()):
        return result.to(device)
    if depth > 3:
        return result
    if isinstance(result, tuple) and not hasattr(result, "_fields"):
        return tuple(to_device(item, device, depth + 1) for item in result)
    if isinstance(result, list):
        return [to_device(item, device, depth + 1) for item in result]
    keys = getattr(result, "keys", None)
    if callable(keys) and hasattr(result, "__setitem__"):
        for key in list(keys()):
            if key in NEVER_MOVED:
                continue
            value = result[key]
            new = to_device(value, device, depth + 1)
            if new is not value:
                result[key] = new
    return result


SHIM = Shim(
    id="generate-input-device",
    fixes=(BUG_ID, MASK_BUG),
    targets=(Target("transformers.generation.utils", "GenerationMixin.generate"),),
    wrapper=align_generate_inputs_once_known,
    state=weakref.WeakKeyDictionary,
    more_targets="devmap_shims.hooks.transformers._generate_overrides:override_targets",
    summary="move generate()'s tensor inputs to the input embeddings' device (and the result back)",
)


# -- scenario ---------------------------------------------------------------------------------------
NEW_TOKENS = 8
GPU_MEMORY = "2GiB"  # transformers 5's allocator warm-up assumes at least 1.2 GiB per GPU


@scenario(
    BUG_ID,
    "model on cuda:1 with no accelerate hooks, inputs moved with .to('cuda'): generate must run and give the CPU tokens",
    needs=("torch", "transformers", "accelerate"),
)
def inputs_on_cuda0_model_on_cuda1() -> str:
    """A one-device ``device_map={"": 1}`` (no accelerate hooks) and inputs moved with ``.to("cuda")``,
    which means ``cuda:0``; from transformers 5.13 ``generate`` moves the forward's inputs itself."""
    import torch
    from transformers import AutoModelForCausalLM, BatchEncoding

    from devmap_shims.scenarios.checkpoints import cpu_greedy_tokens, same_tokens, tiny_checkpoint
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import PAD_ID, sample_input_ids

    path = tiny_checkpoint("qwen2", "gen")
    reference = cpu_greedy_tokens(path, NEW_TOKENS)
    ids = sample_input_ids()
    with simulated_gpus(2, memory=GPU_MEMORY), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, device_map={"": 1})
        inputs = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)}).to("cuda")
        out = model.generate(
            **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID
        )
        where = f"model on {model.device}, inputs on {inputs['input_ids'].device}, output on {out.device}"
        return same_tokens(out[:, ids.shape[-1]:], reference, where)


@scenario(
    MASK_BUG,
    "model on cuda:1 with no accelerate hooks, input_ids on cuda:1, attention_mask left on the CPU",
    needs=("torch", "transformers", "accelerate"),
)
def mask_left_on_the_cpu() -> str:
    """A Llama (its rotary embedding multiplies by position_ids on every release since 4.38) whose
    inputs were moved by hand, the mask forgotten."""
    import torch
    from transformers import AutoModelForCausalLM

    from devmap_shims.scenarios.checkpoints import cpu_greedy_tokens, same_tokens, tiny_checkpoint
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import PAD_ID, sample_input_ids

    path = tiny_checkpoint("llama", "gen")
    reference = cpu_greedy_tokens(path, NEW_TOKENS)
    ids = sample_input_ids()
    with simulated_gpus(2, memory=GPU_MEMORY), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, device_map={"": 1})
        out = model.generate(
            ids.to("cuda:1"), attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID,
        )
        return same_tokens(out[:, ids.shape[-1]:], reference, "input_ids on cuda:1, attention_mask on the cpu")
