"""The text of ``devmap-shims demo``'s report and the numbers of its closing line: a block per
row that applies (or misbehaved), a line per other row, all within :data:`WIDTH` columns."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence

from devmap_shims._text import wrap as text_wrap

#: the report's width: every line fits
WIDTH = 100
#: a verdict of a scenario that means something is wrong
PROBLEM_VERDICTS = ("NOT FIXED", "UNEXPECTED FAILURE", "not reproduced")


def summarize(bugs: List[Dict[str, Any]], broken: Sequence[str] = ()) -> Dict[str, int]:
    """The closing line's numbers, counted from the rows' ``status``; each shim module in
    ``broken`` (it failed to import) is a problem too."""
    count = lambda *statuses: sum(1 for b in bugs if b["status"] in statuses)  # noqa: E731
    return {
        "rows": len(bugs),
        "applicable": sum(1 for b in bugs if b["affected_here"]),
        "fixed": count("fixed"),
        "shim_not_replayed": count("shim-not-replayed"),
        "warned_only": sum(
            1 for b in bugs if b["status"] == "shim-not-replayed" and b.get("shim_warns_only")),
        "workaround_only": count("workaround-only"),
        "problems": count("problem") + len(broken),
        "not_affected": sum(1 for b in bugs if not b["affected_here"]),
        "not_affected_replayed": sum(1 for b in bugs if b["status"] == "not-affected" and b["replayed"] == "works"),
    }


# -- text ---------------------------------------------------------------------------------------
def wrap(text: str, first: str = "", later: Optional[str] = None, width: int = WIDTH, max_lines: int = 0) -> List[str]:
    """``text`` on lines of at most ``width`` columns, the first after ``first``, the others after
    ``later`` (default: as many spaces), broken the way every command breaks text
    (:func:`devmap_shims._text.wrap`: between words, never inside an id or a version range, a name
    kept with the version after it). ``max_lines``: the rest is elided with ``...``."""
    later = " " * len(first) if later is None else later
    return text_wrap(text, width, indent=first, hang=later, max_lines=max_lines or None)


def _marks() -> Dict[str, str]:
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "\u2714\u2718\u2022".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return {"ok": "+", "bad": "x", "note": "*"}
    return {"ok": "\u2714", "bad": "\u2718", "note": "\u2022"}


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def closing_line(summary: Dict[str, int], selected: bool = False) -> str:
    """``"10 known bugs apply to your stack; 9 fixed by devmap-shims, 1 only warned about by a shim."``
    (``warned_only`` rows are among the ``shim_not_replayed`` ones.)"""
    n = summary["applicable"]
    text = f"{n} known bug{'' if n == 1 else 's'} {'applies' if n == 1 else 'apply'} to your stack"
    if selected:
        text = f"Of the rows asked for, {text}"
    parts = [f"{summary['fixed']} fixed by devmap-shims"]
    warned = summary.get("warned_only", 0)
    if summary["shim_not_replayed"] - warned:
        parts.append(f"{summary['shim_not_replayed'] - warned} by a shim not replayed here")
    if warned:
        parts.append(f"{warned} only warned about by a shim")
    if summary["workaround_only"]:
        parts.append(f"{summary['workaround_only']} with a workaround only")
    return f"{text}; {', '.join(parts)}."


def _block(bug: Dict[str, Any], replays: List[Dict[str, Any]], marks: Dict[str, str]) -> List[str]:
    status = bug["status"]
    label = {
        "fixed": f"{marks['ok']} fixed",
        "shim-not-replayed": f"{marks['note']} shim",
        "workaround-only": f"{marks['note']} workaround",
        "problem": f"{marks['bad']} PROBLEM",
    }.get(status, f"{marks['ok']} ok")
    warns_only = status == "shim-not-replayed" and bool(bug.get("shim_warns_only"))
    if warns_only:
        label = f"{marks['note']} warns"
    lines = wrap(bug["bug_id"], f"{label}  ", "    ")
    lines += wrap(bug["title"], "    ")
    if status == "problem" and not bug["affected_here"]:
        lines += wrap(f"not affected here: {bug['not_affected_reason']}", "    ")
    if status == "shim-not-replayed":  # its replays were unavailable: "not replayed" below says why
        replays = []
    several = len(replays) > 1
    for r in replays:
        pad = "    "
        if several:
            lines.append(f"    {r['scenario']}:")
            pad = "      "
        without, with_shims = r["without_shims"], r["with_shims"]
        head = "skipped: " if without["unavailable"] else "without: "
        lines += wrap(without["detail"], pad + head, pad + "  ", max_lines=2)
        if with_shims:
            state = "" if with_shims["ok"] else "FAILED: "
            lines += wrap(state + with_shims["detail"], f"{pad}with {r['shim']}: ", pad + "  ", max_lines=2)
        if r["verdict"] in PROBLEM_VERDICTS:
            lines += wrap(f"verdict: {r['verdict']}", pad)
    if status == "shim-not-replayed":
        lines += wrap(f"{bug['shim']}: {bug['shim_summary']}", "    ", "      ", max_lines=2)
        lines += wrap(f"not replayed: {bug['not_replayed_because']}", "    ", "      ", max_lines=2)
    unrepaired = status == "problem" and not bug["shim"] and bug["affected_here"]
    if status == "workaround-only" or warns_only or unrepaired:
        lines += wrap(f"workaround: {bug['workaround'] or 'none known'}", "    ", "      ", max_lines=3)
    return lines


def _not_affected_lines(bugs: List[Dict[str, Any]]) -> List[str]:
    if not bugs:
        return []
    column = min(max(len(b["bug_id"]) for b in bugs), 52) + 4
    lines = []
    for b in bugs:
        first = f"  {b['bug_id']}  ".ljust(column)
        lines += wrap(b["not_affected_reason"] or b["applicability"], first, " " * column)
    return lines


def render(bugs: List[Dict[str, Any]], rows: List[Dict[str, Any]], versions: Dict[str, Optional[str]],
           selected: bool = False, seconds: Optional[float] = None, broken: Sequence[str] = ()) -> str:
    """The report: versions, the shim modules that failed to import, a block per row that applies
    (or misbehaved), a line per other row, the closing line. Every line fits :data:`WIDTH` columns."""
    marks = _marks()
    summary = summarize(bugs, broken)
    replays: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        replays.setdefault(r["bug_id"], []).append(r)
    installed = ", ".join(f"{d} {v}" for d, v in sorted(versions.items()) if v) or "none of the target libraries"
    out = wrap(f"Installed: {installed}.", later="  ")
    out += wrap(f"Replayed on simulated GPUs, without the shims and with them; the compat matrix has "
                f"{_plural(summary['rows'], 'row', 'rows')}{' asked for' if selected else ''}.")
    if broken:
        out += ["", f"Shim modules that failed to import ({len(broken)}); the rows they fix read as "
                    "having no shim:"]
        for message in broken:
            out += wrap(message, f"{marks['bad']} PROBLEM  ", "    ")
    for heading, blocks in (
        ("Known bugs that apply to your stack", [b for b in bugs if b["affected_here"]]),
        ("Rows that do not apply here, yet their replay failed",
         [b for b in bugs if not b["affected_here"] and b["status"] == "problem"]),
    ):
        if blocks:
            out += ["", f"{heading} ({len(blocks)}):"]
            for bug in blocks:
                out += [""] + _block(bug, replays.get(bug["bug_id"], []), marks)
    others = [b for b in bugs if b["status"] == "not-affected"]
    groups = (
        ("Not affected here; replayed, the libraries behave", lambda b: b["replayed"] == "works"),
        ("Not affected here; not replayed within the time budget (`demo --all` replays them)",
         lambda b: b["replayed"] == "skipped"),
        ("Not affected here; no scenario that runs on this stack", lambda b: b["replayed"] not in ("works", "skipped")),
    )
    for heading, member in groups:
        group = [b for b in others if member(b)]
        if group:
            out += [""] + wrap(f"{heading} ({len(group)}):") + _not_affected_lines(group)
    out += [""] + wrap(closing_line(summary, selected))
    ran = sum(1 for r in rows if r["verdict"] != "unavailable")
    took = f" in {seconds:.0f} s" if seconds is not None else ""
    out += wrap(f"{_plural(summary['problems'], 'problem', 'problems')}; "
                f"{_plural(ran, 'scenario', 'scenarios')} replayed{took}. "
                "`devmap-shims explain ID` tells more about a row.")
    return "\n".join(out)
