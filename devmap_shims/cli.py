"""The ``devmap-shims`` command (also ``python -m devmap_shims``).

Exit codes: 0 success, 1 the command ran and found a problem (``demo`` with a failing scenario),
2 usage error (unknown command, bad arguments, unreadable input).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A one-line message for the user; the command exits with status 2."""


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def _table(rows: List[List[str]], headers: List[str]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(str(c))) for w, c in zip(widths, row)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


# -- matrix / explain ------------------------------------------------------------------------------
def _matrix_rows(args: argparse.Namespace) -> List[Any]:
    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.shims import catalog
    from devmap_shims.versions import installed_versions

    extra: List[Dict[str, Any]] = []
    if os.environ.get("DEVMAP_SHIMS_NO_PLUGINS", "").strip() not in ("1", "true", "yes", "on"):
        extra, problems = catalog.plugin_rows()
        for problem in problems:
            print(f"devmap-shims: warning: {problem}", file=sys.stderr)
    matrix = load_matrix(extra_rows=extra)
    rows = list(matrix.rows)
    if args.library:
        libraries = {r.library for r in rows}
        if args.library not in libraries:
            raise UsageError(f"--library {args.library!r} matches no row; libraries: {', '.join(sorted(libraries))}")
        rows = [r for r in rows if r.library == args.library]
    if args.applicable:
        names = sorted({d for r in rows for d in r.affected})
        versions = installed_versions(names)
        rows = [r for r in rows if r.applies(versions)]
    return rows


def cmd_matrix(args: argparse.Namespace) -> int:
    from devmap_shims.compat_matrix import render_markdown, row_to_dict

    if args.markdown:
        # COMPAT.md documents the built-in rows only, whatever plugins this machine has.
        from devmap_shims.compat_matrix import load_matrix

        sys.stdout.write(render_markdown(load_matrix()))
        return EXIT_OK
    rows = _matrix_rows(args)
    if args.json:
        _print_json({"schema_version": 1, "rows": [row_to_dict(r) for r in rows]})
        return EXIT_OK
    table = [
        [r.id, r.library, r.affected_text, r.fixed_in_text, r.shim or "workaround"]
        for r in rows
    ]
    print(_table(table, ["id", "library", "affected", "fixed in", "shim"]))
    print(f"\n{len(rows)} row(s). `devmap-shims explain ID` shows one in full.")
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    from devmap_shims.compat_matrix import load_matrix, row_to_dict
    from devmap_shims.versions import installed_versions

    matrix = load_matrix()
    try:
        row = matrix.get(args.id)
    except KeyError as exc:
        raise UsageError(str(exc).strip("'\"")) from None
    versions = installed_versions(sorted(row.affected))
    applies, why = row.applicability(versions)
    if args.json:
        data = row_to_dict(row)
        data["applies_here"] = applies
        data["applicability"] = why
        _print_json(data)
        return EXIT_OK
    print(f"{row.id}: {row.title}")
    print(f"  library:     {row.library}")
    print(f"  affected:    {row.affected_text}")
    print(f"  here:        {'AFFECTED' if applies else 'not affected'} ({why})")
    print(f"  fixed in:    {row.fixed_in_text}")
    if row.shim:
        print(f"  shim:        {row.shim}")
    if getattr(row, "workaround", None):
        print(f"  workaround:  {row.workaround}")
    print(f"  symptom:     {row.symptom}")
    print(f"  root cause:  {row.root_cause}")
    for url in row.upstream_urls:
        print(f"  upstream:    {url}")
    if isinstance(row.fixed_in, dict) and row.fixed_in:
        upgrades = ", ".join(f"{k}>={v}" for k, v in row.fixed_in.items())
        what = "drop this shim" if row.shim else "drop the workaround"
        print(f"  fixed in {row.fixed_in_text}: upgrade ({upgrades}) to {what}.")
    else:
        print(f"  {row.fixed_in_text}: keep the {'shim' if row.shim else 'workaround'}.")
    return EXIT_OK


# -- doctor ----------------------------------------------------------------------------------------
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
        "active": bool(pth) and bool(start) and (value or "").strip().lower() in ("1", "true", "yes", "on"),
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


def cmd_doctor(args: argparse.Namespace) -> int:
    import importlib

    import devmap_shims
    from devmap_shims.compat_matrix import row_to_dict

    devmap_shims.install()
    if not args.no_import:
        from devmap_shims.shims.registry import REGISTRY

        modules = sorted({t.target.module for e in REGISTRY.shims.values() for t in e.targets})
        for name in modules:
            top = name.split(".")[0]
            if devmap_shims.status()["versions"].get(top) is None and top != "transformers":
                continue
            try:
                importlib.import_module(name)
            except Exception:
                pass  # absent or failing target: its entry tells
    data = devmap_shims.status()
    from devmap_shims.shims.registry import REGISTRY

    matrix = REGISTRY.matrix()
    versions = data["versions"]
    applicable = [r for r in matrix.rows if r.applies(versions)]
    data["applicable_rows"] = [row_to_dict(r) for r in applicable]
    data["auto_enable"] = _auto_enable_info()
    data["devices"] = _devices() if not args.no_devices else None
    data["module_versions"] = {
        name: getattr(sys.modules[name], "__version__", None)
        for name in ("torch", "transformers", "accelerate", "bitsandbytes", "diffusers")
        if name in sys.modules
    }
    if args.json:
        _print_json(data)
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
        print(f"  {row.id}  [{row.shim or 'no shim: ' + (row.workaround or '')[:60]}]")
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


# -- run -------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("run needs a command: devmap-shims run -- python serve.py")
    env = dict(os.environ)
    env["DEVMAP_SHIMS"] = "1"
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        raise UsageError(f"cannot run {command[0]!r}: {exc.strerror}") from None
    return EXIT_OK  # pragma: no cover


# -- parser ----------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="devmap-shims", description="Keep the Hugging Face stack placing tensors on the right GPU.")
    parser.add_argument("--version", action="version", version="devmap-shims 0.1.0")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("doctor", help="versions, devices, applicable bugs and the state of every shim")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-import", action="store_true", help="do not import the target libraries (faster, shims stay pending)")
    p.add_argument("--no-devices", action="store_true", help="do not import torch to list GPUs")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("matrix", help="list the known bugs")
    p.add_argument("--applicable", action="store_true", help="only rows that apply to the installed versions")
    p.add_argument("--library", metavar="L", help="only rows about library L")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--markdown", action="store_true", help="COMPAT.md as generated from the matrix")
    p.set_defaults(func=cmd_matrix)

    p = sub.add_parser("explain", help="one known bug in full, with its upstream links and fix")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("run", help="run a command with DEVMAP_SHIMS=1", prefix_chars="\0")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_run)

    for module_name, name, help_text in (
        ("devmap_shims.planning.plan_command", "plan", "the device map from_pretrained would compute, with and without the shims"),
        ("devmap_shims.demo", "demo", "replay the known bugs on simulated GPUs, without and with the shims"),
    ):
        try:
            import importlib

            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        p = sub.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"devmap-shims {args.command_name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `devmap-shims matrix | head`
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
