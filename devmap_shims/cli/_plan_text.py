"""``devmap-shims plan``'s text output: one strategy's map per device, or the four side by side,
in 100 columns."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from devmap_shims._text import fit
from devmap_shims.planning.assess import TOLERANCE
from devmap_shims.planning.sizes import format_bytes

#: Text output is wrapped to this many columns.
WIDTH = 100


def _size(n: int) -> str:
    """``23 GiB`` / ``23.5 GiB``: a topology's sizes, without trailing zeros."""
    text = format_bytes(n)
    number, _, unit = text.partition(" ")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return f"{number} {unit}"


def describe_gpus(gpus: List[int]) -> str:
    """``4 x 23 GiB`` or ``2 x 80 GiB + 2 x 40 GiB``: runs of equal GPUs, in order."""
    runs: List[List[int]] = []
    for size in gpus:
        if runs and runs[-1][1] == size:
            runs[-1][0] += 1
        else:
            runs.append([1, size])
    return " + ".join(f"{count} x {_size(size)}" for count, size in runs)

def _device_order(key: str) -> Tuple[int, Any]:
    return (0, int(key)) if key.isdigit() else (1, {"cpu": 0, "disk": 1}.get(key, 2))


def render(report: Dict[str, Any]) -> str:
    gpus = describe_gpus([int(v) for v in report["gpus"].values()])
    lines = _header(report, f"device_map={report['strategy']!r} on {len(report['gpus'])} GPU(s): {gpus}")
    rows = [("device", "bytes", "share", "modules")]
    budgets = report["max_memory"]
    devices = sorted(set(report["bytes_per_device"]) | set(report["gpus"]), key=_device_order)
    empty: List[str] = []  # a run of empty GPUs in a row: one line, however many (4,096 GPUs print ~1)

    def close_run() -> None:
        if empty:
            label = f"GPU {empty[0]}" + (f"-{empty[-1]}" if len(empty) > 1 else "")
            rows.append((label, format_bytes(0), "0.0%", "-"))
            empty.clear()

    for dev in devices:
        used = report["bytes_per_device"].get(dev, 0)
        modules = ", ".join(report["modules_per_device"].get(dev, [])) or "-"
        if dev.isdigit() and not used and modules == "-":
            empty.append(dev)
            continue
        close_run()
        capacity = report["gpus"].get(dev) or budgets.get(dev)
        share = f"{100 * used / capacity:.1f}%" if capacity else "-"
        label = f"GPU {dev}" if dev.isdigit() else dev
        rows.append((label, format_bytes(used), share, modules))
    close_run()
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:  # the padded columns are the first line's prefix, so wrapping keeps them aligned
        head = "  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  "
        lines.append(fit(r[3], WIDTH, indent=head, hang=" " * len(head)))
    lines.extend(_verdict_lines(report))
    before = report.get("without_shims")
    if before:
        lines.append(wrap(
            f"without devmap-shims: {before['verdict']} ({before['balance_ratio']:.2f}x); "
            f"repaired by {', '.join(report['shims_applied'])}"
        ))
    elif report["shims_armed"]:
        lines.append("devmap-shims leaves this map unchanged")
    else:
        lines.append(wrap(f"devmap-shims: device-map shim not armed ({_why_not_armed(report)})"))
    return "\n".join(lines)


def _header(report: Dict[str, Any], what: str) -> List[str]:
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v)
    return [
        wrap(f"model: {report.get('model_class') or report['model_type']} "
             f"from {elide_path(report['config'])} ({format_bytes(report['model_bytes'])} to place, "
             f"{report['quantization']}, {report['dtype']})"),
        wrap(what),
        wrap(f"stack: {versions}"),
    ]


def _why_not_armed(report: Dict[str, Any]) -> str:
    off = report.get("shims_switched_off_by")
    if off:
        return f"{off} switches it off, as in a program run with it"
    return "--without-shims, or the bug does not apply here"


def _verdict_lines(report: Dict[str, Any], label: str = "verdict") -> List[str]:
    ratio = report.get("balance_ratio")
    verdict = f"{label}: {report['verdict']}"
    if ratio is not None and not report.get("offload_unavoidable"):
        verdict += f" (busiest GPU {ratio:.2f}x the lower bound {format_bytes(report['lower_bound'])}"
        best = report.get("best_split")
        if report["verdict"] == "ok" and best is not None and ratio > TOLERANCE:
            verdict += "; no split of whole modules in order does better"
        verdict += ")"
    lines = [wrap(verdict)]
    for problem in report["problems"]:
        lines.append(wrap(f"  - {problem}", indent="    "))
    return lines

def _gpus_used(bytes_per_device: Dict[str, int]) -> str:
    from devmap_shims.planning.assess import _ranges

    used = sorted(int(k) for k, v in bytes_per_device.items() if k.isdigit() and v > 0)
    return _ranges(used) or "none"


def _row(strategy: str, side: str, judged: Dict[str, Any]) -> List[str]:
    per = judged["bytes_per_device"]
    busiest = max([v for k, v in per.items() if k.isdigit()] or [0])
    ratio = judged.get("balance_ratio")
    offloaded = judged.get("offloaded_bytes") or 0
    shown = ratio is not None and not judged.get("offload_unavoidable")
    return [strategy, side, judged["verdict"], _gpus_used(per), format_bytes(busiest),
            f"{ratio:.2f}x" if shown else "-", format_bytes(offloaded) if offloaded else "-"]


def render_all(report: Dict[str, Any]) -> str:
    from devmap_shims.cli._output import table

    gpus = describe_gpus([int(v) for v in report["gpus"].values()])
    lines = _header(report, f"{len(report['gpus'])} GPU(s): {gpus}")
    armed = bool(report["shims_armed"])
    rows = []
    for entry in report["strategies"]:
        if armed:
            rows.append(_row(entry["strategy"], "with", entry))
            rows.append(_row("", "without", entry["without_shims"]))
        else:
            rows.append(_row(entry["strategy"], "without", entry))
    lines.append(table(rows, ["strategy", "shims", "verdict", "GPUs", "busiest GPU", "x bound", "CPU/disk"]))
    if not armed:
        lines.append(wrap(f"devmap-shims: device-map shim not armed ({_why_not_armed(report)}): each "
                          "row is the library's own map"))
    # the problems of the maps shown first, each set once with the strategies it concerns
    groups: Dict[Tuple[str, ...], List[Dict[str, Any]]] = {}
    for entry in report["strategies"]:
        if entry["problems"]:
            groups.setdefault((entry["verdict"], *entry["problems"]), []).append(entry)
    for entries in groups.values():
        label = ", ".join(e["strategy"] for e in entries)
        lines.append(wrap(f"{label}: {entries[0]['verdict']}"))
        lines.extend(wrap(f"  - {problem}", indent="    ") for problem in entries[0]["problems"])
    return "\n".join(lines)

# -- text that fits WIDTH columns ---------------------------------------------------------------------

def elide_path(path: str, width: int = WIDTH - 2) -> str:
    """``path`` when it fits ``width`` columns, else ``.../`` and as many of its last components
    as fit (the file name at least)."""
    if len(path) <= width:
        return path
    tail = path[-(width - 4):]
    cut = tail.find("/")
    return ".../" + (tail[cut + 1:] if cut >= 0 else path.rsplit("/", 1)[-1])


def wrap(text: str, width: int = WIDTH, indent: str = "  ") -> str:
    """``text`` on lines of at most ``width`` columns (:func:`devmap_shims._text.wrap`: between
    words, never inside a version range, a name and its version or a size), continuation lines
    indented by ``indent``."""
    return fit(text, width, hang=indent)
