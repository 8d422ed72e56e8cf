"""Shim ``split-module-buffers-placed``: a device map that splits a module also places the buffers
registered directly on it.

After ``infer_auto_device_map`` returns, every module that the map splits (its children are in the
map, itself is not) has its own buffers (``named_buffers(recurse=False)``) given the device its
last mapped part runs on, which is where its forward ends: that part's GPU, or the main GPU (the
first in the map, as ``dispatch_model`` picks it) when that part is offloaded to the CPU or disk.
``dispatch_model`` then accepts the map and the buffer is where the module uses it. A map that already covers them is returned unchanged (the
same object). transformers >= 5 plans with its own copy of the function, which has the same gap.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    accelerate-split-expansion-omits-buffers
        affected: accelerate >=0.8.0
        fixed in: unfixed (last checked 2026-11-01)
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.calls import argument
from devmap_shims.scenarios import BugObserved, scenario
from devmap_shims.shims import LazyLogger, Shim, Target

BUG_ID = "accelerate-split-expansion-omits-buffers"

logger = LazyLogger(__name__)


def _covered(name: str, keys: Any) -> bool:
    """Whether a map with ``keys`` gives ``name`` a device (itself or an enclosing module)."""
    while True:
        if name in keys:
            return True
        if not name:
            return False
        name = name.rpartition(".")[0]


def unplaced_buffers(model: Any, device_map: Dict[str, Any]) -> Dict[str, Any]:
    """``{buffer name: device}`` for the direct buffers of every module ``device_map`` splits, with
    the device that module's last mapped part runs on; the model's own buffers, which accelerate
    before 0.20 also left out of a split map, with its first device, where later releases put them."""
    keys = set(device_map)
    offload = ("cpu", "disk")
    main = next((d for d in device_map.values() if str(d) not in offload), None)
    found: Dict[str, Any] = {}
    for name, module in model.named_modules():
        if not name:
            own = [n for n, b in module.named_buffers(recurse=False) if b is not None and n not in keys]
            first = next(iter(device_map.values()), None)
            found.update({buffer: first for buffer in own} if first is not None else {})
            continue
        if _covered(name, keys):
            continue
        buffers = [n for n, b in module.named_buffers(recurse=False) if b is not None and f"{name}.{n}" not in keys]
        if not buffers:
            continue
        parts = [device for key, device in device_map.items() if key.startswith(name + ".")]
        if parts:
            runs_on = main if str(parts[-1]) in offload and main is not None else parts[-1]
            found.update({f"{name}.{buffer}": runs_on for buffer in buffers})
    return found


def place_buffers(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``infer_auto_device_map``, then the direct buffers of the modules it split get a device."""
    result = wrapped(*args, **kwargs)
    if not isinstance(result, dict) or "" in result or not result:
        return result
    _, model = argument(wrapped, "model", args, kwargs)
    if model is None or not hasattr(model, "named_modules"):
        return result
    missing = unplaced_buffers(model, result)
    if not missing:
        return result
    logger.debug("%s placed buffers the device map left out: %s", SHIM.id, ", ".join(missing))
    placed = type(result)(result) if type(result) is not dict else dict(result)
    placed.update(missing)
    return placed


SHIM = Shim(
    id="split-module-buffers-placed",
    fixes=(BUG_ID,),
    targets=(
        Target("accelerate.utils.modeling", "infer_auto_device_map", expect_params=("model",), wrapper=place_buffers),
        Target(
            "transformers.integrations.accelerate",
            "infer_auto_device_map",
            when={"transformers": ">=5"},
            expect_params=("model",),
            wrapper=place_buffers,
        ),
    ),
    summary="give the buffers of a module the device map splits the device of its last part",
)


# -- scenario -----------------------------------------------------------------------------------
def block_model() -> Any:
    """A block of two layers and a scale buffer of its own (as Gemma-4's decoder layers hold
    ``layer_scalar``), after a first layer; float32, about 0.8 MB."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(256, 256)
            self.down = torch.nn.Linear(256, 256)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 256))

        def forward(self, x: Any) -> Any:
            return self.down(self.up(x)) * self.scale

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(256, 256)
            self.block = Block()

        def forward(self, x: Any) -> Any:
            return self.block(self.first(x))

    generator = torch.Generator().manual_seed(0)
    model = Model()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def _checkpoint() -> str:
    """The block model's weights in a checkpoint file, written once per process."""
    from devmap_shims.scenarios.checkpoints import once, scratch_dir

    def make() -> str:
        import os

        import torch

        path = os.path.join(scratch_dir("split-buffers"), "model.bin")
        torch.save(block_model().state_dict(), path)
        return path

    return once("split-buffers", make)


@scenario(BUG_ID, "load_checkpoint_and_dispatch(device_map='auto') of a model whose block, holding a buffer of "
          "its own, is split over three small GPUs and the CPU; then a forward", needs=("torch", "accelerate"))
def split_block_with_a_buffer() -> str:
    import torch
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    from devmap_shims.testing import simulated_gpus

    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = block_model()(x)
        checkpoint = _checkpoint()
        with simulated_gpus(3, memory="1GiB"):
            with init_empty_weights():
                model = block_model()
            # 400 kB per GPU: one layer each, so the block (two layers and the buffer) is split
            model = load_checkpoint_and_dispatch(
                model, checkpoint, device_map="auto", max_memory={0: 400_000, 1: 400_000, 2: 400_000, "cpu": 10**9}
            )
            device_map = model.hf_device_map
            split = sorted(k for k in device_map if k.startswith("block."))
            out = model(x).cpu()
    if not split:
        raise BugObserved(f"the scenario needs a split block, got {dict(device_map)}")
    if not torch.allclose(out, reference, atol=1e-5):
        raise BugObserved(f"split over {dict(device_map)} the output differs from the CPU's")
    return f"block split as {', '.join(f'{k}: {device_map[k]}' for k in split)}; output equal to the CPU's"
