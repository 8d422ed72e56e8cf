"""The tiny Qwen2-VL: determinism, a prompt the model accepts, a device map covering every weight
with the vision tower alone, offline save/reload."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from devmap_shims.testing.models import (  # noqa: E402
    IMAGE_TOKEN_ID,
    UnsupportedArchError,
    qwen2_vl_image_prompt,
    save_tiny_qwen2_vl,
    tiny_qwen2_vl,
    vision_text_split,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HAS_QWEN2_VL = hasattr(transformers, "Qwen2VLForConditionalGeneration")
needs_qwen2_vl = pytest.mark.skipif(not HAS_QWEN2_VL, reason=f"transformers {transformers.__version__} has no Qwen2-VL")


@pytest.mark.skipif(HAS_QWEN2_VL, reason="this transformers has Qwen2-VL")
def test_without_qwen2_vl_the_builders_say_so():
    with pytest.raises(UnsupportedArchError, match="no Qwen2-VL"):
        tiny_qwen2_vl()
    with pytest.raises(UnsupportedArchError, match="no Qwen2-VL"):
        qwen2_vl_image_prompt()


@needs_qwen2_vl
def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = tiny_qwen2_vl(), tiny_qwen2_vl(), tiny_qwen2_vl(seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].dim() == 2)
    assert not a.training and a.config.tie_word_embeddings is False


@needs_qwen2_vl
def test_the_prompt_has_one_image_token_per_merged_patch_group_and_runs():
    prompt = qwen2_vl_image_prompt(batch=2, grid=(4, 6))
    assert prompt["pixel_values"].shape == (2 * 24, 3 * 2 * 14 * 14)
    assert prompt["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 6]]
    assert ((prompt["input_ids"] == IMAGE_TOKEN_ID).sum(-1) == 6).all()
    if "mm_token_type_ids" in prompt:
        assert torch.equal(prompt["mm_token_type_ids"].bool(), prompt["input_ids"] == IMAGE_TOKEN_ID)
    with pytest.raises(ValueError, match="multiple of 2"):
        qwen2_vl_image_prompt(grid=(3, 4))
    model = tiny_qwen2_vl()
    with torch.no_grad():
        logits = model(**prompt).logits
        tokens = model.generate(**qwen2_vl_image_prompt(), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                pad_token_id=0)[0, -8:]
    assert logits.shape[:2] == prompt["input_ids"].shape and torch.isfinite(logits).all()
    assert len(set(tokens.tolist())) > 2  # not one repeated token


@needs_qwen2_vl
def test_the_split_puts_the_vision_tower_alone_on_gpu0_and_covers_every_weight():
    model = tiny_qwen2_vl()
    device_map = vision_text_split(model)
    vision = [name for name, gpu in device_map.items() if gpu == 0]
    assert len(vision) == 1 and vision[0].split(".")[-1] == "visual"
    assert set(device_map.values()) == {0, 1}
    for name, _ in model.named_parameters():
        owners = [key for key in device_map if name == key or name.startswith(key + ".")]
        assert len(owners) == 1, (name, owners)
        assert (device_map[owners[0]] == 0) == (".visual." in f".{name}")
    assert vision_text_split(model, vision_gpu=2, text_gpu=3)[vision[0]] == 2


@needs_qwen2_vl
def test_saved_checkpoint_reloads_offline_with_the_same_logits(tmp_path):
    model = tiny_qwen2_vl()
    path = save_tiny_qwen2_vl(tmp_path / "qwen2-vl")
    assert any(p.suffix == ".safetensors" for p in path.iterdir())
    reloaded = type(model).from_pretrained(path).eval()
    prompt = qwen2_vl_image_prompt()
    with torch.no_grad():
        assert torch.allclose(model(**prompt).logits, reloaded(**prompt).logits, atol=1e-6)
