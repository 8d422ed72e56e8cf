"""``devmap-shims demo`` on the installed stack: every matrix row accounted for, in 100 columns,
with no library progress bar or warning in the output, and a closing line that adds up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from devmap_shims.cli import demo
from devmap_shims.compat_matrix import load_matrix
from devmap_shims.compat_matrix.not_affected import not_affected_reason
from devmap_shims.scenarios import all_scenarios
from devmap_shims.shims.catalog import builtin_shims, shim_of_rows
from devmap_shims.versions import TARGET_DISTRIBUTIONS, installed_versions, release_tuple, version_in

REPO = Path(__file__).resolve().parents[2]
MATRIX = load_matrix()
VERSIONS = installed_versions(sorted(set(MATRIX.distributions()) | set(TARGET_DISTRIBUTIONS)))
SCENARIOS = all_scenarios()
SHIMS = builtin_shims()[0]
SHIM_OF = shim_of_rows(SHIMS)
SUMMARY_OF = {shim.id: shim.summary for shim in SHIMS}
WARNS_ONLY = {shim.id for shim in SHIMS if not shim.repairs}

#: what tqdm, diffusers' pipeline loader and transformers' logger print when they are not silenced
LIBRARY_NOISE = re.compile("[\u2588-\u258f]" r"|it/s|s/it|w/s|\d+%\||Loading (pipeline|checkpoint)|\[transformers\]"
                           r"|Warning|warn\(|bitsandbytes was compiled")


# -- why a row does not apply -------------------------------------------------------------------
def test_every_row_that_does_not_apply_says_why_in_terms_of_its_range():
    for row in MATRIX.rows:
        reason = not_affected_reason(row, VERSIONS)
        if row.applies(VERSIONS):
            assert reason is None, row.id
            continue
        assert reason, row.id
        match = re.fullmatch(r"fixed in (\S+) (\S+)", reason)
        if match:
            dist, fixed = match.groups()
            assert row.fixed_in[dist] == fixed and release_tuple(VERSIONS[dist]) >= release_tuple(fixed), row.id
            assert not version_in(VERSIONS[dist], row.affected[dist]), row.id
            continue
        match = re.fullmatch(r"introduced in (\S+) (\S+)", reason)
        if match:
            dist, first = match.groups()
            assert dist == row.library and release_tuple(VERSIONS[dist]) < release_tuple(first), row.id
            assert first in row.affected[dist], row.id
            continue
        match = re.fullmatch(r"(?:needs|affects) (\S+) (\S+)(?: only)?", reason)
        if match:
            dist, spec = match.groups()
            assert row.affected[dist] == spec and not version_in(VERSIONS[dist], spec), row.id
            continue
        match = re.fullmatch(r"(\S+) (\S+) is left out of (\S+)", reason)
        if match:
            dist, version, spec = match.groups()
            assert version == VERSIONS[dist] and spec == row.affected[dist] and "!=" in spec, row.id
            continue
        match = re.fullmatch(r"(\S+) is not installed", reason)
        assert match and VERSIONS.get(match.group(1)) is None, (row.id, reason)


def test_the_first_fixed_release_reads_fixed_and_a_release_before_the_range_reads_introduced():
    checked = 0
    for row in MATRIX.rows:
        if len(row.affected) != 1:
            continue
        (dist, spec), = row.affected.items()
        if not row.unfixed and dist in row.fixed_in and not version_in(row.fixed_in[dist], spec):
            assert not_affected_reason(row, {dist: row.fixed_in[dist]}) == f"fixed in {dist} {row.fixed_in[dist]}"
            checked += 1
        lower = re.match(r">=(\d[\d.]*)", spec)
        if lower and dist == row.library and not version_in("0.0.1", spec):
            assert not_affected_reason(row, {dist: "0.0.1"}) == f"introduced in {dist} {lower.group(1)}"
            checked += 1
        assert not_affected_reason(row, {dist: None}) == f"{dist} is not installed"
    assert checked >= 20  # most rows have one range and a fixed release


# -- the report, from the real matrix -----------------------------------------------------------
def _bugs_without_replays():
    return [
        demo.bug_entry(row, row.applicability(VERSIONS), VERSIONS, SHIM_OF.get(row.id), SUMMARY_OF, [], False,
                       warns_only=WARNS_ONLY)
        for row in MATRIX.rows
    ]


def _closing_numbers(text):
    flat = " ".join(text.split())
    match = re.search(r"(\d+) known bugs? (?:apply|applies) to your stack; (\d+) fixed by devmap-shims"
                      r"(?:, (\d+) by a shim not replayed here)?(?:, (\d+) only warned about by a shim)?"
                      r"(?:, (\d+) with a workaround only)?\.", flat)
    assert match, text[-600:]
    problems = re.search(r"(\d+) problems?;", flat)
    return [int(n or 0) for n in match.groups()] + [int(problems.group(1))]


def test_every_row_is_in_the_report_once_every_line_fits_and_the_closing_line_adds_up():
    bugs = _bugs_without_replays()
    text = demo.render(bugs, [], VERSIONS, seconds=12.0)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= demo.WIDTH, [line for line in lines if len(line) > demo.WIDTH]
    for row in MATRIX.rows:  # each row's id starts exactly one line (its block or its line)
        starts = [line for line in lines if re.match(rf"(\S+ \S+ +| +){re.escape(row.id)}(\s|$)", line)]
        assert len(starts) == 1, (row.id, starts)
    applicable = [row for row in MATRIX.rows if row.applies(VERSIONS)]
    with_shim = sum(1 for row in applicable if row.id in SHIM_OF)
    warned = sum(1 for row in applicable if SHIM_OF.get(row.id) in WARNS_ONLY)
    # nothing replayed: every row that applies is covered by its shim or by a workaround only
    assert _closing_numbers(text) == [
        len(applicable), 0, with_shim - warned, warned, len(applicable) - with_shim, 0]
    summary = demo.summarize(bugs)
    assert summary["applicable"] == summary["fixed"] + summary["shim_not_replayed"] + summary["workaround_only"]
    assert summary["not_affected"] == len(MATRIX.rows) - len(applicable)


def test_a_replay_that_reproduces_and_fixes_a_bug_counts_as_fixed_and_a_failed_one_as_a_problem():
    row = next(r for r in MATRIX.rows if r.id in SHIM_OF)
    replay = {
        "bug_id": row.id, "scenario": "s", "title": row.title, "affected_here": True, "applicability": "",
        "shim": SHIM_OF[row.id], "verdict": "fixed",
        "without_shims": {"ok": False, "detail": "RuntimeError: " + "word " * 60, "seconds": 1.0, "unavailable": False},
        "with_shims": {"ok": True, "detail": "fine", "seconds": 1.0, "unavailable": False},
    }
    fixed = demo.bug_entry(row, (True, "in range"), VERSIONS, SHIM_OF[row.id], SUMMARY_OF, [replay], False)
    broken = demo.bug_entry(row, (True, "in range"), VERSIONS, SHIM_OF[row.id], SUMMARY_OF,
                            [dict(replay, verdict="NOT FIXED")], False)
    assert (fixed["status"], broken["status"]) == ("fixed", "problem")
    summary = demo.summarize([fixed, broken])
    assert (summary["applicable"], summary["fixed"], summary["problems"]) == (2, 1, 1)
    text = demo.render([fixed], [replay], VERSIONS)
    assert max(len(line) for line in text.splitlines()) <= demo.WIDTH
    assert any(line.rstrip().endswith("...") for line in text.splitlines())  # the long error is elided
    text = demo.render([broken], [dict(replay, verdict="NOT FIXED")], VERSIONS)
    assert re.search(rf"^\S PROBLEM  {re.escape(row.id)}$", text, re.M) and "verdict: NOT FIXED" in text
    assert _closing_numbers(text) == [1, 0, 0, 0, 0, 1]


def test_a_row_whose_shim_only_warns_is_warned_about_not_fixed_and_shows_its_workaround():
    """launcher-sharding-guard warns about a hang it cannot repair: demo must not count its row as
    covered by a shim the way a repairing shim's is, and the user needs the workaround."""
    assert WARNS_ONLY == {"launcher-sharding-guard"}
    row = MATRIX.get("device-map-auto-generate-hang-grpo")
    warned = demo.bug_entry(row, (True, "in range"), VERSIONS, SHIM_OF[row.id], SUMMARY_OF, [], False,
                            warns_only=WARNS_ONLY)
    plain = demo.bug_entry(row, (True, "in range"), VERSIONS, SHIM_OF[row.id], SUMMARY_OF, [], False)
    assert (warned["status"], warned["shim_warns_only"], plain["shim_warns_only"]) == (
        "shim-not-replayed", True, False)
    summary = demo.summarize([warned])
    assert (summary["shim_not_replayed"], summary["warned_only"]) == (1, 1)
    text = demo.render([warned], [], VERSIONS)
    assert re.search(rf"^\S warns  {re.escape(row.id)}$", text, re.M), text
    assert "workaround: Under `accelerate launch`" in text
    assert _closing_numbers(text) == [1, 0, 0, 1, 0, 0]
    text = demo.render([plain], [], VERSIONS)  # a shim that repairs: no workaround, counted as before
    assert "workaround:" not in text and _closing_numbers(text) == [1, 0, 1, 0, 0, 0]


