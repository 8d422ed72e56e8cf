"""Text fitted to a terminal width: broken between words, never inside a version range
(``>=0.41.2,<0.43.0``) or a short bracketed group, elided with ``...`` where it must stay short.

Plain functions with no imports from the rest of the package, so every layer can use them
(``status()``'s summary as well as the commands; ``devmap_shims.cli._output`` re-exports them).
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

#: The width every command's plain-text output fits (JSON output is not wrapped).
WIDTH = 100

#: What stands for text left out at the end of an elided line.
ELLIPSIS = "..."

_OPENERS, _CLOSERS = "([{", ")]}"
#: A bracketed group up to this wide is kept whole (``(last checked 2026-11-01)``); a longer one
#: is prose in parentheses and is broken between its words like the rest.
GROUP_WIDTH = 40
#: A word that starts a version specifier (``>=0.41.2,<0.43.0``, ``==4.27.2``) or is a version
#: (``0.45.3``): it stays on the line of the word before it, so ``accelerate >=1.4.0`` and
#: ``bitsandbytes 0.45.3`` are never split in two.
_SPECIFIER = re.compile(r"^(?:(?:[<>]=?|[=!~]=|===)(?:\S|$)|\d+\.\d+)")
#: how a row reads a "*" specifier (``bitsandbytes (any version)``): kept with the name like a version
ANY_VERSION = "(any version)"
#: A unit after a number (``3.82 GiB``, ``0.94 x``): it stays on the line of its number.
_UNIT = re.compile(r"^(?:B|KiB|MiB|GiB|TiB|KB|MB|GB|TB|x)(?:\W|$)")


def _depth(word: str) -> int:
    return sum(word.count(c) for c in _OPENERS) - sum(word.count(c) for c in _CLOSERS)


def atoms(text: str) -> List[str]:
    """``text``'s unbreakable pieces, in order: its words, except that a bracketed group of up to
    ``GROUP_WIDTH`` columns (``[no shim: pass max_memory]``, ``(last checked 2026-11-01)``) is one
    piece, and a version
    specifier, number or ``(any version)`` is one piece with the word before it
    (``bitsandbytes >=0.41.2,<0.45.3``).
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
        if merged and (_SPECIFIER.match(piece) or piece.startswith(ANY_VERSION)
                       or (_UNIT.match(piece) and merged[-1][-1:].isdigit())):
            merged[-1] += " " + piece
        else:
            merged.append(piece)
        i = j
    return merged


def _head(piece: str, room: int) -> Tuple[str, str]:
    """The start of a piece wider than ``room`` that fits in it, and the rest: broken at its
    spaces first, then after a comma or semicolon (between two specifiers, never inside one),
    then after a slash, colon or dot (a path, ``module.path:Class.method``); only a word with
    none of those is cut at ``room``."""
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
    for marks in (",;", "/:."):  # between two specifiers first, then in a path or dotted name
        cut = max(piece.rfind(c, 0, room) for c in marks)
        if cut > 0:
            return piece[: cut + 1], piece[cut + 1:]
    return piece[:room], piece[room:]


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
    line is the one thing that is broken inside (see :func:`_head`)."""
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


def elide(text: str, width: int = WIDTH, indent: str = "") -> str:
    """``text`` on one line of at most ``width`` columns (``indent`` included), ending in ``...``
    where words were left out; never ends in a fragment of a version range or of a bracketed
    group."""
    return wrap(text, width, indent, max_lines=1)[0]
