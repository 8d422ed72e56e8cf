"""The devmap-shims command: output formats and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from devmap_shims.cli import main


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_matrix_json_rows_have_stable_keys(capsys):
    code, out, _ = run_cli(capsys, "matrix", "--json")
    data = json.loads(out)
    assert code == 0 and data["schema_version"] == 1
    keys = {tuple(row) for row in data["rows"]}
    assert len(keys) == 1  # every row has the same keys in the same order
    assert {"id", "affected", "fixed_in", "shim", "upstream"} <= set(data["rows"][0])


def test_matrix_library_filter_and_unknown_library(capsys):
    code, out, _ = run_cli(capsys, "matrix", "--json", "--library", "bitsandbytes")
    assert code == 0
    assert {row["library"] for row in json.loads(out)["rows"]} == {"bitsandbytes"}
    code, _, err = run_cli(capsys, "matrix", "--library", "tensorflow")
    assert code == 2 and "tensorflow" in err and "\n" == err[-1] and err.count("\n") == 1


def test_matrix_applicable_matches_installed_versions(capsys):
    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.versions import installed_versions

    matrix = load_matrix()
    expected = [r.id for r in matrix.rows if r.applies(installed_versions(matrix.distributions()))]
    code, out, _ = run_cli(capsys, "matrix", "--applicable", "--json")
    assert [row["id"] for row in json.loads(out)["rows"]] == expected


def test_explain_known_and_unknown(capsys):
    code, out, _ = run_cli(capsys, "explain", "bnb-quantstate-code-not-moved")
    assert code == 0
    assert "https://github.com/bitsandbytes-foundation/bitsandbytes/issues/1528" in out
    assert "upgrade (bitsandbytes>=0.45.3) to drop this shim" in out
    code, _, err = run_cli(capsys, "explain", "bnb-quantstate")
    assert code == 2 and "did you mean 'bnb-quantstate-code-not-moved'" in err
    # bug ids and shim ids are one list to suggest from: a mistyped shim id gets that shim first
    code, _, err = run_cli(capsys, "explain", "int8-state-follow-weight")
    assert code == 2 and "no bug or shim 'int8-state-follow-weight'; did you mean 'int8-state-follows-weight'" in err


def test_explain_a_shim_shows_its_module_targets_and_the_range_of_each_row(capsys):
    from devmap_shims.compat_matrix import load_matrix

    code, out, _ = run_cli(capsys, "explain", "quant-state-follows-weight")
    assert code == 0
    assert "module:      devmap_shims.hooks.bitsandbytes.quant_state_follows_weight" in out
    assert "wraps:       bitsandbytes.nn.modules:Params4bit.to" in out
    for bug_id in ("bnb-quantstate-code-not-moved", "bnb-params4bit-to-drops-bnb_quantized"):
        row = load_matrix().get(bug_id)
        line = f"fixes:       {bug_id}: {row.affected_text}; fixed in {row.fixed_in_text}"
        assert line in out.replace("\n" + " " * 15, " ")  # on one line, or wrapped under its column
    code, out, _ = run_cli(capsys, "explain", "--json", "dispatch-skip-keys")
    data = json.loads(out)
    assert data["schema_version"] == 1 and data["shim"] == "dispatch-skip-keys"
    assert [r["id"] for r in data["rows"]] == [
        "dispatch-without-skip-keys-moves-kv-cache", "accelerate-skip-keys-not-propagated"]
    assert data["rows"][1]["affected"] == {"accelerate": ">=0.20.0,<1.0.0"}
    assert data["repairs"] is True
    # a shim that warns about a hang and repairs nothing
    code, out, _ = run_cli(capsys, "explain", "launcher-sharding-guard")
    assert code == 0 and "warns about: device-map-auto-generate-hang-grpo" in out and "fixes:" not in out
    code, out, _ = run_cli(capsys, "explain", "--json", "launcher-sharding-guard")
    assert json.loads(out)["repairs"] is False
    code, out, _ = run_cli(capsys, "explain", "device-map-auto-generate-hang-grpo")  # its row
    flat = " ".join(out.split())
    assert "launcher-sharding-guard, which warns only" in flat and flat.endswith("keep the workaround.")


def test_matrix_fits_100_columns_and_keeps_each_range_whole(capsys):
    from devmap_shims.compat_matrix import load_matrix

    code, out, _ = run_cli(capsys, "matrix")
    lines = out.splitlines()
    assert code == 0 and max(len(line) for line in lines) <= 100
    for row in load_matrix().rows:
        assert any(line.split()[:1] == [row.id] for line in lines), row.id
        for spec in row.affected_text.split("; "):  # e.g. "bitsandbytes >=0.41.2,<0.45.3"
            assert any(spec in line for line in lines), spec


def test_explain_fits_100_columns_for_every_row_and_shim(capsys):
    code, out, _ = run_cli(capsys, "matrix", "--json")
    rows = json.loads(out)["rows"]
    ids = [r["id"] for r in rows] + sorted({r["shim"] for r in rows if r["shim"]})
    for name in ids:
        code, out, _ = run_cli(capsys, "explain", name)
        assert code == 0 and max(len(line) for line in out.splitlines()) <= 100, name
    code, out, _ = run_cli(capsys, "explain", "bnb-quantstate-code-not-moved")
    # the error message in the symptom keeps its own lines
    assert "\n               [..., (torch.Size([16]), device(type='cuda', index=0))]\n" in out


def test_explain_json_says_whether_it_applies(capsys):
    code, out, _ = run_cli(capsys, "explain", "--json", "balanced-memory-large-unquantized-embedding-collapse")
    data = json.loads(out)
    assert code == 0 and isinstance(data["applies_here"], bool) and data["applicability"]
    assert data["schema_version"] == 1 and data["id"] == "balanced-memory-large-unquantized-embedding-collapse"


@pytest.mark.parametrize(("env", "armed", "reason"), [
    ({"DEVMAP_SHIMS": "0"}, False, "DEVMAP_SHIMS=0 switches it off"),
    ({"DEVMAP_SHIMS_DISABLE": "quant-state-follows-weight"}, False,
     "DEVMAP_SHIMS_DISABLE=quant-state-follows-weight switches it off"),
    ({"DEVMAP_SHIMS_DISABLE": "*", "DEVMAP_SHIMS_FORCE": "quant-state-follows-weight"}, False,
     "DEVMAP_SHIMS_DISABLE=* switches it off"),
])
def test_explain_says_a_switch_keeps_a_shim_off(capsys, monkeypatch, env, armed, reason):
    """What install() would do in this environment: the kill switch and DEVMAP_SHIMS_DISABLE keep a
    shim off whatever the versions, and beat DEVMAP_SHIMS_FORCE."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, _ = run_cli(capsys, "explain", "--json", "quant-state-follows-weight")
    data = json.loads(out)
    assert code == 0 and (data["armed_here"], data["armed_reason"]) == (armed, reason)
    code, out, _ = run_cli(capsys, "explain", "quant-state-follows-weight")
    assert f"armed here:  no ({reason})" in " ".join(out.split()).replace("armed here: no", "armed here:  no")


