"""Shim ``tied-sizes-counted-once``: a module tied to several parameters of another module counts
that module's size once, not once per tied parameter.

``infer_auto_device_map`` (and ``fallback_allocate``) size a module together with the modules
holding the parameters tied to it with ``get_module_size_with_ties``, which adds the tied module's
size once per tied parameter. A decoder layer sharing four weights with an encoder layer is counted
four times, so a module that fits is sent to the next GPU, the CPU or the disk. The wrapper
replaces that sum by one that adds each tied module once (as transformers 5.13 does in its own
copy); everything else (the subtraction of each tied parameter's own size, the names and modules
returned, their order) is accelerate's; a tied parameter's module is found by its name and a dot,
as accelerate >= 1.3 does (1.2.0 matched any substring). A tied parameter whose module is no longer in the list of
modules to place (placed already, with an earlier part of the current module) adds nothing instead
of raising ``IndexError``. When no module is tied more than once and every lookup succeeds, the
original runs unchanged. ``infer_auto_device_map`` reads the function from its module's globals at
each call, so the shim composes with the shims that wrap ``infer_auto_device_map`` itself;
transformers 5.0 imports it by name (rebound by the engine); transformers 5.1 to 5.12 size ties
with a copy of their own (row ``transformers-tied-size-overcount``, not shimmed).

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    accelerate-tied-size-overcount
        affected: accelerate >=1.2.0
        fixed in: unfixed (last checked 2026-11-24)
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

from devmap_shims.calls import argument_at
from devmap_shims.scenarios import BugObserved, ScenarioUnavailable, scenario
from devmap_shims.shims import LazyLogger, Shim, Target

BUG_ID = "accelerate-tied-size-overcount"

logger = LazyLogger(__name__)


def tied_owners(tied_params: Any, modules_to_treat: Any) -> Optional[List[Tuple[str, Optional[int]]]]:
    """``[(tied parameter, index in modules_to_treat of the module holding it, or None)]`` when the
    call is one the original gets wrong (a module holds several of the tied parameters, or one
    parameter's module is not in the list); None when the original is right (or the arguments are
    not lists of names and ``(name, module)`` pairs)."""
    if not isinstance(tied_params, (list, tuple)) or not tied_params:
        return None
    if not isinstance(modules_to_treat, (list, tuple)):
        return None
    try:
        names = [entry[0] for entry in modules_to_treat]
    except (TypeError, IndexError, KeyError):
        return None
    if not all(isinstance(p, str) for p in tied_params) or not all(isinstance(n, str) for n in names):
        return None
    owners: List[Tuple[str, Optional[int]]] = []
    for param in tied_params:
        index = next((i for i, name in enumerate(names) if param.startswith(name + ".")), None)
        owners.append((param, index))
    held = [index for _, index in owners if index is not None]
    if len(held) == len(owners) and len(set(held)) == len(held):
        return None
    return owners


def count_tied_modules_once(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``get_module_size_with_ties`` adding each tied module's size once."""
    tied_params = argument_at(args, kwargs, 0, "tied_params")
    module_size = argument_at(args, kwargs, 1, "module_size")
    module_sizes = argument_at(args, kwargs, 2, "module_sizes")
    modules_to_treat = argument_at(args, kwargs, 3, "modules_to_treat")
    owners = tied_owners(tied_params, modules_to_treat)
    if owners is None or module_sizes is None or module_size is None:
        return wrapped(*args, **kwargs)
    tied_module_names: List[str] = []
    tied_modules: List[Any] = []
    size = module_size
    for param, index in owners:
        if index is None:  # its module already has a device: nothing of it is placed with this one
            continue
        name, module = modules_to_treat[index][0], modules_to_treat[index][1]
        if name not in tied_module_names:
            tied_module_names.append(name)
            tied_modules.append(module)
            size += module_sizes[name]
        size -= module_sizes[param]
    if logger.isEnabledFor(10):  # logging.DEBUG, without importing logging at start-up
        original = _original_sum(owners, module_size, module_sizes, modules_to_treat)
        logger.debug("%s: %s tied to %s sized %s bytes (accelerate: %s)", SHIM.id, len(owners),
                     tied_module_names, size, original)
    return size, tied_module_names, tied_modules