def test_a_warning_shim_switched_off_does_not_read_as_warning():
    """DEVMAP_SHIMS_DISABLE=launcher-sharding-guard: the shim neither warns nor repairs, so its row
    reads as a shim kept off by that switch, not as "warns"."""
    row = MATRIX.get("device-map-auto-generate-hang-grpo")
    replay = {
        "bug_id": row.id, "scenario": "s", "title": row.title, "affected_here": True, "applicability": "",
        "shim": SHIM_OF[row.id], "verdict": "unavailable", "switched_off_by": "DEVMAP_SHIMS_DISABLE",
        "without_shims": {"ok": False, "detail": "needs two processes", "seconds": 0.0, "unavailable": True},
        "with_shims": None,
    }
    off = demo.bug_entry(row, (True, "in range"), VERSIONS, SHIM_OF[row.id], SUMMARY_OF, [replay], False,
                         warns_only=WARNS_ONLY)
    assert (off["status"], off["shim_warns_only"]) == ("shim-not-replayed", False)
    assert off["not_replayed_because"] == "DEVMAP_SHIMS_DISABLE switches the shim off"
    assert demo.summarize([off])["warned_only"] == 0
    text = demo.render([off], [replay], VERSIONS)
    assert not re.search(r"^\S warns ", text, re.M), text
    assert re.search(rf"^\S shim  {re.escape(row.id)}$", text, re.M), text


