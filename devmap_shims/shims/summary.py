"""A short, readable form of ``status()``: what a person reads at a glance, within 100 columns.

``status()`` returns a :class:`Status`, a ``dict`` with every key and value it always had (JSON as
before, ``status()["shims"]`` as before) whose ``str()`` is :func:`summary`. ``doctor`` prints its
shims with :func:`shim_lines` too, so both say the same thing the same way.

Shims fall in five groups: ``failed``, ``active`` and ``pending`` shims get a line each; shims off
because no bug they fix is in the installed versions (the usual case, most of them on any stack)
share one line; shims off for another reason (disabled, kill switch, target missing on this stack)
get a line each. When even that is more lines than the room given, groups become lists of ids.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional

from devmap_shims._text import WIDTH, elide, wrap

#: The order groups are shown in, most urgent first.
GROUPS = ("failed", "pending", "active", "off", "off: bug not here")


class Status(dict):
    """``status()``'s data: a plain ``dict`` (every key kept, JSON-serialisable) whose ``str()``
    is a short summary. ``repr()`` stays the full data."""

    def __str__(self) -> str:
        return summary(self)

    def summary(self, width: int = WIDTH) -> str:
        return summary(self, width)


def group_of(shim: Dict[str, Any]) -> str:
    """Which of :data:`GROUPS` a shim (an item of ``status()["shims"]``) belongs to."""
    state = shim.get("state")
    if state in ("failed", "pending", "active"):
        return str(state)
    if shim.get("selected", True) and not shim.get("applies") and not shim.get("forced"):
        return "off: bug not here"
    return "off"


def _bugs_here(shim: Dict[str, Any]) -> List[str]:
    """The ids of the rows ``shim`` fixes that apply here, from its ``applicability`` text."""
    why = shim.get("applicability") or ""
    return [bug for bug in shim.get("fixes", ()) if f"{bug}: affected (" in why]


def reason(shim: Dict[str, Any]) -> str:
    """A short reason for ``shim``'s state: the ids of the bugs it fixes here (active; "warns only"
    for a shim that does not repair them), what it waits for (pending), its error (failed), why it
    is off."""
    group = group_of(shim)
    targets = shim.get("targets") or []
    if group == "active":
        bugs = _bugs_here(shim)
        listed = ", ".join(bugs) if bugs else "forced on (DEVMAP_SHIMS_FORCE)"
        return listed if shim.get("repairs", True) else f"warns only: {listed}"
    if group == "failed":
        failed = [t for t in targets if t.get("state") == "failed"]
        if failed:
            first = failed[0]
            more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
            return f"{first.get('target')}{more}: {first.get('error') or first.get('reason')}"
        return f"{shim.get('call_failures', 0)} call(s) fell back to the original"
    if group == "pending":
        pending = [t for t in targets if t.get("state") == "pending"]
        modules = sorted({str(t.get("target", "")).partition(":")[0] for t in pending})
        return f"waits for {modules[0]} to be imported" if len(modules) == 1 else (
            f"waits for {len(modules)} modules to be imported: {', '.join(modules)}")
    if group == "off":
        reasons = [t.get("reason") for t in targets if t.get("reason")]
        return str(reasons[0]) if reasons else "no target here"
    return "its bugs are not in these versions"


def shim_lines(
    shims: List[Dict[str, Any]],
    width: int = WIDTH,
    room: Optional[int] = None,
    more: str = "",
    indent: str = "  ",
) -> List[str]:
    """Lines for ``shims`` (``status()["shims"]``), at most ``width`` columns and, with ``room``,
    at most ``room`` lines: a line per shim (a second one for the first that need it while room
    lasts); else the active shims as a list of ids; else every group as a list. ``more`` tells
    where the full list is (``(--verbose lists them)``); it ends the line of the shims off here."""
    groups: Dict[str, List[Dict[str, Any]]] = {g: [] for g in GROUPS}
    for shim in shims:
        groups[group_of(shim)].append(shim)
    id_width = min(max([len(str(s["id"])) for s in shims] + [4]), 30)
    hang = indent + " " * (id_width + 10)
    bug_not_here = groups.pop("off: bug not here")
    tail = []
    if bug_not_here:
        n = len(bug_not_here)
        tail = wrap(
            f"{n} shim{'s' if n != 1 else ''} off: {'their' if n != 1 else 'its'} bugs are not in "
            f"these versions {more}".rstrip(),
            width, indent, hang=indent + "  ",
        )

    def one(shim: Dict[str, Any], max_lines: int) -> List[str]:
        state = "OFF" if shim.get("state") == "skipped" else str(shim.get("state")).upper()
        prefix = f"{indent}{str(shim['id']):{id_width}s}  {state:8s}"
        return wrap(reason(shim), width, prefix, hang=hang, max_lines=max_lines)

    def listed(name: str, members: List[Dict[str, Any]], max_lines: int) -> List[str]:
        ids = ", ".join(str(s["id"]) for s in members)
        reasons = {reason(s) for s in members}
        if name == "off" and len(reasons) == 1:  # all off for one cause: say it
            name = f"off ({reasons.pop()})"
        return wrap(f"{len(members)} {name}: {ids}", width, indent, hang=indent + "  ", max_lines=max_lines)

    shown = [(g, m) for g, m in groups.items() if m]
    def each(max_lines: int) -> List[str]:
        """A line per shim, and a second line for the first ones that need it while room lasts."""
        members = [s for _, m in shown for s in m]
        spare = max_lines if room is None else room - len(members) - len(tail)
        lines = []
        for shim in members:
            two = one(shim, 2)
            if len(two) > 1 and spare > 0:
                lines += two
                spare -= 1
            else:
                lines += one(shim, 1)
        return lines

    def actives_listed() -> List[str]:
        """The active shims as a list of ids, on the lines the others leave."""
        others = [x for g, m in shown if g != "active" for s in m for x in one(s, 1)]
        spare = 3 if room is None else max(room - len(others) - len(tail), 1)
        return [line for g, m in shown for line in (
            listed(g, m, spare) if g == "active" else [x for s in m for x in one(s, 1)])]

    attempts = [
        lambda: each(len(shims)),
        lambda: actives_listed(),
        lambda: [line for g, m in shown for line in listed(g, m, 2)],
        lambda: [line for g, m in shown for line in listed(g, m, 1)],
    ]
    for attempt in attempts:
        lines = attempt() + tail
        if room is None or len(lines) <= room:
            return lines
    return lines[: max(room, 1)]


def _versions_line(versions: Dict[str, Any], width: int) -> List[str]:
    text = ", ".join(f"{name} {version or '-'}" for name, version in versions.items())
    return wrap(text, width, "  versions: ", hang="            ", max_lines=2)


def summary(data: Dict[str, Any], width: int = WIDTH) -> str:
    """``status()`` (``data``) in at most about 20 lines of at most ``width`` columns."""
    shims = data.get("shims") or []
    counts: Dict[str, int] = {}
    for shim in shims:
        state = str(shim.get("state"))
        counts[state] = counts.get(state, 0) + 1
    states = ", ".join(
        f"{counts.get(s, 0)} {'off' if s == 'skipped' else s}" for s in ("active", "pending", "failed", "skipped"))
    if not data.get("installed") and not data.get("killed") and not shims:
        lines = ["devmap-shims: not installed (call devmap_shims.install(), or set DEVMAP_SHIMS=1)"]
        return "\n".join(lines + _versions_line(data.get("versions") or {}, width))
    if data.get("killed"):
        head = "devmap-shims: off (kill switch DEVMAP_SHIMS=0)"
    elif data.get("installed"):
        how = "at start-up (DEVMAP_SHIMS=1)" if data.get("auto_enabled") else "by install()"
        head = f"devmap-shims: installed {how}{', strict' if data.get('strict') else ''}"
    else:
        head = "devmap-shims: not installed (call devmap_shims.install(), or set DEVMAP_SHIMS=1)"
    lines = wrap(f"{head}; {len(shims)} shims: {states}", width, hang="  ")
    lines += _versions_line(data.get("versions") or {}, width)
    lines += shim_lines(shims, width, room=12, more='(status()["shims"] lists them)')
    warnings = data.get("warnings") or []
    for warning in warnings[:2]:
        lines.append(elide(f"warning: {warning}", width, "  "))
    if len(warnings) > 2:
        lines.append(f"  and {len(warnings) - 2} more warnings (status()[\"warnings\"])")
    footer = '(a dict: status()["shims"] has every shim and target; json.dumps(status()) prints it all)'
    lines.append(elide(footer, width))
    return "\n".join(lines)
