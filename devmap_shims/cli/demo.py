"""``devmap-shims demo``: the whole compat matrix against the installed stack, on simulated GPUs.

Every known bug that applies here and has a scenario is replayed twice, without the shims (the bug
shows) and with them (it does not). Every other row is accounted for in one line: why it does not
apply ("fixed in transformers 4.46.0", "introduced in accelerate 1.15.0"), or, for a row that
applies but cannot be replayed, what covers it (a shim, a workaround). Rows that do not apply are
replayed too while the time budget lasts (``--all``: every one), to show the library behaving.

Needs no GPU, no network and no weights: every scenario builds a tiny model from a config in code
and runs it on the simulated multi-GPU machine of :mod:`devmap_shims.testing`. The libraries'
progress bars and warnings are switched off and whatever a scenario prints is kept out of the
report; the only other output is one progress line per replay on stderr (``--json`` too).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

from devmap_shims.cli._demo_text import PROBLEM_VERDICTS, WIDTH, render, summarize, wrap  # noqa: F401 (demo.wrap)
from devmap_shims.cli._output import UsageError, no_such_id, print_json
from devmap_shims.cli._quiet import captured, quiet_libraries
from devmap_shims.compat_matrix.not_affected import not_affected_reason

#: seconds after the start past which rows that do not apply are no longer replayed (``--all``: no limit)
REPLAY_BUDGET_S = 60.0
#: ``schema_version`` of ``demo --json``; 2 added ``versions``, ``summary`` and ``bugs``, 3
#: ``broken_shims``
SCHEMA_VERSION = 3



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print every row and replay as JSON")
    parser.add_argument(
        "--all", action="store_true",
        help=f"replay the scenarios of rows that do not apply too, all of them (by default: while "
             f"the first {REPLAY_BUDGET_S:.0f} s last)",
    )
    parser.add_argument("ids", nargs="*", metavar="ID",
                        help="only these matrix rows (replayed whether they apply or not); "
                        "a shim id: the rows it fixes")


# -- replaying ----------------------------------------------------------------------------------
def collect(
    ids: List[str],
    replay_all: bool,
    progress: Optional[Callable[[str], None]] = None,
    budget: float = REPLAY_BUDGET_S,
    start: Optional[float] = None,
) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], Dict[str, Optional[str]], List[str]]:
    """Replay and account for the matrix rows (``ids``: only those, every one replayed).

    Returns ``(bugs, rows, versions, broken)``: one entry per matrix row (see :func:`bug_entry`),
    one per replayed scenario (the ``rows`` of ``--json``), the installed versions, and a message
    for each built-in shim module that failed to import (its rows then read as if no shim fixed
    them, and its scenarios are missing: each message is a problem). Rows that apply are
    replayed first; the others while ``budget`` seconds have not passed since ``start`` (a
    ``time.perf_counter()``; default: now), and always with ``replay_all``.
    """
    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.scenarios import all_scenarios
    from devmap_shims.shims.catalog import builtin_shims, shim_of_rows
    from devmap_shims.versions import TARGET_DISTRIBUTIONS, installed_versions

    start = time.perf_counter() if start is None else start
    matrix = load_matrix()
    scenarios = all_scenarios()
    shims, broken = builtin_shims()
    shim_of = shim_of_rows(shims)
    summary_of = {shim.id: shim.summary for shim in shims}
    warns_only = {shim.id for shim in shims if not shim.repairs}
    versions = installed_versions(sorted(set(matrix.distributions()) | set(TARGET_DISTRIBUTIONS)))
    rows_of: Dict[str, List[str]] = {}  # a shim id asks for the rows it fixes
    for bug_id, shim_id in shim_of.items():
        rows_of.setdefault(shim_id, []).append(bug_id)
    asked: List[str] = []
    for name in ids:
        if name in rows_of and name not in matrix:
            asked += rows_of[name]
        elif name in matrix:
            asked.append(name)
        else:
            raise UsageError(no_such_id(name, [r.id for r in matrix.rows] + list(rows_of)))
    ids = asked
    chosen = [row for row in matrix.rows if not ids or row.id in ids]
    applies = {row.id: row.applicability(versions) for row in chosen}
    order = [r for r in chosen if applies[r.id][0]] + [r for r in chosen if not applies[r.id][0]]
    total = sum(len(scenarios.get(r.id, [])) for r in order)
    done = 0
    replays: Dict[str, List[Dict[str, Any]]] = {}
    skipped: Dict[str, bool] = {}
    for row in order:
        affected, why = applies[row.id]
        items = scenarios.get(row.id, [])
        if items and not (affected or ids or replay_all) and time.perf_counter() - start > budget:
            skipped[row.id] = True
            done += len(items)
            continue
        shim = shim_of.get(row.id)
        for item in items:
            done += 1
            if progress:
                progress(f"[{done}/{total}] replaying {row.id} ...")
            replays.setdefault(row.id, []).append(_replay_row(row.id, item, affected, why, shim))
    bugs = [
        bug_entry(row, applies[row.id], versions, shim_of.get(row.id), summary_of, replays.get(row.id, []),
                   skipped.get(row.id, False), warns_only=warns_only)
        for row in chosen
    ]
    rows = [entry for row in chosen for entry in replays.get(row.id, [])]
    return bugs, rows, versions, broken


def _replay_row(bug_id: str, item: Any, affected: bool, why: str, shim: Optional[str]) -> Dict[str, Any]:
    from devmap_shims.scenarios.replay import replay
    from devmap_shims.shims.config import read_settings

    off = read_settings().switched_off(shim) if shim else ""  # install() would not arm it here
    with captured():
        without = replay(item, shims=False)
        replayed = shim and not off and not without.unavailable
        with_shims = replay(item, shims=True, shim_id=shim) if replayed else None
    return {
        "switched_off_by": off or None,
        "bug_id": bug_id,
        "scenario": item.name,
        "title": item.title,
        "affected_here": affected,
        "applicability": why,
        "shim": shim,
        "without_shims": without.as_dict(),
        "with_shims": with_shims.as_dict() if with_shims else None,
        "verdict": _verdict(affected, without, with_shims, off),
    }


def _verdict(applies: bool, without: Any, with_shims: Any, off: str = "") -> str:
    if without.unavailable:
        return "unavailable"
    if applies:
        if without.ok:
            return "not reproduced"  # the row says affected, the stack disagrees
        if with_shims is None:  # no shim, or one a switch keeps off
            return f"reproduced ({off} switches the shim off)" if off else (
                "reproduced (no shim: see workaround)")
        return "fixed" if with_shims.ok else "NOT FIXED"
    ok = without.ok and (with_shims is None or with_shims.ok)
    return "ok (not affected)" if ok else "UNEXPECTED FAILURE"


def _first_sentence(text: Optional[str]) -> str:
    text = " ".join((text or "").split())
    for end in (". ", ".\n"):
        if end in text:
            return text[: text.index(end) + 1]
    return text


def bug_entry(
    row: Any, applicability: Tuple[bool, str], versions: Dict[str, Optional[str]], shim: Optional[str],
    summary_of: Dict[str, str], replays: List[Dict[str, Any]], skipped: bool,
    warns_only: Collection[str] = (),
) -> Dict[str, Any]:
    """One matrix row's part of the story: ``status`` is ``fixed`` (replayed: the bug shows without
    the shim, not with it), ``shim-not-replayed`` (applies, a shim covers it, no scenario runs
    here), ``workaround-only`` (applies, no shim), ``problem`` (a replay went wrong) or
    ``not-affected`` (with ``not_affected_reason`` and ``replayed``: ``works``, ``skipped`` for
    the time budget, ``unavailable`` or None when it has no scenario). ``shim_warns_only``: the
    shim is in ``warns_only``, the ids of shims that warn about their rows and do not repair them,
    and no switch keeps it off (then it does not even warn)."""
    affected, why = applicability
    verdicts = [r["verdict"] for r in replays]
    ran = [v for v in verdicts if v != "unavailable"]
    if any(v in PROBLEM_VERDICTS for v in verdicts):
        status = "problem"
    elif not affected:
        status = "not-affected"
    elif shim is None:
        status = "workaround-only"
    elif ran and all(v == "fixed" for v in ran):
        status = "fixed"
    else:
        status = "shim-not-replayed"
    if not replays:
        replayed = "skipped" if skipped else None
    elif ran:
        replayed = "works" if not affected and all(v == "ok (not affected)" for v in ran) else "reproduced"
    else:
        replayed = "unavailable"
    not_replayed_because = None
    off = next((r["switched_off_by"] for r in replays if r.get("switched_off_by")), None)
    if off is None and shim and not replays:  # no replay asked the switches: ask them here
        from devmap_shims.shims.config import read_settings

        off = read_settings().switched_off(shim) or None
    if status == "shim-not-replayed" and off:
        not_replayed_because = f"{off} switches the shim off"
    elif status == "shim-not-replayed":
        not_replayed_because = (
            "; ".join(r["without_shims"]["detail"] for r in replays) if replays
            else _first_sentence(row.no_scenario) or "no scenario yet"
        )
    return {
        "bug_id": row.id,
        "title": row.title,
        "library": row.library,
        "affected_here": affected,
        "applicability": why,
        "not_affected_reason": None if affected else not_affected_reason(row, versions),
        "fixed_in": row.fixed_in_text,
        "shim": shim,
        "shim_summary": summary_of.get(shim) if shim else None,
        "shim_warns_only": bool(shim) and shim in warns_only and not off,
        "workaround": " ".join(row.workaround.split()) or None,
        "scenarios": [r["scenario"] for r in replays],
        "replayed": replayed,
        "not_replayed_because": not_replayed_because,
        "status": status,
    }


# -- the command --------------------------------------------------------------------------------
def _progress_printer(stream: Any) -> Tuple[Callable[[str], None], Callable[[], None]]:
    """One short line per replay on ``stream``; on a terminal each overwrites the last."""
    tty = hasattr(stream, "isatty") and stream.isatty()

    def show(message: str) -> None:
        text = message if len(message) <= WIDTH - 1 else message[: WIDTH - 5] + " ..."
        if tty:
            stream.write("\r\033[K" + text)
        else:
            stream.write(text + "\n")
        stream.flush()

    def done() -> None:
        if tty:
            stream.write("\r\033[K")
            stream.flush()

    return show, done


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    quiet_libraries()
    show, done = _progress_printer(sys.stderr)  # stderr: --json keeps stdout for the JSON alone
    try:
        bugs, rows, versions, broken = collect(list(args.ids), args.all, show, start=started)
    finally:
        done()
    summary = summarize(bugs, broken)
    if args.json:
        print_json({"schema_version": SCHEMA_VERSION, "versions": versions, "summary": summary,
                    "seconds": round(time.perf_counter() - started, 1), "broken_shims": broken, "bugs": bugs,
                    "rows": rows})
    else:
        print(render(bugs, rows, versions, selected=bool(args.ids), seconds=time.perf_counter() - started,
                     broken=broken))
    return 1 if summary["problems"] else 0