def test_explain_does_not_offer_to_force_a_shim_whose_targets_are_for_other_versions(capsys, monkeypatch):
    from devmap_shims.versions import installed_version

    if (installed_version("transformers") or "").startswith(("4.45.", "4.46.")):
        pytest.skip("its targets are for this transformers")
    code, out, _ = run_cli(capsys, "explain", "--json", "vlm-inputs-follow-embeddings")
    data = json.loads(out)
    assert data["armed_here"] is False and data["armed_reason"].startswith("its targets are for other versions: ")
    assert "FORCE" not in data["armed_reason"]


def test_plan_decides_arming_as_explain_does_targets_for_other_versions_included(monkeypatch):
    """plan and explain ask one function whether install() would arm a shim here: a shim whose
    targets are all for other versions stays off even when forced, and a switch is named."""
    from devmap_shims.cli import plan
    from devmap_shims.hooks.accelerate import device_map_balance as module
    from devmap_shims.shims import Target
    from devmap_shims.shims.catalog import armed_here

    elsewhere = tuple(Target(t.module, t.qualname, when={"accelerate": ">=999"}, expect_params=t.expect_params,
                             wrapper=t.wrapper) for t in module.SHIM.targets)
    monkeypatch.setenv("DEVMAP_SHIMS_FORCE", "device-map-balance")
    with monkeypatch.context() as patched:
        patched.setattr(module, "SHIM", module.SHIM.replace(targets=elsewhere))
        assert plan.shim_armed() == (False, "")
        armed, why, switch = armed_here(module.SHIM, True)
        assert (armed, switch) == (False, "") and why.startswith("its targets are for other versions: ")
        patched.setenv("DEVMAP_SHIMS_DISABLE", "device-map-balance")
        assert plan.shim_armed() == (False, "DEVMAP_SHIMS_DISABLE=device-map-balance")
    assert plan.shim_armed() == (True, "")  # its own targets: forced on


