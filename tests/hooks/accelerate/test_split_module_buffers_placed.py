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


def test_the_models_own_buffers_go_to_its_first_device_where_the_map_lacks_them():
    """accelerate before 0.20 listed the model's own parameters and children, not its buffers, so
    a split map gave them no device; later releases place them first."""
    model = hook.block_model()
    model.register_buffer("position_ids", torch.arange(4))
    split = {"first": 1, "block.up": 2, "block.down": "cpu"}
    assert hook.unplaced_buffers(model, split) == {"position_ids": 1, "block.scale": 1}
    assert hook.unplaced_buffers(model, {**split, "position_ids": 0}) == {"block.scale": 1}
    assert hook.unplaced_buffers(model, {"first": 0, "block": 1}) == {"position_ids": 0}
