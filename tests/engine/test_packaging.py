"""Fresh virtualenvs: the .pth auto-enable after `pip install .` and `pip install -e .`, and plugins;
the release check of the sdist and wheel; the README's quick start and the runtime stack it installs.

The tests marked slow build real distributions, so they take tens of seconds; they need PyPI (or a
warm pip/uv cache) for hatchling, wrapt and packaging.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STACKS = REPO / "stacks"
# packaging does not depend on the target libraries: build the virtualenvs once per CI run
pytestmark = pytest.mark.skipif(
    os.environ.get("DEVMAP_STACK") not in (None, "engine"), reason="packaging tests run in the engine session"
)
# the tests that build distributions install them with uv (stacks/test.txt has it; the test extra does not)
needs_uv = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("uv") is None,
    reason="needs uv (`python -m uv`): pip install uv, or use stacks/test.txt",
)


def sh(*cmd, env=None, check=True, cwd=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEVMAP_SHIMS", "VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(extra)
    return env


def make_venv(path: Path) -> Path:
    sh(sys.executable, "-m", "uv", "venv", "--seed", "-q", "--python", sys.executable, path, env=clean_env())
    return path / "bin" / "python"


PROBE = "import devmap_shims, sys; print(devmap_shims.is_installed(), devmap_shims.__file__)"


@pytest.mark.slow
@needs_uv
@pytest.mark.parametrize("editable", [False, True], ids=["pip-install", "pip-install-editable"])
def test_pth_auto_enable_in_fresh_virtualenv(tmp_path, editable):
    python = make_venv(tmp_path / "venv")
    args = ["-e", REPO] if editable else [REPO]
    sh(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args, env=clean_env())
    on = sh(python, "-c", PROBE, env=clean_env(DEVMAP_SHIMS="1"), cwd=tmp_path)
    off = sh(python, "-c", PROBE, env=clean_env(), cwd=tmp_path)
    installed, location = on.stdout.split()
    assert installed == "True", on.stderr
    assert off.stdout.split()[0] == "False"
    assert (location.startswith(str(REPO))) == editable
    site = sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    assert (Path(site) / "devmap_shims.pth").exists()
    # Python 3.15+ (PEP 829) skips the .pth import line and calls the .start entry point at every
    # start. Emulate it: site's path lines with the variable still unset (so the import line does
    # nothing), then set it, or not, and call the entry point as site would
    entry = (Path(site) / "devmap_shims.start").read_text().strip()
    call_start = textwrap.dedent(
        f"""
        import os, pkgutil, site, sys
        site.addsitedir({site!r})
        if len(sys.argv) > 1:
            os.environ["DEVMAP_SHIMS"] = sys.argv[1]
        pkgutil.resolve_name({entry!r})()
        loaded = sorted(m for m in sys.modules if m.startswith("devmap_shims"))
        print(loaded or "none", "devmap_shims" in sys.modules and sys.modules["devmap_shims"].is_installed())
        """
    )
    on = sh(python, "-S", "-c", call_start, "1", env=clean_env(), cwd=tmp_path)
    assert on.stdout.split()[-1] == "True", on.stderr
    off = sh(python, "-S", "-c", call_start, env=clean_env(), cwd=tmp_path)
    assert off.stdout.split() == ["none", "False"], off.stderr


PLUGIN_MODULE = '''
from devmap_shims import Shim, Target

def add_hundred(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 100

SHIMS = [Shim("fix-compute", ("compute-off-by-100",), (Target("acme_target.core", "compute"),), add_hundred,
              summary="acme's own fix")]

ROWS = [{
    "id": "compute-off-by-100",
    "title": "acme_target.compute is off by 100",
    "library": "acme-plugin",
    "affected": {"acme-plugin": ">=1.0"},
    "fixed_in": "unfixed",
    "last_checked": "2026-11-01",
    "symptom": "compute(1) returns 2",
    "root_cause": "demo",
    "upstream": ["acme/acme#1"],
    "verification": ["I"],
    "workaround": "upgrade acme",
}]

def broken():
    raise RuntimeError("this plugin is broken")
'''


def write_plugin(root: Path) -> Path:
    (root / "acme_target").mkdir(parents=True)
    (root / "acme_target" / "__init__.py").write_text("from acme_target.core import compute\n")
    (root / "acme_target" / "core.py").write_text("def compute(x):\n    return x * 2\n")
    (root / "acme_plugin.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    (root / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["hatchling"]
            build-backend = "hatchling.build"
            [project]
            name = "acme-plugin"
            version = "1.0.0"
            [tool.hatch.build.targets.wheel]
            packages = ["acme_target"]
            only-include = ["acme_target", "acme_plugin.py"]
            [project.entry-points."devmap_shims.shims"]
            acme = "acme_plugin:SHIMS"
            broken = "acme_plugin:broken"
            [project.entry-points."devmap_shims.matrix"]
            acme = "acme_plugin:ROWS"
            """
        )
    )
    return root


