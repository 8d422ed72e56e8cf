"""``devmap-shims doctor``: versions, devices, the bugs that apply here and the state of every shim.

By default at most :data:`MAX_LINES` lines of at most 100 columns, whatever the stack: the shims
off because their bugs are not in these versions share one line; ``--verbose`` lists every shim
and each of its targets, ``--json`` everything."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Dict, List, Optional, Set, Tuple

from devmap_shims.cli._output import EXIT_OK, WIDTH, elide, print_json, wrap
from devmap_shims.cli._quiet import libraries_silent
from devmap_shims.shims.config import flag, read_settings
from devmap_shims.shims.summary import shim_lines
from devmap_shims.versions import TARGET_DISTRIBUTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-import", action="store_true", help="do not import the target libraries (faster, shims stay pending)")
    parser.add_argument("--no-devices", action="store_true", help="do not import torch to list GPUs")
    parser.add_argument("--verbose", "-v", action="store_true", help="every bug that applies, every shim and each of its targets")


def _auto_enable_info() -> Dict[str, Any]:
    import site
    import sysconfig

    dirs = set(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    dirs.add(sysconfig.get_paths()["purelib"])
    def found(name: str) -> List[str]:
        return [os.path.join(d, name) for d in sorted(dirs) if os.path.exists(os.path.join(d, name))]

    pth, start = found("devmap_shims.pth"), found("_devmap_shims_start.py")
    value = os.environ.get("DEVMAP_SHIMS")
    return {
        "pth_files": pth,
        "start_modules": start,  # what the .pth and the PEP 829 .start file call
        "DEVMAP_SHIMS": value,
        "active": bool(pth) and bool(start) and bool(flag(value)),
    }


def _devices() -> Dict[str, Any]:
    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401  (doctor may pay the import; install() never does)
        except Exception as exc:
            return {"error": f"torch not importable: {type(exc).__name__}: {exc}"}
    import torch

    info: Dict[str, Any] = {
        "torch_cuda_build": torch.version.cuda,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    try:
        available = torch.cuda.is_available()
        info["cuda_available"] = available
        info["gpus"] = (
            [
                {"index": i, "name": torch.cuda.get_device_name(i),
                 "total_memory": torch.cuda.get_device_properties(i).total_memory}
                for i in range(torch.cuda.device_count())
            ]
            if available
            else []
        )
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


def run(args: argparse.Namespace) -> int:
    import importlib
    import itertools

    from devmap_shims.compat_matrix import row_to_dict
    from devmap_shims.shims.catalog import builtin_shims, shim_of_rows
    from devmap_shims.shims.engine import ENGINE

    ENGINE.install()
    ENGINE.load_builtins()
    if not args.no_import:
        # the warnings the libraries log or raise as they are imported (a missing optional kernel, a
        # processor without torchvision) are theirs, not the report's, and a shim that fails to arm
        # is in the report; their errors pass, and everything does when DEVMAP_SHIMS_LOG asks for logs
        with libraries_silent(read_settings().log_level is None, up_to=logging.WARNING):
            versions = ENGINE.registry.versions()
            modules = sorted({t.target.module for t in ENGINE.registry.target_entries()})
            for name in modules:
                top = name.split(".")[0]
                if versions.get(top) is None and top != "transformers":
                    continue
                try:
                    importlib.import_module(name)
                except Exception:
                    pass  # absent or failing target: its entry tells
    # the GPUs first: listing them imports torch, which the report's imported_now and shims then show;
    # what torch says about its GPUs (a driver too old, an unsupported GPU) is shown
    devices = _devices() if not args.no_devices else None
    data = ENGINE.status()
    matrix = ENGINE.registry.matrix()
    # the installed shims first (a plugin's included), then the built-in ones, which the registry
    # lacks when the kill switch is on: a row's shim is the same whatever switches are set
    installed = (e.shim for e in ENGINE.registry.shims.values())
    builtins, broken = builtin_shims()
    shim_of = shim_of_rows(itertools.chain(installed, builtins))
    versions = data["versions"]
    applicable = [r for r in matrix.rows if r.applies(versions)]
    data["applicable_rows"] = [row_to_dict(r, shim_of.get(r.id)) for r in applicable]
    data["broken_shims"] = broken  # built-in shim modules that fail to import: exit 1, as demo
    data["auto_enable"] = _auto_enable_info()
    data["devices"] = devices
    data["module_versions"] = {
        name: getattr(sys.modules[name], "__version__", None)
        for name in TARGET_DISTRIBUTIONS
        if name in sys.modules
    }
    if args.json:
        print_json(data)
    else:
        print("\n".join(verbose_report(data) if args.verbose else report(data)))
    return 1 if broken else EXIT_OK


#: The most lines ``doctor`` prints without ``--verbose``, whatever the stack and the shims.
MAX_LINES = 30


def _heading(data: Dict[str, Any]) -> List[str]:
    """Versions, devices and auto-enable, each on a line (two at most)."""
    versions = ", ".join(f"{name} {version or '-'}" for name, version in data["versions"].items())
    lines = wrap(versions, WIDTH, "  versions:    ", hang=" " * 15, max_lines=2)
    lines += [elide(line[15:], WIDTH, line[:15]) for line in _device_lines(data["devices"])]
    auto = data["auto_enable"]
    lines.append(elide(
        f"{'active' if auto['active'] else 'inactive'} "
        f"({'DEVMAP_SHIMS=' + auto['DEVMAP_SHIMS'] if auto['DEVMAP_SHIMS'] else 'DEVMAP_SHIMS unset'}; "
        f".pth {'present' if auto['pth_files'] else 'missing'}; "
        f"start module {'present' if auto['start_modules'] else 'missing: reinstall devmap-shims'})", WIDTH,
        "  auto-enable: "))
    return lines


def _device_lines(dev: Optional[Dict[str, Any]]) -> List[str]:
    """One line for no GPU or an error; otherwise a line per kind of GPU (three kinds at most)."""
    if dev is None:
        return ["  devices:     not looked at (--no-devices)"]
    if "error" in dev and "gpus" not in dev:
        return [f"  devices:     {dev['error']}"]
    visible = dev.get("CUDA_VISIBLE_DEVICES")
    where = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    gpus = dev.get("gpus") or []
    if not gpus:
        error = f"; {dev['error']}" if dev.get("error") else ""
        build = dev.get("torch_cuda_build")
        return [f"  devices:     no CUDA GPU available (torch built for CUDA {build}; {where}){error}"]
    kinds: Dict[Tuple[str, int], List[int]] = {}
    for gpu in gpus:
        kinds.setdefault((gpu["name"], gpu["total_memory"]), []).append(gpu["index"])
    lines = []
    for i, ((name, memory), indices) in enumerate(kinds.items()):
        label = "  devices:     " if i == 0 else " " * 15
        at = f"cuda:{indices[0]}" if len(indices) == 1 else f"cuda:{indices[0]}..{indices[-1]}"
        lines.append(f"{label}{len(indices)} x {name}, {memory / 2**30:.1f} GiB each ({at})")
    if len(lines) > 3:
        lines = lines[:2] + [f"{' ' * 15}and {len(kinds) - 2} more kinds of GPU (--json lists them)"]
    return lines


def report(data: Dict[str, Any], max_lines: int = MAX_LINES) -> List[str]:
    """What a person reads at a glance, in at most ``max_lines`` lines of at most ``WIDTH``
    columns: versions, devices, how many known bugs apply and how many an active shim fixes, a
    line per shim that is active, pending or failed (the shims off because their bugs are not in
    these versions share one line), and the bugs that apply with no active shim. ``data`` is what
    ``doctor --json`` prints."""
    shims = data["shims"]
    rows = data["applicable_rows"]
    active = {s["id"] for s in shims if s["state"] == "active"}
    warns_only = active & _warns_only(shims)
    fixed = [r for r in rows if r["shim"] in active - warns_only]
    warned = [r for r in rows if r["shim"] in warns_only]
    unfixed = [r for r in rows if r["shim"] not in active - warns_only]
    counts = {state: sum(1 for s in shims if s["state"] == state)
              for state in ("active", "pending", "failed", "skipped")}
    lines = wrap(
        f"devmap-shims doctor: {len(rows)} known {'bugs apply' if len(rows) != 1 else 'bug applies'} "
        "to your stack; "
        f"{len(fixed)} fixed by active shims" + (f", {len(warned)} warned about" if warned else ""),
        WIDTH, hang="  ")
    lines += _heading(data)
    tail: List[str] = []
    if unfixed:
        def state(shim_id: str) -> str:
            return "warns only" if shim_id in warns_only else _state_of(data, shim_id)

        names = ", ".join(r["id"] + (f" (shim {r['shim']} {state(r['shim'])})" if r["shim"] else "")
                          for r in unfixed)
        tail += ["", f"Bugs here that no active shim fixes ({len(unfixed)}); "
                     "`devmap-shims explain ID` for the workaround:"]
        tail += wrap(names, WIDTH, "  ", max_lines=3)
    warnings = data["warnings"]
    if warnings:
        tail.append("")
        tail += [elide(w, WIDTH, "warning: ") for w in warnings[:2]]
        if len(warnings) > 2:
            tail.append(f"and {len(warnings) - 2} more warnings (--json lists them)")
    tail += ["", "Each shim's targets: --verbose. Tensors on the wrong device in your model or pipeline:",
             "  devmap_shims.check_devices(model_or_pipe)"]
    killed = f" ({KILLED})" if data.get("killed") else ""
    broken = data.get("broken_shims") or ()
    plural = "s" if len(broken) != 1 else ""
    modules = f"; {len(broken)} shim module{plural} failed to import" if broken else ""
    counted = (f"Shims ({len(shims)}): {counts['active']} active, {counts['pending']} pending, "
               f"{counts['failed']} failed, {counts['skipped']} off{killed}{modules}")
    head = [""] + wrap(counted, WIDTH, hang="  ")
    room = max_lines - len(lines) - len(tail) - len(head)
    lines += head + shim_lines(shims, WIDTH, room=room, more="(--verbose lists them)")
    return lines + tail


def _warns_only(shims: List[Dict[str, Any]]) -> Set[str]:
    """The ids of the shims that warn about their rows and do not repair them (``Shim(repairs=False)``)."""
    return {s["id"] for s in shims if not s.get("repairs", True)}


#: The widest column of shim ids in ``doctor --verbose``.
NAME_COLUMN = 44

#: How doctor names the state of every shim while ``DEVMAP_SHIMS=0`` is set.
KILLED = "kill switch DEVMAP_SHIMS=0"


def _state_of(data: Dict[str, Any], shim_id: str) -> str:
    state = next((s["state"] for s in data["shims"] if s["id"] == shim_id), None)
    if state is None:
        return "off" if data.get("killed") else "missing"  # killed: the Shims line says why
    return "off" if state == "skipped" else state


def verbose_report(data: Dict[str, Any]) -> List[str]:
    """Everything: each applicable row, each shim with each of its targets, within ``WIDTH``."""
    rows = data["applicable_rows"]
    lines = ["devmap-shims doctor --verbose"] + _heading(data)
    lines += ["", f"Known bugs that apply here ({len(rows)}):"]
    warns_only = _warns_only(data["shims"])
    for row in rows:
        shim = row["shim"]
        text = f"{row['id']} [{shim or 'no shim: ' + row['workaround']}]"
        if shim in warns_only:
            text = f"{row['id']} [{shim}, which warns only: {row['workaround']}]"
        lines += wrap(text, WIDTH, "  ", hang="      ", max_lines=2)
    lines += ["", f"Shims: none installed ({KILLED})" if data.get("killed") else "Shims:"]
    # the longest id sets the column (a plugin's long id at most NAME_COLUMN wide; past it, that row
    # alone runs over)
    name = min(max([28] + [len(shim["id"]) for shim in data["shims"]]), NAME_COLUMN)
    for shim in data["shims"]:
        state = "OFF" if shim["state"] == "skipped" else shim["state"].upper()
        prefix = f"  {shim['id']:{name}s} {state:8s}"
        lines += wrap(shim["applicability"] or "", WIDTH, prefix, hang=" " * (name + 12), max_lines=2)
        for target in shim["targets"]:
            text = f"{target['target']}: {target['state']}"
            if target["state"] != "active":
                text += f" ({target['reason']})"
            elif target["rebound"]:
                text += f" (+{len(target['rebound'])} by-name copies rebound)"
            lines += wrap(text, WIDTH, "      ", hang="          ", max_lines=2)
    lines += [elide(w, WIDTH, "warning: ") for w in data["warnings"]]
    lines += ["", "Tensors on the wrong device in your model or pipeline:",
              "  devmap_shims.check_devices(model_or_pipe)"]
    return lines
