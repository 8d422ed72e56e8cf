"""Scenarios for the bitsandbytes quant-state rows and the diffusers load row (Report 3).

Each replays what the user did on a simulated 2-GPU machine. Quantized weights come from a
pre-quantized NF4 checkpoint made by :mod:`devmap_shims.testing.nf4` and loaded the way
bitsandbytes loads any pre-quantized checkpoint (``Params4bit.from_prequantized``), so no CUDA
kernel runs and every bitsandbytes release can be replayed on a CPU.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

from devmap_shims.scenarios import BugObserved, ScenarioUnavailable, scenario, scratch_dir

_FLUX_NEEDS = ("torch", "bitsandbytes", "diffusers", "transformers")
_CACHE: Dict[str, str] = {}


def _import_before_simulation(*names: str) -> None:
    """Import the libraries before the simulation starts: bitsandbytes probes CUDA (and triton) when
    first imported, which must see the real machine."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ScenarioUnavailable(f"{name} cannot be imported here ({exc})") from exc


def _prepare_flux() -> Any:
    """Everything a Flux scenario needs that must exist before the simulation starts: the libraries
    and model classes (imported lazily by diffusers and transformers, and some of them probe the
    machine on import), the pre-quantized checkpoint and the CPU pipeline it goes into."""
    _import_before_simulation("bitsandbytes", "diffusers", "transformers")
    try:
        from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: F401
    except ImportError as exc:  # diffusers < 0.30
        raise ScenarioUnavailable(f"this diffusers has no Flux pipeline ({exc})") from exc

    from devmap_shims.testing.models import tiny_flux_pipeline

    _prequantized_flux_dir()
    return tiny_flux_pipeline()


def _prequantized_flux_dir() -> str:
    """A pre-quantized tiny Flux transformer checkpoint, written once per process."""
    path = _CACHE.get("flux-nf4")
    if path is None or not os.path.isdir(path):
        from devmap_shims.testing.nf4 import save_prequantized_flux_transformer

        path = os.path.join(scratch_dir("flux-nf4"), "transformer")
        save_prequantized_flux_transformer(path)
        _CACHE["flux-nf4"] = path
    return path


def _load_4bit_transformer(**kwargs: Any) -> Any:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(_prequantized_flux_dir(), **kwargs)


def _pipeline_with(base: Any, transformer: Any) -> Any:
    from diffusers import FluxPipeline

    components = dict(base.components)
    components["transformer"] = transformer
    return FluxPipeline(**components)


def _raise_if_strays(obj: Any, what: str) -> int:
    from devmap_shims.checks import check_devices

    strays = check_devices(obj)
    if strays:
        first = strays[0]
        raise BugObserved(
            f"{what}: {len(strays)} tensor(s) off their module's device, e.g. {first['name']} "
            f"{list(first['shape'])} left on {first['device']} (expected {first['expected']})"
        )
    return _count_quant_states(obj)


def _count_quant_states(obj: Any) -> int:
    from devmap_shims.hooks.quant_state import state_tensors

    modules: List[Any] = list(getattr(obj, "components", {}).values()) if hasattr(obj, "components") else [obj]
    count = 0
    for module in modules:
        for param in getattr(module, "parameters", lambda: [])():
            state = (getattr(param, "__dict__", None) or {}).get("quant_state")
            if state is not None:
                count += sum(1 for _ in state_tensors(state))
    return count


# -- bnb-quantstate-code-not-moved -------------------------------------------------------------------
@scenario(
    "bnb-quantstate-code-not-moved",
    "Params4bit loaded on cuda:0, moved with .to('cuda:1'): every quant-state tensor must follow",
    needs=("torch", "bitsandbytes"),
)
def params4bit_moved_to_second_gpu() -> str:
    _import_before_simulation("bitsandbytes")
    import torch

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.nf4 import params4bit

    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        param = params4bit(weight, "cuda:0", compress_statistics=True)
        moved = param.to("cuda:1")
        state = moved.quant_state
        left = {name: str(t.device) for name, t in _state_devices(state).items() if t.device != moved.device}
        if left:
            names = ", ".join(f"quant_state.{k} on {v}" for k, v in sorted(left.items()))
            raise BugObserved(f"after Params4bit.to('cuda:1') the weight is on {moved.device} but {names}")
        return f"weight and {len(_state_devices(state))} quant-state tensors on {moved.device}"