def test_a_warning_shim_switched_off_on_a_row_without_replays_does_not_read_as_warning(monkeypatch):
    monkeypatch.setenv("DEVMAP_SHIMS_DISABLE", "launcher-sharding-guard")
    row = MATRIX.get("device-map-auto-generate-hang-grpo")
    off = demo.bug_entry(row, (True, "in range"), VERSIONS, SHIM_OF[row.id], SUMMARY_OF, [], False,
                         warns_only=WARNS_ONLY)
    assert off["shim_warns_only"] is False
    assert off["not_replayed_because"] == "DEVMAP_SHIMS_DISABLE=launcher-sharding-guard switches the shim off"


def test_wrapping_never_cuts_a_version_range_or_a_name_from_its_version():
    texts = [f"affects {row.affected_text} and is fixed in {row.fixed_in_text}" for row in MATRIX.rows]
    for width in (40, 57, 100):  # the longest range is 25 characters
        for text in texts:
            lines = demo.wrap(text, "  ", "    ", width=width)
            assert " ".join(" ".join(lines).split()) == " ".join(text.split())
            assert all(len(line) <= width for line in lines)
            for line, after in zip(lines, lines[1:]):  # a name stays with its version where both fit
                name = re.search(r"(accelerate|transformers|bitsandbytes|diffusers|torch)$", line)
                assert not name or len(name.group(1) + " " + after.split()[0]) > width - 4, (width, lines)


