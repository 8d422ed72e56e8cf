"""Run every benchmark, print one table and write benchmarks/results.json.

    python benchmarks/run_all.py            # all of them (several minutes on 2 cores)
    python benchmarks/run_all.py startup    # only the named ones (their rows replace the old ones)

Each benchmark module has a ``run()`` returning rows (dicts with at least ``benchmark``,
``value``, ``unit``, ``target`` and ``met``); measurements are side by side in one run and
reported as medians and ratios, never as timed tests.
"""

from __future__ import annotations

import importlib
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ("startup", "device_map", "pipeline_to", "generate", "int8", "simulator")


def machine() -> dict:
    import os

    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    from devmap_shims.versions import installed_versions

    info["versions"] = installed_versions()
    return info


def _normalise(row: dict, group: str) -> dict:
    """Give every row the common columns (the device-map benchmark reports per-case fields)."""
    row.setdefault("group", group)
    if "benchmark" not in row and row.get("kind") == "timing":
        row.update(
            benchmark=f"device map, {row['case']}: time added by the shim",
            value=round(row["added_s"], 3), unit="s", baseline=round(row["library_s"], 3),
            ratio=row["ratio"], target="< 1 s and < 2x", met=bool(row.get("meets_target")),
        )
    elif "benchmark" not in row and row.get("kind") == "ratio":
        ratio = row.get("shim_ratio")
        row.update(
            benchmark=f"balance ratio {row['case']}",
            value=ratio, unit="x", baseline=row.get("library_ratio"), ratio=None,
            target="<= 1.10", met=ratio is None or ratio <= 1.10 or ratio == row.get("best_contiguous"),
        )
    return row


def main(names) -> int:
    sys.path.insert(0, str(HERE))
    rows, failures = [], []
    for name in names:
        start = time.perf_counter()
        print(f"== {name} ...", file=sys.stderr, flush=True)
        try:
            module = importlib.import_module(f"bench_{name}")
            result = module.run()
        except Exception as exc:  # one broken benchmark must not hide the others
            failures.append({"benchmark": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for row in result if isinstance(result, list) else result.get("rows", [result]):
            rows.append(_normalise(dict(row), name))
        print(f"   {time.perf_counter() - start:.1f}s", file=sys.stderr)
    width = max([len(str(r.get("benchmark", ""))) for r in rows] + [20])
    print(f"{'benchmark':{width}}  {'value':>12}  {'baseline':>10}  {'ratio':>7}  target        met")
    for r in rows:
        value = f"{r.get('value')} {r.get('unit', '')}"
        ratio = r.get("ratio")
        print(
            f"{str(r.get('benchmark')):{width}}  {value:>12}  {str(r.get('baseline', '')):>10}  "
            f"{(f'{ratio:.3f}' if isinstance(ratio, (int, float)) else '-'):>7}  {str(r.get('target', '')):12}  "
            f"{'yes' if r.get('met') else 'NO'}"
        )
    for f in failures:
        print(f"FAILED {f['benchmark']}: {f['error']}")
    out = {"machine": machine(), "rows": rows, "failures": failures}
    results = HERE / "results.json"
    if set(names) != set(BENCHMARKS) and results.exists():  # a partial run replaces only its own groups
        kept = [r for r in json.loads(results.read_text()).get("rows", []) if r.get("group") not in names]
        order = {name: i for i, name in enumerate(BENCHMARKS)}
        out["rows"] = sorted(kept + rows, key=lambda r: order.get(r.get("group"), len(order)))
    results.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"\nwrote {results}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or BENCHMARKS))
