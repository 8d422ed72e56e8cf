"""Scenario for the generate input-device row (Report 5), on a simulated 2-GPU machine.

The user's model sits on one GPU without accelerate hooks (a one-device ``device_map={"": 1}``, the
collapsed map of Report 1 in small) and the user moved the tokenizer's output with
``.to("cuda")``, which means ``cuda:0``. Before transformers 5.13 nothing moves the inputs to the
model and the embedding fails; from 5.13 ``generate`` moves the forward's inputs to
``model.device`` itself (huggingface/transformers#46590).
"""

from __future__ import annotations

from typing import Any

from devmap_shims.scenarios import BugObserved, cpu_greedy_tokens, scenario, tiny_checkpoint

NEW_TOKENS = 8
GPU_MEMORY = "2GiB"  # transformers 5's allocator warm-up assumes at least 1.2 GiB per GPU


def qwen2_checkpoint() -> str:
    """A tiny Qwen2 checkpoint (safetensors), written once per process."""
    return tiny_checkpoint("qwen2", "gen")


def cpu_reference(path: str) -> Any:
    """The greedy tokens of the checkpoint on the CPU (computed once per process)."""
    return cpu_greedy_tokens(path, NEW_TOKENS)


def compare(new_tokens: Any, reference: Any, where: str) -> str:
    import torch

    if not torch.equal(new_tokens.cpu(), reference):
        raise BugObserved(
            f"{where}: generated {new_tokens.cpu().tolist()} instead of the CPU tokens {reference.tolist()}"
        )
    return f"{where}: {reference.shape[-1]} tokens equal to the CPU reference"


@scenario(
    "generate-input-device-type-warning",
    "model on cuda:1 with no accelerate hooks, inputs moved with .to('cuda'): generate must run and give the CPU tokens",
    needs=("torch", "transformers", "accelerate"),
)
def inputs_on_cuda0_model_on_cuda1() -> str:
    import torch
    from transformers import AutoModelForCausalLM, BatchEncoding

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import PAD_ID, sample_input_ids

    path = qwen2_checkpoint()
    reference = cpu_reference(path)
    ids = sample_input_ids()
    with simulated_gpus(2, memory=GPU_MEMORY), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, device_map={"": 1})
        inputs = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)}).to("cuda")
        out = model.generate(
            **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID
        )
        where = f"model on {model.device}, inputs on {inputs['input_ids'].device}, output on {out.device}"
        return compare(out[:, ids.shape[-1]:], reference, where)
