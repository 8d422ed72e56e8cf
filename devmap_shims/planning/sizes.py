"""Memory sizes and GPU topologies written by people: ``23GiB``, ``80GB``, ``8x23GiB``.

Units follow accelerate's ``convert_file_size_to_int``: ``KB/MB/GB/TB`` are powers of 1000,
``KiB/MiB/GiB/TiB`` powers of 1024, and a bare number is bytes. Case does not matter. ``PB/PiB``
are read too, so that a size past the bound of :data:`MAX_SIZE` is told so rather than unreadable.
"""

from __future__ import annotations

import re
from typing import List

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pb": 10**15,
    "pib": 2**50,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_GROUP_RE = re.compile(r"^\s*(?:(\d+)\s*[xX*]\s*)?(.+?)\s*$")


#: Bounds of a plausible machine: no memory size above 1 PiB, no more than 4096 GPUs in all.
MAX_SIZE = 2**50
MAX_GPUS = 4096


class TopologyError(ValueError):
    """A size or GPU topology string that cannot be read."""


def parse_size(text: "str | int") -> int:
    """``"23GiB"`` -> 24696061952. Raises :class:`TopologyError` on anything else."""
    if isinstance(text, bool):
        raise TopologyError(f"not a memory size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise TopologyError(f"memory size cannot be negative: {text}")
        return _bounded(text, str(text))
    text = str(text)
    match = _SIZE_RE.match(text) if len(text) <= 64 else None
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise TopologyError(
            f"not a memory size: {text[:64]!r} (write e.g. 23GiB, 80GB or a number of bytes; "
            "KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000)"
        )
    number = float(match.group(1))
    if number * _UNITS[unit] > MAX_SIZE:
        raise TopologyError(f"memory size {text.strip()!r} is over 1 PiB: not a plausible machine")
    return int(number * _UNITS[unit])


def _bounded(size: int, text: str) -> int:
    if size > MAX_SIZE:
        raise TopologyError(f"memory size {text[:64]} is over 1 PiB: not a plausible machine")
    return size


def parse_gpus(text: str) -> List[int]:
    """GPU capacities from ``"8x23GiB"``, ``"2x80GiB,2x40GiB"`` or ``"80GiB,40GiB"``."""
    if not isinstance(text, str) or not text.strip():
        raise TopologyError("empty GPU topology (write e.g. 8x23GiB)")
    capacities: List[int] = []
    for part in text.split(","):
        match = _GROUP_RE.match(part)
        if match is None or not match.group(2):
            raise TopologyError(f"cannot read GPU group {part!r} in {text!r} (write e.g. 8x23GiB)")
        digits = match.group(1)
        count = int(digits) if digits is not None and len(digits) <= 6 else (1 if digits is None else MAX_GPUS + 1)
        if count < 1:
            raise TopologyError(f"GPU count must be at least 1 in {part[:64]!r}")
        if count + len(capacities) > MAX_GPUS:
            raise TopologyError(f"{text[:64]!r} adds up to more than {MAX_GPUS} GPUs: not a plausible machine")
        try:
            size = parse_size(match.group(2))
        except TopologyError as exc:
            raise TopologyError(f"in GPU topology {text!r}: {exc}") from None
        if size <= 0:
            raise TopologyError(f"GPU memory must be positive in {part!r}")
        capacities.extend([size] * count)
    return capacities


def format_bytes(n: float) -> str:
    """Human-readable size in binary units (``2.20 GiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"  # pragma: no cover
