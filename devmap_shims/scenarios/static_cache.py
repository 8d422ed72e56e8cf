"""A tiny Llama split over two simulated GPUs generating with ``cache_implementation="static"``:
the user code of the transformers static-cache rows."""

from __future__ import annotations

from typing import Any

from devmap_shims.scenarios import BugObserved

NEEDS = ("torch", "transformers", "accelerate")
NEW_TOKENS = 6


def _split_checkpoint_and_reference() -> Any:
    """The tiny Llama's checkpoint, its two-GPU split and its greedy tokens on the CPU with a static cache."""
    from devmap_shims.scenarios.checkpoints import once, tiny_checkpoint

    def make() -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        from devmap_shims.testing.models import PAD_ID, sample_input_ids, two_gpu_split

        path = tiny_checkpoint("llama", "static-cache")
        model = AutoModelForCausalLM.from_pretrained(path)
        ids = sample_input_ids()
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                    cache_implementation="static", pad_token_id=PAD_ID)
        return path, two_gpu_split(model), tokens[:, ids.shape[-1]:]

    return once("static-cache", make)


def generate_on_a_split_model() -> str:
    """Load the tiny Llama with a device map over cuda:0 and cuda:1 and generate greedily with a static
    cache; the summary when the tokens equal the CPU's, the error (or BugObserved) otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    from devmap_shims.scenarios.checkpoints import same_tokens
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import PAD_ID, sample_input_ids

    path, device_map, reference = _split_checkpoint_and_reference()
    if len(set(device_map.values())) < 2:
        raise BugObserved(f"the scenario needs a split model, got {device_map}")
    ids = sample_input_ids()
    with simulated_gpus(2, memory="2GiB"), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map)
        out = model.generate(ids.to("cuda:0"), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             cache_implementation="static", pad_token_id=PAD_ID)
        return same_tokens(out[:, ids.shape[-1]:], reference, "split over cuda:0 and cuda:1 with a static cache")
