"""Shim ``main-device-in-map-order``: ``dispatch_model`` without a ``main_device`` takes the first GPU
of the device map, in map order, as accelerate documents and as it did before 1.15.

The main device is where the model's root hook sends the inputs and where the layers mapped to
``"cpu"`` or ``"disk"`` are loaded and run. accelerate 1.15 picks it as
``list(set(device_map.values()) - {"cpu", "disk"})[0]``: for string values (``"cuda:0"``,
``"cuda:1"``) the order of that set follows the strings' hashes, which change with
``PYTHONHASHSEED``, so the same map runs its offloaded layers on ``cuda:0`` in one process and on
``cuda:1`` in the next; for integer values it is the lowest GPU index, wherever it sits in the map.

When the caller gives no ``main_device`` (or None) and the map has at least two different
non-offload devices, the wrapper passes the first of them in map order, compared exactly as
accelerate compares them (``d not in ["cpu", "disk"]``). With one such device, or an explicit
``main_device``, the call is unchanged.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    accelerate-main-device-set-order
        affected: accelerate >=1.15.0
        fixed in: unfixed (last checked 2026-11-24)
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, Tuple

from devmap_shims.calls import argument, with_argument
from devmap_shims.scenarios import BugObserved, ScenarioUnavailable, scenario
from devmap_shims.shims import LazyLogger, Shim, Target

BUG_ID = "accelerate-main-device-set-order"

logger = LazyLogger(__name__)

OFFLOAD = ["cpu", "disk"]  # a list, as accelerate's own test: compared with ==, not hashed


def first_in_map_order(device_map: Any) -> Any:
    """The main device accelerate < 1.15 chose: the first value of ``device_map`` that is neither
    ``"cpu"`` nor ``"disk"``; None when there is none."""
    for device in device_map.values():
        if device not in OFFLOAD:
            return device
    return None


def set_order_pick(device_map: Any) -> Any:
    """The main device accelerate 1.15 takes for ``device_map`` in this process (None when there is
    no non-offload device); raises TypeError, as accelerate does, for unhashable values."""
    remaining = set(device_map.values()) - set(OFFLOAD)
    return list(remaining)[0] if remaining else None


def choose_in_map_order(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Wrapper for ``dispatch_model``: a missing ``main_device`` becomes the first GPU in map order."""
    _, main_device = argument(wrapped, "main_device", args, kwargs)
    if main_device is None:
        _, device_map = argument(wrapped, "device_map", args, kwargs)
        chosen = _map_order_choice(device_map)
        if chosen is not None:
            args, kwargs = with_argument(wrapped, "main_device", chosen, args, kwargs)
    return wrapped(*args, **kwargs)


def _map_order_choice(device_map: Any) -> Any:
    """The main device to pass, or None when accelerate's own choice cannot differ from it."""
    values = getattr(device_map, "values", None)
    if not callable(values):
        return None
    try:
        if len(set(values()) - set(OFFLOAD)) < 2:
            return None  # one GPU (or none): the set has only that one to offer
        theirs = set_order_pick(device_map)
    except TypeError:  # unhashable values: accelerate raises its own error on them
        return None
    chosen = first_in_map_order(device_map)
    if theirs != chosen:
        logger.debug("%s passes main_device=%r, the first GPU of the map (the set order gives %r)", SHIM.id, chosen, theirs)
    return chosen


SHIM = Shim(
    id="main-device-in-map-order",
    fixes=(BUG_ID,),
    targets=(
        Target(
            "accelerate.big_modeling",
            "dispatch_model",
            expect_params=("model", "device_map", "main_device"),
            wrapper=choose_in_map_order,
        ),
    ),
    summary="dispatch_model without main_device runs offloaded layers on the first GPU of the map, "
    "not on whichever the hash order of a set gives",
)


# -- scenario ---------------------------------------------------------------------------------------
GPUS = 4  # the map uses two of them; more names to choose from make a disagreeing pair certain


def offload_model() -> Any:
    """Three linear layers run in a row; each remembers the device its weight was on when it ran."""
    import torch

    class Recording(torch.nn.Linear):
        ran_on: Optional[str] = None

        def forward(self, x: Any) -> Any:
            self.ran_on = str(self.weight.device)
            return super().forward(x)

    torch.manual_seed(0)
    return torch.nn.Sequential(Recording(8, 8), Recording(8, 8), Recording(8, 8))


def disagreeing_map() -> Dict[str, Any]:
    """A map ``{"0": first GPU, "1": "cpu", "2": second GPU}`` with string values whose first GPU, in
    map order, is not the one ``list(set(...) - {"cpu", "disk"})[0]`` gives in this process."""
    pairs = [(0, 1), (1, 0)] + [(a, b) for a in range(GPUS) for b in range(GPUS) if a != b and {a, b} != {0, 1}]
    for first, second in pairs:
        device_map = {"0": f"cuda:{first}", "1": "cpu", "2": f"cuda:{second}"}
        if set_order_pick(device_map) != device_map["0"]:
            return device_map
    raise ScenarioUnavailable(  # pragma: no cover - every pair hashing in map order: about one process in a thousand
        "in this process the set of every pair of GPU names iterates in map order, so map order and set "
        "order cannot disagree here; another process (PYTHONHASHSEED) will"
    )


@scenario(
    BUG_ID,
    "dispatch_model over two GPUs given as 'cuda:N' strings with the middle layer on 'cpu': the root hook "
    "and the offloaded layer must run on the map's first GPU",
    needs=("torch", "accelerate"),
)
def offloaded_layer_on_first_gpu() -> str:
    """The main device does not depend on the process.

    The device map is ordered at run time so that, in this process, its first GPU is not the first
    element of the set accelerate 1.15 builds from its values. The same literal map in another process
    (another ``PYTHONHASHSEED``) may come out either way, so a fixed map would reproduce the bug only
    in some runs: choosing the order here makes every run show it where the set decides.
    """
    import torch
    from accelerate import dispatch_model

    from devmap_shims.devices.accelerate_hooks import execution_device
    from devmap_shims.testing import simulated_gpus

    device_map = disagreeing_map()
    first = device_map["0"]
    with simulated_gpus(GPUS, memory="1GiB"), torch.no_grad():
        model = dispatch_model(offload_model(), device_map=dict(device_map))
        root = str(execution_device(model))
        output = model(torch.ones(2, 8, device=first))
        offloaded = model[1].ran_on
        out_device = str(output.device)
    if root != first or offloaded != first:
        raise BugObserved(
            f"device map {device_map}: the root hook runs on {root} and the cpu-offloaded layer ran on "
            f"{offloaded}, not on {first}, the map's first GPU (main device taken from a set's hash order)"
        )
    return f"map {device_map}: root hook and offloaded layer on {first}, output on {out_device}"