def test_armed_here_says_a_shim_that_only_warns_warns(monkeypatch):
    """launcher-sharding-guard cannot fix the hang of its row: explain must not say it fixes it."""
    from devmap_shims.shims import Shim, Target
    from devmap_shims.shims.catalog import armed_here

    for name in ("DEVMAP_SHIMS", "DEVMAP_SHIMS_DISABLE", "DEVMAP_SHIMS_FORCE"):
        monkeypatch.delenv(name, raising=False)
    targets = (Target("json", "dumps"),)
    assert armed_here(Shim("warner", ("row",), targets, repairs=False), True) == (
        True, "a row it warns about applies", "")
    assert armed_here(Shim("fixer", ("row",), targets), True) == (True, "a row it fixes applies", "")


def test_armed_here_says_why_a_shim_none_of_whose_rows_applies_is_off(monkeypatch):
    """explain's armed_reason is what decides it, then how to arm it anyway."""
    from devmap_shims.shims import Shim, Target
    from devmap_shims.shims.catalog import armed_here

    for name in ("DEVMAP_SHIMS", "DEVMAP_SHIMS_DISABLE", "DEVMAP_SHIMS_FORCE"):
        monkeypatch.delenv(name, raising=False)
    targets = (Target("json", "dumps"),)
    assert armed_here(Shim("fixer", ("row",), targets), False) == (
        False, "none of its rows applies to the installed versions (DEVMAP_SHIMS_FORCE=fixer arms it anyway)",
        "")


def test_strict_mode_refusing_a_mistyped_switch_is_a_usage_error_with_the_whole_message(capsys, monkeypatch):
    """DEVMAP_SHIMS_STRICT=1 makes install() refuse DEVMAP_SHIMS_DISABLE=typo: doctor says so as a
    usage error (exit 2), the message whole (every known id), not as a crash cut at 300 characters."""
    from devmap_shims.shims.catalog import builtin_ids

    monkeypatch.setenv("DEVMAP_SHIMS_STRICT", "1")
    monkeypatch.setenv("DEVMAP_SHIMS_DISABLE", "typo")
    code, out, err = run_cli(capsys, "doctor", "--json", "--no-import", "--no-devices")
    assert (code, out) == (2, "")
    assert err.startswith(
        "devmap-shims doctor: error: DEVMAP_SHIMS_DISABLE names unknown shim 'typo'; known shims: ")
    assert all(shim_id in err for shim_id in builtin_ids())
    assert "strict mode" in err and "ValueError" not in err


def test_doctor_json(capsys):
    code, out, _ = run_cli(capsys, "doctor", "--json", "--no-import", "--no-devices")
    data = json.loads(out)
    assert code == 0
    assert {"versions", "shims", "applicable_rows", "auto_enable", "warnings"} <= set(data)
    assert all(s["state"] in ("pending", "active", "skipped", "failed") for s in data["shims"])


