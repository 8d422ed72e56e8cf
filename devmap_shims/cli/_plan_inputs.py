"""What ``devmap-shims plan`` reads: the model config (a file or a folder holding one, bounded and
checked before anything is built) and the memory budgets the user describes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from devmap_shims.cli._output import UsageError
from devmap_shims.planning.sizes import TopologyError, parse_size

#: A model config is a few kilobytes; nothing larger is read.
MAX_CONFIG_BYTES = 4 << 20
#: What a config may ask the planner to build on the meta device: a few thousand layers at most.
MAX_LAYERS = 4096
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def read_config_dict(path_text: str) -> Tuple[Dict[str, Any], Path]:
    """The JSON object of a local ``config.json`` (or of a folder's), read without blocking on a
    FIFO or a device and without following it past :data:`MAX_CONFIG_BYTES`."""
    import os
    import stat

    path = Path(path_text)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UsageError(f"{path} is a folder without a config.json (give a model folder holding "
                             "config.json, or the config file itself)")
        path = path / "config.json"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UsageError(f"no such file or folder: {path} (give a model folder holding config.json, "
                         "or the config file itself)") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{path} is not a regular file (a model config is a JSON file)")
        raw = os.read(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise UsageError(f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a model config")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except (RecursionError, ValueError) as exc:  # nested too deep; numbers too long to convert
        raise UsageError(f"{path} cannot be read as a model config ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} does not hold a JSON object")
    if not isinstance(data.get("model_type"), str):
        raise UsageError(f"{path} has no \"model_type\"; it does not look like a transformers model config")
    _check_plausible(data, path)
    return data, path


def _is_layer_count(key: str) -> bool:
    """A key that counts layers or blocks: ``num_hidden_layers`` and its aliases, any ``..._layers``
    (``decoder_layers``, ``num_decoder_layers``), ``num_blocks``, ``depth`` (vision towers)."""
    return key in _LAYER_KEYS or key.endswith(("_layers", "_blocks")) or key == "depth" or key.endswith("_depth")


def _check_plausible(data: Dict[str, Any], path: Path) -> None:
    """Refuse, in one line, configs the planner cannot build on the meta device: no layers, more
    than :data:`MAX_LAYERS` (in one count, or over all the sub-configs: ``text_config``,
    ``vision_config``, an encoder and a decoder), or sizes no machine has."""
    for key in _LAYER_KEYS:
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{path}: {key} = {json.dumps(value)[:40]} is not a whole number of layers "
                             f"(a JSON integer from 1 to {MAX_LAYERS})")
        if not 1 <= value <= MAX_LAYERS:
            raise UsageError(f"{path}: {key} = {str(value)[:40]} (plan builds models of 1 to {MAX_LAYERS} layers)")
    total = 0
    stack: List[Tuple[str, Dict[str, Any]]] = [("", data)]
    while stack:  # every sub-config, however nested (json.loads bounds the depth)
        prefix, config = stack.pop()
        # one config's layers: its num_hidden_layers (or the largest alias), and every other count
        # (an encoder's and a decoder's, T5's num_decoder_layers); a count given twice is counted
        # twice, which only matters far above any real model
        aliases = parts = 0
        for key, value in config.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                stack.append((f"{name}.", value))
            elif isinstance(value, list) and str(key).endswith("depths"):  # Swin's blocks per stage
                parts += sum(v for v in value if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 2**40)
            elif isinstance(value, int) and not isinstance(value, bool):
                if abs(value) > 2**40:
                    raise UsageError(
                        f"{path}: {name} = {str(value)[:40]}... is larger than any model dimension"
                    )
                if _is_layer_count(str(key)):
                    if value > MAX_LAYERS:
                        raise UsageError(
                            f"{path}: {name} = {value} (plan builds models of 1 to {MAX_LAYERS} layers)"
                        )
                    if key in _LAYER_KEYS:
                        aliases = max(aliases, value)
                    else:
                        parts += max(value, 0)
        total += aliases + parts
    if total > MAX_LAYERS:
        raise UsageError(
            f"{path}: {total} layers over the config and its sub-configs (plan builds models of 1 to "
            f"{MAX_LAYERS} layers)"
        )


def parse_caps(text: Optional[str]) -> Dict[Any, int]:
    caps: Dict[Any, int] = {}
    if not text:
        return caps
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise TopologyError(f"cannot read max_memory entry {part!r} (write e.g. 0=10GiB or cpu=100GiB)")
        if key.isascii() and key.isdigit():  # "²" is a digit to isdigit(), not to int()
            caps[int(key)] = size_of(f"--max-memory {part.strip()}", value)
        elif key in ("cpu", "disk"):
            caps[key] = size_of(f"--max-memory {part.strip()}", value)
        else:
            raise TopologyError(f"unknown device {key!r} in --max-memory (use GPU numbers, cpu or disk)")
    return caps


def size_of(option: str, value: str) -> int:
    """``parse_size(value)``, its error naming the option it came from."""
    try:
        return parse_size(value)
    except TopologyError as exc:
        raise TopologyError(f"{option}: {exc}") from None


def default_cpu_memory() -> Optional[int]:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # pragma: no cover - psutil comes with accelerate
        return None


def build_max_memory(gpus: List[int], cpu: Optional[int], caps: Dict[Any, int]) -> Dict[Any, int]:
    for key in caps:
        if isinstance(key, int) and key >= len(gpus):
            raise TopologyError(f"--max-memory names GPU {key}, but the topology has {len(gpus)} GPU(s)")
    mm: Dict[Any, int] = {i: min(size, caps.get(i, size)) for i, size in enumerate(gpus)}
    cpu_budget = caps.get("cpu", cpu)
    if cpu_budget is not None:
        mm["cpu"] = cpu_budget
    if "disk" in caps:
        mm["disk"] = caps["disk"]
    return mm


def quantization_of(args: argparse.Namespace, data: Dict[str, Any]) -> str:
    qc = data.pop("quantization_config", None)
    if args.quantization:
        return args.quantization
    if not qc:
        return "none"
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "bitsandbytes":
        if qc.get("load_in_4bit"):
            return "4bit"
        if qc.get("load_in_8bit"):
            return "8bit"
    raise UsageError(
        f"the config is quantized with {method or 'an unknown method'}, which plan does not model; "
        "pass --quantization none, 4bit or 8bit to choose"
    )
