"""Scenario for Report 4 (QwenLM/Qwen3#327), replayed exactly as its user wrote it.

A Qwen2 model (the report's "Qwen1.5") is built on the meta device, given balanced budgets and a
device map by accelerate, and loaded with ``load_checkpoint_and_dispatch`` without ``skip_keys``;
``generate`` then runs on two simulated GPUs. On transformers < 4.42 the second decoding step hands
the model a legacy tuple cache, the root hook moves all of it to ``cuda:0`` and the layer on
``cuda:1`` fails in ``torch.cat``. The tiny model keeps an untied output head, as Qwen1.5-7B does
(a tied head is not in the checkpoint and cannot be loaded this way).
"""

from __future__ import annotations

from typing import Any, Dict

from devmap_shims.scenarios import cpu_greedy_tokens, scenario, tiny_checkpoint

NEW_TOKENS = 8
GPU_MEMORY = "2GiB"  # transformers 5's allocator warm-up assumes at least 1.2 GiB per GPU


def fp16_checkpoint() -> str:
    """A tiny float16 Qwen2 checkpoint with an untied head, written once per process."""
    import torch

    return tiny_checkpoint("qwen2", "dispatch", tie_word_embeddings=False, dtype=torch.float16)


def dtype_kwargs() -> Dict[str, Any]:
    """``torch_dtype=float16`` as in the report; transformers 5 renamed it ``dtype``."""
    import torch
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": torch.float16} if major >= 5 else {"torch_dtype": torch.float16}


def cpu_reference(path: str) -> Any:
    return cpu_greedy_tokens(path, NEW_TOKENS, **dtype_kwargs())


@scenario(
    "dispatch-without-skip-keys-moves-kv-cache",
    "Qwen2 loaded with init_empty_weights + get_balanced_memory + infer_auto_device_map + "
    "load_checkpoint_and_dispatch over two GPUs (QwenLM/Qwen3#327), then generate",
    needs=("torch", "transformers", "accelerate"),
)
def report4_load_checkpoint_and_dispatch() -> str:
    import torch
    from accelerate import infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch
    from accelerate.utils import get_balanced_memory
    from transformers import AutoConfig, AutoModelForCausalLM

    from devmap_shims.scenarios import BugObserved
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import greedy_generate, sample_input_ids

    model_dir = fp16_checkpoint()
    reference = cpu_reference(model_dir)
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
    if not torch.equal(tokens, reference):
        raise BugObserved(f"generated {tokens.tolist()} instead of the CPU tokens {reference.tolist()}")
    return f"split over GPUs {', '.join(devices)}; {NEW_TOKENS} tokens equal to the CPU reference"


def _state_model() -> Any:
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
    "accelerate-skip-keys-not-propagated",
    "dispatch_model(..., skip_keys='state'): the keyword must reach the layers inside a mapped block unmoved",
    needs=("torch", "accelerate"),
)
def skip_keys_inside_a_mapped_block() -> str:
    import torch
    from accelerate import dispatch_model

    from devmap_shims.scenarios import BugObserved
    from devmap_shims.testing import simulated_gpus

    with simulated_gpus(2, memory=GPU_MEMORY), torch.no_grad():
        model = dispatch_model(_state_model(), device_map={"block": 0, "head": 1}, skip_keys="state")
        state = torch.zeros(4, device="cuda:1")
        model(torch.ones(1, 4, device="cuda:0"), state=state)
        seen, kept = str(model.block.inner.state_device), str(state.device)
    if seen != kept:
        raise BugObserved(
            f"'state' is in skip_keys and the caller keeps it on {kept}, but the layer inside the "
            f"block mapped to cuda:0 received it on {seen}: the block's child hooks were built without skip_keys"
        )
    return f"'state' reached the layer inside the cuda:0 block on {seen}, untouched"
