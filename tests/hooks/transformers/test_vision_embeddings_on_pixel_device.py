"""vision-embeddings-on-pixel-device: the vision embeddings make their tensors next to the pixel values.

The shim is forced, so these run on every stack with Idefics3 / SmolVLM; where the upstream bug is
absent (every release but 4.55.0) the results must be the same with and without it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

from devmap_shims.hooks.transformers import vision_embeddings_on_pixel_device as hook  # noqa: E402
from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.testing.models import (  # noqa: E402
    sample_vision_language_inputs,
    tiny_vision_language_model,
    unsupported_vision_language_archs,
)

ARCHS = [
    pytest.param(a, marks=pytest.mark.skipif(a in unsupported_vision_language_archs(), reason=f"no {a} here"))
    for a in ("idefics3", "smolvlm")
]


def _embeddings(model):
    return next(m for m in model.modules() if type(m).__name__.endswith("VisionEmbeddings"))


@pytest.mark.parametrize("arch", ARCHS)
def test_an_image_on_the_gpu_gives_the_cpu_logits(shim, arch):
    model = tiny_vision_language_model(arch)
    inputs = sample_vision_language_inputs(model.config, images=2)
    with torch.no_grad():
        reference = model(**inputs).logits
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        model.to("cuda:1")
        logits = model(**{k: v.to("cuda:1") for k, v in inputs.items()}).logits
        assert logits.device == torch.device("cuda", 1)
        logits = logits.cpu()
    assert torch.equal(logits, reference)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_embeddings_alone_give_the_cpu_result_and_leave_the_default_device(shim, arch):
    embeddings = _embeddings(tiny_vision_language_model(arch))
    pixels = sample_vision_language_inputs(embeddings_config(arch))["pixel_values"][0]
    mask = torch.ones((1, 4, 4), dtype=torch.bool)
    with torch.no_grad():
        on_cpu = embeddings(pixel_values=pixels, patch_attention_mask=mask)
        with simulated_gpus(1, memory="1GiB"):
            embeddings.to("cuda:0")
            on_gpu = embeddings(pixels.to("cuda:0"), mask.to("cuda:0"))  # by position
            assert on_gpu.device == torch.device("cuda", 0)
            assert torch.empty(0).device == torch.device("cpu")  # the device context ended with the call
            on_gpu = on_gpu.cpu()
    assert torch.equal(on_cpu, on_gpu)


def embeddings_config(arch):
    from devmap_shims.testing.models import tiny_vision_language_config

    return tiny_vision_language_config(arch)


def test_without_pixel_values_on_a_gpu_the_call_passes_through(direct):
    calls = []

    def forward(pixel_values, patch_attention_mask):
        calls.append(str(torch.empty(0).device))
        return "result"

    wrapper = direct(hook.SHIM, hook.on_pixel_device)
    assert wrapper(forward, None, (torch.zeros(1), None), {}) == "result"
    assert wrapper(forward, None, (), {"pixel_values": torch.zeros(1, device="meta"), "patch_attention_mask": None}) == "result"
    assert wrapper(forward, None, ("not a tensor", None), {}) == "result"
    with simulated_gpus(1):
        assert wrapper(forward, None, (torch.zeros(1, device="cuda:0"), None), {}) == "result"
    assert calls == ["cpu", "cpu", "cpu", "cuda:0"]
