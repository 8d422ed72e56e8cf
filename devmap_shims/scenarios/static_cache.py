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


def _split_map(model: Any) -> Any:
    """:func:`two_gpu_split` with ``lm_head`` beside the embedding it is tied to (Gemma-2 ties them;
    accelerate keeps tied weights on one device)."""
    from devmap_shims.testing.models import two_gpu_split

    device_map = two_gpu_split(model)
    if getattr(model.config, "tie_word_embeddings", False):
        device_map["lm_head"] = device_map["model.embed_tokens"]
    return device_map


def forward_on_a_split_model(arch: str) -> str:
    """A plain ``model(input_ids)`` (eval mode, the model builds its own cache) of a tiny ``arch``
    split over cuda:0 and cuda:1; the summary when the logits equal the CPU's."""
    import torch
    from transformers import AutoModelForCausalLM

    from devmap_shims.scenarios.checkpoints import tiny_checkpoint
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import sample_input_ids

    path = tiny_checkpoint(arch, "split-forward")
    cpu = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = sample_input_ids()
    with torch.no_grad():
        reference = cpu(ids).logits
    device_map = _split_map(cpu)
    with simulated_gpus(2, memory="2GiB"), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map).eval()
        logits = model(ids.to("cuda:0")).logits.cpu()
    if not torch.allclose(logits, reference, atol=1e-5):
        raise BugObserved(f"logits differ from the CPU's by {(logits - reference).abs().max():.3g}")
    return f"{arch} split over cuda:0 and cuda:1: model(input_ids) gives the CPU's logits"


def _cache_argument(model: Any) -> str:
    """The name ``model``'s forward takes a cache by: ``cache`` from transformers 5.24, where
    ``past_key_values`` still works but warns, else ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def generate_with_a_user_static_cache() -> str:
    """``generate(past_key_values=StaticCache(..., device="cuda:0"))`` (``cache=`` on transformers
    >= 5.24) on the tiny Llama split over cuda:0 and cuda:1; the summary when the tokens equal the
    CPU's."""
    import torch
    from transformers import AutoModelForCausalLM, StaticCache

    from devmap_shims.scenarios.checkpoints import same_tokens
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import PAD_ID, sample_input_ids

    path, device_map, reference = _split_checkpoint_and_reference()
    ids = sample_input_ids()
    with simulated_gpus(2, memory="2GiB"), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map)
        cache = StaticCache(config=model.config, max_batch_size=ids.shape[0], max_cache_len=ids.shape[-1] + NEW_TOKENS,
                            device="cuda:0", dtype=torch.float32)
        out = model.generate(ids.to("cuda:0"), **{_cache_argument(model): cache}, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID)
    return same_tokens(out[:, ids.shape[-1]:], reference, "split over cuda:0 and cuda:1 with a StaticCache on cuda:0")


#: The window of the tiny Mistral: longer than prompt and new tokens, so the window never slides
#: and the tokens can be compared with the dynamic cache's on the CPU.
SLIDING_WINDOW = 16


def generate_with_a_user_sliding_window_cache() -> str:
    """``generate(past_key_values=SlidingWindowCache(..., device="cuda:0"))`` on a tiny Mistral split
    over cuda:0 and cuda:1, as the class's docstring builds it; the summary when the tokens equal
    the CPU's."""
    import torch

    from devmap_shims.scenarios import ScenarioUnavailable
    from devmap_shims.scenarios.checkpoints import cpu_greedy_tokens, same_tokens, tiny_checkpoint
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import PAD_ID, sample_input_ids, supported_archs, two_gpu_split
    from devmap_shims.versions import installed_version, version_in

    try:
        from transformers import AutoModelForCausalLM, SlidingWindowCache
    except ImportError:
        raise ScenarioUnavailable(f"transformers {installed_version('transformers')} has no SlidingWindowCache") from None
    if "mistral" not in supported_archs():
        raise ScenarioUnavailable("this transformers cannot build Mistral")
    if version_in(installed_version("transformers") or "0", ">=4.45.0,<4.46.0"):
        raise ScenarioUnavailable("4.45's SlidingWindowCache.__init__ calls StaticCache.__init__() without its "
                                  "config: no SlidingWindowCache can be built")
    path = tiny_checkpoint("mistral", "sliding-window", sliding_window=SLIDING_WINDOW)
    reference = cpu_greedy_tokens(path, NEW_TOKENS)
    ids = sample_input_ids()
    device_map = two_gpu_split(AutoModelForCausalLM.from_pretrained(path))
    with simulated_gpus(2, memory="2GiB"), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map)
        length = ids.shape[-1] + NEW_TOKENS
        cache = SlidingWindowCache(config=model.config, max_batch_size=ids.shape[0], max_cache_len=length,
                                   device="cuda:0", dtype=torch.float32)
        out = model.generate(ids.to("cuda:0"), attention_mask=torch.ones_like(ids).to("cuda:0"),
                             **{_cache_argument(model): cache}, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID)
    return same_tokens(out[:, ids.shape[-1]:], reference,
                       "Mistral split over cuda:0 and cuda:1 with a SlidingWindowCache on cuda:0")
