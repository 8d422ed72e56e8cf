"""A library that rebinds a model's method from its ``__func__`` keeps the repair in the call.

accelerate's ``prepare_model`` with mixed precision replaces ``model.forward`` with
``MethodType(autocast(model.forward.__func__), model)``; run in a fresh interpreter, as
``Accelerator`` keeps process-wide state.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("torch")

PROGRAM = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import devmap_shims
from devmap_shims import Shim, Target
calls = []
def spy(wrapped, instance, args, kwargs):
    calls.append(type(instance).__name__)
    return wrapped(*args, **kwargs)
row = {"id": "tiny-bug", "title": "t", "library": "torch", "affected": {"torch": ">=1.0"},
       "fixed_in": "unfixed", "symptom": "s", "root_cause": "r", "upstream": ["acme/tiny#1"],
       "verification": ["I"], "workaround": "w", "last_checked": "2026-11-01"}
shim = Shim("tiny-fix", ("tiny-bug",), (Target("tinylib", "Net.forward"),), spy)
devmap_shims.register(shim, matrix_rows=[row])
devmap_shims.install(only=["tiny-fix"])
import tinylib
from accelerate import Accelerator
net = Accelerator(mixed_precision="bf16", cpu=True).prepare(tinylib.Net())
assert net.forward.__func__ is not tinylib.Net.forward  # accelerate replaced it
out = net(torch.ones(1, 2))
print("CALLS", calls, out.dtype)
"""


def test_accelerate_mixed_precision_prepare_keeps_the_repair(tmp_path):
    (tmp_path / "tinylib.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.l = torch.nn.Linear(2, 2)\n"
        "    def forward(self, x):\n        return self.l(x)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CALLS ['Net'] torch.float32" in proc.stdout, proc.stdout