def test_progress_overwrites_one_line_on_a_terminal_and_writes_lines_elsewhere():
    class Stream:
        def __init__(self, tty):
            self.text, self.tty = "", tty

        def write(self, text):
            self.text += text

        def flush(self):
            pass

        def isatty(self):
            return self.tty

    tty, pipe = Stream(True), Stream(False)
    for stream in (tty, pipe):
        show, done = demo._progress_printer(stream)
        show("[1/2] replaying a-row ...")
        show("[2/2] replaying " + "b" * 200)
        done()
    assert "\n" not in tty.text and tty.text.endswith("\r\x1b[K") and tty.text.count("\r") == 3
    assert pipe.text.count("\n") == 2 and all(len(line) < demo.WIDTH for line in pipe.text.splitlines())


# -- a real run ---------------------------------------------------------------------------------
def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TQDM_", "TRANSFORMERS_", "DIFFUSERS_", "HF_HUB_DISABLE", "PYTHONWARNINGS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONIOENCODING"] = "utf-8"
    return env


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "devmap_shims", "demo", *args], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=600)


def _row_to_replay(applies):
    """A row with a scenario (diffusers' first: its pipelines print progress bars) that applies or not."""
    rows = [r for r in MATRIX.rows if SCENARIOS.get(r.id) and r.applies(VERSIONS) == applies
            and (not applies or r.id in SHIM_OF)
            and all(VERSIONS.get(d) for item in SCENARIOS[r.id] for d in item.needs)]
    rows.sort(key=lambda r: ("diffusers" not in {d for item in SCENARIOS[r.id] for d in item.needs},
                             len(SCENARIOS[r.id])))
    return rows[0] if rows else None


def test_a_real_run_prints_no_library_progress_or_warning_fits_100_columns_and_adds_up():
    fixed_row, other_row = _row_to_replay(True), _row_to_replay(False)
    ids = [row.id for row in (fixed_row, other_row) if row]
    if not ids:
        pytest.skip("no row with a scenario that runs on this stack")
    proc = _cli(*ids)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out_lines = proc.stdout.splitlines()
    assert not LIBRARY_NOISE.search(proc.stdout), proc.stdout
    noise = [line for line in proc.stderr.splitlines() if not re.fullmatch(r"\[\d+/\d+\] replaying \S+ \.\.\.", line)]
    assert not noise, proc.stderr[-3000:]
    assert max(len(line) for line in out_lines) <= demo.WIDTH, [line for line in out_lines if len(line) > demo.WIDTH]
    applies, fixed, by_shim, warned, workaround, problems = _closing_numbers(proc.stdout)
    assert applies == (1 if fixed_row else 0) and problems == 0
    assert fixed == sum(1 for line in out_lines if re.match(r"\S fixed  \S", line)) == applies
    assert by_shim == warned == workaround == 0
    if other_row:  # replayed (working) or unavailable here, with the reason it does not apply
        reason = not_affected_reason(other_row, VERSIONS)
        assert any(re.fullmatch(rf"  {re.escape(other_row.id)} +{re.escape(reason)}", line) for line in out_lines)
        assert {"Not affected here; replayed, the libraries behave (1):",
                "Not affected here; no scenario that runs on this stack (1):"} & set(out_lines), proc.stdout


def test_json_keeps_every_row_with_why_it_does_not_apply():
    without_scenario = [row.id for row in MATRIX.rows if not SCENARIOS.get(row.id)]
    proc = _cli("--json", *without_scenario)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["schema_version"] == demo.SCHEMA_VERSION and data["rows"] == []
    assert [bug["bug_id"] for bug in data["bugs"]] == without_scenario
    for bug in data["bugs"]:
        row = MATRIX.get(bug["bug_id"])
        assert bug["affected_here"] == row.applies(VERSIONS)
        assert bug["not_affected_reason"] == not_affected_reason(row, VERSIONS)
        assert bug["status"] == ("not-affected" if not bug["affected_here"]
                                 else "shim-not-replayed" if row.id in SHIM_OF else "workaround-only")
        assert bug["shim_warns_only"] == (SHIM_OF.get(row.id) in WARNS_ONLY)  # the CLI reads each shim
    assert any(bug["shim_warns_only"] for bug in data["bugs"])
    assert data["summary"] == demo.summarize(data["bugs"])


