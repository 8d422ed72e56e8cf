"""Shim ``dispatch-skip-keys``: ``dispatch_model`` / ``load_checkpoint_and_dispatch`` get the
``skip_keys`` that ``from_pretrained`` would pass, and every accelerate hook they build gets them.

When the caller gave no ``skip_keys`` (None) and the model declares
``_skip_keys_device_placement`` (``"past_key_values"`` for decoder models), it is passed, exactly
as ``from_pretrained`` does; an explicit ``skip_keys`` (even an empty list) is the caller's choice
and is kept. After the dispatch, every accelerate hook in the model that has no ``skip_keys`` gets
the dispatch's, which is what accelerate >= 1.0 builds; there nothing changes.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    dispatch-without-skip-keys-moves-kv-cache
        affected: accelerate >=0.20.0; transformers >=4.30.0,<4.42.0
        fixed in: transformers 4.42.0
    accelerate-skip-keys-not-propagated
        affected: accelerate >=0.20.0,<1.0.0
        fixed in: accelerate 1.0.0
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.calls import argument, with_argument
from devmap_shims.devices.accelerate_hooks import hooks_of
from devmap_shims.scenarios import BugObserved, scenario
from devmap_shims.shims import LazyLogger, Shim, Target

CACHE_BUG = "dispatch-without-skip-keys-moves-kv-cache"
CHILD_HOOKS_BUG = "accelerate-skip-keys-not-propagated"

logger = LazyLogger(__name__)


def model_skip_keys(model: Any) -> Any:
    """What ``from_pretrained`` passes: the model's ``_skip_keys_device_placement`` as it is (a string,
    or a list, or the set transformers 5 builds), or None when the model declares none."""
    keys = getattr(model, "_skip_keys_device_placement", None)
    if isinstance(keys, str):
        return keys or None
    if isinstance(keys, (list, tuple, set, frozenset)) and keys and all(isinstance(k, str) for k in keys):
        return keys
    return None


def dispatch_with_skip_keys(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Wrapper for ``dispatch_model`` and ``load_checkpoint_and_dispatch``."""
    _, model = argument(wrapped, "model", args, kwargs)
    _, skip_keys = argument(wrapped, "skip_keys", args, kwargs)
    if skip_keys is None:
        declared = model_skip_keys(model)
        if declared is not None:
            skip_keys = declared
            args, kwargs = with_argument(wrapped, "skip_keys", declared, args, kwargs)
            logger.debug(
                "%s passes skip_keys=%r (%s._skip_keys_device_placement) to %s",
                SHIM.id, declared, type(model).__name__, getattr(wrapped, "__name__", "dispatch"),
            )
    result = wrapped(*args, **kwargs)
    if skip_keys:
        propagate_skip_keys(result if result is not None else model, skip_keys)
    return result


def propagate_skip_keys(model: Any, skip_keys: Any) -> int:
    """Give every accelerate hook in ``model`` without ``skip_keys`` these ones; returns how many."""
    modules = getattr(model, "modules", None)
    if not callable(modules):
        return 0
    changed = 0
    for module in modules():
        for hook in hooks_of(module):
            if hasattr(hook, "skip_keys") and hook.skip_keys is None:
                hook.skip_keys = skip_keys
                changed += 1
    if changed:
        logger.debug("%s gave skip_keys=%r to %d child hook(s)", SHIM.id, skip_keys, changed)
    return changed


SHIM = Shim(
    id="dispatch-skip-keys",
    fixes=(CACHE_BUG, CHILD_HOOKS_BUG),
    targets=(
        Target(
            "accelerate.big_modeling",
            "dispatch_model",
            expect_params=("model", "device_map", "skip_keys"),
            wrapper=dispatch_with_skip_keys,
        ),
        Target(
            "accelerate.big_modeling",
            "load_checkpoint_and_dispatch",
            expect_params=("model", "checkpoint", "device_map", "skip_keys"),
            wrapper=dispatch_with_skip_keys,
        ),
    ),
    summary="pass the model's _skip_keys_device_placement to dispatch_model / load_checkpoint_and_dispatch "
    "and to every child hook, as from_pretrained does",
)


# -- scenarios --------------------------------------------------------------------------------------
NEW_TOKENS = 8
GPU_MEMORY = "2GiB"  # transformers 5's allocator warm-up assumes at least 1.2 GiB per GPU


