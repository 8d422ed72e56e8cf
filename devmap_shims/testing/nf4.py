"""A small pure-torch NF4 quantizer that produces bitsandbytes 4-bit parameters without a GPU.

bitsandbytes before 0.46 quantizes only through its CUDA library, so on a CPU-only machine (or on
the simulated GPUs of :mod:`devmap_shims.testing`) ``Linear4bit.to("cuda")`` cannot run. These
helpers compute the same packed layout and quantization statistics on the CPU and hand them to
``Params4bit.from_prequantized``, the path bitsandbytes itself uses for pre-quantized checkpoints,
which needs no kernel::

    data, state = quantize_nf4(weight)                     # packed uint8 + bnb QuantState
    param = params4bit(weight, device="cuda:0")            # Params4bit.from_prequantized
    layer = linear4bit(torch.nn.Linear(64, 64), "cuda:0")  # a bnb Linear4bit holding it
    save_prequantized_flux_transformer(path)               # a pre-quantized diffusers checkpoint
    save_prequantized_transformers_model(model, path)      # a pre-quantized transformers checkpoint

Layout (bitsandbytes' ``quantize_4bit``): the weight is flattened and cut into blocks of
``blocksize`` values; each block is scaled by the reciprocal of its absolute maximum (``absmax``,
float32) and every value is replaced by the index of the nearest NF4 code (ties go to the lower
code, as in bitsandbytes' thresholds); two indices are packed per byte, the first in the high
nibble, into a ``[(n + 1) // 2, 1]`` uint8 tensor. With ``compress_statistics`` the absmax vector is
itself quantized to 8 bits in blocks of 256 with bitsandbytes' dynamic map, around its mean
(``offset``), as bitsandbytes' nested ("double") quantization does.

One deliberate difference: an all-zero block gets absmax 0 and code 0.0 here; bitsandbytes' CUDA
kernel divides by zero there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Linear4bit, Params4bit

NESTED_BLOCKSIZE = 256
QUANT_TYPE = "nf4"


def nf4_code(device: Any = "cpu") -> torch.Tensor:
    """bitsandbytes' 16-entry NF4 table (``get_4bit_type("nf4")``), float32 on ``device``."""
    from bitsandbytes.functional import get_4bit_type

    return get_4bit_type(QUANT_TYPE, device=torch.device("cpu")).to(device)


def dynamic_code(device: Any = "cpu") -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map()``), float32 on ``device``."""
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=True).to(torch.float32).to(device)


def _nearest_index(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted ``code`` for each value; ties go to the lower entry."""
    midpoints = (code[1:] + code[:-1]) / 2
    return torch.bucketize(scaled, midpoints)


