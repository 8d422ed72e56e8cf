"""accelerate's hooks on a module (``module._hf_hook``) and the device they run it on."""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, List

#: the methods dispatch_model guards with "You shouldn't move a model that is dispatched using accelerate hooks":
#: ``to`` and the machine's device method (accelerate 1.15 big_modeling.py; ``sdaa`` and ``neuron`` in
#: recent releases)
GUARDED_METHODS = ("to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa", "neuron")


def hooks_of(module: Any) -> List[Any]:
    """The hooks accelerate attached to ``module`` (a ``SequentialHook`` unpacked), outermost first."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    inner = getattr(hook, "hooks", None)  # SequentialHook
    return list(inner) if inner is not None else [hook]


def is_offloading(hook: Any) -> bool:
    """Whether ``hook`` keeps the module's weights elsewhere (``offload=True``)."""
    return bool(getattr(hook, "offload", False))


def is_model_cpu_offload(hook: Any) -> bool:
    """accelerate's ``CpuOffload``: the whole model moves to the GPU at call time."""
    return type(hook).__name__ == "CpuOffload"


def as_device(value: Any) -> Any:
    """A hook's ``execution_device`` (an int GPU index, a string or a ``torch.device``) as a
    ``torch.device``; None when it is None or not a device."""
    if value is None:
        return None
    import torch

    if isinstance(value, torch.device):
        return value
    if isinstance(value, bool):
        return None
    if not isinstance(value, str):
        import operator

        try:
            return device_of_index(operator.index(value))  # an int, a numpy integer
        except TypeError:
            return None
    try:
        return torch.device(value)
    except (TypeError, RuntimeError, ValueError):
        return None


def device_of_index(index: int) -> Any:
    """Accelerator ``index`` as torch (2.5+) and accelerate read a bare int: the current
    accelerator's device of that index, ``cuda:N`` on a CUDA machine. torch 2.6 raises for an
    int when no accelerator is available; CUDA then, as earlier releases read it."""
    import torch

    try:
        return torch.device(index)
    except RuntimeError:
        return torch.device("cuda", index)


def execution_device(module: Any) -> Any:
    """The device accelerate's hook on ``module`` runs it on (a ``torch.device``), or None when it
    has no hook that says."""
    for hook in hooks_of(module):
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return as_device(device)
    return None


def any_hooks(model: Any) -> bool:
    """Whether accelerate hooked ``model`` or any of its submodules."""
    return any(hooks_of(module) for module in model.modules())


def any_offloading(model: Any) -> bool:
    """Whether a hook anywhere in ``model`` keeps weights off their execution device."""
    return any(is_offloading(hook) or is_model_cpu_offload(hook) for module in model.modules() for hook in hooks_of(module))


def remove_hooks(model: Any) -> None:
    """Remove accelerate's hooks from ``model`` and its submodules, and the ``to``/``cuda`` guards
    ``dispatch_model`` put on the model (``remove_hook_from_module`` leaves them on accelerate
    0.29.3; 0.34.2 drops them)."""
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(model, recurse=True)
    namespace = vars(model)
    for name in GUARDED_METHODS:
        if hasattr(namespace.get(name), "__wrapped__"):
            del namespace[name]


def one_gpu(device_map: Any) -> bool:
    """True when ``device_map`` sends everything to one device that is neither the CPU nor the disk,
    however each entry spells it (``0``, ``"cuda:0"``, ``torch.device("cuda", 0)``)."""
    if not isinstance(device_map, dict) or not device_map:
        return False
    devices = set()
    for value in device_map.values():
        device = as_device(value)  # None for "disk", which names no torch device
        if device is None or device.type in ("cpu", "meta"):
            return False
        devices.add(device)
    return len(devices) == 1