@pytest.mark.slow
@needs_uv
def test_plugin_distribution_shim_and_row(tmp_path):
    python = make_venv(tmp_path / "venv")
    plugin = write_plugin(tmp_path / "plugin")
    sh(sys.executable, "-m", "uv", "pip", "install", "-q", "--python", python, REPO, plugin, env=clean_env())
    code = (
        "import devmap_shims, json; devmap_shims.install(); import acme_target; "
        "st = devmap_shims.status(); "
        "print(json.dumps({'value': acme_target.compute(1), "
        "'shim': [s for s in st['shims'] if s['id'].startswith('acme-plugin')]}))"
    )
    proc = sh(python, "-c", code, env=clean_env(), cwd=tmp_path)
    data = json.loads(proc.stdout)
    assert data["value"] == 102
    (shim,) = data["shim"]
    assert shim["id"] == "acme-plugin:fix-compute" and shim["fixes"] == ["acme-plugin:compute-off-by-100"]
    assert shim["state"] == "active" and shim["source"] == "plugin acme-plugin"
    assert "broken" in proc.stderr and "this plugin is broken" in proc.stderr  # skipped with a warning
    matrix = sh(tmp_path / "venv" / "bin" / "devmap-shims", "matrix", "--json", env=clean_env(), cwd=tmp_path)
    ids = [row["id"] for row in json.loads(matrix.stdout)["rows"]]
    assert "acme-plugin:compute-off-by-100" in ids
    no_plugins = sh(python, "-c", code, env=clean_env(DEVMAP_SHIMS_NO_PLUGINS="1"), cwd=tmp_path)
    assert json.loads(no_plugins.stdout) == {"value": 2, "shim": []}


def pins(lock: Path) -> dict:
    """name -> version of a uv-compiled lock file."""
    found = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith((" ", "#", "-")):
            name, _, version = line.split(";")[0].strip().partition("==")
            found[name] = version
    return found


def quick_start_commands() -> list:
    section = re.search(r"^## Quick start\n(.*?)^## ", (REPO / "README.md").read_text(), re.S | re.M).group(1)
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_quick_start_makes_a_virtualenv_first_and_names_files_that_exist():
    """A system Python under PEP 668 refuses pip install: the first command makes the virtualenv."""
    first, second = quick_start_commands()
    steps = [step.strip() for step in first.split("&&")]
    assert steps[0].startswith("python3 -m venv "), first
    venv = steps[0].split()[-1]
    assert steps[1] == f". {venv}/bin/activate", first
    assert any(step.startswith("pip install ") for step in steps[2:]), first
    assert steps[-1].startswith("devmap-shims demo"), first
    named = re.findall(r"-r (\S+)", first + " " + second)
    assert named == ["stacks/current-runtime.txt"]
    for path in named:
        assert (REPO / path).is_file(), path
    assert "python3 -m nox" in second


def test_runtime_stack_is_current_without_the_test_tools():
    """stacks/current-runtime.txt is current.txt's versions, less what only the tests need."""
    runtime, current = pins(STACKS / "current-runtime.txt"), pins(STACKS / "current.txt")
    drifted = {name: (pin, current.get(name)) for name, pin in runtime.items() if current.get(name) != pin}
    assert drifted == {}, "relock with `nox -s lock`: the runtime stack differs from current.txt"
    targets = {"torch", "transformers", "accelerate", "bitsandbytes", "diffusers", "peft"}
    targets |= {"wrapt", "packaging"}  # devmap-shims' own dependencies
    assert targets <= set(runtime)
    test_tools = {line.split("==")[0] for line in (STACKS / "test.in").read_text().splitlines()
                  if line and not line.startswith("#")} - targets
    assert test_tools and not test_tools & set(runtime), test_tools & set(runtime)
    assert "-r current-runtime.in" in (STACKS / "current.in").read_text().splitlines()


def check_dist(folder: Path) -> subprocess.CompletedProcess:
    return sh(sys.executable, REPO / "scripts" / "check_dist.py", folder, check=False)


@pytest.mark.slow
@needs_uv
def test_release_check_passes_the_built_distributions_and_names_what_is_missing(tmp_path):
    dist = tmp_path / "dist"
    # the newest hatchling for this Python (nox -s package pins the one of stacks/package.txt, for 3.10+)
    sh(sys.executable, "-m", "uv", "build", "-q", "-o", dist, REPO, env=clean_env())
    good = check_dist(dist)
    assert good.returncode == 0, good.stderr
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        startup = {"devmap_shims.pth", "devmap_shims.start", "_devmap_shims_start.py"}
        assert startup | {"devmap_shims/py.typed"} <= set(names)
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
        # a wheel that lost its start-up line and its licence, and gained a stray top-level module
        lost = ("devmap_shims.pth", next(n for n in names if n.endswith(".dist-info/licenses/LICENSE")))
        broken = {name: archive.read(name) for name in names if name not in lost}
    broken["conftest.py"] = b""
    wheel.unlink()
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in broken.items():
            archive.writestr(name, data)
    bad = check_dist(dist)
    assert bad.returncode == 1
    assert "devmap_shims.pth is missing" in bad.stderr
    assert "licenses/LICENSE is missing" in bad.stderr
    assert "conftest.py" in bad.stderr
