"""split-module-buffers-placed: which buffers a split leaves out, and the device they get."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from devmap_shims.hooks.accelerate import split_module_buffers_placed as hook  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return hook.block_model()


@pytest.mark.parametrize("device_map, expected", [
    ({"": 0}, {}),
    ({"first": 0, "block": 1}, {}),
    ({"first": 0, "block.up": 1, "block.down": 2}, {"block.scale": 2}),
    ({"first": 1, "block.up": 2, "block.down": "cpu"}, {"block.scale": 1}),  # offloaded parts run on the main GPU
    ({"first": 0, "block.up": 1, "block.down": 2, "block.scale": 0}, {}),
])
def test_unplaced_buffers(model, device_map, expected):
    assert hook.unplaced_buffers(model, device_map) == expected


def test_a_map_that_covers_everything_is_returned_as_it_is(model, direct):
    covered = {"first": 0, "block": 1}
    assert direct(hook.SHIM, hook.place_buffers)(lambda model: covered, None, (model,), {}) is covered
    split = {"first": 0, "block.up": 1, "block.down": 2}
    placed = direct(hook.SHIM, hook.place_buffers)(lambda model: split, None, (model,), {})
    assert placed == {**split, "block.scale": 2} and split == {"first": 0, "block.up": 1, "block.down": 2}
