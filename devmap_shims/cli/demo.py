"""``devmap-shims demo``: replay the known bugs on simulated GPUs, without and with the shims.

Needs no GPU, no network and no weights: every scenario builds a tiny model from a config in code
and runs it on the simulated multi-GPU machine of :mod:`devmap_shims.testing`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List

from devmap_shims.cli._output import UsageError, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--all", action="store_true", help="also replay rows that do not apply to the installed stack")
    parser.add_argument("ids", nargs="*", metavar="ID", help="only these matrix rows")


def collect(ids: List[str], include_all: bool, progress: Any = None) -> List[Dict[str, Any]]:
    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.scenarios import all_scenarios
    from devmap_shims.scenarios.replay import replay
    from devmap_shims.shims.catalog import builtin_shims, shim_of_rows
    from devmap_shims.versions import installed_versions

    matrix = load_matrix()
    scenarios = all_scenarios()
    shim_of = shim_of_rows(builtin_shims()[0])
    versions = installed_versions(matrix.distributions())
    for bug_id in ids:
        matrix.get(bug_id)  # KeyError with suggestions for a typo
    rows = []
    for row in matrix.rows:
        if ids and row.id not in ids:
            continue
        applies, why = row.applicability(versions)
        if not (applies or include_all or ids):
            continue
        shim = shim_of.get(row.id)
        for item in scenarios.get(row.id, []):
            if progress:
                progress(f"replaying {row.id} ({item.name}) ...")
            without = replay(item, shims=False)
            with_shims = replay(item, shims=True, shim_id=shim) if shim else None
            rows.append(
                {
                    "bug_id": row.id,
                    "scenario": item.name,
                    "title": item.title,
                    "affected_here": applies,
                    "applicability": why,
                    "shim": shim,
                    "without_shims": without.as_dict(),
                    "with_shims": with_shims.as_dict() if with_shims else None,
                    "verdict": _verdict(applies, without, with_shims),
                }
            )
    return rows


def _verdict(applies: bool, without: Any, with_shims: Any) -> str:
    if without.unavailable:
        return "unavailable"
    if applies:
        if without.ok:
            return "not reproduced"  # the row says affected, the stack disagrees
        if with_shims is None:
            return "reproduced (no shim: see workaround)"
        return "fixed" if with_shims.ok else "NOT FIXED"
    ok = without.ok and (with_shims is None or with_shims.ok)
    return "ok (not affected)" if ok else "UNEXPECTED FAILURE"


def _quiet_libraries() -> None:
    """Progress bars and library warnings would drown the table."""
    import logging
    import os

    for name, value in (
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("DIFFUSERS_VERBOSITY", "error"),
        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
        ("HF_HUB_OFFLINE", "1"),
    ):
        os.environ.setdefault(name, value)
    for name in ("transformers", "diffusers", "accelerate", "bitsandbytes", "huggingface_hub", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore")
    try:  # tiny models: one thread is faster than contending for two cores
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


def run(args: argparse.Namespace) -> int:
    _quiet_libraries()

    def progress(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    try:
        rows = collect(list(args.ids), args.all, progress)
    except KeyError as exc:
        raise UsageError(str(exc).strip("'\"")) from None
    bad = [r for r in rows if r["verdict"] in ("NOT FIXED", "UNEXPECTED FAILURE", "not reproduced")]
    if args.json:
        json.dump({"schema_version": 1, "rows": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 1 if bad else 0
    if not rows:
        print("No known bug with a replayable scenario applies to the installed stack (use --all to replay them anyway).")
        return 0
    cells = []
    for r in rows:
        with_shims = r["with_shims"]
        cells.append(
            [
                r["bug_id"],
                "yes" if r["affected_here"] else "no",
                _cut(r["without_shims"]["detail"] if not r["without_shims"]["ok"] else "ok: " + r["without_shims"]["detail"]),
                _cut(("ok: " if with_shims["ok"] else "FAILED: ") + with_shims["detail"]) if with_shims else "-",
                r["verdict"],
                f"{r['without_shims']['seconds'] + (with_shims['seconds'] if with_shims else 0):.1f}s",
            ]
        )
    print(table(cells, ["bug id", "affected here?", "without shims", "with shims", "verdict", "time"]))
    print(f"\n{len(rows)} scenario(s); {len(bad)} problem(s). `devmap-shims explain ID` tells more about a row.")
    return 1 if bad else 0


def _cut(text: str, width: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
