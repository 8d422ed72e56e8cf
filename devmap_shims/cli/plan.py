"""``devmap-shims plan``: the device map ``from_pretrained`` would compute, without weights or GPUs.

::

    devmap-shims plan ./gemma-2-27b/config.json --gpus 8x23GiB --quantization 4bit
    devmap-shims plan ./llama-3-70b --gpus 8x80GiB --dtype bfloat16 --json
    devmap-shims plan ./llama-3-8b --gpus 4x23GiB --device-map all


The model is built on the meta device from a local ``config.json`` (no Hub access), bitsandbytes
modules are swapped in for 4-bit / 8-bit the way ``from_pretrained(quantization_config=...)``
does, and the installed stack's own device-map step runs with ``max_memory`` set to the described
GPUs (each fully free) and CPU. By default the map is the one you get with devmap-shims installed;
``--without-shims`` shows the library's own. ``--device-map all`` builds the model once and
compares the four strategies, each with and without the shims.

What it is doing (importing, building, planning: seconds each) is said on stderr, never on
stdout; ``--quiet`` silences it, and warnings and log lines below CRITICAL, the libraries' and
ours (bitsandbytes on a machine without its native library logs one at import). Text output fits
100 columns.

Exit status: 0 when the map is healthy, 1 when it is degenerate (collapsed, skipped GPU,
offloaded, imbalanced), 2 for a usage error (unreadable config, not a causal LM, bad topology).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from devmap_shims.cli._output import EXIT_OK, EXIT_PROBLEM, UsageError, one_line, print_json
from devmap_shims.cli._plan_inputs import (
    build_max_memory, default_cpu_memory, parse_caps, quantization_of, read_config_dict, size_of,
)
from devmap_shims.cli._plan_text import describe_gpus, render, render_all, wrap
from devmap_shims.cli._quiet import libraries_silent
from devmap_shims.planning.sizes import TopologyError, parse_gpus

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="a local config.json, or a folder holding one")
    parser.add_argument("--gpus", required=True, metavar="TOPOLOGY",
                        help="GPU count and memory, e.g. 8x23GiB, or 2x80GiB,2x40GiB")
    parser.add_argument("--cpu-memory", metavar="SIZE",
                        help="CPU memory available for offload (default: what this machine has free)")
    parser.add_argument("--max-memory", metavar="CAPS",
                        help="per-device max_memory as the user would pass it, e.g. 0=10GiB,3=20GiB,cpu=100GiB")
    parser.add_argument("--quantization", choices=("4bit", "8bit", "none"),
                        help="bitsandbytes quantization (default: the config's own bitsandbytes "
                        "settings, else none; a config quantized another way is refused)")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the unquantized weights (default bfloat16)")
    parser.add_argument("--device-map", default="auto", choices=STRATEGIES + ("all",),
                        help="the device_map strategy passed to from_pretrained (default auto); "
                        "all: the four side by side, with and without the shims")
    parser.add_argument("--without-shims", action="store_true", help="show the library's own map, unrepaired")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress lines on stderr, nor warnings or log lines below CRITICAL "
                        "(the libraries' and devmap-shims')")


# -- the run ------------------------------------------------------------------------------------------


class Progress:
    """One line on stderr per step of the run, flushed at once; nothing with ``--quiet``."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet

    def __call__(self, text: str) -> None:
        if not self.quiet:
            print(wrap(f"plan: {text}", indent="  "), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    say = Progress(getattr(args, "quiet", False))
    with libraries_silent(say.quiet):  # --quiet: nor the libraries' import-time warnings and logs
        return _run(args, say)


def _run(args: argparse.Namespace, say: Progress) -> int:
    try:
        gpus = parse_gpus(args.gpus)
        cpu = size_of("--cpu-memory", args.cpu_memory) if args.cpu_memory else default_cpu_memory()
        caps = parse_caps(args.max_memory)
        max_memory = build_max_memory(gpus, cpu, caps)
    except TopologyError as exc:
        raise UsageError(str(exc)) from None
    data, path = read_config_dict(args.config)
    quantization = quantization_of(args, data)
    versions = _versions()

    say(f"importing torch {versions.get('torch') or '?'} and "
        f"transformers {versions.get('transformers') or '?'} ...")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"plan needs torch and transformers installed ({exc})") from None
    from devmap_shims.cli import device_map_step as stack

    config = _build_config(data, path)
    architectures = data.get("architectures")
    name = architectures[0] if isinstance(architectures, list) and architectures and isinstance(
        architectures[0], str) else f"the {data['model_type']} causal LM"
    say(f"building {name[:80]} on the meta device ({args.dtype}, quantization {quantization}) ...")
    try:
        meta = stack.build_meta_model(config, args.dtype, quantization)
    except stack.PlanInputError as exc:
        raise UsageError(str(exc)) from None
    except ImportError as exc:
        raise UsageError(f"{quantization} quantization needs bitsandbytes installed ({one_line(exc)})") from None
    except Exception as exc:
        raise UsageError(f"cannot build {data['model_type']} from {path}: {type(exc).__name__}: {one_line(exc)}") from None

    armed, switched_off = shim_armed()
    armed = armed and not args.without_shims
    strategies = STRATEGIES if args.device_map == "all" else (args.device_map,)
    shown = "with and without the shims" if armed else "the library's own map"
    say(f"planning device_map={args.device_map!r} for {_parameters(meta.parameters)} "
        f"over {describe_gpus(gpus)}, {shown} ...")
    reports = []
    try:
        for strategy in strategies:
            library_map = stack.device_map_step(meta, strategy, max_memory, shim=False)
            final_map = stack.device_map_step(meta, strategy, max_memory, shim=True) if armed else library_map
            layout, budgets = stack.layout_and_budgets(meta, strategy, max_memory)
            reports.append(_report(strategy, meta, layout, budgets, library_map, final_map, armed, gpus,
                                   max_memory, path, versions))
            reports[-1]["shims_switched_off_by"] = switched_off or None
    except (MemoryError, RecursionError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"the device-map step failed for {path}: {type(exc).__name__}: {one_line(exc)}") from None
    report = reports[0] if len(reports) == 1 else _combined(reports)
    if args.json:
        print_json(report)
    else:
        print(render(report) if len(reports) == 1 else render_all(report))
    return EXIT_OK if all(r["verdict"] == "ok" for r in reports) else EXIT_PROBLEM


