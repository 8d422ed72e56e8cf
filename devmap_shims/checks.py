"""Find tensors that sit on another device than the one their module runs on.

``check_devices(model_or_pipeline)`` returns one record per stray tensor, for instance the ``[16]``
NF4 table that bitsandbytes < 0.45.3 leaves on ``cuda:0`` after ``pipe.to("cuda:1")``
(bnb-quantstate-code-not-moved)::

    >>> devmap_shims.check_devices(pipe)
    [{'name': 'transformer.proj_out.weight.quant_state.code', 'kind': 'quant_state',
      'device': 'cuda:0', 'expected': 'cuda:1', 'shape': (16,), ...}]

What "the device a tensor should be on" means:

* a quantization-state tensor (bitsandbytes ``QuantState``: ``code``, ``absmax``, ``offset``,
  ``state2.*``) and any tensor attached to a parameter (``Int8Params.SCB``): the device of that
  parameter (skipped while the parameter is on ``meta``);
* the int8 weights and scales a bitsandbytes ``Linear8bitLt`` keeps on its ``state`` after its first
  forward (``state.CB``, ``state.SCB``; bnb-int8-stats-stay-on-old-device): its weight's device;
* a parameter or buffer: the execution device of its module's accelerate hook (``device_map``
  dispatch), or its own entry in a split ``hf_device_map`` (accelerate splits a module holding
  parameters of its own into one key per parameter), or the nearest hook above it, or its module's
  entry in the map, or, for a model that runs on one device, the device holding most of the
  model's elements. A one-device ``hf_device_map`` is not used (``.to()`` moves a model without
  updating it), nor a split one that no hook runs any more while the tensors are on one device or
  less than 90 % of their elements sit where it says (a model moved whole after its hooks were
  removed). Modules whose weights accelerate
  offloads (``offload=True`` hooks) are not checked: their weights live elsewhere by design.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

Record = Dict[str, Any]


def check_devices(obj: Any) -> List[Record]:
    """Every tensor of ``obj`` (a model, a diffusers or transformers pipeline, a dict or list of
    models, or a parameter) that is not on the device its module runs on; ``[]`` when everything is
    in place. Values of a dict or list that are no model (``pipe.components``' tokenizers,
    schedulers and ``None``) are skipped; one that holds a model among its attributes is refused.

    Each record has ``name`` (dotted path, prefixed by the pipeline component: ``model.`` and
    ``assistant_model.`` for a transformers pipeline), ``kind``
    (``"parameter"``, ``"buffer"``, ``"quant_state"``, ``"attached"`` or ``"int8_state"``), ``device``,
    ``expected``, ``shape`` and ``dtype``.
    """
    import torch

    records: List[Record] = []
    for prefix, item in _components(obj, torch):
        if isinstance(item, torch.nn.Module):
            records.extend(_check_module(prefix, item, torch))
        elif isinstance(item, torch.Tensor):
            records.extend(_check_attached(prefix, item, item.device, torch))
    return records


def _components(
    obj: Any, torch: Any, prefix: str = "", _inside: Tuple[int, ...] = ()
) -> Iterator[Tuple[str, Any]]:
    if isinstance(obj, (torch.nn.Module, torch.Tensor)):
        yield prefix, obj
        return
    if id(obj) in _inside:  # a dict or list that holds itself: looked at once
        return
    nested = bool(_inside)
    _inside = _inside + (id(obj),)
    components = getattr(obj, "components", None)
    if isinstance(components, dict):  # a diffusers pipeline
        for name, value in components.items():
            if isinstance(value, (torch.nn.Module, torch.Tensor)):
                yield _join(prefix, name), value
        return
    model = getattr(obj, "model", None)
    if isinstance(model, torch.nn.Module):  # a transformers pipeline, with its assistant if any
        yield _join(prefix, "model"), model
        assistant = getattr(obj, "assistant_model", None)
        if isinstance(assistant, torch.nn.Module):
            yield _join(prefix, "assistant_model"), assistant
        return
    if isinstance(obj, dict):
        for name, value in obj.items():
            yield from _components(value, torch, _join(prefix, str(name)), _inside)
        return
    if isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _components(value, torch, _join(prefix, str(index)), _inside)
        return
    if nested and not _holds_a_module(obj, torch):  # in pipe.components: a tokenizer, a scheduler, None
        return
    raise TypeError(
        f"check_devices() takes a torch module, a diffusers pipeline (.components), a transformers pipeline "
        f"(.model), a dict or list of them, or a tensor; got {type(obj).__name__}"
    )


def _holds_a_module(obj: Any, torch: Any) -> bool:
    """Whether one of ``obj``'s attributes is a torch module (a trainer holding its model): such an
    object is refused rather than passed over as holding nothing to check."""
    try:
        values = list(vars(obj).values())
    except TypeError:  # no __dict__: None, a number, a string
        return False
    return any(isinstance(value, torch.nn.Module) for value in values)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _normalize(device: Any, torch: Any) -> Any:
    """``device`` as the ``torch.device`` its tensors report: an int is the accelerator of that
    index (``cuda:N`` on a CUDA machine, as torch reads it), and a device without an index gets
    the current one of its kind, as a tensor made there does; None for what names no device."""
    from devmap_shims.devices.accelerate_hooks import as_device

    device = as_device(device)
    if device is not None and device.index is None and device.type not in ("cpu", "meta"):
        backend = getattr(torch, device.type, None)
        current = getattr(backend, "current_device", None)
        try:
            index = current() if callable(current) else 0
        except Exception:  # a backend that cannot say: its first device
            index = 0
        return torch.device(device.type, index)
    return device


def _elements_by_device(model: Any) -> Dict[Any, int]:
    """How many elements of ``model``'s tensors each device holds; meta tensors hold no data and
    do not count, nor do a lazy module's parameters, which have no shape yet."""
    from torch.nn.parameter import is_lazy

    totals: Dict[Any, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        device = tensor.device
        if device.type != "meta" and not is_lazy(tensor):
            totals[device] = totals.get(device, 0) + tensor.numel()
    return totals


def _hook_placement(module: Any, torch: Any) -> Tuple[Optional[Any], bool]:
    """(execution device, offloaded) from accelerate's hook on ``module``, if any."""
    from devmap_shims.devices import accelerate_hooks

    for hook in accelerate_hooks.hooks_of(module):
        if accelerate_hooks.is_model_cpu_offload(hook):
            # model CPU offload: the whole model moves at call time; it is checked as one device
            return None, False
        if accelerate_hooks.is_offloading(hook):
            return None, True
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return _normalize(device, torch), False
    return None, False


#: Without accelerate's hooks, a split map is taken as where the tensors belong only while at least
#: this share of their elements sits where it says (strays are a few tensors, not most of them).
MAP_STILL_HOLDS = 0.9


def _split_map(model: Any, held: Dict[Any, int], torch: Any) -> Dict[str, Any]:
    """``{module or parameter name: device}`` of ``model.hf_device_map`` when it is a split that
    still holds. A one-device map says where the model was loaded, not where it runs (``.to()``
    moves a model without updating it). A split map holds while accelerate's hooks run the model;
    without them (removed, then the model moved whole: accelerate's guard only warns) only while
    the tensors (``held``: elements per device) are split and :data:`MAP_STILL_HOLDS` of their
    elements sit where the map says. Devices on ``disk`` hold no tensor in memory and are left out."""
    from devmap_shims.devices.accelerate_hooks import any_hooks

    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict) or len({str(d) for d in device_map.values()}) < 2:
        return {}
    hooked = any_hooks(model)
    if len(held) < 2 and not hooked:
        return {}
    lookup: Dict[str, Any] = {}
    for key, device in device_map.items():  # "disk" names no device: left out
        device = _normalize(device, torch)
        if device is not None:  # a hand-made map may key a module by a number ({0: 0, 1: 1})
            lookup[str(key)] = device
    if not hooked and _share_in_place(model, lookup) < MAP_STILL_HOLDS:
        return {}
    return lookup


