"""What every subcommand shares: exit codes, the usage error, tables, text fitted to the terminal
width and JSON output."""

from __future__ import annotations

import json
import re
import sys
from typing import Any, List, Optional, Tuple

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

#: The width every command's plain-text output fits (JSON output is not wrapped).
WIDTH = 100

#: What stands for text left out at the end of an elided line.
ELLIPSIS = "..."

_OPENERS, _CLOSERS = "([{", ")]}"
#: A bracketed group up to this wide is kept whole (``(last checked 2026-11-01)``); a longer one
#: is prose in parentheses and is broken between its words like the rest.
GROUP_WIDTH = 40
#: A word that starts a version specifier (``>=0.41.2,<0.43.0``, ``==4.27.2``): it stays on the
#: line of the word before it, so ``accelerate >=1.4.0`` is never split in two.
_SPECIFIER = re.compile(r"^(?:[<>]=?|[=!~]=|===)\S")


class UsageError(Exception):
    """A one-line message for the user; the command exits with status 2."""


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def _depth(word: str) -> int:
    return sum(word.count(c) for c in _OPENERS) - sum(word.count(c) for c in _CLOSERS)


def atoms(text: str) -> List[str]:
    """``text``'s unbreakable pieces, in order: its words, except that a bracketed group of up to
    ``GROUP_WIDTH`` columns (``[no shim: pass max_memory]``, ``(last checked 2026-11-01)``) is one
    piece, and a version
    specifier is one piece with the word before it (``bitsandbytes >=0.41.2,<0.45.3``).
    Whitespace is normalised to one space."""
    words = text.split()
    merged: List[str] = []
    i = 0
    while i < len(words):
        group, depth, j = [words[i]], _depth(words[i]), i + 1
        while depth > 0 and j < len(words):
            group.append(words[j])
            depth += _depth(words[j])
            j += 1
        if depth > 0 or len(" ".join(group)) > GROUP_WIDTH:  # unclosed, or prose: words apart
            group, j = [words[i]], i + 1
        piece = " ".join(group)
        if merged and _SPECIFIER.match(piece):
            merged[-1] += " " + piece
        else:
            merged.append(piece)
        i = j
    return merged


def _head(piece: str, room: int) -> Tuple[str, str]:
    """The start of a piece wider than ``room`` that fits in it, and the rest: broken at its
    spaces first, then after a comma, semicolon or slash (between two specifiers, never inside
    one); only a word with none of those is cut at ``room``."""
    if len(piece) <= room:
        return piece, ""
    if " " in piece:
        words = piece.split(" ")
        head = words[0]
        if len(head) > room:
            head, rest = _head(head, room)
            return head, " ".join([rest] + words[1:]).strip()
        n = 1
        while n < len(words) and len(head) + 1 + len(words[n]) <= room:
            head += " " + words[n]
            n += 1
        return head, " ".join(words[n:])
    cut = max(piece.rfind(c, 0, room) for c in ",;/")
    at = cut + 1 if cut > 0 else room
    return piece[:at], piece[at:]


def wrap(
    text: str,
    width: int = WIDTH,
    indent: str = "",
    hang: Optional[str] = None,
    max_lines: Optional[int] = None,
) -> List[str]:
    """``text`` as lines of at most ``width`` columns, broken between words and never inside a
    version range or a bracketed group (see :func:`atoms`). The first line starts with ``indent``,
    the others with ``hang`` (default: ``indent``). With ``max_lines``, what does not fit in that
    many lines is left out and the last line ends with ``...``. A single piece wider than a whole
    line is the one thing that is broken inside (at its spaces, commas or slashes if it has any)."""
    hang = indent if hang is None else hang
    queue = atoms(text)
    queue.reverse()
    lines: List[str] = []
    line, prefix = "", indent
    while queue:
        piece = queue.pop()
        room = max(width - len(prefix), 1)
        candidate = piece if not line else line + " " + piece
        if len(candidate) <= room:
            line = candidate
            continue
        if line:  # the piece starts the next line
            queue.append(piece)
        else:  # one piece wider than a whole line: the only case broken inside
            line, rest = _head(piece, room)
            if rest:
                queue.append(rest)
        lines.append(prefix + line)
        line, prefix = "", hang
    if line or not lines:
        lines.append(prefix + line)
    if max_lines is not None and len(lines) > max_lines:
        lines = lines[: max(max_lines, 1)]
        lines[-1] = _with_ellipsis(lines[-1], width, len(indent if len(lines) == 1 else hang))
    return lines


def _with_ellipsis(line: str, width: int, prefix_len: int) -> str:
    """``line`` (more text follows it) ending in `` ...`` within ``width``: whole pieces are
    dropped from its end until the marker fits."""
    prefix, body = line[:prefix_len], line[prefix_len:]
    pieces = atoms(body)
    room = width - prefix_len - len(ELLIPSIS) - 1
    while pieces and len(" ".join(pieces)) > room:
        pieces.pop()
    if not pieces:  # not even the first piece fits beside the marker
        return prefix + body[: max(width - prefix_len - len(ELLIPSIS), 0)] + ELLIPSIS
    return prefix + " ".join(pieces) + " " + ELLIPSIS


def fit(
    text: str,
    width: int = WIDTH,
    indent: str = "",
    hang: Optional[str] = None,
    max_lines: Optional[int] = None,
) -> str:
    """:func:`wrap`'s lines joined by newlines."""
    return "\n".join(wrap(text, width, indent, hang, max_lines))


def elide(text: str, width: int = WIDTH) -> str:
    """``text`` on one line of at most ``width`` columns, ending in ``...`` where words were left
    out; never ends in a fragment of a version range or of a bracketed group."""
    return wrap(text, width, max_lines=1)[0]


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


def _narrowed(widths: List[int], headers: List[str], cells: List[List[str]], width: int) -> Optional[List[int]]:
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
