"""Start-up cost of devmap-shims.

* interpreter start with the package installed (``.pth`` present, ``DEVMAP_SHIMS`` unset) against
  the same interpreter without the package: ``python -c pass``, one start of each per round in a
  shuffled order, the ratio taken within each round and its median over the rounds reported
  (target within 2 % of wall time), with a bootstrap 95 % interval.
  Two layouts, since ``site`` treats them differently: a virtualenv, where it executes every
  ``.pth`` line twice (``site.venv()`` and ``site.main()`` both process the virtualenv's
  site-packages: python/cpython#75723), and a base install (a Docker image's or conda's own
  interpreter), where it executes them once. The base install is a copy of this interpreter's
  binary beside links to its standard library, with an empty site-packages of its own. The
  child's CPU time (from ``wait4``) is reported beside the wall time and, where valgrind is
  installed, the instructions executed, which do not depend on what else the machine is doing.
  A third interpreter of each layout whose only ``.pth`` line is ``import os`` gives the floor
  (``floor_ratio``): what any ``.pth`` import line costs, since ``site`` opens, reads and compiles
  it at every start;
* ``import devmap_shims`` + ``install()`` with no target library imported, timed inside fresh
  interpreters: target under 30 ms;
* ``install()`` after torch/transformers/accelerate/bitsandbytes/diffusers are imported (arming
  happens at once, including the by-name sweep of ``sys.modules``).

Run: ``python benchmarks/bench_startup.py`` (about three minutes).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = 40
START_RUNS = 1000  # process starts are ~10 ms and noisy: many interleaved rounds
FLOOR_PTH = "import os\n"


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("DEVMAP_SHIMS", "VIRTUAL_ENV", "PYTHONPATH"))}


def _install(python: Path) -> None:
    """Install the package byte-compiled, as pip does."""
    subprocess.run(
        [sys.executable, "-m", "uv", "pip", "install", "-q", "--compile-bytecode", "--break-system-packages",
         "--python", str(python), str(REPO)],
        check=True, env=_env(),
    )


def _site_packages(python: Path) -> Path:
    return next((python.parents[1] / "lib").glob("python*/site-packages"))


def _venv(path: Path, kind: str) -> Path:
    subprocess.run([sys.executable, "-m", "uv", "venv", "-q", "--python", sys.executable, str(path)], check=True, env=_env())
    return _fill(path / "bin" / "python", kind)


def _base_install(path: Path, kind: str) -> Path:
    """An interpreter laid out as a base install (no pyvenv.cfg): a copy of this interpreter's binary
    in ``bin``, links to each entry of its standard library and its own empty site-packages, so
    that ``site`` processes that site-packages once, as in a Docker image or a conda environment."""
    stdlib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    real = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    (path / "bin").mkdir(parents=True)
    lib = path / "lib" / stdlib.name
    (lib / "site-packages").mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name != "site-packages":
            (lib / entry.name).symlink_to(entry)
    for shared in stdlib.parent.glob("libpython*"):  # for a binary that finds it through $ORIGIN/../lib
        (path / "lib" / shared.name).symlink_to(shared)
    python = path / "bin" / real.name
    python.write_bytes(real.read_bytes())  # a copy: a link would lead getpath back to the real prefix
    python.chmod(0o755)
    return _fill(python, kind)


def _fill(python: Path, kind: str) -> Path:
    """``kind``: "bare" (nothing), "floor" (one ``import os`` .pth) or "package" (devmap-shims)."""
    if kind == "package":
        _install(python)
    elif kind == "floor":
        (_site_packages(python) / "floor.pth").write_text(FLOOR_PTH)
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


def _in_process(python: str, pre: str, runs: int, env: Optional[dict] = None) -> list:
    # run outside the checkout: ``-c`` puts the working directory first on sys.path, and the
    # checkout's sources (not byte-compiled under PYTHONDONTWRITEBYTECODE) would shadow the install
    out = []
    for _ in range(runs):
        proc = subprocess.run(
            [python, "-c", IN_PROCESS.format(pre=pre)], capture_output=True, text=True, env=env or _env(), check=True,
            cwd=tempfile.gettempdir(),
        )
        out.append(float(proc.stdout.strip().splitlines()[-1]))
    return out


LAYOUTS = {
    "virtualenv": (_venv, "site executes each .pth line twice in a virtualenv (python/cpython#75723)"),
    "base install": (_base_install, "site executes each .pth line once"),
}


def _median_interval(values: list, rounds: int = 300) -> tuple:
    """Bootstrap 95 % interval of the median of ``values``."""
    rng, n, medians = random.Random(0), len(values), []
    for _ in range(rounds):
        medians.append(statistics.median(values[rng.randrange(n)] for _ in range(n)))
    medians.sort()
    return round(medians[int(rounds * 0.025)], 4), round(medians[int(rounds * 0.975) - 1], 4)


def _start_rows(pythons: dict) -> list:
    for python in pythons.values():  # warm the page cache before timing
        for _ in range(5):
            _time_start(python)
    times = {key: [] for key in pythons}
    order, rng = list(pythons), random.Random(0)
    for _ in range(START_RUNS):  # interleaved, in a new order every round, so drift hits all alike
        rng.shuffle(order)
        for key in order:
            times[key].append(_time_start(pythons[key]))
    rows = []
    for layout, (_, note) in LAYOUTS.items():
        for kind, column, unit, scale in (("wall", 0, "ms", 1000), ("CPU time", 1, "ms", 1000)):
            bare, floor, package = ([t[column] for t in times[layout, k]] for k in ("bare", "floor", "package"))
            # the ratio within each round, then their median: a slow spell of the machine hits the
            # three starts of a round alike, where it would move the median of each by different amounts
            ratios = [p / b for p, b in zip(package, bare)]
            ratio, judged = statistics.median(ratios), column == 0
            rows.append(
                {
                    "benchmark": f"interpreter start, {layout}, .pth present, DEVMAP_SHIMS unset ({kind})",
                    "value": round(statistics.median(package) * scale, 2), "unit": unit,
                    "baseline": round(statistics.median(bare) * scale, 2),
                    "ratio": round(ratio, 4), "ci95": _median_interval(ratios),
                    "floor_ratio": round(statistics.median(f / b for f, b in zip(floor, bare)), 4),
                    "target": "<= 1.02x" if judged else "(reported)",
                    "met": ratio <= 1.02 if judged else True, "runs": START_RUNS, "note": note,
                }
            )
        counts = {k: _instructions(pythons[layout, k]) for k in ("bare", "floor", "package")}
        if counts["bare"] and counts["package"]:
            rows.append(
                {
                    "benchmark": f"interpreter start, {layout}, .pth present, DEVMAP_SHIMS unset (instructions, valgrind)",
                    "value": round(counts["package"] / 1e6, 2), "unit": "M", "baseline": round(counts["bare"] / 1e6, 2),
                    "ratio": round(counts["package"] / counts["bare"], 4),
                    "floor_ratio": round(counts["floor"] / counts["bare"], 4) if counts["floor"] else None,
                    "target": "(reported)", "met": True, "runs": 1,
                }
            )
    return rows


def run() -> list:
    with tempfile.TemporaryDirectory() as tmp:
        pythons = {
            (layout, kind): make(Path(tmp) / f"{layout.split()[0]}-{kind}", kind)
            for layout, (make, _) in LAYOUTS.items() for kind in ("bare", "floor", "package")
        }
        rows = _start_rows(pythons)
        installed = pythons["virtualenv", "package"]
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
        # this interpreter may hold the package as an editable install of the checkout: byte-compile
        # it into a cache of its own (one run unmeasured), as pip does for an install
        with tempfile.TemporaryDirectory() as cache:
            env = {k: v for k, v in _env().items() if k != "PYTHONDONTWRITEBYTECODE"}
            env["PYTHONPYCACHEPREFIX"] = cache
            _in_process(sys.executable, pre, 1, env)
            warm = statistics.median(_in_process(sys.executable, pre, 7, env))
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
        line = f"{row['benchmark']:90s} {row['value']:>9} {row['unit']:3s} target {row['target']:10s} {'met' if row['met'] else 'NOT MET'}"
        if row.get("ratio"):
            line += f" (baseline {row['baseline']} {row['unit']}, ratio {row['ratio']}"
            line += f", 95 % interval {row['ci95'][0]}-{row['ci95'][1]}" if row.get("ci95") else ""
            line += f", a .pth of `import os` alone: {row['floor_ratio']})" if row.get("floor_ratio") else ")"
        print(line)
    print(json.dumps(results, indent=1))