def _share_in_place(model: Any, lookup: Dict[str, Any]) -> float:
    """The share of ``model``'s elements (on a device, of a tensor the map places) that sit where
    ``lookup`` puts them."""
    import itertools

    from torch.nn.parameter import is_lazy

    placed = total = 0
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if tensor.device.type == "meta" or is_lazy(tensor):
            continue
        expected = _map_device(lookup, name)
        if expected is not None:
            total += tensor.numel()
            placed += tensor.numel() if tensor.device == expected else 0
    return placed / total if total else 1.0


def _map_device(lookup: Dict[str, Any], name: str) -> Optional[Any]:
    """The device of the longest key of ``lookup`` that ``name`` (a module's or a parameter's) is
    under; one lookup per level of the name."""
    while True:
        if name in lookup:
            return lookup[name]
        if not name:
            return None
        name = name.rpartition(".")[0]


def _check_module(prefix: str, model: Any, torch: Any) -> List[Record]:
    from torch.nn.parameter import is_lazy

    records: List[Record] = []
    held = _elements_by_device(model)
    home = max(held.items(), key=lambda item: item[1])[0] if held else None  # most elements; ties: first met
    lookup = _split_map(model, held, torch)
    placement: Dict[str, Tuple[Optional[Any], bool]] = {}
    seen = set()  # a tensor two modules hold (tied weights) is checked once, where it is met first
    for name, module in model.named_modules():
        parent = placement.get(name.rpartition(".")[0], (None, False)) if name else (None, False)
        own_device, offloaded = _hook_placement(module, torch)
        hook_device = own_device or parent[0]
        offloaded = offloaded or parent[1]
        placement[name] = (hook_device, offloaded)
        expected = hook_device or _map_device(lookup, name) or home
        module_prefix = _join(prefix, name)
        for pname, param in module._parameters.items():
            if param is None or id(param) in seen or is_lazy(param):
                continue
            seen.add(id(param))
            full = _join(module_prefix, pname)
            # a map key naming the parameter itself (accelerate splits a module holding its own
            # parameters so) comes before a hook inherited from a parent module
            where = own_device or lookup.get(_join(name, pname)) or expected
            if not offloaded and where is not None and param.device.type != "meta" and param.device != where:
                records.append(_record(full, "parameter", param, where))
            records.extend(_check_attached(full, param, param.device, torch))
        for bname, buffer in module._buffers.items():
            if buffer is None or offloaded or expected is None or id(buffer) in seen or is_lazy(buffer):
                continue
            seen.add(id(buffer))
            where = own_device or lookup.get(_join(name, bname)) or expected
            if buffer.device.type != "meta" and buffer.device != where:
                records.append(_record(_join(module_prefix, bname), "buffer", buffer, where))
        records.extend(_check_module_state(module_prefix, module, torch))
        records.extend(_check_int8_state(module_prefix, module, torch))
    return records