def _parameters(count: int) -> str:
    if count >= 10**9:
        return f"{count / 1e9:.1f} B parameters"
    if count >= 10**6:
        return f"{count / 1e6:.1f} M parameters"
    return f"{count} parameters"


def _build_config(data: Dict[str, Any], path: Path) -> Any:
    from transformers import AutoConfig

    fields = dict(data)
    model_type = fields.pop("model_type")
    _known_model_type(model_type, path)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        raise UsageError(f"{path}: {one_line(exc)}") from None
    except Exception as exc:
        raise UsageError(f"{path}: cannot build a {model_type} config: {type(exc).__name__}: {one_line(exc)}") from None


def _known_model_type(model_type: str, path: Path) -> None:
    """Refuse a ``model_type`` the installed transformers has no config class for, naming its
    version and the closest type it knows (transformers' own message lists all of them)."""
    import difflib

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING:
        return
    close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=1)
    raise UsageError(
        f"{path}: transformers {transformers.__version__} cannot build model_type {model_type[:64]!r}"
        + (f"; did you mean {close[0]!r}?" if close else "")
        + " (a model newer than this transformers needs a newer release; plan runs no remote code)"
    )


def shim_armed() -> Tuple[bool, str]:
    """Would ``devmap_shims.install()`` arm the device-map shim here, and if not because of a
    switch in the environment, which one (``DEVMAP_SHIMS=0``, ``DEVMAP_SHIMS_DISABLE``)?"""
    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.hooks.accelerate.device_map_balance import SHIM
    from devmap_shims.shims.catalog import armed_here
    from devmap_shims.versions import installed_versions

    matrix = load_matrix()
    versions = installed_versions(matrix.distributions())
    armed, _why, switch = armed_here(SHIM, any(matrix.get(bug_id).applies(versions) for bug_id in SHIM.fixes))
    return armed, switch


def _versions() -> Dict[str, Optional[str]]:
    from devmap_shims.versions import installed_versions

    return installed_versions(("torch", "transformers", "accelerate", "bitsandbytes"))


def _report(strategy, meta, layout, budgets, library_map, final_map, armed, gpus, max_memory, path,
            versions) -> Dict[str, Any]:
    from devmap_shims.hooks.accelerate.device_map_balance import SHIM
    from devmap_shims.planning import assess

    low_zero = strategy == "balanced_low_0"

    def judge(device_map):
        units = layout.unit_devices(device_map)
        if units is None:
            return None
        return assess(layout, units, budgets, low_zero, in_order=strategy == "sequential")

    final, library = judge(final_map), judge(library_map)
    applied = [SHIM.id] if armed and final_map != library_map else []
    report: Dict[str, Any] = {
        "schema_version": 1,
        "config": str(path),
        "model_type": getattr(meta.model.config, "model_type", None),
        "model_class": type(meta.model).__name__,
        "parameters": meta.parameters,
        "strategy": strategy,
        "quantization": meta.quantization,
        "dtype": str(meta.dtype).replace("torch.", ""),
        "gpus": {str(i): size for i, size in enumerate(gpus)},
        "max_memory": {str(k): v for k, v in max_memory.items()},
        "device_map": {k: v for k, v in final_map.items()},
        "model_bytes": layout.total,
        "shims_armed": [SHIM.id] if armed else [],
        "shims_applied": applied,
        "versions": versions,
        "modules_per_device": _modules_per_device(final_map),
    }
    report.update(_judged(final, layout.total, meta.quantization))
    if applied and library is not None:
        judged = _judged(library, layout.total, meta.quantization)
        report["without_shims"] = {"device_map": dict(library_map), **judged}
    return report


