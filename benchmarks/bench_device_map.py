"""Cost and quality of the device-map-balance shim.

1. Time: computing the device map ``from_pretrained`` computes for an 80-layer 70B-class model
   (Llama-3-70B) on 8 GPUs, with the library alone and through the shim, median of repeated runs
   (interleaved, so both see the same machine load). Targets: the shim adds under 1 s and stays
   under 2x the library's own time.
2. Quality: for every case of the device-map corpus (tests/planning/device_map_corpus.py), the
   balance ratio (busiest GPU / lower bound) of the library's map and of the shim's, and the
   GPUs each uses.

Run: ``python benchmarks/bench_device_map.py [--repeat N]``. ``run()`` returns the rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "planning"))

TIMING_CASES = (
    # (label, model, gpus, GiB per GPU, quantization, strategy)
    ("llama-3-70b 4bit 8x23GiB auto (repaired)", "llama-3-70b", 8, 23, "4bit", "auto"),
    ("llama-3-70b bf16 8x80GiB auto (kept)", "llama-3-70b", 8, 80, "none", "auto"),
)


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timing_rows(repeat: int = 15) -> List[Dict[str, Any]]:
    from device_map_corpus import Case, config_for

    from devmap_shims.cli import device_map_step as stack

    rows = []
    for label, model, n, gib, quant, strategy in TIMING_CASES:
        case = Case(model, n, gib, quantization=quant, strategy=strategy)
        meta = stack.build_meta_model(config_for(model), "bfloat16", quant)
        mm = case.max_memory()
        # warm up both paths (first calls import and cache signatures)
        stack.device_map_step(meta, strategy, mm, shim=False)
        stack.device_map_step(meta, strategy, mm, shim=True)
        plain, shimmed = [], []
        for _ in range(repeat):
            plain.append(_median_time(lambda: stack.device_map_step(meta, strategy, mm, shim=False), 1))
            shimmed.append(_median_time(lambda: stack.device_map_step(meta, strategy, mm, shim=True), 1))
        p, s = statistics.median(plain), statistics.median(shimmed)
        rows.append({
            "case": label,
            "library_s": p,
            "with_shim_s": s,
            "added_s": s - p,
            "ratio": s / p if p else float("nan"),
            "meets_target": (s - p) < 1.0 and s < 2 * p,
        })
    return rows


def ratio_rows() -> List[Dict[str, Any]]:
    from device_map_checks import budgets_for, check_map, library_sizes
    from device_map_corpus import CASES, ArchitectureMissing, config_for

    from devmap_shims.cli import device_map_step as stack

    metas: Dict[Any, Any] = {}
    rows = []
    for case in CASES:
        key = (case.model, case.quantization)
        if key not in metas:
            try:
                metas[key] = stack.build_meta_model(config_for(case.model), "bfloat16", case.quantization)
            except ArchitectureMissing as exc:
                metas[key] = None
                print(f"skipping {case.model}: {exc}")
        meta = metas[key]
        if meta is None:
            continue
        sizes = library_sizes(meta, case.strategy)
        budgets = budgets_for(meta, case.max_memory())
        without = check_map(meta, stack.device_map_step(meta, case.strategy, case.max_memory(), shim=False),
                            budgets, case.strategy, sizes)
        with_shim = check_map(meta, stack.device_map_step(meta, case.strategy, case.max_memory(), shim=True),
                              budgets, case.strategy, sizes)
        rows.append({
            "case": case.id,
            "library_ratio": without.ratio,
            "shim_ratio": with_shim.ratio,
            "best_contiguous": with_shim.optimum_ratio,
            "library_gpus": len(without.gpus_used),
            "shim_gpus": len(with_shim.gpus_used),
            "library_rules_broken": len(without.violations),
            "shim_rules_broken": len(with_shim.violations),
            "exempt": case.ratio_exemption is not None,
        })
    return rows


def _table(rows: List[Dict[str, Any]], columns: List[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}"
        return "-" if v is None else str(v)

    cells = [columns] + [[fmt(r[c]) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells)


def run(repeat: int = 15) -> List[Dict[str, Any]]:
    import logging

    logging.getLogger("devmap_shims").setLevel(logging.WARNING)
    import transformers

    from devmap_shims.versions import installed_versions

    print("versions:", {k: v for k, v in installed_versions().items() if v})
    timing = timing_rows(repeat)
    print(f"\nDevice-map computation, median of {repeat} interleaved runs (seconds)")
    print(_table(timing, ["case", "library_s", "with_shim_s", "added_s", "ratio", "meets_target"]))
    ratios = ratio_rows()
    print("\nBalance ratio (busiest GPU / max(total / GPUs, largest block)) per corpus case")
    print(_table(ratios, ["case", "library_ratio", "shim_ratio", "best_contiguous", "library_gpus", "shim_gpus",
                          "library_rules_broken", "shim_rules_broken"]))
    scored = [r["shim_ratio"] for r in ratios if not r["exempt"]]
    print(f"\nworst shim ratio over {len(scored)} scored cases: {max(scored):.3f} "
          f"(transformers {transformers.__version__})")
    return [{"kind": "timing", **r} for r in timing] + [{"kind": "ratio", **r} for r in ratios]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    run(parser.parse_args().repeat)
