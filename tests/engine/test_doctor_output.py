"""What ``doctor`` and ``print(devmap_shims.status())`` show a person: at most 30 lines of at most
100 columns by default, whatever the stack and however many shims; every target with
``--verbose``, everything in ``--json``."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import devmap_shims
from devmap_shims.cli import main
from devmap_shims.cli.doctor import MAX_LINES, report, verbose_report
from devmap_shims.shims.summary import Status, reason, shim_lines

REPO = Path(__file__).resolve().parents[2]


def fits(lines, max_lines=None):
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    if max_lines is not None:
        assert len(lines) <= max_lines, "\n".join(lines)


def env(**extra):
    out = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    out["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    out.update(extra)
    return out


#: doctor, where torch (if any) warns as it is asked for GPUs, as it does with a driver too old
DOCTOR_WITH_A_DEVICE_WARNING = """
import sys, warnings
try:
    import torch
except ImportError:
    pass
else:
    available = torch.cuda.is_available
    def is_available():
        warnings.warn("CUDA initialization: the NVIDIA driver on your system is too old (test)")
        return available()
    torch.cuda.is_available = is_available
from devmap_shims.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def doctor_run():
    """``doctor --json`` on this stack, the target modules imported (one run for the module)."""
    proc = subprocess.run([sys.executable, "-c", DOCTOR_WITH_A_DEVICE_WARNING, "doctor", "--json"],
                          capture_output=True, text=True, env=env(), timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def doctor_json(doctor_run):
    return json.loads(doctor_run.stdout)


def test_doctor_keeps_the_libraries_import_warnings_out_and_torchs_word_on_gpus_in(doctor_run, doctor_json):
    """What the current stack's libraries warn as doctor imports them (bitsandbytes without its
    optional kernels package, transformers' image processors without torchvision) is not the
    report; what torch says when asked for the GPUs (a driver too old) is the user's to see."""
    for chatter in ("gemm_4bit_forward", "requires torchvision", "compiled without GPU support"):
        assert chatter not in doctor_run.stderr, doctor_run.stderr
    said = [line for line in doctor_run.stderr.splitlines() if "driver on your system is too old" in line]
    assert len(said) == (1 if doctor_json["versions"].get("torch") else 0), doctor_run.stderr


@pytest.mark.parametrize("log", [None, "error"])
def test_doctor_quiets_import_warnings_only_not_with_devmap_shims_log(log, capsys, caplog, monkeypatch):
    """Each target import logs a warning and an error and raises a warning: the warnings stay out,
    the error shows; with DEVMAP_SHIMS_LOG set, everything does."""
    import importlib
    import logging
    import warnings

    from devmap_shims.versions import TARGET_DISTRIBUTIONS

    real = importlib.import_module

    def import_module(name, package=None):
        if name.split(".")[0] not in TARGET_DISTRIBUTIONS:
            return real(name, package)
        logging.getLogger("a_library").warning("import-time warning")
        logging.getLogger("a_library").error("import-time error")
        warnings.warn("import-time UserWarning")
        raise ImportError(f"{name} is not imported in this test")

    monkeypatch.setattr(importlib, "import_module", import_module)
    if log:
        monkeypatch.setenv("DEVMAP_SHIMS_LOG", log)
    level = logging.getLogger("devmap_shims").level
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert main(["doctor", "--json", "--no-devices"]) == 0
    finally:
        logging.getLogger("devmap_shims").setLevel(level)
    json.loads(capsys.readouterr().out)
    messages = [r.getMessage() for r in caplog.records if r.name == "a_library"]
    assert "import-time error" in messages
    assert ("import-time warning" in messages) == bool(log)
    assert any("import-time UserWarning" in str(w.message) for w in seen) == bool(log)


def test_doctor_default_fits_30_lines_of_100_columns_on_this_stack(doctor_json):
    lines = report(doctor_json)
    fits(lines, MAX_LINES)
    text = "\n".join(lines)
    for name, version in doctor_json["versions"].items():
        assert f"{name} {version or '-'}" in text
    off_here = [s for s in doctor_json["shims"] if s["state"] == "skipped" and s["selected"] and not s["applies"]]
    for shim in doctor_json["shims"]:
        if shim["state"] in ("active", "pending", "failed"):
            # a line of its own, or (more shims than lines) named in the "N active: ..." list
            own_line = any(line.split()[:2] == [shim["id"], shim["state"].upper()] for line in lines)
            n = sum(1 for s in doctor_json["shims"] if s["state"] == shim["state"])
            assert own_line or shim["id"] in _listed(lines, f"{n} {shim['state']}: "), shim["id"]
    if off_here:
        assert f"{len(off_here)} shim{'s' if len(off_here) != 1 else ''} off: " in text
        assert not any(line.split()[:1] == [off_here[0]["id"]] for line in lines)
    rows = doctor_json["applicable_rows"]
    assert f"{len(rows)} known bug" in lines[0]
    active = {s["id"] for s in doctor_json["shims"] if s["state"] == "active"}
    for row in rows:  # each applicable row is named: under its active shim, or in the list below
        if row["shim"] not in active:
            assert row["id"] in text


def _listed(lines, heading):
    """The ids of the list that starts with ``heading`` (its continuation lines are indented)."""
    for i, line in enumerate(lines):
        if line.strip().startswith(heading):
            chunk = [line.strip()[len(heading):]]
            for more in lines[i + 1:]:
                if not more.startswith("    "):
                    break
                chunk.append(more.strip())
            return {name.strip() for name in " ".join(chunk).split(",")}
    return set()


def test_doctor_verbose_lists_every_target_within_100_columns(doctor_json):
    lines = verbose_report(doctor_json)
    fits(lines)
    text = " ".join(line.strip() for line in lines)
    n_targets = sum(len(s["targets"]) for s in doctor_json["shims"])
    assert len(lines) > n_targets
    for shim in doctor_json["shims"]:
        assert shim["id"] in text
    assert {"shims", "applicable_rows", "devices", "auto_enable"} <= set(doctor_json)
    assert all("targets" in s for s in doctor_json["shims"])  # always in --json


def test_doctor_verbose_puts_every_shims_state_in_one_column(doctor_json):
    # four-bit-quantized-after-weight is 31 characters: its state once stood three columns right
    states = ("ACTIVE", "PENDING", "FAILED", "OFF")
    columns = set()
    for line in verbose_report(doctor_json):
        words = line.split()
        if line.startswith("  ") and not line.startswith("   ") and len(words) > 1 and words[1] in states:
            columns.add(line.index(" " + words[1] + " ") + 1)
    assert len(columns) == 1, columns


def test_doctor_stays_short_when_every_shim_is_forced_on_or_failing(doctor_json):
    """Many shims active or failed (more shims later, a broken library): the groups become lists."""
    data = copy.deepcopy(doctor_json)
    shims = data["shims"]
    clones = []
    for n in range(3):  # three times as many shims as today
        for shim in shims:
            clone = copy.deepcopy(shim)
            clone["id"] = f"{shim['id']}-{n}"
            clone["state"] = ("active", "failed", "pending")[n]
            if n == 1:
                clone["targets"][0].update(state="failed", error="AttributeError: " + "x" * 150)
            clones.append(clone)
    data["shims"] = shims + clones
    data["warnings"] = [f"warning number {i} " + "y" * 120 for i in range(5)]
    data["devices"] = {"torch_cuda_build": "12.1", "CUDA_VISIBLE_DEVICES": None, "cuda_available": True,
                       "gpus": [{"index": i, "name": f"GPU kind {i % 5}", "total_memory": 80 * 2**30} for i in range(8)]}
    lines = report(data)
    fits(lines, MAX_LINES)
    text = "\n".join(lines)
    assert "failed" in text and "and 3 more warnings" in text


def test_doctor_cli_default_no_import(capsys):
    code = main(["doctor", "--no-import", "--no-devices"])
    out = capsys.readouterr().out
    assert code == 0
    fits(out.splitlines(), MAX_LINES)
    assert "--verbose" in out and "targets" in out


def test_doctor_engine_only_fits(tmp_path):
    """No target library importable or installed: the engine alone (wrapt and packaging)."""
    import packaging
    import wrapt

    site = tmp_path / "site"
    site.mkdir()
    for module in (wrapt, packaging):
        (site / module.__name__).symlink_to(Path(module.__file__).parent)
    if sys.version_info < (3, 11):
        import tomli

        (site / "tomli").symlink_to(Path(tomli.__file__).parent)
    code = (f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(site)!r}]; "
            "from devmap_shims.cli import main; sys.exit(main(['doctor']))")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    fits(lines, MAX_LINES)
    assert "torch -" in proc.stdout and "0 known bugs apply" in lines[0]
    assert "torch not importable" in proc.stdout


