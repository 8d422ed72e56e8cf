"""Regenerate what is generated from the compat matrix, after editing known_bugs.toml or a shim:

* COMPAT.md (``devmap-shims matrix --markdown``);
* the row lines at the end of each built-in shim module's docstring (after ``Rows (generated ...):``).

    python scripts/regenerate.py          # rewrite them
    python scripts/regenerate.py --check  # exit 1 and name what is stale, change nothing
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devmap_shims.cli.matrix import builtin_markdown, docstring_rows  # noqa: E402
from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.shims.catalog import ROWS_HEADING, builtin_modules  # noqa: E402


def with_rows(source: str, rows: list, path: Path) -> str:
    """``source`` with the lines between ROWS_HEADING and the docstring's end replaced by ``rows``."""
    lines = source.split("\n")
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == ROWS_HEADING)
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == '"""')
    except StopIteration:
        raise SystemExit(f"{path}: the module docstring must end with the line {ROWS_HEADING!r}") from None
    return "\n".join(lines[: start + 1] + rows + lines[end:])


def expected() -> dict:
    """{path: text it should have} for COMPAT.md and every built-in shim module."""
    matrix = load_matrix()
    files = {ROOT / "COMPAT.md": builtin_markdown()}
    for name in builtin_modules():
        module = importlib.import_module(name)
        path = Path(module.__file__)
        files[path] = with_rows(path.read_text(encoding="utf-8"), docstring_rows(module.SHIM, matrix), path)
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args()
    stale = []
    for path, text in expected().items():
        if path.read_text(encoding="utf-8") != text:
            stale.append(path)
            if not args.check:
                path.write_text(text, encoding="utf-8")
    for path in stale:
        print(f"{'stale' if args.check else 'rewrote'}: {path.relative_to(ROOT)}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