def _state_devices(state: Any) -> Dict[str, Any]:
    from devmap_shims.hooks.quant_state import state_tensors

    return {name: tensor for _owner, _attr, name, tensor in state_tensors(state)}


@scenario(
    "bnb-quantstate-code-not-moved",
    "tiny Flux pipeline with a 4-bit transformer loaded on cuda:0, then pipe.to('cuda:1')",
    needs=_FLUX_NEEDS,
)
def flux_4bit_pipe_to_second_gpu() -> str:
    base = _prepare_flux()
    import torch

    from devmap_shims.testing import simulated_gpus

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = _load_4bit_transformer()
        pipe = _pipeline_with(base, transformer)
        pipe.to("cuda:1")
        checked = _raise_if_strays(pipe, "after pipe.to('cuda:1')")
        return f"pipe.to('cuda:1'): all tensors on cuda:1, {checked} quant-state tensors checked"


# -- bnb-params4bit-to-drops-bnb_quantized -----------------------------------------------------------
@scenario(
    "bnb-params4bit-to-drops-bnb_quantized",
    "p = p.to('cuda:1'); p = p.to('cuda:0') on a 4-bit parameter: must not re-quantize the packed data",
    needs=("torch", "bitsandbytes"),
)
def params4bit_moved_twice() -> str:
    _import_before_simulation("bitsandbytes")
    import torch

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.nf4 import params4bit

    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        param = params4bit(weight, "cuda:0")
        packed = param.data.cpu().clone()
        param = param.to("cuda:1")
        if not param.bnb_quantized:
            flag = "bnb_quantized=False on the Params4bit returned by .to()"
        else:
            flag = ""
        param = param.to("cuda:0")  # raises on the affected releases: quantizes the uint8 data again
        if flag:
            raise BugObserved(f"{flag} (the second move happened not to re-quantize)")
        if param.dtype != packed.dtype or not torch.equal(param.data.cpu(), packed):
            raise BugObserved("the packed 4-bit data changed after two moves")
        return "moved cuda:0 -> cuda:1 -> cuda:0: bnb_quantized kept, packed data bit-identical"


# -- diffusers-quantized-load-on-current-device --------------------------------------------------
@scenario(
    "diffusers-quantized-load-on-current-device",
    "4-bit Flux transformer loaded while cuda:0 is current, pipeline moved with pipe.to('cuda:1')",
    needs=_FLUX_NEEDS,
)
def flux_4bit_loaded_on_current_device_then_moved() -> str:
    base = _prepare_flux()
    import torch

    from devmap_shims.testing import simulated_gpus

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = _load_4bit_transformer()  # no device_map: diffusers picks the current device
        pipe = _pipeline_with(base, transformer)
        pipe.to("cuda:1")
        checked = _raise_if_strays(pipe, "after pipe.to('cuda:1')")
        return f"loaded on the current GPU, pipe.to('cuda:1'): {checked} quant-state tensors on cuda:1"


@scenario(
    "diffusers-quantized-load-on-current-device",
    "4-bit Flux transformer loaded with device_map={'': 'cuda:1'} while cuda:0 is current",
    needs=_FLUX_NEEDS,
)
def flux_4bit_loaded_with_one_gpu_device_map() -> str:
    _prepare_flux()
    import torch

    from devmap_shims.testing import simulated_gpus

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = _load_4bit_transformer(device_map={"": "cuda:1"})
        devices = sorted({str(p.device) for p in transformer.parameters()})
        if devices != ["cuda:1"]:
            raise BugObserved(f"device_map={{'': 'cuda:1'}} loaded parameters on {', '.join(devices)}")
        checked = _raise_if_strays(transformer, "after loading with device_map={'': 'cuda:1'}")
        return f"loaded with device_map={{'': 'cuda:1'}}: every parameter and {checked} quant-state tensors on cuda:1"
