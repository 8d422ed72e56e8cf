"""Shim ``balanced-budgets-reach-the-map``: ``from_pretrained(..., device_map="auto" | "balanced" |
"balanced_low_0")`` places the model with the balanced budgets, computed from the caller's
``max_memory``.

``from_pretrained`` computes the balanced per-GPU budgets with accelerate's ``get_balanced_memory``
and then places the model with ``infer_auto_device_map``. transformers 4.27.0 and 4.27.1 hand the
placer the caller's ``max_memory`` instead of the balanced budgets (so "balanced" fills GPU 0
first, as "sequential" does); 4.27.2 hands it the budgets but computes them from every device's
full memory, not from the caller's ``max_memory``.

While a ``from_pretrained`` call runs on a thread, the wrappers keep the caller's ``max_memory``
and what ``get_balanced_memory`` returned for the model. ``get_balanced_memory`` called with no
``max_memory`` gets the caller's; ``infer_auto_device_map`` called for the same model with the very
``max_memory`` the budgets were computed from (the dropped result) gets the budgets instead.
Every other call, and every call outside ``from_pretrained``, is passed through unchanged.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    transformers-balanced-maxmem-discarded
        affected: transformers >=4.27.0,<4.27.2
        fixed in: transformers 4.27.2
    transformers-user-maxmem-ignored-balanced
        affected: transformers ==4.27.2
        fixed in: transformers 4.27.3
"""

from __future__ import annotations

import threading

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Tuple

from devmap_shims.calls import argument, with_argument
from devmap_shims.scenarios import BugObserved, scenario
from devmap_shims.shims import Shim, Target, with_context

DISCARDED = "transformers-balanced-maxmem-discarded"
IGNORED = "transformers-user-maxmem-ignored-balanced"


class _Loads(threading.local):
    """Per thread, one entry per ``from_pretrained`` call in progress (innermost last):
    ``[caller's max_memory, (model, max_memory given, budgets) or None]``."""

    def __init__(self) -> None:
        self.stack: List[List[Any]] = []


@with_context
def keep_callers_max_memory(context: Any, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``from_pretrained`` unchanged; while it runs, the caller's ``max_memory`` is known."""
    stack = context.state.stack
    stack.append([kwargs.get("max_memory"), None])
    try:
        return wrapped(*args, **kwargs)
    finally:
        stack.pop()


@with_context
def balance_callers_max_memory(context: Any, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``get_balanced_memory``: inside ``from_pretrained``, computed from the caller's
    ``max_memory`` when it was not passed on; the result is kept for the placer."""
    stack = context.state.stack
    if not stack:
        return wrapped(*args, **kwargs)
    load = stack[-1]
    _, given = argument(wrapped, "max_memory", args, kwargs)
    if given is None and load[0] is not None:
        given = load[0]
        args, kwargs = with_argument(wrapped, "max_memory", given, args, kwargs)
    budgets = wrapped(*args, **kwargs)
    _, model = argument(wrapped, "model", args, kwargs)
    load[1] = (model, given, budgets)
    return budgets


@with_context
def place_with_budgets(context: Any, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``infer_auto_device_map``: inside ``from_pretrained``, given the balanced budgets where it
    was handed the ``max_memory`` they were computed from."""
    stack = context.state.stack
    if stack and stack[-1][1] is not None:
        (model, given, budgets), stack[-1][1] = stack[-1][1], None
        _, placed = argument(wrapped, "model", args, kwargs)
        _, max_memory = argument(wrapped, "max_memory", args, kwargs)
        if placed is model and max_memory is given and budgets is not given:
            args, kwargs = with_argument(wrapped, "max_memory", budgets, args, kwargs)
    return wrapped(*args, **kwargs)


SHIM = Shim(
    id="balanced-budgets-reach-the-map",
    fixes=(DISCARDED, IGNORED),
    targets=(
        Target(
            "transformers.modeling_utils",
            "PreTrainedModel.from_pretrained",
            expect_params=("pretrained_model_name_or_path",),
            wrapper=keep_callers_max_memory,
        ),
        Target(
            "accelerate.utils.modeling",
            "get_balanced_memory",
            expect_params=("model", "max_memory"),
            wrapper=balance_callers_max_memory,
        ),
        Target(
            "accelerate.utils.modeling",
            "infer_auto_device_map",
            expect_params=("model", "max_memory"),
            wrapper=place_with_budgets,
        ),
    ),
    state=_Loads,
    summary="place from_pretrained's balanced device maps with the balanced budgets, computed from the caller's max_memory",
)


# -- scenarios --------------------------------------------------------------------------------------
GPU_MEMORY = "2GiB"  # transformers 5's allocator warm-up assumes at least 1.2 GiB per GPU


def _tiny_gpt2() -> str:
    """A four-block GPT-2 checkpoint (GPT-2 is built by every transformers release the rows and
    the stacks span; 4.27 has no Llama), written once per process."""

    def make() -> str:
        import os

        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        from devmap_shims.scenarios.checkpoints import scratch_dir

        path = os.path.join(scratch_dir("balanced"), "gpt2")
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=64)).save_pretrained(path)
        return path

    import os

    from devmap_shims.scenarios.checkpoints import once

    return once(("checkpoint", "gpt2-balanced"), make, os.path.isdir)


def _bytes_per_gpu(model: Any) -> Dict[int, int]:
    placed: Dict[int, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type == "cuda":
            placed[tensor.device.index] = placed.get(tensor.device.index, 0) + tensor.numel() * tensor.element_size()
    return placed


def _load_balanced(**kwargs: Any) -> Tuple[Any, Dict[int, int]]:
    from transformers import GPT2LMHeadModel

    from devmap_shims.testing import simulated_gpus

    path = _tiny_gpt2()
    with simulated_gpus(2, memory=GPU_MEMORY):
        model = GPT2LMHeadModel.from_pretrained(path, device_map="balanced", **kwargs)
        # transformers 5 sets no hf_device_map when the whole model lands on one device
        return getattr(model, "hf_device_map", {"": str(model.device)}), _bytes_per_gpu(model)


@scenario(DISCARDED, 'from_pretrained(device_map="balanced") of a four-block GPT-2 on two simulated GPUs',
          needs=("torch", "transformers", "accelerate"))
def balanced_uses_both_gpus() -> str:
    device_map, placed = _load_balanced()
    if len(placed) < 2:
        raise BugObserved(f'device_map="balanced" put the whole model on one GPU: {dict(device_map)}, bytes per GPU {placed}')
    return f"split over both GPUs: bytes per GPU {placed}"


USER_CAP = 60_000  # bytes: about an eighth of the tiny GPT-2


@scenario(IGNORED, f'from_pretrained(device_map="balanced", max_memory={{0: {USER_CAP}, 1: "2GiB"}}) of a four-block GPT-2',
          needs=("torch", "transformers", "accelerate"))
def balanced_keeps_the_callers_cap() -> str:
    device_map, placed = _load_balanced(max_memory={0: USER_CAP, 1: GPU_MEMORY})
    if placed.get(0, 0) > USER_CAP:
        raise BugObserved(f"max_memory caps GPU 0 at {USER_CAP} B, the balanced map put {placed[0]} B there: {dict(device_map)}")
    return f"GPU 0 holds {placed.get(0, 0)} B (cap {USER_CAP}), bytes per GPU {placed}"
