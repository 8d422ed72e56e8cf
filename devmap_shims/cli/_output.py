"""What every subcommand shares: exit codes, the usage error, tables and JSON output."""

from __future__ import annotations

import json
import sys
from typing import Any, List

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A one-line message for the user; the command exits with status 2."""


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def table(rows: List[List[str]], headers: List[str]) -> str:
    """Left-aligned columns under ``headers``, two spaces apart."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(str(c))) for w, c in zip(widths, row)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def one_line(exc: BaseException, width: int = 300) -> str:
    """``exc``'s message on one line, cut at ``width`` characters."""
    return " ".join(str(exc).split())[:width]
