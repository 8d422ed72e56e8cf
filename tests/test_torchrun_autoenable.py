"""Workers started by torchrun inherit DEVMAP_SHIMS=1 and install the shims at start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import devmap_shims
    import torch.distributed as dist

    dist.init_process_group("gloo")
    report = {"rank": dist.get_rank(), "world": dist.get_world_size(), "installed": devmap_shims.is_installed(),
              "auto": devmap_shims.status()["auto_enabled"]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        print("REPORT " + json.dumps(gathered), flush=True)
    dist.barrier()
    # torch 2.4's gloo teardown can hang at interpreter exit: leave without it
    os._exit(0)
    """
)


def test_two_torchrun_workers_report_shims_installed(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    env.update(DEVMAP_SHIMS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(out for out in proc.stdout.splitlines() if out.startswith("REPORT "))
    reports = json.loads(line[len("REPORT "):])
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["installed"] and r["auto"] and r["world"] == 2 for r in reports)