def _check_attached(name: str, param: Any, device: Any, torch: Any) -> List[Record]:
    """Quant-state tensors and other tensors stored on a parameter object, against its device."""
    from devmap_shims.devices.quant_state import state_tensors

    if device.type == "meta":
        return []
    records: List[Record] = []
    namespace = getattr(param, "__dict__", None) or {}
    state = namespace.get("quant_state")
    if state is not None:
        for _owner, _attr, sub, tensor in state_tensors(state):
            if tensor.device != device:
                records.append(_record(_join(name, f"quant_state.{sub}"), "quant_state", tensor, device))
    for attr, value in namespace.items():
        if isinstance(value, torch.Tensor) and value.device != device:
            records.append(_record(_join(name, attr), "attached", value, device))
    return records


def _check_module_state(module_prefix: str, module: Any, torch: Any) -> List[Record]:
    """A ``Linear4bit.quant_state`` that is not the weight's own object (checked there otherwise)."""
    from devmap_shims.devices.quant_state import state_tensors

    state = module.__dict__.get("quant_state")
    weight = module._parameters.get("weight")
    if state is None or weight is None or weight.device.type == "meta":
        return []
    if (getattr(weight, "__dict__", None) or {}).get("quant_state") is state:
        return []
    return [
        _record(_join(module_prefix, f"quant_state.{sub}"), "quant_state", tensor, weight.device)
        for _owner, _attr, sub, tensor in state_tensors(state)
        if tensor.device != weight.device
    ]


def _check_int8_state(module_prefix: str, module: Any, torch: Any) -> List[Record]:
    """A ``Linear8bitLt``'s ``state.CB``/``state.SCB`` (its ``MatmulLtState``), against its weight."""
    from devmap_shims.devices.int8_state import layer_state_tensors

    held = list(layer_state_tensors(module))
    weight = module._parameters.get("weight") if held else None
    if weight is None or weight.device.type == "meta":
        return []
    return [
        _record(_join(module_prefix, f"state.{attr}"), "int8_state", tensor, weight.device)
        for attr, tensor in held
        if isinstance(tensor, torch.Tensor) and tensor.device != weight.device
    ]


def _record(name: str, kind: str, tensor: Any, expected: Any) -> Record:
    return {
        "name": name,
        "kind": kind,
        "device": str(tensor.device),
        "expected": str(expected),
        "shape": tuple(tensor.shape),
        "dtype": str(tensor.dtype).replace("torch.", ""),
    }


def format_records(records: List[Record]) -> str:
    """Human-readable lines for :func:`check_devices`' records (for error messages and logs)."""
    if not records:
        return "every tensor is on its module's device"
    lines = [f"{len(records)} tensor(s) off their module's device:"]
    for item in records:
        lines.append(
            f"  {item['name']} ({item['kind']}, {list(item['shape'])} {item['dtype']}): on {item['device']}, "
            f"expected {item['expected']}"
        )
    return "\n".join(lines)


__all__ = ["check_devices", "format_records"]
