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

A vision-language model (Qwen2-VL), and a map that puts its vision tower on its own GPU::

    model = tiny_qwen2_vl()
    inputs = qwen2_vl_image_prompt()
    Qwen2VLForConditionalGeneration.from_pretrained(save_tiny_qwen2_vl(tmp_path),
                                                    device_map=vision_text_split(model))

Flux::

    pipe = tiny_flux_pipeline()
    image = pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="pt").images

The weights are re-drawn from a generator of their own after the library's own
initialisation (see :mod:`.seeding`), so they do not depend on how a given
transformers or diffusers release initialises parameters, and they are scaled so
that greedy decoding produces varied tokens instead of one repeated token.

A LoRA for a diffusers model, as the state dict ``load_lora_weights`` takes::

    pipe.load_lora_weights(tiny_lora_state_dict(pipe.transformer))    # needs peft

Idefics3 / SmolVLM (image and text)::

    model = tiny_vision_language_model("idefics3")
    logits = model(**sample_vision_language_inputs(model.config)).logits

Tied weights (an encoder-decoder whose decoder layers share four weights each with the encoder's,
for device-map code that must size tied modules once)::

    model = tied_backbone_model(layers=2)
    infer_auto_device_map(model, max_memory=..., no_split_module_classes=list(TIED_NO_SPLIT))

Causal LMs live in :mod:`.causal_lm`, Flux in :mod:`.flux`, LoRAs in :mod:`.lora`, Qwen2-VL in
:mod:`.vlm`, Idefics3 and SmolVLM in :mod:`.vision_language`, the tied model in :mod:`.tied`; all
are re-exported here.
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
from .vlm import (
    IMAGE_TOKEN_ID,
    qwen2_vl_image_prompt,
    save_tiny_qwen2_vl,
    tiny_qwen2_vl,
    tiny_qwen2_vl_config,
    vision_text_split,
)
from .flux import (
    FLUX_LATENT_CHANNELS,
    flux_unavailable,
    save_tiny_flux_pipeline,
    tiny_flux_pipeline,
    tiny_flux_transformer,
)
from .lora import ATTENTION_PROJECTIONS, lora_target_modules, tiny_lora_state_dict
from .vision_language import (
    VISION_LANGUAGE_ARCHS,
    sample_vision_language_inputs,
    tiny_vision_language_config,
    tiny_vision_language_model,
    unsupported_vision_language_archs,
)
from .tied import TIED_NO_SPLIT, TIED_PROJECTIONS, tied_backbone_model, tied_backbone_sizes

__all__ = [
    "ARCHS",
    "ATTENTION_PROJECTIONS",
    "BOS_ID",
    "EOS_ID",
    "FLUX_LATENT_CHANNELS",
    "IMAGE_TOKEN_ID",
    "PAD_ID",
    "TIED_NO_SPLIT",
    "TIED_PROJECTIONS",
    "TINY_VOCAB",
    "UnsupportedArchError",
    "VISION_LANGUAGE_ARCHS",
    "flux_unavailable",
    "greedy_generate",
    "lora_target_modules",
    "qwen2_vl_image_prompt",
    "sample_input_ids",
    "sample_vision_language_inputs",
    "save_tiny_causal_lm",
    "save_tiny_flux_pipeline",
    "save_tiny_qwen2_vl",
    "supported_archs",
    "tied_backbone_model",
    "tied_backbone_sizes",
    "tiny_causal_lm",
    "tiny_config",
    "tiny_flux_pipeline",
    "tiny_flux_transformer",
    "tiny_lora_state_dict",
    "tiny_qwen2_vl",
    "tiny_qwen2_vl_config",
    "tiny_vision_language_config",
    "tiny_vision_language_model",
    "two_gpu_split",
    "unsupported_archs",
    "unsupported_vision_language_archs",
    "vision_text_split",
]
