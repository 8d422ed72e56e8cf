"""What every subcommand shares: exit codes, the usage error, tables, text fitted to the terminal
width and JSON output."""

from __future__ import annotations

import json
from typing import Any, List, Optional

from devmap_shims._text import ELLIPSIS, GROUP_WIDTH, WIDTH, atoms, elide, fit, wrap

__all__ = [
    "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "UsageError", "print_json", "table", "one_line",
    "WIDTH", "ELLIPSIS", "GROUP_WIDTH", "atoms", "wrap", "fit", "elide",
]

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A one-line message for the user; the command exits with status 2."""


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout; nothing when stdout is closed (``>&-``), as ``print``."""
    print(json.dumps(data, indent=2, sort_keys=False, default=str))


def table(rows: List[List[str]], headers: List[str], width: Optional[int] = WIDTH) -> str:
    """Left-aligned columns under ``headers``, two spaces apart, at most ``width`` columns wide
    (``None``: as wide as the cells). When the cells do not fit, the widest columns are narrowed
    and their cells wrapped with :func:`wrap`; when even their unbreakable pieces do not fit side
    by side, each row becomes a record: its first cell on a line, then ``header: cell`` fields."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    if width is not None and _total(widths) > width:
        widths = _narrowed(widths, headers, cells, width)
        if widths is None:
            return _records(cells, headers, width)
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        wrapped = [wrap(c, w) if len(c) > w else [c] for c, w in zip(row, widths)]
        for i in range(max(len(w) for w in wrapped)):
            parts = [(col[i] if i < len(col) else "").ljust(w) for col, w in zip(wrapped, widths)]
            lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _total(widths: List[int]) -> int:
    return sum(widths) + 2 * (len(widths) - 1)


def _narrowed(
    widths: List[int], headers: List[str], cells: List[List[str]], width: int
) -> Optional[List[int]]:
    """Column widths that fit ``width`` with the gaps, the widest column giving up a column at a
    time but none going below its header or its widest unbreakable piece; None if none fit."""
    floors = [
        max([len(h)] + [len(a) for row in cells for a in atoms(row[i])])
        for i, h in enumerate(headers)
    ]
    if _total(floors) > width:
        return None
    widths = list(widths)
    while _total(widths) > width:
        i = max(range(len(widths)), key=lambda k: widths[k] - floors[k])
        widths[i] -= 1
    return widths


def _records(cells: List[List[str]], headers: List[str], width: int) -> str:
    """Each row as its first cell on a line and ``header: cell`` fields below it, indented."""
    lines: List[str] = []
    indent = "    "
    for row in cells:
        lines += wrap(row[0], width)
        line = ""
        for header, cell in zip(headers[1:], row[1:]):
            field = f"{header}: {cell}"
            if line and len(indent + line + "  " + field) <= width:
                line += "  " + field
                continue
            if line:
                lines.append(indent + line)
            *full, line = [l[len(indent):] for l in wrap(field, width, indent, indent + "  ")]
            lines += [indent + l for l in full]
        if line:
            lines.append(indent + line)
    return "\n".join(lines)


def one_line(exc: BaseException, width: int = 300) -> str:
    """``exc``'s message on one line, cut at ``width`` characters."""
    return " ".join(str(exc).split())[:width]


def no_such_id(name: str, ids: List[str]) -> str:
    """The message for ``name`` naming no bug or shim, with the closest of ``ids`` (bug and shim ids
    together: a mistyped shim id gets that shim)."""
    import difflib

    close = difflib.get_close_matches(name, ids, n=3, cutoff=0.5)
    hint = (f"did you mean {', '.join(repr(c) for c in close)}?" if close else
            "`devmap-shims matrix` lists the bugs, `devmap-shims doctor --verbose` the shims")
    return f"no bug or shim {name!r}; {hint}"

