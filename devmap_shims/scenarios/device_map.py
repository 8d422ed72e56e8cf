"""Scenario for Report 1: ``device_map="auto"`` puts a model with a large unsplittable embedding on one GPU.

A tiny Qwen2 (tied embeddings, like Gemma-2) whose embedding table is most of its weight, the
shape of Gemma-2-27B in 4-bit, loaded with ``from_pretrained(device_map="auto")`` on four
simulated 2 GiB GPUs. Where bitsandbytes runs 4-bit on the CPU (>= 0.46, with transformers 5) the
model is loaded in 4-bit, as in huggingface/transformers#34751; older bitsandbytes quantizes with
CUDA kernels only, so there it loads unquantized, sized so that accelerate's balancing collapses
it all the same.
"""

from __future__ import annotations

import os
from typing import Any, Dict

from devmap_shims.scenarios import BugObserved, scenario, scratch_dir

VOCAB = 8192
GPUS = 4
GPU_MEMORY = "2GiB"  # transformers' allocator warm-up assumes at least 1.2 GiB per GPU
_CACHE: Dict[str, Any] = {}


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
    if "path" not in _CACHE:
        import transformers

        from devmap_shims.testing.models import greedy_generate, sample_input_ids, save_tiny_causal_lm

        path = os.path.join(scratch_dir("big-vocab"), "model")
        save_tiny_causal_lm(
            "qwen2", path, num_layers=8, vocab_size=VOCAB, hidden_size=128,
            intermediate_size=512 if _quantized() else 256, num_attention_heads=4, num_key_value_heads=2,
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **_load_kwargs())
        _CACHE["path"] = path
        _CACHE["tokens"] = greedy_generate(model, sample_input_ids(vocab=VOCAB), max_new_tokens=8)
    return _CACHE["path"], _CACHE["tokens"]


@scenario(
    "balanced-memory-large-unquantized-embedding-collapse",
    "from_pretrained(device_map='auto') of a model whose embedding dwarfs its layers, on 4 GPUs",
    needs=("torch", "transformers", "accelerate"),
)
def big_embedding_auto_map_on_four_gpus() -> str:
    import torch
    import transformers

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
    if not torch.equal(tokens.cpu(), reference):
        raise BugObserved(f"spread over {', '.join(devices)} but generated {tokens.tolist()} instead of {reference.tolist()}")
    return f"spread over {', '.join(devices)}; greedy tokens equal to CPU"
