"""Shim ``infer-map-default-max-memory``: ``infer_auto_device_map(model)`` without ``max_memory``
plans with every device's free memory, as the documentation says it does.

When the caller passes no ``max_memory`` (or None), the wrapper passes
``accelerate.utils.get_max_memory()``, which is what the function computes for itself on every
release but the one whose refactor dropped the result. A given ``max_memory`` is left alone.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    accelerate-infer-map-maxmem-none
        affected: accelerate ==1.2.0
        fixed in: accelerate 1.2.1
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.calls import argument, with_argument
from devmap_shims.scenarios import BugObserved, scenario
from devmap_shims.shims import Shim, Target

BUG_ID = "accelerate-infer-map-maxmem-none"


def default_max_memory(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``infer_auto_device_map`` with ``max_memory=get_max_memory()`` when the caller gave none."""
    _, max_memory = argument(wrapped, "max_memory", args, kwargs)
    _, model = argument(wrapped, "model", args, kwargs)
    if max_memory is None and model is not None:
        from accelerate.utils.modeling import get_max_memory

        args, kwargs = with_argument(wrapped, "max_memory", get_max_memory(), args, kwargs)
    return wrapped(*args, **kwargs)


SHIM = Shim(
    id="infer-map-default-max-memory",
    fixes=(BUG_ID,),
    targets=(
        Target(
            "accelerate.utils.modeling",
            "infer_auto_device_map",
            expect_params=("model", "max_memory"),
            wrapper=default_max_memory,
        ),
    ),
    summary="give infer_auto_device_map the devices' free memory when the caller gives no max_memory",
)


@scenario(BUG_ID, "infer_auto_device_map(model) with no max_memory on two simulated GPUs",
          needs=("torch", "accelerate"))
def infer_map_without_max_memory() -> str:
    import torch
    from accelerate import infer_auto_device_map

    from devmap_shims.testing import simulated_gpus

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with simulated_gpus(2, memory="1GiB"):
        device_map = infer_auto_device_map(model)
    devices = set(device_map.values())
    if not devices or not devices <= {0, 1, "cuda:0", "cuda:1"}:
        raise BugObserved(f"a 33 kB model with two free 1 GiB GPUs was mapped as {dict(device_map)}")
    return f"mapped as {dict(device_map)} from the GPUs' free memory"
