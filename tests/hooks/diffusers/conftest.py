"""Fixtures for the diffusers shims' tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def checks(monkeypatch):
    """The quant states the pipeline-to-sweep walk reads tensor by tensor (its
    ``align_known_state`` calls), in order."""
    from devmap_shims.hooks.diffusers import pipeline_to_sweep as hook

    seen = []
    check = hook.align_known_state

    def counting(state, device):
        seen.append(state)
        return check(state, device)

    monkeypatch.setattr(hook, "align_known_state", counting)
    return seen
