"""``devmap-shims doctor``: versions, devices, the bugs that apply here and the state of every shim."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List

from devmap_shims.cli._output import EXIT_OK, print_json
from devmap_shims.shims.config import flag
from devmap_shims.versions import TARGET_DISTRIBUTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-import", action="store_true", help="do not import the target libraries (faster, shims stay pending)")
    parser.add_argument("--no-devices", action="store_true", help="do not import torch to list GPUs")


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

    from devmap_shims.compat_matrix import row_to_dict
    from devmap_shims.shims.catalog import shim_of_rows
    from devmap_shims.shims.engine import ENGINE

    ENGINE.install()
    ENGINE.load_builtins()
    if not args.no_import:
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
    data = ENGINE.status()
    matrix = ENGINE.registry.matrix()
    shim_of = shim_of_rows(e.shim for e in ENGINE.registry.shims.values())
    versions = data["versions"]
    applicable = [r for r in matrix.rows if r.applies(versions)]
    data["applicable_rows"] = [row_to_dict(r, shim_of.get(r.id)) for r in applicable]
    data["auto_enable"] = _auto_enable_info()
    data["devices"] = _devices() if not args.no_devices else None
    data["module_versions"] = {
        name: getattr(sys.modules[name], "__version__", None)
        for name in TARGET_DISTRIBUTIONS
        if name in sys.modules
    }
    if args.json:
        print_json(data)
        return EXIT_OK
    print("devmap-shims doctor")
    print("\nInstalled versions:")
    for name, version in versions.items():
        print(f"  {name:14s} {version or '-'}")
    if data["devices"] is not None:
        dev = data["devices"]
        print("\nDevices:")
        if "error" in dev and "gpus" not in dev:
            print(f"  {dev['error']}")
        else:
            print(f"  torch CUDA build: {dev.get('torch_cuda_build')}; CUDA available: {dev.get('cuda_available')}")
            for gpu in dev.get("gpus", []):
                print(f"  cuda:{gpu['index']}  {gpu['name']}  {gpu['total_memory'] / 2**30:.1f} GiB")
    print(f"\nKnown bugs that apply here ({len(applicable)}):")
    for row in applicable:
        print(f"  {row.id}  [{shim_of.get(row.id) or 'no shim: ' + row.workaround[:60]}]")
    print("\nShims:")
    for shim in data["shims"]:
        print(f"  {shim['id']:28s} {shim['state'].upper():8s} {shim['applicability'][:100]}")
        for target in shim["targets"]:
            line = f"      {target['target']}: {target['state']}"
            if target["state"] != "active":
                line += f" ({target['reason'][:110]})"
            elif target["rebound"]:
                line += f" (+{len(target['rebound'])} by-name copies rebound)"
            print(line)
    auto = data["auto_enable"]
    print(
        f"\nAuto-enable: {'active' if auto['active'] else 'inactive'} "
        f"(DEVMAP_SHIMS={auto['DEVMAP_SHIMS'] or 'unset'}; .pth {'present' if auto['pth_files'] else 'missing'}; "
        f"start module {'present' if auto['start_modules'] else 'missing: reinstall devmap-shims'})"
    )
    for warning in data["warnings"]:
        print(f"warning: {warning}")
    print("\nTo find tensors left on the wrong device in your own model or pipeline:")
    print("  devmap_shims.check_devices(model_or_pipe)")
    return EXIT_OK