def test_a_shim_module_that_fails_to_import_is_counted_and_doctor_exits_1():
    """As demo: a built-in shim module that cannot be imported is in the header and --json, exit 1."""
    module = "devmap_shims.hooks.accelerate.hooks_follow_moved_weights"
    code = (f"import sys; sys.modules[{module!r}] = None  # import of it now raises ImportError\n"
            "from devmap_shims.cli import main; sys.exit(main(sys.argv[1:]))")
    for args in (["--json"], []):
        proc = subprocess.run([sys.executable, "-c", code, "doctor", "--no-import", "--no-devices", *args],
                              capture_output=True, text=True, env=env(), timeout=300)
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        if args:
            (message,) = json.loads(proc.stdout)["broken_shims"]
            assert message.startswith(f"built-in shim module {module} failed to import: ")
        else:
            lines = proc.stdout.splitlines()
            fits(lines, MAX_LINES)
            assert any(line.startswith("Shims (") for line in lines)
            assert "; 1 shim module failed to import" in " ".join(proc.stdout.split())


def test_status_is_a_dict_whose_str_is_a_short_summary():
    status = devmap_shims.status()
    assert isinstance(status, dict) and isinstance(status, Status)
    assert json.loads(json.dumps(status)) == dict(status)  # the full data, as before
    assert repr(status) == repr(dict(status))
    text = str(status)
    lines = text.splitlines()
    fits(lines, 20)
    assert lines[0].startswith("devmap-shims: ")
    assert print_of(status) == text + "\n"