def fp16_checkpoint() -> str:
    """A tiny float16 Qwen2 checkpoint with an untied head (as Qwen1.5-7B), written once per process."""
    import torch

    from devmap_shims.scenarios.checkpoints import tiny_checkpoint

    return tiny_checkpoint("qwen2", "dispatch", tie_word_embeddings=False, dtype=torch.float16)


def dtype_kwargs() -> Dict[str, Any]:
    """``torch_dtype=float16`` as in the report; transformers 5 renamed it ``dtype``."""
    import torch

    from devmap_shims.testing.models.causal_lm import dtype_kwargs as for_this_transformers

    return for_this_transformers(torch.float16)


@scenario(
    CACHE_BUG,
    "Qwen2 loaded with init_empty_weights + get_balanced_memory + infer_auto_device_map + "
    "load_checkpoint_and_dispatch over two GPUs (QwenLM/Qwen3#327), then generate",
    needs=("torch", "transformers", "accelerate"),
)
def qwen_split_by_load_checkpoint_and_dispatch() -> str:
    import torch
    from accelerate import infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch
    from accelerate.utils import get_balanced_memory
    from transformers import AutoConfig, AutoModelForCausalLM

    from devmap_shims.scenarios.checkpoints import cpu_greedy_tokens, same_tokens
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import greedy_generate, sample_input_ids

    model_dir = fp16_checkpoint()
    reference = cpu_greedy_tokens(model_dir, NEW_TOKENS, **dtype_kwargs())
    with simulated_gpus(2, memory=GPU_MEMORY), torch.no_grad():
        # -- the report's code, unchanged but for the checkpoint path --
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
        with init_empty_weights():
            engine = AutoModelForCausalLM.from_config(config, trust_remote_code=True, **dtype_kwargs())
        max_memory = get_balanced_memory(
            engine,
            max_memory=None,
            no_split_module_classes=engine._no_split_modules,
            dtype="float16",
            low_zero=False,
        )
        device_map = infer_auto_device_map(
            engine, max_memory=max_memory, no_split_module_classes=engine._no_split_modules, dtype="float16"
        )
        engine = load_checkpoint_and_dispatch(engine, checkpoint=model_dir, device_map=device_map)
        # -- generation, with the inputs on the first GPU --
        devices = sorted({str(d) for d in device_map.values()})
        if len(devices) < 2:
            raise BugObserved(f"the report's map should split the model over two GPUs, got {dict(device_map)}")
        tokens = greedy_generate(engine, sample_input_ids().to("cuda:0"), max_new_tokens=NEW_TOKENS)
    return same_tokens(tokens, reference, f"split over GPUs {', '.join(devices)}")


def state_model() -> Any:
    """A block (mapped to one GPU) whose inner layer reads a per-call ``state`` that the caller keeps on
    another GPU and that the model lists in ``_skip_keys_device_placement`` (as decoder models list
    their KV cache)."""
    import torch

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.state_device = None

        def forward(self, x: Any, state: Any = None) -> Any:
            self.state_device = state.device
            return self.linear(x)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: Any, state: Any = None) -> Any:
            return self.inner(x, state=state)

    class Model(torch.nn.Module):
        _skip_keys_device_placement = "state"

        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.head = torch.nn.Linear(4, 4)

        def forward(self, x: Any, state: Any = None) -> Any:
            return self.head(self.block(x, state=state))

    return Model()


@scenario(
    CHILD_HOOKS_BUG,
    "dispatch_model(..., skip_keys='state'): the keyword must reach the layers inside a mapped block unmoved",
    needs=("torch", "accelerate"),
)
def skip_keys_inside_a_mapped_block() -> str:
    import torch
    from accelerate import dispatch_model

    from devmap_shims.testing import simulated_gpus

    with simulated_gpus(2, memory=GPU_MEMORY), torch.no_grad():
        model = dispatch_model(state_model(), device_map={"block": 0, "head": 1}, skip_keys="state")
        state = torch.zeros(4, device="cuda:1")
        model(torch.ones(1, 4, device="cuda:0"), state=state)
        seen, kept = str(model.block.inner.state_device), str(state.device)
    if seen != kept:
        raise BugObserved(
            f"'state' is in skip_keys and the caller keeps it on {kept}, but the layer inside the "
            f"block mapped to cuda:0 received it on {seen}: the block's child hooks were built without skip_keys"
        )
    return f"'state' reached the layer inside the cuda:0 block on {seen}, untouched"