def _original_sum(owners: List[Tuple[str, Optional[int]]], module_size: Any, module_sizes: Any, modules_to_treat: Any) -> Any:
    """What accelerate's sum gives (for the log), or ``"IndexError"``."""
    if any(index is None for _, index in owners):
        return "IndexError"
    return module_size + sum(module_sizes.get(modules_to_treat[i][0], 0) - module_sizes.get(p, 0) for p, i in owners)


SHIM = Shim(
    id="tied-sizes-counted-once",
    fixes=(BUG_ID,),
    targets=(
        Target(
            "accelerate.utils.modeling",
            "get_module_size_with_ties",
            expect_params=("tied_params", "module_size", "module_sizes", "modules_to_treat"),
            wrapper=count_tied_modules_once,
        ),
    ),
    summary="size a module with its tied modules counting each tied module once",
)


# -- scenario -----------------------------------------------------------------------------------
GPU_BUDGET = 120_000


def _require_the_sizing_function() -> None:
    import accelerate.utils.modeling as modeling

    if not hasattr(modeling, "get_module_size_with_ties"):
        raise ScenarioUnavailable(
            "accelerate < 1.2.0 sizes tied modules inside infer_auto_device_map "
            "(row accelerate-tied-size-overcount-inline, no shim)"
        )


def _off_gpu(device_map: Dict[str, Any]) -> List[str]:
    return sorted(name or "(whole model)" for name, device in device_map.items() if str(device) in ("cpu", "disk", "meta"))


@scenario(BUG_ID, "infer_auto_device_map of an encoder-decoder whose decoder layers share four weights each with "
          "the encoder's, on two simulated GPUs of 120 kB where the whole model fits GPU 0",
          needs=("torch", "accelerate"))
def tied_backbone_on_two_gpus() -> str:
    from accelerate import infer_auto_device_map, init_empty_weights

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models.tied import TIED_NO_SPLIT, tied_backbone_model, tied_backbone_sizes

    _require_the_sizing_function()
    with simulated_gpus(2, memory="1GiB"):
        with init_empty_weights():
            model = tied_backbone_model()
        sizes = tied_backbone_sizes(model)
        if sizes["total"] >= GPU_BUDGET:
            raise AssertionError(f"the scenario's model outgrew its budget: {sizes}")
        device_map = infer_auto_device_map(
            model,
            max_memory={0: GPU_BUDGET, 1: GPU_BUDGET, "cpu": 10**9},
            no_split_module_classes=list(TIED_NO_SPLIT),
        )
    placed = {str(device) for device in device_map.values()}
    off_gpu = _off_gpu(device_map)
    if off_gpu or "0" not in placed:
        raise BugObserved(
            f"the model ({sizes['total']} bytes, each tied weight once) is below each GPU's {GPU_BUDGET} bytes, "
            f"yet the map is {dict(device_map)}"
        )
    return f"{sizes['total']} bytes placed as {dict(device_map)}"


@scenario(BUG_ID, "infer_auto_device_map of the three-layer tied encoder-decoder on simulated GPUs of 40 kB and "
          "150 kB: the first encoder layer takes the whole decoder along, the next one's tied module is gone",
          needs=("torch", "accelerate"))
def tied_module_placed_already() -> str:
    from accelerate import infer_auto_device_map, init_empty_weights

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models.tied import TIED_NO_SPLIT, tied_backbone_model, tied_backbone_sizes

    _require_the_sizing_function()
    with simulated_gpus(2, memory="1GiB"):
        with init_empty_weights():
            model = tied_backbone_model(layers=3)
        total = tied_backbone_sizes(model)["total"]
        try:
            device_map = infer_auto_device_map(
                model, max_memory={0: 40_000, 1: 150_000, "cpu": 10**9}, no_split_module_classes=list(TIED_NO_SPLIT)
            )
        except IndexError as exc:
            raise BugObserved(f"infer_auto_device_map raised IndexError: {exc}") from exc
    off_gpu = _off_gpu(device_map)
    if off_gpu:
        raise BugObserved(f"the model ({total} bytes) fits GPU 1's 150000 bytes, yet the map is {dict(device_map)}")
    return f"{total} bytes placed as {dict(device_map)}"