def _judged(assessment: Any, model_bytes: int, quantization: str) -> Dict[str, Any]:
    """The verdict fields of a report for one map; an offload no placement avoids is "does not fit",
    with the reason (the model's size against what the GPUs offer)."""
    if assessment is None:
        return {"bytes_per_device": {}, "verdict": "unknown", "problems": [], "lower_bound": None,
                "balance_ratio": None, "best_split": None, "offloaded_bytes": 0, "offload_unavoidable": False}
    out: Dict[str, Any] = {
        "bytes_per_device": _bytes(assessment),
        "verdict": assessment.verdict,
        "problems": list(assessment.problems),
        "lower_bound": assessment.lower_bound,
        "balance_ratio": round(assessment.ratio, 4),
        "best_split": assessment.best_split,
        "offloaded_bytes": assessment.offloaded,
        "offload_unavoidable": bool(assessment.unavoidable and assessment.offloaded),
    }
    if out["offload_unavoidable"]:
        out["gpu_room_bytes"] = assessment.gpu_room
        if assessment.verdict == "ok":
            out["verdict"] = "does not fit"
            out["problems"].append(
                f"{assessment.offload_reason(model_bytes)}; add GPUs, raise --max-memory, or quantize")
    if quantization != "none" and assessment.offloaded:
        out["problems"].append(
            "bitsandbytes refuses CPU/disk offload unless llm_int8_enable_fp32_cpu_offload=True is set")
    return out


def _bytes(assessment: Any) -> Dict[str, int]:
    if assessment is None:
        return {}
    return {str(k): int(v) for k, v in assessment.bytes_per_device.items()}


_INDEXED = re.compile(r"^(.*\.)(\d+)$")


def _modules_per_device(device_map: Dict[str, Any]) -> Dict[str, List[str]]:
    """Map entries per device with runs of numbered siblings folded: model.layers.0-6."""
    out: Dict[str, List[str]] = {}
    runs: Dict[str, List[Tuple[str, int, int]]] = {}
    for name, device in device_map.items():
        key = str(device)
        items = runs.setdefault(key, [])
        match = _INDEXED.match(name)
        if match and items and items[-1][0] == match.group(1) and items[-1][2] == int(match.group(2)) - 1:
            prefix, start, _ = items[-1]
            items[-1] = (prefix, start, int(match.group(2)))
        elif match:
            items.append((match.group(1), int(match.group(2)), int(match.group(2))))
        else:
            items.append((name or "(whole model)", -1, -1))
    for key, items in runs.items():
        out[key] = [
            p if s < 0 else (f"{p}{s}" if s == e else f"{p}{s}-{e}") for p, s, e in items
        ]
    return out


# -- --device-map all ---------------------------------------------------------------------------------

#: What every strategy's report shares; the rest goes under "strategies".
_SHARED = ("schema_version", "config", "model_type", "model_class", "parameters", "quantization", "dtype",
           "gpus", "max_memory", "model_bytes", "shims_armed", "shims_switched_off_by", "versions")
_JUDGED = ("device_map", "bytes_per_device", "verdict", "problems", "lower_bound", "balance_ratio",
           "best_split", "offloaded_bytes", "offload_unavoidable")


def _combined(reports: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One report for ``--device-map all``: the shared fields once, then one entry per strategy,
    each with its map as the library computes it under ``without_shims`` (the same map when the
    shims leave it alone or are not armed)."""
    out: Dict[str, Any] = {k: reports[0][k] for k in _SHARED}
    out["strategy"] = "all"
    out["strategies"] = []
    for report in reports:
        entry = {k: v for k, v in report.items() if k not in _SHARED}
        if "without_shims" not in entry:
            entry["without_shims"] = {k: entry[k] for k in _JUDGED}
        out["strategies"].append(entry)
    out["verdicts"] = {r["strategy"]: r["verdict"] for r in reports}
    return out
