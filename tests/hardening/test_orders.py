"""Import / install / uninstall orders, each in a fresh interpreter, on the real accelerate and transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.slow,
    # each case imports transformers in a fresh interpreter; the engine is the same on every stack,
    # so run the permutations where the by-name copies differ most (transformers 4.x and 5.x)
    pytest.mark.skipif(
        os.environ.get("DEVMAP_STACK") not in (None, "current", "legacy-2024"),
        reason="order permutations run on the current and legacy-2024 stacks",
    ),
]

HERE = Path(__file__).resolve().parent
IMPORT = "import accelerate, accelerate.utils.modeling, transformers.modeling_utils"
FOREIGN = (
    "import wrapt, accelerate.utils.modeling as m\n"
    "def foreign(w, i, a, k):\n    foreign.calls += 1\n    return w(*a, **k)\n"
    "foreign.calls = 0\n"
    "wrapt.wrap_function_wrapper(m, 'infer_auto_device_map', foreign)\n"
)

ORDERS = {
    "import-then-install": (f"{IMPORT}\ndevmap_shims.install()", True),
    "install-then-import": (f"devmap_shims.install()\n{IMPORT}", True),
    "install-twice": (f"devmap_shims.install()\n{IMPORT}\ndevmap_shims.install()", True),
    "install-uninstall-install": (f"devmap_shims.install()\n{IMPORT}\ndevmap_shims.uninstall()\ndevmap_shims.install()", True),
    "install-then-uninstall": (f"{IMPORT}\ndevmap_shims.install()\ndevmap_shims.uninstall()", False),
    "uninstall-without-install": (f"devmap_shims.uninstall()\n{IMPORT}", False),
    "auto-enable-plus-install": (f"devmap_shims.install()\n{IMPORT}", True),
    "foreign-layer-before-ours": (
        f"{IMPORT}\n{FOREIGN}\nlayer = m.infer_auto_device_map\ndevmap_shims.install()\ndevmap_shims.uninstall()\n"
        "assert m.infer_auto_device_map is layer, 'foreign layer lost'",
        False,
    ),
    "foreign-layer-after-ours": (
        f"{IMPORT}\ndevmap_shims.install()\n{FOREIGN}\nlayer = m.infer_auto_device_map\ndevmap_shims.uninstall()\n"
        "assert m.infer_auto_device_map is layer, 'foreign layer removed'\n"
        "from devmap_shims.shims import wrapping\nassert not wrapping.is_ours(layer.__wrapped__), 'ours still inside'",
        False,
    ),
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_order(order):
    body, expect_installed = ORDERS[order]
    script = f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport devmap_shims, audit\n{body}\naudit.main({expect_installed})\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    if order == "auto-enable-plus-install":
        env["DEVMAP_SHIMS"] = "1"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(out for out in proc.stdout.splitlines() if out.startswith("AUDIT "))
    result = json.loads(line[len("AUDIT "):])
    assert result["problems"] == []
    assert result["installed"] is expect_installed
    if expect_installed:
        assert result["active"] >= 1  # the device-map shim applies on every stack (unfixed upstream)
