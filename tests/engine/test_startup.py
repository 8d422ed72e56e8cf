"""Start-up behaviour in fresh interpreters: no target imports, auto-enable, bad variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TARGETS = ("torch", "transformers", "accelerate", "bitsandbytes", "diffusers")


def run_python(code: str, **env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_and_install_import_no_target_library():
    proc = run_python(
        "import sys, json, devmap_shims; devmap_shims.install(); "
        f"print(json.dumps([m for m in {TARGETS!r} if m in sys.modules]))"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_shim_modules_load_just_before_the_first_target_library_and_for_status(tmp_path):
    """install() imports no shim module; the first import of a target library (a fake "torch" here)
    loads them before that library's code runs; status() lists every shim either way."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "import sys\nLOADED_FIRST = sorted(m for m in sys.modules if m.startswith('devmap_shims.hooks.'))\n"
    )
    code = (
        "import sys, json, devmap_shims; devmap_shims.install(); "
        "before = sorted(m for m in sys.modules if m.startswith('devmap_shims.hooks.')); "
        "import torch; "
        "print(json.dumps([before, torch.LOADED_FIRST, [s['id'] for s in devmap_shims.status()['shims']]]))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + sys.path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    before, when_torch_ran, ids = json.loads(proc.stdout)
    assert before == []
    assert "devmap_shims.hooks.bitsandbytes.quant_state_follows_weight" in when_torch_ran
    assert {"device-map-balance", "quant-state-follows-weight", "generate-input-device"} <= set(ids)
    status_only = run_python("import json, devmap_shims; devmap_shims.install(); "
                             "print(json.dumps([s['id'] for s in devmap_shims.status()['shims']]))")
    assert json.loads(status_only.stdout) == ids


def test_auto_enable_through_pth():
    proc = run_python(
        "import sys, devmap_shims; st = devmap_shims.status(); "
        "print(devmap_shims.is_installed(), st['auto_enabled'], 'torch' in sys.modules)",
        DEVMAP_SHIMS="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "False"]


def test_unset_variable_installs_nothing():
    proc = run_python("import sys; print('devmap_shims' in sys.modules)")
    assert proc.stdout.strip() == "False"  # the .pth line costs one lookup and imports nothing


@pytest.mark.parametrize("value", [None, "", "0"], ids=["unset", "empty", "zero"])
def test_start_up_imports_no_devmap_shims_module_unless_enabled(value):
    overrides = {} if value is None else {"DEVMAP_SHIMS": value}
    proc = run_python("import sys; print(sorted(m for m in sys.modules if m.startswith('devmap_shims')))", **overrides)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_start_module_survives_a_missing_package(tmp_path):
    """A half-removed install (the start module left, the package gone) prints one line, no traceback."""
    startup = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "startup")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEVMAP_SHIMS", "PYTHONPATH"))}
    proc = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {startup!r}); import _devmap_shims_start; print('ran')"],
        capture_output=True, text=True, env=dict(env, DEVMAP_SHIMS="1"), cwd=tmp_path, timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr
    assert "devmap_shims cannot be imported" in proc.stderr and "Traceback" not in proc.stderr
    # Python 3.15+ imports the module (which runs it) and then calls run(): one run, one line
    proc = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {startup!r}); import _devmap_shims_start as m; m.run()"],
        capture_output=True, text=True, env=dict(env, DEVMAP_SHIMS="1"), cwd=tmp_path, timeout=60,
    )
    assert proc.returncode == 0 and proc.stderr.count("cannot be imported") == 1, proc.stderr


def test_without_a_console_start_up_messages_do_not_go_to_stdout():
    # fd 2 closed (a daemon, pythonw): sys.stderr is None, and print(file=None) writes to stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    env.update(DEVMAP_SHIMS="1", DEVMAP_SHIMS_STRICT="1", DEVMAP_SHIMS_DISABLE="no-such-shim")
    proc = subprocess.run([sys.executable, "-c", "import sys; print(sys.stderr is None)"], stdout=subprocess.PIPE,
                          text=True, env=env, timeout=120, preexec_fn=lambda: os.close(2))
    assert proc.returncode == 0 and proc.stdout == "True\n", proc.stdout