def print_of(obj):
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        print(obj)
    return buffer.getvalue()


def test_status_summary_counts_match_the_data(doctor_json):
    data = Status(doctor_json)
    text = str(data)
    fits(text.splitlines(), 20)
    counts = {state: sum(1 for s in data["shims"] if s["state"] == state) for state in ("active", "pending", "failed")}
    assert f"{len(data['shims'])} shims: {counts['active']} active, {counts['pending']} pending, {counts['failed']} failed" in text


def test_a_shim_that_only_warns_counts_its_rows_as_warned_about_not_fixed(doctor_json):
    """A shim that warns about a bug it cannot repair (launcher-sharding-guard) is active, but its
    row is not fixed: doctor says so in its first line and names the row with the unfixed ones."""
    assert {s["id"] for s in doctor_json["shims"] if not s["repairs"]} == {"launcher-sharding-guard"}

    def doctor_with_a_guard(repairs):
        data = copy.deepcopy(doctor_json)
        data["shims"].append({
            "id": "a-guard", "fixes": ["a-hang"], "summary": "", "source": "test", "repairs": repairs,
            "selected": True, "forced": False, "applies": True,
            "applicability": "a-hang: affected (x 1 in >=1)",
            "state": "active", "call_failures": 0, "targets": [],
        })
        row = {"id": "a-hang", "shim": "a-guard", "workaround": "load one copy per rank"}
        data["applicable_rows"].insert(0, row)  # first: the list of unfixed rows is cut at 3 lines
        return data, "\n".join(report(data))

    def first_line_counts(data, text):
        active = {s["id"] for s in data["shims"] if s["state"] == "active"}
        repairing = active - {s["id"] for s in data["shims"] if not s["repairs"]}
        fixed = sum(1 for r in data["applicable_rows"] if r["shim"] in repairing)
        warned = sum(1 for r in data["applicable_rows"] if r["shim"] in active - repairing)
        first = " ".join(text.split("\n  versions:")[0].split())
        return fixed, warned, first

    data, text = doctor_with_a_guard(repairs=False)
    fixed, warned, first = first_line_counts(data, text)
    assert warned >= 1 and first.endswith(f"; {fixed} fixed by active shims, {warned} warned about")
    assert reason(data["shims"][-1]) == "warns only: a-hang"  # its line, where shims get lines of their own
    assert "a-hang (shim a-guard warns only)" in " ".join(text.split())  # the list may wrap
    verbose = " ".join(" ".join(verbose_report(data)).split())
    assert "a-hang [a-guard, which warns only: load one copy per rank]" in verbose
    data, text = doctor_with_a_guard(repairs=True)
    fixed_too, warned_less, first = first_line_counts(data, text)
    assert (fixed_too, warned_less) == (fixed + 1, warned - 1)
    still_warned = f", {warned - 1} warned about" if warned > 1 else ""
    assert first.endswith(f"; {fixed + 1} fixed by active shims{still_warned}")
    assert "warns only: a-hang" not in text and "a-hang (shim" not in " ".join(text.split())


