"""A tiny 4-bit Flux pipeline for the scenarios of the bitsandbytes and diffusers rows.

Quantized weights come from a pre-quantized NF4 checkpoint made by
:mod:`devmap_shims.testing.nf4` and loaded the way bitsandbytes loads any pre-quantized checkpoint
(``Params4bit.from_prequantized``), so no CUDA kernel runs and every bitsandbytes release can be
replayed on a CPU.
"""

from __future__ import annotations

import os
from typing import Any, List

from devmap_shims.scenarios import BugObserved, ScenarioUnavailable, import_before_simulation
from devmap_shims.scenarios.checkpoints import once, scratch_dir

NEEDS = ("torch", "bitsandbytes", "diffusers", "transformers")


def prepare() -> Any:
    """Everything a Flux scenario needs that must exist before the simulation starts: the libraries
    and model classes (imported lazily by diffusers and transformers, and some of them probe the
    machine on import), the pre-quantized checkpoint, and a CPU pipeline to take components from."""
    import_before_simulation("bitsandbytes", "diffusers", "transformers")
    try:
        from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: F401
    except ImportError as exc:  # diffusers < 0.30
        raise ScenarioUnavailable(f"this diffusers has no Flux pipeline ({exc})") from exc

    from devmap_shims.testing.models import tiny_flux_pipeline

    prequantized_transformer_dir()
    return tiny_flux_pipeline()


def prequantized_transformer_dir() -> str:
    """A pre-quantized tiny Flux transformer checkpoint, written once per process."""

    def make() -> str:
        from devmap_shims.testing.nf4 import save_prequantized_flux_transformer

        path = os.path.join(scratch_dir("flux-nf4"), "transformer")
        save_prequantized_flux_transformer(path)
        return path

    return once("flux-nf4", make, os.path.isdir)


def prequantized_text_encoder_dir(encoder: Any) -> str:
    """``encoder`` (the CPU pipeline's CLIP text encoder) as a pre-quantized 4-bit transformers
    checkpoint, written once per process."""

    def make() -> str:
        from devmap_shims.testing.nf4 import save_prequantized_transformers_model

        path = os.path.join(scratch_dir("flux-nf4-clip"), "text_encoder")
        save_prequantized_transformers_model(encoder, path)
        return path

    return once("flux-nf4-clip", make, os.path.isdir)


def transformer_dir(transformer: Any) -> str:
    """``transformer`` (the CPU pipeline's, unquantized) as a diffusers checkpoint, written once per
    process, for loads that quantize (8-bit)."""

    def make() -> str:
        path = os.path.join(scratch_dir("flux-fp32"), "transformer")
        transformer.save_pretrained(path)
        return path

    return once("flux-fp32", make, os.path.isdir)


def load_8bit_transformer(path: str, **kwargs: Any) -> Any:
    """The transformer at ``path`` quantized to 8-bit by bitsandbytes on load (diffusers puts it on
    the current GPU)."""
    from diffusers import BitsAndBytesConfig, FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True), **kwargs)


def tiny_image(pipe: Any) -> Any:
    """Two denoising steps of a 32x32 image with a fixed CPU generator, as a CPU tensor."""
    import torch

    generator = torch.Generator("cpu").manual_seed(0)
    out = pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="pt", generator=generator)
    return out.images.cpu()


def load_4bit_transformer(**kwargs: Any) -> Any:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(prequantized_transformer_dir(), **kwargs)


def pipeline_with(base: Any, transformer: Any) -> Any:
    """``base``'s pipeline with ``transformer`` in place of its own."""
    from diffusers import FluxPipeline

    components = dict(base.components)
    components["transformer"] = transformer
    return FluxPipeline(**components)


def raise_if_strays(obj: Any, what: str) -> int:
    """BugObserved naming the first tensor off its module's device; else how many quant-state
    tensors were checked."""
    from devmap_shims.checks import check_devices

    strays = check_devices(obj)
    if strays:
        first = strays[0]
        raise BugObserved(
            f"{what}: {len(strays)} tensor(s) off their module's device, e.g. {first['name']} "
            f"{list(first['shape'])} left on {first['device']} (expected {first['expected']})"
        )
    return count_quant_state_tensors(obj)


def count_quant_state_tensors(obj: Any) -> int:
    from devmap_shims.devices.quant_state import quant_state_of, state_tensors

    modules: List[Any] = list(getattr(obj, "components", {}).values()) if hasattr(obj, "components") else [obj]
    count = 0
    for module in modules:
        for param in getattr(module, "parameters", lambda: [])():
            state = quant_state_of(param)
            if state is not None:
                count += sum(1 for _ in state_tensors(state))
    return count
