"""Adding a shim is adding one module and its matrix row: README's "Adding a shim", done for real.

A copy of the package gets the module and the row of a throw-away shim for a bug in ``tinylib`` (a
library written here), and nothing else. Then, in that copy: the shared contract test picks the
shim up and passes, ``install()`` arms it where the row says, and ``devmap-shims demo`` and
``explain`` know it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import devmap_shims

REPO = Path(__file__).resolve().parents[2]

SHIM_MODULE = '''
"""Shim ``tiny-fix``: ``tinylib.core.compute`` gives ``x * scale + 1``, as tinylib 2.0 does.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
"""

from __future__ import annotations

from devmap_shims.scenarios import BugObserved, scenario
from devmap_shims.shims import Shim, Target

BUG_ID = "tinylib-compute-off-by-one"


def add_one(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    return result + 1 if isinstance(result, int) else result


SHIM = Shim(
    id="tiny-fix",
    fixes=(BUG_ID,),
    targets=(Target("tinylib.core", "compute", expect_params=("x",)),),
    wrapper=add_one,
    summary="add the one that tinylib < 2.0 forgets",
)


@scenario(BUG_ID, "compute(3) must give 7", needs=("tinylib",))
def compute_three() -> str:
    import tinylib.core

    value = tinylib.core.compute(3)
    if value != 7:
        raise BugObserved(f"compute(3) gave {value}")
    return "compute(3) gave 7"
'''

ROW = '''
[[bug]]
id = "tinylib-compute-off-by-one"
title = "compute() forgets to add one"
library = "tinylib"
affected = { tinylib = ">=1.0,<2.0" }
fixed_in = { tinylib = "2.0.0" }
symptom = "compute(3) returns 6"
root_cause = "the + 1 was lost in a refactoring"
upstream = ["acme/tinylib#1"]
verification = ["I"]
workaround = "Upgrade to tinylib>=2.0, or add one yourself."
'''


def make_world(tmp_path: Path, tinylib_version: str = "1.2.0") -> dict:
    """A copy of the package with the throw-away shim, tinylib on the path; the environment to use
    (run with ``cwd=tmp_path``: ``python -c`` and ``-m`` put the working directory first on sys.path)."""
    package = tmp_path / "pkg" / "devmap_shims"
    shutil.copytree(Path(devmap_shims.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    folder = package / "hooks" / "tinylib"
    folder.mkdir()
    (folder / "__init__.py").write_text('"""Shims for bugs that live in tinylib."""\n')
    (folder / "tiny_fix.py").write_text(textwrap.dedent(SHIM_MODULE).lstrip())
    matrix = package / "compat_matrix" / "known_bugs.toml"
    matrix.write_text(matrix.read_text() + ROW)
    lib = tmp_path / "lib"
    (lib / "tinylib").mkdir(parents=True)
    (lib / "tinylib" / "__init__.py").write_text("")
    (lib / "tinylib" / "core.py").write_text("def compute(x, scale=2):\n    return x * scale\n")
    dist = lib / f"tinylib-{tinylib_version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tinylib\nVersion: {tinylib_version}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(package.parent), str(lib)])
    return env


def run(env, *args, cwd=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_the_contract_test_picks_up_a_new_shim_module_and_it_passes(tmp_path):
    env = make_world(tmp_path)
    proc = run(env, "-m", "pytest", str(REPO / "tests" / "test_shim_contract.py"), "-q", "-p", "no:cacheprovider",
               "-k", "tiny-fix", "-rs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    assert passed >= 12 and "failed" not in proc.stdout, proc.stdout[-2000:]


def test_the_contract_test_fails_a_new_shim_that_breaks_the_contract(tmp_path):
    env = make_world(tmp_path)
    module = tmp_path / "pkg" / "devmap_shims" / "hooks" / "tinylib" / "tiny_fix.py"
    # a repair that assumes the library returned an int breaks the healthy path for other results
    module.write_text(module.read_text().replace("result + 1 if isinstance(result, int) else result", "result + 1"))
    proc = run(env, "-m", "pytest", str(REPO / "tests" / "test_shim_contract.py"), "-q", "-p", "no:cacheprovider",
               "-k", "tiny-fix and nothing_to_repair", cwd=tmp_path)
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-2000:]


def test_install_arms_it_where_its_row_applies_and_demo_and_explain_know_it(tmp_path):
    code = "import devmap_shims, tinylib.core; devmap_shims.install(); print(tinylib.core.compute(3))"
    affected, fixed = tmp_path / "affected", tmp_path / "fixed"
    assert run(make_world(affected), "-c", code, cwd=affected).stdout.strip() == "7"
    fixed_env = make_world(fixed, tinylib_version="2.0.0")
    assert run(fixed_env, "-c", code, cwd=fixed).stdout.strip() == "6"  # outside the row: the shim stays off

    env = make_world(tmp_path / "demo")
    demo = run(env, "-m", "devmap_shims", "demo", "tinylib-compute-off-by-one", "--json", cwd=tmp_path / "demo")
    assert demo.returncode == 0, demo.stderr[-2000:]
    (row,) = json.loads(demo.stdout)["rows"]
    assert (row["shim"], row["verdict"]) == ("tiny-fix", "fixed")
    assert row["without_shims"]["detail"] == "BugObserved: compute(3) gave 6"
    by_shim = run(env, "-m", "devmap_shims", "demo", "tiny-fix", "--json", cwd=tmp_path / "demo")
    assert [r["bug_id"] for r in json.loads(by_shim.stdout)["rows"]] == ["tinylib-compute-off-by-one"]  # its rows
    typo = run(env, "-m", "devmap_shims", "demo", "tiny-fxi", cwd=tmp_path / "demo")
    assert typo.returncode == 2 and "no bug or shim 'tiny-fxi'; did you mean 'tiny-fix'" in typo.stderr
    explain = run(env, "-m", "devmap_shims", "explain", "tiny-fix", cwd=tmp_path / "demo")
    assert "devmap_shims.hooks.tinylib.tiny_fix" in explain.stdout
    assert "tinylib-compute-off-by-one: tinylib >=1.0,<2.0; fixed in tinylib 2.0.0" in explain.stdout


@pytest.mark.parametrize(("name", "value"), [("DEVMAP_SHIMS_DISABLE", "tiny-fix"), ("DEVMAP_SHIMS", "0")])
def test_demo_says_a_switch_keeps_the_shim_off_and_is_no_problem(tmp_path, name, value):
    """A shim the operator switched off is not replayed, and that is no failed fix (exit 0)."""
    env = {**make_world(tmp_path), name: value}
    demo = run(env, "-m", "devmap_shims", "demo", "tinylib-compute-off-by-one", "--json", cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    report = json.loads(demo.stdout)
    (bug,) = report["bugs"]
    assert bug["status"] == "shim-not-replayed" and report["summary"]["problems"] == 0
    assert bug["not_replayed_because"] == f"{name}={value} switches the shim off"
    (row,) = report["rows"]
    assert row["with_shims"] is None and row["switched_off_by"] == f"{name}={value}"