def test_shim_lines_keep_within_the_room_given(doctor_json):
    shims = doctor_json["shims"] * 4
    for room in (3, 6, 10, 30):
        lines = shim_lines(shims, room=room)
        fits(lines, room)


def _readme_section(heading):
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index(heading + "\n")
    end = text.find("\n#", start + len(heading))
    return text[start:end]


def _top_level_names(bullet):
    """The backquoted names of ``bullet`` outside any parenthesis."""
    import re

    depth, kept = 0, []
    for ch in bullet:
        depth += ch == "("
        if depth == 0:
            kept.append(ch)
        depth -= ch == ")" and depth > 0
    return set(re.findall(r"`([A-Za-z_]+)`", "".join(kept)))


def test_readme_documents_every_top_level_key_of_doctor_json(capsys):
    section = _readme_section("## JSON output")
    bullet = section[section.index("* `doctor`:"):section.index("\n* `matrix`")]
    code = main(["doctor", "--json", "--no-import", "--no-devices"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert _top_level_names(bullet[len("* `doctor`:"):]) == set(data)
    shim_keys = bullet[bullet.index("(each:"):bullet.index("`targets`")]
    assert {k for k in data["shims"][0] if k != "targets"} <= _top_level_names(shim_keys.replace("(each:", ""))
    assert set(devmap_shims.status()) < set(data)  # status() has the keys before applicable_rows


def test_readme_lists_every_accepted_log_level():
    from devmap_shims.shims.config import LOG_LEVELS

    section = _readme_section("### Environment variable, no code change")
    row = next(line for line in section.splitlines() if line.startswith("| `DEVMAP_SHIMS_LOG`"))
    documented = row.split("|")[2].split("(")[0]
    import re

    assert set(re.findall(r"`(\w+)`", documented)) == set(LOG_LEVELS)


def test_status_summary_says_why_shims_are_off_when_the_user_disabled_them():
    code = "import devmap_shims; devmap_shims.install(); print(devmap_shims.status())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env(DEVMAP_SHIMS_DISABLE="*"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    fits(lines, 20)
    import re

    n = re.search(r"; (\d+) shims: 0 active, 0 pending, 0 failed, (\d+) off$", lines[0])
    assert n and n.group(1) == n.group(2) and int(n.group(1)) > 0, lines[0]
    assert any(line.strip().startswith(f"{n.group(1)} off (disabled by DEVMAP_SHIMS_DISABLE=*): ")
               for line in lines), proc.stdout


def test_the_kill_switch_keeps_each_bugs_shim_named_and_says_why_none_runs(doctor_json):
    from devmap_shims.shims.catalog import builtin_shims, shim_of_rows

    def doctor(*options):
        proc = subprocess.run([sys.executable, "-m", "devmap_shims", "doctor", *options], capture_output=True,
                              text=True, env=env(DEVMAP_SHIMS="0"), timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    killed = json.loads(doctor("--json"))
    assert killed["killed"] is True and killed["shims"] == []
    assert killed["applicable_rows"] == doctor_json["applicable_rows"]  # the rows and their shims, as when on
    shim_of = shim_of_rows(builtin_shims()[0])
    assert all(row["shim"] == shim_of.get(row["id"]) for row in killed["applicable_rows"])
    text = doctor("--no-import", "--no-devices")
    assert "0 off (kill switch DEVMAP_SHIMS=0)" in text
    verbose = doctor("--verbose", "--no-import", "--no-devices")
    assert "Shims: none installed (kill switch DEVMAP_SHIMS=0)" in verbose
    for row in killed["applicable_rows"]:
        assert f"{row['id']} [{row['shim'] or 'no shim: '}" in verbose.replace("\n      ", " ")
