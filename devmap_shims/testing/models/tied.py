"""A tiny encoder-decoder whose decoder layers share several weights with the encoder's layers.

The shape of models that tie a whole backbone (DiffusionGemma ties every weight of its encoder's
text layers to the decoder layer of the same index): each decoder layer holds four projections
tied to its encoder layer and one projection of its own (DiffusionGemma's self-conditioning
layers), and both layer classes are kept whole by a device map (``TIED_NO_SPLIT``). A module
holding several tied parameters is what device-map code must size once, not once per tie::

    model = tied_backbone_model()
    infer_auto_device_map(model, max_memory={0: ..., 1: ..., "cpu": ...},
                          no_split_module_classes=list(TIED_NO_SPLIT))

Weights are drawn from a generator of their own (seed 0 by default); float32; about 10 kB per
projection with the default ``hidden=48``.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

TIED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
TIED_NO_SPLIT = ("TiedEncoderLayer", "TiedDecoderLayer")


class TiedEncoderLayer(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        for name in TIED_PROJECTIONS:
            setattr(self, name, torch.nn.Linear(hidden, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.o_proj(torch.tanh(self.q_proj(x) * self.k_proj(x)) * self.v_proj(x))
        return x + mixed


class TiedDecoderLayer(TiedEncoderLayer):
    """The encoder layer's projections (tied by :func:`tied_backbone_model`) plus one of its own."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden)
        self.self_cond = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.self_cond(x)


class TiedStack(torch.nn.Module):
    def __init__(self, layer: type, layers: int, hidden: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([layer(hidden) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TiedBackboneModel(torch.nn.Module):
    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.encoder = TiedStack(TiedEncoderLayer, layers, hidden)
        self.decoder = TiedStack(TiedDecoderLayer, layers, hidden)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Every decoder layer's projections are its encoder layer's (same Parameter objects).

        Set in ``_parameters`` directly so that the ties hold under accelerate's
        ``init_empty_weights`` too, whose ``register_parameter`` would make a new meta Parameter.
        """
        for encoder_layer, decoder_layer in zip(self.encoder.layers, self.decoder.layers):
            for name in TIED_PROJECTIONS:
                getattr(decoder_layer, name)._parameters["weight"] = getattr(encoder_layer, name).weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def tied_backbone_model(layers: int = 2, hidden: int = 48, seed: int = 0) -> TiedBackboneModel:
    """The model, with weights drawn from ``torch.Generator().manual_seed(seed)`` (on the meta
    device when built under ``init_empty_weights``)."""
    model = TiedBackboneModel(layers, hidden)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # each tied Parameter once
            if param.device.type != "meta":
                param.copy_(torch.randn(param.shape, generator=generator) / hidden**0.5)
    return model


def tied_backbone_sizes(model: TiedBackboneModel) -> Dict[str, Any]:
    """Bytes of each layer, each tied weight counted once: ``{"encoder_layer": ...,
    "decoder_layer_own": ..., "total": ...}`` (the decoder layer's own part is what it adds to its
    encoder layer)."""
    encoder_layer = sum(p.numel() * p.element_size() for p in model.encoder.layers[0].parameters())
    own = model.decoder.layers[0].self_cond.weight
    decoder_own = own.numel() * own.element_size()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"encoder_layer": encoder_layer, "decoder_layer_own": decoder_own, "total": total}
