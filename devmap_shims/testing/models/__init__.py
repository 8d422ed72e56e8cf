"""Tiny offline models for tests, demos and user CI.

Every model here is built from a config written in code, with random weights drawn
from a fixed seed: no Hub access, no downloads, no tokenizer files fetched. They are
small enough that greedy ``generate`` of 32 tokens, or two Flux denoising steps,
take well under a second on a CPU, and big enough to have the module structure
that device-placement code sees in real checkpoints (embeddings, decoder layers,
tied heads, a Flux transformer + VAE + two text encoders).

Causal LMs::

    model = tiny_causal_lm("llama")                 # random, seed 0
    path = save_tiny_causal_lm("qwen2", tmp_path)   # safetensors, reloadable offline
    AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    tokens = greedy_generate(model, sample_input_ids(), max_new_tokens=16)

Flux::

    pipe = tiny_flux_pipeline()
    image = pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="pt").images

The weights are re-drawn from a generator of their own after the library's own
initialisation (see :mod:`.seeding`), so they do not depend on how a given
transformers or diffusers release initialises parameters, and they are scaled so
that greedy decoding produces varied tokens instead of one repeated token.

Tied weights (an encoder-decoder whose decoder layers share four weights each with the encoder's,
for device-map code that must size tied modules once)::

    model = tied_backbone_model(layers=2)
    infer_auto_device_map(model, max_memory=..., no_split_module_classes=list(TIED_NO_SPLIT))

Causal LMs live in :mod:`.causal_lm`, Flux in :mod:`.flux`, the tied model in :mod:`.tied`; all are
re-exported here.
"""

from __future__ import annotations

from .causal_lm import (
    ARCHS,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TINY_VOCAB,
    UnsupportedArchError,
    greedy_generate,
    sample_input_ids,
    save_tiny_causal_lm,
    supported_archs,
    tiny_causal_lm,
    tiny_config,
    two_gpu_split,
    unsupported_archs,
)
from .flux import (
    FLUX_LATENT_CHANNELS,
    flux_unavailable,
    save_tiny_flux_pipeline,
    tiny_flux_pipeline,
    tiny_flux_transformer,
)
from .tied import TIED_NO_SPLIT, TIED_PROJECTIONS, tied_backbone_model, tied_backbone_sizes

__all__ = [
    "ARCHS",
    "BOS_ID",
    "EOS_ID",
    "FLUX_LATENT_CHANNELS",
    "PAD_ID",
    "TIED_NO_SPLIT",
    "TIED_PROJECTIONS",
    "TINY_VOCAB",
    "UnsupportedArchError",
    "flux_unavailable",
    "greedy_generate",
    "sample_input_ids",
    "save_tiny_causal_lm",
    "save_tiny_flux_pipeline",
    "supported_archs",
    "tied_backbone_model",
    "tied_backbone_sizes",
    "tiny_causal_lm",
    "tiny_config",
    "tiny_flux_pipeline",
    "tiny_flux_transformer",
    "two_gpu_split",
    "unsupported_archs",
]
