"""tiny_lora_state_dict: a LoRA built in code that diffusers' load_lora_weights takes as a real one."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

torch = pytest.importorskip("torch")

from devmap_shims.testing.models import (  # noqa: E402
    ATTENTION_PROJECTIONS,
    flux_unavailable,
    lora_target_modules,
    tiny_lora_state_dict,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Attention(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(width, width) for _ in range(3))
        self.to_out = torch.nn.ModuleList([torch.nn.Linear(width, 2 * width), torch.nn.Dropout()])
        self.add_q_proj = torch.nn.Linear(width, width)


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.attn = Attention(width)
        self.ff = torch.nn.Linear(width, width)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(4), Block(6)])


def test_one_a_b_pair_per_attention_projection_with_the_layer_shapes():
    model = Model()
    state = tiny_lora_state_dict(model, rank=3)
    expected = [f"blocks.{i}.attn.{p}" for i in (0, 1) for p in ATTENTION_PROJECTIONS]
    assert lora_target_modules(model) == expected
    assert sorted(state) == sorted(f"transformer.{n}.lora_{ab}.weight" for n in expected for ab in "AB")
    modules = dict(model.named_modules())
    for name in expected:
        linear = modules[name]
        a, b = state[f"transformer.{name}.lora_A.weight"], state[f"transformer.{name}.lora_B.weight"]
        assert a.shape == (3, linear.in_features) and b.shape == (linear.out_features, 3)
        assert a.dtype == b.dtype == torch.float32 and a.device.type == b.device.type == "cpu"
        assert b.abs().sum() > 0  # unlike a fresh LoRA, B is not zero: loading it changes the output


def test_seeded_prefix_and_targets():
    model = Model()
    first, again, other = (tiny_lora_state_dict(model, seed=s) for s in (0, 0, 1))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
    bare = tiny_lora_state_dict(model, prefix=None, targets=("add_q_proj",))
    assert sorted(bare) == sorted(f"blocks.{i}.attn.add_q_proj.lora_{ab}.weight" for i in (0, 1) for ab in "AB")
    assert lora_target_modules(model, ("ff",)) == ["blocks.0.ff", "blocks.1.ff"]


def test_a_model_without_matching_layers_or_a_zero_rank_is_refused():
    with pytest.raises(ValueError, match="no Linear module named like"):
        tiny_lora_state_dict(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="rank must be at least 1"):
        tiny_lora_state_dict(Model(), rank=0)


def test_load_lora_weights_takes_it_into_every_projection_of_the_tiny_flux_transformer():
    pytest.importorskip("peft")
    pytest.importorskip("diffusers")
    if flux_unavailable():
        pytest.skip(flux_unavailable())
    from devmap_shims.testing.models import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    kwargs = dict(num_inference_steps=2, height=32, width=32, output_type="pt")
    with torch.no_grad():
        plain = pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs).images
        pipe.load_lora_weights(tiny_lora_state_dict(pipe.transformer))
        adapted = pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs).images
    modules = dict(pipe.transformer.named_modules())
    names = [n for n in modules if n.endswith(ATTENTION_PROJECTIONS)]
    assert names and all(hasattr(modules[n], "lora_A") for n in names)
    assert not torch.allclose(plain, adapted, atol=1e-3)
