"""Seeded builds for the tiny models: weights that depend on a seed, not on the library release.

A model is built under :func:`seeded` (so whatever the library draws at construction is
reproducible and the caller's RNG state is left alone), then :func:`reinit_weights` redraws its
weights from a generator of their own, so they do not depend on how a given transformers or
diffusers release initialises parameters.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["reinit_weights", "seeded"]


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator for a block and give the caller's RNG state back afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def reinit_weights(module: torch.nn.Module, seed: int, *, embedding_std: float = 1.0) -> None:
    """Redraw every matrix / conv kernel of ``module`` from its own seeded generator.

    Matrices get ``N(0, 1/fan_in)`` (activations keep unit scale through the layers),
    embedding tables ``N(0, embedding_std**2)``; biases get a small spread so that
    they matter; normalisation weights keep their initial values. Parameters are
    visited by name, once each (tied weights are one parameter), so the result depends
    only on ``seed`` and the module structure, not on the library's own initialiser.
    """
    gen = torch.Generator().manual_seed(seed)
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    norms = {
        id(p)
        for m in module.modules()
        if "norm" in type(m).__name__.lower()
        for p in m.parameters(recurse=False)
    }
    with torch.no_grad():
        for name, param in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if id(param) in norms or param.ndim == 0:
                continue
            if id(param) in embeddings:
                std = embedding_std
            elif param.ndim >= 2:
                std = (param[0].numel()) ** -0.5
            else:
                std = 0.02
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.copy_(values.to(param.dtype))
