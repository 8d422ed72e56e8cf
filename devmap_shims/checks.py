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
* a parameter or buffer: the execution device of the nearest accelerate hook (``device_map``
  dispatch) or, failing that, the module's entry in a split ``hf_device_map``, or, for a model that
  runs on one device, the device holding most of the model's elements (a one-device
  ``hf_device_map`` is not used: ``.to()`` moves a model without updating it). Modules whose weights accelerate
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
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _home_device(model: Any, torch: Any) -> Any:
    """The device holding most of ``model``'s elements (ties: the first met); meta tensors hold no
    data and do not count."""
    totals: Dict[Any, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        device = tensor.device
        if device.type != "meta":
            totals[device] = totals.get(device, 0) + tensor.numel()
    if not totals:
        return None
    return max(totals.items(), key=lambda item: item[1])[0]


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


def _map_device(device_map: Any, name: str, torch: Any) -> Optional[Any]:
    # A one-device map says where the model was loaded, not where it runs: ``.to()`` moves the model
    # without updating ``hf_device_map``. Only a split map (which ``.to()`` refuses) is trusted.
    if not isinstance(device_map, dict) or len({str(d) for d in device_map.values()}) < 2:
        return None
    best = None
    best_len = -1
    for key, device in device_map.items():
        key = str(key)  # a hand-made map may key a module by a number ({0: 0, 1: 1} for a Sequential)
        if key == "" or name == key or name.startswith(key + "."):
            if len(key) > best_len:
                best, best_len = device, len(key)
    if best is None or best in ("disk",):
        return None
    try:
        return _normalize(best, torch)
    except (RuntimeError, TypeError):
        return None


def _check_module(prefix: str, model: Any, torch: Any) -> List[Record]:
    records: List[Record] = []
    home = _home_device(model, torch)
    device_map = getattr(model, "hf_device_map", None)
    placement: Dict[str, Tuple[Optional[Any], bool]] = {}
    for name, module in model.named_modules():
        parent = placement.get(name.rpartition(".")[0], (None, False)) if name else (None, False)
        hook_device, offloaded = _hook_placement(module, torch)
        hook_device = hook_device or parent[0]
        offloaded = offloaded or parent[1]
        placement[name] = (hook_device, offloaded)
        expected = hook_device or _map_device(device_map, name, torch) or home
        module_prefix = _join(prefix, name)
        for pname, param in module._parameters.items():
            if param is None:
                continue
            full = _join(module_prefix, pname)
            if not offloaded and expected is not None and param.device.type != "meta" and param.device != expected:
                records.append(_record(full, "parameter", param, expected))
            records.extend(_check_attached(full, param, param.device, torch))
        for bname, buffer in module._buffers.items():
            if buffer is None or offloaded or expected is None:
                continue
            if buffer.device.type != "meta" and buffer.device != expected:
                records.append(_record(_join(module_prefix, bname), "buffer", buffer, expected))
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