def test_kill_switch_in_environment():
    proc = run_python("import devmap_shims; print(devmap_shims.install(), devmap_shims.is_installed())", DEVMAP_SHIMS="0")
    assert proc.stdout.split() == ["False", "False"]


def test_the_kill_switch_set_by_the_program_after_start_up_removes_the_shims():
    code = ("import os, devmap_shims as d; before = d.is_installed(); os.environ['DEVMAP_SHIMS'] = '0'; "
            "print(before, d.install(), d.is_installed(), d.status()['killed'])")
    proc = run_python(code, DEVMAP_SHIMS="1")
    assert proc.stdout.split() == ["True", "False", "False", "True"], proc.stderr
    assert proc.stderr.count("shims installed before are removed") == 1


def test_bad_enable_value_warns_once_and_program_goes_on():
    proc = run_python("print('still running')", DEVMAP_SHIMS="maybe")
    assert proc.returncode == 0
    assert proc.stdout.strip() == "still running"
    assert proc.stderr.count("DEVMAP_SHIMS='maybe'") == 1
    assert "use 1" in proc.stderr and "0" in proc.stderr


def test_a_bad_enable_value_is_said_once_also_when_the_program_installs():
    code = "import devmap_shims as d; d.install(); print(len(d.status()['warnings']))"
    proc = run_python(code, DEVMAP_SHIMS="2")
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr  # still in the report
    assert proc.stderr.count("DEVMAP_SHIMS='2' is not understood") == 1, proc.stderr
    assert "yes/no, on/off" in proc.stderr


def test_logging_the_program_configures_after_start_up_gets_our_records_once():
    code = ("import logging, sys; logging.basicConfig(stream=sys.stdout, format='PROGRAM %(name)s: %(message)s'); "
            "logging.getLogger('devmap_shims').info('a record')")
    proc = run_python(code, DEVMAP_SHIMS="1", DEVMAP_SHIMS_LOG="info")
    assert proc.returncode == 0 and proc.stdout == "PROGRAM devmap_shims: a record\n", (proc.stdout, proc.stderr)
    assert "a record" not in proc.stderr
    before = run_python("import logging; logging.getLogger('devmap_shims').info('a record')",
                        DEVMAP_SHIMS="1", DEVMAP_SHIMS_LOG="info")
    assert before.stderr.count("a record") == 1 and before.stdout == ""  # no logging set up: on stderr


def test_bad_values_in_other_variables_are_named(tmp_path):
    proc = run_python(
        "import devmap_shims; devmap_shims.install(); print(devmap_shims.is_installed())",
        DEVMAP_SHIMS_STRICT="sometimes",
        DEVMAP_SHIMS_LOG="loud",
        DEVMAP_SHIMS_DISABLE="no-such-shim",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
    assert "DEVMAP_SHIMS_STRICT='sometimes'" in proc.stderr
    assert "DEVMAP_SHIMS_LOG='loud'" in proc.stderr and "debug, info, warning" in proc.stderr
    assert "DEVMAP_SHIMS_DISABLE names unknown shim 'no-such-shim'" in proc.stderr


def test_python_dash_m_and_console_script_agree():
    a = subprocess.run([sys.executable, "-m", "devmap_shims", "matrix", "--json"], capture_output=True, text=True)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["rows"]


def test_install_stays_cheap_no_slow_imports():
    """The 30 ms start-up budget: install() must not pull in typing, inspect, logging, wrapt ..."""
    slow = ("typing", "inspect", "logging", "importlib.metadata", "wrapt", "packaging", "tomllib", "dataclasses")
    proc = run_python(
        "import sys, json, devmap_shims; devmap_shims.install(); "
        f"print(json.dumps([m for m in {slow!r} if m in sys.modules]))"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
