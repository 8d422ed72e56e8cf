"""Fresh virtualenvs: the .pth auto-enable after `pip install .` and `pip install -e .`, and plugins.

These build real distributions, so they take tens of seconds; they need PyPI (or a warm pip/uv
cache) for hatchling, wrapt and packaging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    # packaging does not depend on the target libraries: build the virtualenvs once per CI run
    pytest.mark.skipif(
        os.environ.get("DEVMAP_STACK") not in (None, "engine"), reason="packaging tests run in the engine session"
    ),
    # they make virtualenvs and install into them with uv (stacks/test.txt has it; the test extra does not)
    pytest.mark.skipif(
        __import__("importlib.util").util.find_spec("uv") is None,
        reason="needs uv (`python -m uv`): pip install uv, or use stacks/test.txt",
    ),
]


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
