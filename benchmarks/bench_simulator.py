"""Speed of the simulated multi-GPU machine against plain CPU execution.

Tiny Llama (devmap_shims.testing.models, 2 layers) loaded with ``from_pretrained`` and an
explicit map that splits it over 2 simulated GPUs, greedy ``generate`` of 32 new tokens,
against the same checkpoint on the plain CPU. Runs are interleaved in rounds (one CPU run,
then one simulated run in a fresh simulation after an untimed warm-up), so both sides see the
same machine load; both run with the same number of torch threads (1 by default: tiny ops
gain nothing from more, and a busy CI box makes OpenMP spin). The tokens must match.
Target: the simulation at most 5x slower.

Run: ``python benchmarks/bench_simulator.py [--repeat N] [--threads N]``. ``run()`` returns the
row as a dict.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NEW_TOKENS = 32
TARGET_RATIO = 5.0
def _timed_generate(model: Any, ids: Any) -> tuple:
    from devmap_shims.testing.models import greedy_generate

    start = time.perf_counter()
    tokens = greedy_generate(model, ids, NEW_TOKENS)
    return time.perf_counter() - start, tokens


def run(repeat: int = 7, threads: int = 1) -> Dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import sample_input_ids, save_tiny_causal_lm, two_gpu_split

    repeat = max(repeat, 5)
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
            path = save_tiny_causal_lm("llama", Path(tmp) / "llama")
            ids = sample_input_ids(batch=1, length=8)
            cpu_model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
            device_map = two_gpu_split(cpu_model)
            _, cpu_tokens = _timed_generate(cpu_model, ids)  # warm-up
            cpu_times, sim_times, match = [], [], True
            for _ in range(repeat):
                elapsed, _ = _timed_generate(cpu_model, ids)
                cpu_times.append(elapsed)
                with simulated_gpus(2, memory="2GiB"):
                    sim_model = AutoModelForCausalLM.from_pretrained(
                        path, device_map=device_map, local_files_only=True
                    )
                    sim_ids = ids.to("cuda:0")
                    _timed_generate(sim_model, sim_ids)  # warm-up
                    elapsed, tokens = _timed_generate(sim_model, sim_ids)
                    del sim_model, sim_ids
                sim_times.append(elapsed)
                match = match and torch.equal(tokens, cpu_tokens)
    finally:
        torch.set_num_threads(before_threads)

    sim, cpu = statistics.median(sim_times), statistics.median(cpu_times)
    ratio = sim / cpu
    row = {
        "benchmark": f"simulator: tiny-llama generate {NEW_TOKENS} tok, 2 sim GPUs vs CPU",
        "value": round(sim, 4),
        "unit": "s",
        "baseline": round(cpu, 4),
        "ratio": ratio,
        "target": f"<= {TARGET_RATIO:g}x",
        "met": ratio <= TARGET_RATIO and match,
        "tokens_match": match,
        "runs": repeat,
        "threads": threads,
        "device_map": device_map,
        "sim_times_s": [round(t, 4) for t in sim_times],
        "cpu_times_s": [round(t, 4) for t in cpu_times],
    }
    print(
        f"{row['benchmark']}: simulated {sim * 1000:.1f} ms, CPU {cpu * 1000:.1f} ms "
        f"(median of {repeat}, {threads} thread(s)), ratio {ratio:.2f}x, target {row['target']}, "
        f"tokens {'match' if match else 'DIFFER'}, {'met' if row['met'] else 'NOT met'}"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="interleaved rounds (at least 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on both sides")
    args = parser.parse_args()
    run(repeat=args.repeat, threads=args.threads)


if __name__ == "__main__":
    main()