def test_doctor_reports_the_start_files(capsys, monkeypatch):
    monkeypatch.setenv("DEVMAP_SHIMS", "1")
    code, out, _ = run_cli(capsys, "doctor", "--json", "--no-import", "--no-devices")
    auto = json.loads(out)["auto_enable"]
    assert code == 0
    assert [os.path.basename(p) for p in auto["pth_files"]] == ["devmap_shims.pth"]
    assert [os.path.basename(p) for p in auto["start_modules"]] == ["_devmap_shims_start.py"]
    assert auto["active"] is True


def test_doctor_reports_the_libraries_imported_when_it_reports():
    # --no-import still lists the GPUs, which imports torch: the report says so, in every field
    proc = subprocess.run([sys.executable, "-m", "devmap_shims", "doctor", "--json", "--no-import"],
                          capture_output=True, text=True)
    data = json.loads(proc.stdout)
    assert proc.returncode == 0 and set(data["module_versions"]) <= set(data["imported_now"]), data
    torch_installed = data["versions"].get("torch") is not None
    assert ("torch" in data["imported_now"]) == torch_installed


def test_usage_errors_exit_2():
    for args in (["bogus"], ["matrix", "--json", "--markdown"], ["explain"], ["run"]):
        proc = subprocess.run([sys.executable, "-m", "devmap_shims", *args], capture_output=True, text=True)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_run_help_is_runs_own_and_after_the_separator_belongs_to_the_command():
    proc = subprocess.run([sys.executable, "-m", "devmap_shims", "run", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: devmap-shims run [-h] -- COMMAND"), proc.stderr
    assert "Exits with COMMAND's status" in " ".join(proc.stdout.split())
    proc = subprocess.run([sys.executable, "-m", "devmap_shims", "run", "--", "--help"], capture_output=True, text=True)
    assert proc.returncode == 127 and "cannot run '--help'" in proc.stderr


def test_run_sets_the_variable():
    proc = subprocess.run(
        [sys.executable, "-m", "devmap_shims", "run", "--", sys.executable, "-c",
         "import os, devmap_shims; print(os.environ['DEVMAP_SHIMS'], devmap_shims.is_installed())"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "True"]


def _row_with_text_beyond_ascii():
    """A matrix row whose explanation needs more than ASCII (a ``·`` in its root cause)."""
    from devmap_shims.compat_matrix import load_matrix

    return next(r for r in load_matrix().rows if any(ord(c) > 127 for c in r.root_cause + r.title + r.symptom))


def test_a_terminal_without_utf8_gets_escapes_instead_of_a_crash_part_way():
    row = _row_with_text_beyond_ascii()
    ascii_io = dict(os.environ, PYTHONIOENCODING="ascii")
    c_locale = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "PYTHONIOENCODING"))}
    c_locale.update(LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")  # ascii, errors=surrogateescape
    for env in (ascii_io, c_locale):
        for args in (["explain", row.id], ["matrix", "--markdown"]):
            proc = subprocess.run([sys.executable, "-m", "devmap_shims", *args], capture_output=True, env=env)
            assert proc.returncode == 0, (args, proc.stderr[-500:])
            assert proc.stdout.isascii() and (b"\\x" in proc.stdout or b"\\u" in proc.stdout), args


def test_main_called_in_process_gives_the_hosts_streams_back_as_they_were(monkeypatch):
    import io

    row = _row_with_text_beyond_ascii()
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stream)
    assert main(["explain", row.id]) == 0
    assert stream.errors == "strict"  # the host's setting again
    stream.flush()
    assert b"\\x" in raw.getvalue() or b"\\u" in raw.getvalue()
    monkeypatch.setattr(sys, "stderr", None)
    assert main(["matrix", "--library", "tensorflow"]) == 2 and sys.stderr is None
    stream.flush()
    assert b"tensorflow" not in raw.getvalue()  # the error of a closed stderr is not written to stdout


def test_a_closed_stdout_ends_every_format_quietly():
    for args in ("matrix", "matrix --json", "matrix --markdown", "explain accelerate-dispatched-to-keeps-hooks --json"):
        proc = subprocess.run(["bash", "-c", f"{sys.executable} -m devmap_shims {args} >&-"], capture_output=True,
                              text=True)
        assert proc.returncode == 0 and proc.stderr == "", (args, proc.stderr)
