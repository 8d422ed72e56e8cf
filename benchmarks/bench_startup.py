"""Start-up cost of devmap-shims.

* interpreter start with the package installed (``.pth`` present, ``DEVMAP_SHIMS`` unset) against
  the same interpreter in a virtualenv without the package: ``python -c pass``, interleaved runs,
  median of at least 30 each; target within 2 % of wall time. The child's CPU time (from
  ``wait4``) is reported beside it, and, where valgrind is installed, the instructions executed,
  which do not depend on what else the machine is doing. A third virtualenv whose only ``.pth``
  line is ``import os`` gives the floor (``floor_ratio``): what any ``.pth`` import line costs,
  since ``site`` opens, reads and compiles it at every start, twice in a virtualenv;
* ``import devmap_shims`` + ``install()`` with no target library imported, timed inside fresh
  interpreters: target under 30 ms;
* ``install()`` after torch/transformers/accelerate/bitsandbytes/diffusers are imported (arming
  happens at once, including the by-name sweep of ``sys.modules``).

Run: ``python benchmarks/bench_startup.py`` (about two minutes).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = 40
START_RUNS = 500  # process starts are ~15 ms and noisy: many interleaved pairs


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("DEVMAP_SHIMS", "VIRTUAL_ENV", "PYTHONPATH"))}


def _venv(path: Path, with_package: bool) -> Path:
    subprocess.run([sys.executable, "-m", "uv", "venv", "-q", "--python", sys.executable, str(path)], check=True, env=_env())
    python = path / "bin" / "python"
    if with_package:  # byte-compiled, as pip installs it
        subprocess.run(
            [sys.executable, "-m", "uv", "pip", "install", "-q", "--compile-bytecode", "--python", str(python), str(REPO)],
            check=True, env=_env(),
        )
    return python


def _time_start(python: Path) -> tuple:
    """Wall and CPU seconds of one ``python -c pass``."""
    env = _env()
    start = time.perf_counter()
    pid = os.posix_spawn(str(python), [str(python), "-c", "pass"], env)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    if status:
        raise RuntimeError(f"{python} -c pass exited with status {status}")
    return wall, usage.ru_utime + usage.ru_stime


def _instructions(python: Path) -> "int | None":
    """Instructions executed by ``python -c pass`` under valgrind (deterministic), or None."""
    env = dict(_env(), PYTHONHASHSEED="0")
    try:
        proc = subprocess.run(
            ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", str(python), "-c", "pass"],
            capture_output=True, text=True, env=env,
        )
    except FileNotFoundError:
        return None
    for line in proc.stderr.splitlines():
        if "I" in line and "refs:" in line:
            return int(line.split("refs:")[1].strip().replace(",", ""))
    return None


IN_PROCESS = (
    "import time, sys; {pre}; t = time.perf_counter(); import devmap_shims; devmap_shims.install(); "
    "print(time.perf_counter() - t)"
)


def _in_process(python: str, pre: str, runs: int) -> list:
    # run outside the checkout: ``-c`` puts the working directory first on sys.path, and the
    # checkout's sources (not byte-compiled under PYTHONDONTWRITEBYTECODE) would shadow the install
    out = []
    for _ in range(runs):
        proc = subprocess.run(
            [python, "-c", IN_PROCESS.format(pre=pre)], capture_output=True, text=True, env=_env(), check=True,
            cwd=tempfile.gettempdir(),
        )
        out.append(float(proc.stdout.strip().splitlines()[-1]))
    return out


def run() -> list:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bare = _venv(Path(tmp) / "bare", with_package=False)
        installed = _venv(Path(tmp) / "with", with_package=True)
        # the least any .pth auto-enable can cost: a venv whose only .pth line is `import os`
        floor = _venv(Path(tmp) / "floor", with_package=False)
        site = next((floor.parents[1] / "lib").glob("python*/site-packages"))
        (site / "floor.pth").write_text("import os\n")
        pythons = {"bare": bare, "floor": floor, "package": installed}
        for python in pythons.values():  # warm the page cache before timing
            for _ in range(5):
                _time_start(python)
        times = {name: [] for name in pythons}
        for i in range(START_RUNS):  # interleaved, reversing the order every round, so drift hits all alike
            for name in (list(pythons) if i % 2 else list(pythons)[::-1]):
                times[name].append(_time_start(pythons[name]))
        for kind, column, unit, scale in (("wall", 0, "ms", 1000), ("CPU time", 1, "ms", 1000)):
            base = statistics.median(t[column] for t in times["bare"])
            low = statistics.median(t[column] for t in times["floor"])
            pkg = statistics.median(t[column] for t in times["package"])
            rows.append(
                {
                    "benchmark": f"interpreter start, .pth present, DEVMAP_SHIMS unset ({kind})",
                    "value": round(pkg * scale, 2), "unit": unit, "baseline": round(base * scale, 2),
                    "ratio": round(pkg / base, 3), "floor_ratio": round(low / base, 3),
                    "target": "<= 1.02x" if column == 0 else "(reported)",
                    "met": pkg / base <= 1.02 if column == 0 else True, "runs": START_RUNS,
                }
            )
        base, low, pkg = _instructions(bare), _instructions(floor), _instructions(installed)
        if base and pkg:
            rows.append(
                {
                    "benchmark": "interpreter start, .pth present, DEVMAP_SHIMS unset (instructions, valgrind)",
                    "value": round(pkg / 1e6, 2), "unit": "M", "baseline": round(base / 1e6, 2),
                    "ratio": round(pkg / base, 4), "floor_ratio": round(low / base, 4) if low else None,
                    "target": "(reported)", "met": True, "runs": 1,
                }
            )
        cold = statistics.median(_in_process(str(installed), "pass", RUNS))
        rows.append(
            {
                "benchmark": "import devmap_shims + install(), no target imported",
                "value": round(cold * 1000, 2), "unit": "ms", "baseline": 0.0, "ratio": None,
                "target": "< 30 ms", "met": cold < 0.030, "runs": RUNS,
            }
        )
    try:
        import torch  # noqa: F401  (only to know whether the stack is here)

        pre = "import torch, transformers, accelerate, diffusers; import transformers.modeling_utils, accelerate.utils.modeling"
        warm = statistics.median(_in_process(sys.executable, pre, 7))
        rows.append(
            {
                "benchmark": "import devmap_shims + install(), target libraries already imported",
                "value": round(warm * 1000, 2), "unit": "ms", "baseline": None, "ratio": None,
                "target": "(reported)", "met": True, "runs": 7,
            }
        )
    except ImportError:
        pass
    return rows


if __name__ == "__main__":
    results = run()
    for row in results:
        print(f"{row['benchmark']:70s} {row['value']:>9} {row['unit']:3s} target {row['target']:10s} {'met' if row['met'] else 'NOT MET'}"
              + (f" (baseline {row['baseline']} {row['unit']}, ratio {row['ratio']}" if row.get("ratio") else "")
              + (f", a .pth of `import os` alone: {row['floor_ratio']})" if row.get("floor_ratio") else ")" if row.get("ratio") else ""))
    print(json.dumps(results, indent=1))