def test_a_shim_module_that_fails_to_import_is_a_problem_not_a_row_without_a_shim():
    module = "devmap_shims.hooks.accelerate.hooks_follow_moved_weights"
    bug_id = "accelerate-dispatched-to-keeps-hooks"
    assert SHIM_OF[bug_id] == "hooks-follow-moved-weights"
    code = (f"import sys; sys.modules[{module!r}] = None  # import of it now raises ImportError\n"
            "from devmap_shims.cli import main; sys.exit(main(sys.argv[1:]))")

    def demo_with_broken_module(*args):
        return subprocess.run([sys.executable, "-c", code, "demo", *args, bug_id], capture_output=True, text=True,
                              env=_env(), cwd=REPO, timeout=600)

    proc = demo_with_broken_module("--json")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    (message,) = data["broken_shims"]
    assert re.search(rf"built-in shim module {re.escape(module)} failed to import: (ModuleNotFound|Import)Error", message)
    assert message.endswith(f"(so nothing fixes {bug_id})")  # read from the module's file
    assert data["summary"]["problems"] == 1 and data["summary"] == demo.summarize(data["bugs"], data["broken_shims"])
    (bug,) = data["bugs"]
    assert bug["shim"] is None  # what a broken module leaves: the reason it is counted as a problem
    proc = demo_with_broken_module()
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert "Shim modules that failed to import (1); the rows they fix read as having no shim:" in lines
    assert any(f"PROBLEM  built-in shim module {module}" in line for line in lines), proc.stdout
    assert "1 problem; 0 scenarios replayed" in proc.stdout and max(map(len, lines)) <= demo.WIDTH


def test_json_output_keeps_stdout_for_the_json_and_the_progress_lines_on_stderr():
    row = _row_to_replay(False) or _row_to_replay(True)
    if row is None:
        pytest.skip("no row with a scenario that runs on this stack")
    proc = _cli("--json", row.id)
    data = json.loads(proc.stdout)
    assert [r["bug_id"] for r in data["rows"]] == [row.id] * len(SCENARIOS[row.id])
    lines = proc.stderr.splitlines()
    assert lines == [f"[{i}/{len(lines)}] replaying {row.id} ..." for i in range(1, len(lines) + 1)], proc.stderr
    assert len(lines) == len(SCENARIOS[row.id])


def test_the_replay_of_a_row_whose_shim_a_switch_keeps_off_names_the_switch(monkeypatch):
    """DEVMAP_SHIMS_DISABLE=<shim>: the row is replayed without the shim only, and its verdict names
    the switch rather than saying there is no shim."""
    from types import SimpleNamespace

    from devmap_shims.scenarios import replay as replay_module
    from devmap_shims.scenarios.replay import Outcome

    runs = []

    def replayed(item, shims, shim_id=None):
        runs.append(shims)
        return Outcome(ok=False, detail="the bug shows", seconds=0.0)

    monkeypatch.setattr(replay_module, "replay", replayed)
    monkeypatch.setenv("DEVMAP_SHIMS_DISABLE", "generate-input-device")
    item = SimpleNamespace(name="s", title="t")
    bug_id = "transformers-generate-mask-device"
    row = demo._replay_row(bug_id, item, True, "in range", "generate-input-device")
    assert runs == [False] and row["with_shims"] is None
    assert row["verdict"] == "reproduced (DEVMAP_SHIMS_DISABLE=generate-input-device switches the shim off)"
    monkeypatch.delenv("DEVMAP_SHIMS_DISABLE")
    row = demo._replay_row(bug_id, item, True, "in range", None)
    assert row["verdict"] == "reproduced (no shim: see workaround)"