def _blockwise(values: torch.Tensor, code: torch.Tensor, blocksize: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Code indices (int64, one per value) and float32 absmax (one per block) of a flat tensor."""
    flat = values.reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = (n + blocksize - 1) // blocksize
    padded = torch.zeros(blocks * blocksize, dtype=torch.float32)
    padded[:n] = flat
    padded = padded.view(blocks, blocksize)
    absmax = padded.abs().amax(dim=1)
    scale = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    # Values past the end count as 0.0 (bitsandbytes loads zeros there), so an odd tail packs the
    # code of 0.0 into the last low nibble.
    scaled = (padded * scale.unsqueeze(1)).clamp(-1.0, 1.0).reshape(-1)[: n + n % 2]
    order = torch.argsort(code)
    index = order[_nearest_index(scaled, code[order])]
    return index, absmax


def quantize_nf4(
    weight: torch.Tensor,
    *,
    blocksize: int = 64,
    compress_statistics: bool = False,
    quant_storage: torch.dtype = torch.uint8,
) -> Tuple[torch.Tensor, "QuantState"]:
    """``(packed data, QuantState)`` for ``weight``, both on the CPU, as ``quantize_4bit(..., "nf4")``.

    ``weight`` is read on the CPU (a tensor on a simulated GPU is read through its CPU storage).
    The state's ``dtype`` is the weight's dtype, which is what dequantization returns.
    """
    from bitsandbytes.functional import QuantState

    if not weight.is_floating_point():
        raise ValueError(f"quantize_nf4 needs a floating-point weight, got {weight.dtype}")
    source = weight.detach().to("cpu")
    index, absmax = _blockwise(source, nf4_code(), blocksize)
    nibbles = index.to(torch.uint8)
    packed = ((nibbles[::2] << 4) | nibbles[1::2]).unsqueeze(1)
    if quant_storage != torch.uint8:
        packed = packed.reshape(-1).view(quant_storage).unsqueeze(1)
    code = nf4_code()
    if not compress_statistics:
        state = QuantState(
            absmax=absmax, shape=source.shape, code=code, blocksize=blocksize, quant_type=QUANT_TYPE, dtype=source.dtype
        )
        return packed, state
    offset = absmax.mean()
    qabsmax, state2 = quantize_blockwise_dynamic(absmax - offset)
    state = QuantState(
        absmax=qabsmax,
        shape=source.shape,
        code=code,
        blocksize=blocksize,
        quant_type=QUANT_TYPE,
        dtype=source.dtype,
        offset=offset,
        state2=state2,
    )
    return packed, state


def quantize_blockwise_dynamic(values: torch.Tensor, blocksize: int = NESTED_BLOCKSIZE) -> Tuple[torch.Tensor, "QuantState"]:
    """8-bit blockwise quantization with the dynamic map (bitsandbytes' ``quantize_blockwise``)."""
    from bitsandbytes.functional import QuantState

    code = dynamic_code()
    index, absmax = _blockwise(values, code, blocksize)
    index = index[: values.numel()]
    state = QuantState(absmax=absmax, code=code, blocksize=blocksize, dtype=torch.float32)
    return index.to(torch.uint8), state


def dequantize_nf4(packed: torch.Tensor, state: "QuantState") -> torch.Tensor:
    """The weight back from ``(packed, state)``, on the CPU, in ``state.dtype`` (reference decoder)."""
    data = packed.detach().to("cpu").reshape(-1).view(torch.uint8)
    n = 1
    for dim in state.shape:
        n *= int(dim)
    index = torch.stack([data >> 4, data & 0x0F], dim=1).reshape(-1)[:n].long()
    absmax = state.absmax.detach().to("cpu")
    if state.nested:
        nested = state.state2
        absmax = _dequantize_blockwise(absmax, nested.code.to("cpu"), nested.absmax.to("cpu"), nested.blocksize)
        absmax = absmax + state.offset.to("cpu")
    values = state.code.detach().to("cpu")[index]
    block = torch.arange(n) // state.blocksize
    return (values * absmax.to(torch.float32)[block]).reshape(state.shape).to(state.dtype)


def _dequantize_blockwise(index: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    flat = index.reshape(-1).long()
    block = torch.arange(flat.numel()) // blocksize
    return code[flat] * absmax[block]


def prequantized_stats(weight: torch.Tensor, **kwargs: Any) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """``(packed data, quantized_stats)`` in the form bitsandbytes serializes (``QuantState.as_dict(packed=True)``).

    The stats are the ``weight.*`` entries of a pre-quantized checkpoint without the ``weight.``
    prefix: ``absmax``, ``quant_map``, ``quant_state.bitsandbytes__nf4`` and, when nested,
    ``nested_absmax`` and ``nested_quant_map``.
    """
    packed, state = quantize_nf4(weight, **kwargs)
    return packed, state.as_dict(packed=True)


def params4bit(
    weight: torch.Tensor,
    device: Any = "cpu",
    *,
    module: Optional[torch.nn.Module] = None,
    **kwargs: Any,
) -> "Params4bit":
    """A ``Params4bit`` holding ``weight`` quantized to NF4, built with ``Params4bit.from_prequantized``
    on ``device`` (its quant state is created there, as a load onto that device creates it)."""
    from bitsandbytes.nn import Params4bit

    packed, stats = prequantized_stats(weight, **kwargs)
    try:
        param = Params4bit.from_prequantized(packed, stats, requires_grad=False, device=device, module=module)
    except TypeError:  # bitsandbytes < 0.44 has no ``module`` argument
        param = Params4bit.from_prequantized(packed, stats, requires_grad=False, device=device)
    # bitsandbytes < 0.44 leaves these unset (and copy.deepcopy then fails); later releases set them
    namespace = param.__dict__
    namespace.setdefault("quant_storage", packed.dtype)
    namespace.setdefault("module", module)
    if module is not None:
        module.quant_state = param.quant_state
    return param


def linear4bit(
    linear: torch.nn.Linear,
    device: Any = "cpu",
    *,
    compute_dtype: Optional[torch.dtype] = None,
    **kwargs: Any,
) -> "Linear4bit":
    """A bitsandbytes ``Linear4bit`` with ``linear``'s weight (NF4) and bias, on ``device``."""
    from bitsandbytes.nn import Linear4bit

    quant_storage = kwargs.get("quant_storage", torch.uint8)
    layer = Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=kwargs.get("compress_statistics", False),
        quant_type=QUANT_TYPE,
        quant_storage=quant_storage,
        device="meta",
    )
    layer.weight = params4bit(linear.weight, device, module=layer, **kwargs)
    if linear.bias is not None:
        layer.bias = torch.nn.Parameter(linear.bias.detach().to(device), requires_grad=False)
    return layer


def quantize_linears_(module: torch.nn.Module, device: Any = "cpu", **kwargs: Any) -> int:
    """Replace every ``nn.Linear`` inside ``module`` by a :func:`linear4bit` on ``device``; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear:
            setattr(module, name, linear4bit(child, device, **kwargs))
            count += 1
        else:
            count += quantize_linears_(child, device, **kwargs)
    return count


def save_prequantized_flux_transformer(
    path: "str | os.PathLike[str]",
    *,
    seed: int = 0,
    blocksize: int = 64,
    compress_statistics: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the tiny Flux transformer of :func:`devmap_shims.testing.models.tiny_flux_pipeline` as
    a pre-quantized bitsandbytes NF4 checkpoint (config with ``quantization_config``, safetensors
    with every ``nn.Linear`` weight packed and its quant-state entries), as ``save_pretrained``
    writes a 4-bit model. ``FluxTransformer2DModel.from_pretrained(path)`` then loads it on any
    diffusers >= 0.31 without running a quantization kernel. Returns ``path``.
    """
    from safetensors.torch import save_file

    from devmap_shims.testing.models.flux import build_tiny_flux_transformer, flux_component_seed
    from devmap_shims.testing.models.seeding import reinit_weights, seeded

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    component_seed = flux_component_seed(seed, "transformer")
    with seeded(component_seed):
        model = build_tiny_flux_transformer(True)
    reinit_weights(model, component_seed, embedding_std=1.0)
    tensors = prequantized_state_dict(model.state_dict(), model, blocksize, compress_statistics)
    save_file(tensors, str(path / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    model.save_config(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = _bnb_config_dict(compute_dtype, compress_statistics)
    (path / "config.json").write_text(json.dumps(config, indent=2, default=_json_default))
    return path


def prequantized_state_dict(
    state: Dict[str, torch.Tensor], model: torch.nn.Module, blocksize: int, compress_statistics: bool,
) -> Dict[str, torch.Tensor]:
    """``state`` with the weight of every ``nn.Linear`` of ``model`` packed to NF4 and followed by
    its ``weight.*`` quant-state entries, as bitsandbytes serializes a 4-bit model."""
    linears = {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    tensors: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        owner, _, leaf = key.rpartition(".")
        if owner in linears and leaf == "weight":
            packed, stats = prequantized_stats(value, blocksize=blocksize, compress_statistics=compress_statistics)
            tensors[key] = packed
            tensors.update({f"{key}.{k}": v.contiguous() for k, v in stats.items()})
        else:
            tensors[key] = value.detach().contiguous()
    return tensors


def save_prequantized_transformers_model(
    model: torch.nn.Module,
    path: "str | os.PathLike[str]",
    *,
    blocksize: int = 64,
    compress_statistics: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a transformers ``model`` as a pre-quantized bitsandbytes NF4 checkpoint: every
    ``nn.Linear`` packed (``llm_int8_skip_modules=[]``, so transformers converts them all), the
    config with ``quantization_config``. ``type(model).from_pretrained(path)`` loads it as a 4-bit
    model on the current GPU (a simulated one will do) without running a quantization kernel."""
    from safetensors.torch import load_file, save_file
    from transformers import BitsAndBytesConfig

    if getattr(model, "_keep_in_fp32_modules", None):
        raise ValueError(f"{type(model).__name__} keeps modules in float32; pick a model that has none")
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    weights = path / "model.safetensors"
    save_file(prequantized_state_dict(load_file(str(weights)), model, blocksize, compress_statistics), str(weights),
              metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=QUANT_TYPE,
        bnb_4bit_use_double_quant=compress_statistics,
        bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=[],
    ).to_dict()
    (path / "config.json").write_text(json.dumps(config, indent=2, default=_json_default))
    return path


def _bnb_config_dict(compute_dtype: torch.dtype, compress_statistics: bool) -> Dict[str, Any]:
    from diffusers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=QUANT_TYPE,
        bnb_4bit_use_double_quant=compress_statistics,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    return config.to_dict()


def _json_default(value: Any) -> Any:
    if isinstance(value, (tuple, set)):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    raise TypeError(f"cannot write {type(value).__name__} to config.json")


__all__ = [
    "dequantize_nf4",
    "dynamic_code",
    "linear4bit",
    "nf4_code",
    "params4bit",
    "prequantized_state_dict",
    "prequantized_stats",
    "quantize_blockwise_dynamic",
    "quantize_linears_",
    "quantize_nf4",
    "save_prequantized_flux_transformer",
    "save_prequantized_transformers_model",
]
