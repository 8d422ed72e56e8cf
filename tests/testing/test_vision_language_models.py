"""Tiny Idefics3 / SmolVLM: build, determinism, inputs that fit the config, a run on a simulated GPU."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

transformers = pytest.importorskip("transformers")

from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.testing.models import (  # noqa: E402
    VISION_LANGUAGE_ARCHS,
    UnsupportedArchError,
    sample_vision_language_inputs,
    tiny_vision_language_config,
    tiny_vision_language_model,
    unsupported_vision_language_archs,
)
from devmap_shims.testing.models.vision_language import IMAGE_TOKEN_ID, image_tokens_per_image  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH_PARAMS = [
    pytest.param(a, id=a, marks=pytest.mark.skipif(a in unsupported_vision_language_archs(),
                                                   reason=unsupported_vision_language_archs().get(a, "")))
    for a in VISION_LANGUAGE_ARCHS
]


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_config_is_tiny_and_inputs_fit_it(arch):
    config = tiny_vision_language_config(arch)
    assert config.vision_config.image_size == 32 and config.vision_config.patch_size == 8
    assert image_tokens_per_image(config) == 4
    inputs = sample_vision_language_inputs(config, images=2, text_length=5)
    ids = inputs["input_ids"]
    assert ids.shape == (1, 5 + 2 * 4)
    assert (ids == IMAGE_TOKEN_ID).sum().item() == 8 and (ids[:, :5] != IMAGE_TOKEN_ID).all()
    assert inputs["pixel_values"].shape == (1, 2, 3, 32, 32)
    assert inputs["attention_mask"].shape == ids.shape


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_same_seed_same_weights_and_images_change_the_logits(arch):
    a, b = tiny_vision_language_model(arch), tiny_vision_language_model(arch)
    assert not a.training
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    other = tiny_vision_language_model(arch, seed=1)
    assert not all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), other.state_dict().values()))
    inputs = sample_vision_language_inputs(a.config)
    with torch.no_grad():
        logits = a(**inputs).logits
        shifted = a(**dict(inputs, pixel_values=inputs["pixel_values"] + 1.0)).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], 256)
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits, shifted)  # the image reaches the text model


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_runs_on_a_simulated_gpu_like_on_the_cpu(arch):
    if transformers.__version__ == "4.55.0":
        pytest.skip("transformers 4.55.0 cannot run these models on a GPU (transformers-4550-bucketize-boundaries-cpu)")
    model = tiny_vision_language_model(arch)
    inputs = sample_vision_language_inputs(model.config)
    with torch.no_grad():
        reference = model(**inputs).logits
    with simulated_gpus(1, memory="1GiB"), torch.no_grad():
        model.to("cuda:0")
        logits = model(**{k: v.to("cuda:0") for k, v in inputs.items()}).logits
        assert logits.device == torch.device("cuda", 0)
        logits = logits.cpu()
    assert torch.equal(logits, reference)


def test_unknown_and_missing_architectures_say_why(monkeypatch):
    with pytest.raises(ValueError, match="choose one of idefics3, smolvlm"):
        tiny_vision_language_config("llava")
    from devmap_shims.testing.models import vision_language

    # as on a transformers release without the class
    monkeypatch.setitem(vision_language._CLASSES, "smolvlm", ("SmolVLMConfig", "NoSuchVLMForConditionalGeneration"))
    with pytest.raises(UnsupportedArchError, match="has no NoSuchVLMForConditionalGeneration"):
        tiny_vision_language_model("smolvlm")
    assert "smolvlm" in unsupported_vision_language_archs()
