"""The tied-backbone model: which weights are tied, its sizes, seeding, and the ties under
accelerate's init_empty_weights."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from devmap_shims.testing.models.tied import (  # noqa: E402
    TIED_NO_SPLIT,
    TIED_PROJECTIONS,
    tied_backbone_model,
    tied_backbone_sizes,
)


def test_each_decoder_layer_shares_its_projections_with_its_encoder_layer_and_keeps_its_own():
    model = tied_backbone_model(layers=3)
    for i, (encoder, decoder) in enumerate(zip(model.encoder.layers, model.decoder.layers)):
        for name in TIED_PROJECTIONS:
            assert getattr(decoder, name).weight is getattr(encoder, name).weight, (i, name)
        others = [p for j, layer in enumerate(model.encoder.layers) if j != i for p in layer.parameters()]
        assert all(decoder.self_cond.weight is not p for p in list(encoder.parameters()) + others)
    named = dict(model.named_parameters(remove_duplicate=False))
    assert len(named) == 3 * (4 + 5) and len(list(model.parameters())) == 3 * 5
    assert sorted({type(m).__name__ for m in model.modules()} & set(TIED_NO_SPLIT)) == sorted(TIED_NO_SPLIT)


def test_sizes_count_each_tied_weight_once():
    model = tied_backbone_model(layers=2, hidden=48)
    sizes = tied_backbone_sizes(model)
    assert sizes == {"encoder_layer": 4 * 48 * 48 * 4, "decoder_layer_own": 48 * 48 * 4, "total": 2 * 5 * 48 * 48 * 4}
    assert sizes["total"] == sum(p.numel() * p.element_size() for p in model.parameters())


def test_weights_follow_the_seed_and_a_reloaded_state_dict_keeps_the_ties():
    a, b, c = tied_backbone_model(seed=0), tied_backbone_model(seed=0), tied_backbone_model(seed=1)
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(a(x), b(x)) and not torch.allclose(a(x), c(x))
        c.load_state_dict(a.state_dict())
        assert torch.equal(c(x), a(x))
        assert c.decoder.layers[1].v_proj.weight is c.encoder.layers[1].v_proj.weight
        # the decoder runs on the encoder's weights: changing one changes the output through both
        before = a(x)
        a.encoder.layers[0].q_proj.weight.mul_(2)
        assert torch.equal(a.decoder.layers[0].q_proj.weight, a.encoder.layers[0].q_proj.weight)
        assert not torch.allclose(a(x), before)


def test_the_ties_hold_on_the_meta_device_under_init_empty_weights():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import find_tied_parameters

    with accelerate.init_empty_weights():
        model = tied_backbone_model(layers=2)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    groups = find_tied_parameters(model)
    assert sorted(map(sorted, groups)) == sorted(
        sorted([f"decoder.layers.{i}.{n}.weight", f"encoder.layers.{i}.{n}.weight"]) for i in range(2) for n in TIED_PROJECTIONS
    )
