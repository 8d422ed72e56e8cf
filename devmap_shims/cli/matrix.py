"""``devmap-shims matrix`` and ``devmap-shims explain``: the known bugs, and one bug or shim in full."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional, Tuple

from devmap_shims.cli._output import EXIT_OK, WIDTH, UsageError, fit, no_such_id, print_json, wrap

#: ``schema_version`` of ``matrix --json`` and ``explain ID --json``
SCHEMA_VERSION = 1


def add_matrix_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--applicable", action="store_true", help="only rows that apply to the installed versions")
    parser.add_argument("--library", metavar="L", help="only rows about library L")
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--markdown", action="store_true", help="COMPAT.md as generated from the matrix")


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="a matrix row id, or a shim id")
    parser.add_argument("--json", action="store_true")


def _plugins_wanted() -> bool:
    import os

    from devmap_shims.shims.config import ENV_NO_PLUGINS, flag

    return not flag(os.environ.get(ENV_NO_PLUGINS))


def known(with_plugins: bool = True) -> Tuple[Any, List[Any]]:
    """The matrix and every shim (built-in, and from plugins unless turned off), warning on stderr
    about plugins that fail to load and plugin rows left out."""
    from devmap_shims.compat_matrix import load_matrix_skipping_bad_rows
    from devmap_shims.shims import catalog, plugins

    shims, problems = catalog.builtin_shims()
    rows: List[Dict[str, Any]] = []
    if with_plugins and _plugins_wanted():
        rows, more, plugin_problems = plugins.load_all([s.id for s in shims])
        shims += more
        problems += plugin_problems
    matrix, row_problems = load_matrix_skipping_bad_rows(rows)
    for problem in problems + row_problems:
        print(f"devmap-shims: warning: {problem}", file=sys.stderr)
    return matrix, shims


def builtin_markdown() -> str:
    """COMPAT.md: the built-in rows and shims only, whatever plugins this machine has."""
    from devmap_shims.compat_matrix import load_matrix, render_markdown
    from devmap_shims.shims import catalog

    shims, _ = catalog.builtin_shims()
    return render_markdown(load_matrix(), catalog.shim_of_rows(shims))


def docstring_rows(shim: Any, matrix: Any) -> List[str]:
    """The generated lines of ``shim``'s docstring, after ``catalog.ROWS_HEADING`` to its end: each
    row it fixes, with its range and fix."""
    lines = []
    for bug_id in shim.fixes:
        lines.append(f"    {bug_id}")
        if bug_id in matrix:
            row = matrix.get(bug_id)
            lines += [f"        affected: {row.affected_text}", f"        fixed in: {row.fixed_in_text}"]
        else:
            lines.append("        not in the compat matrix")
    return lines


def run_matrix(args: argparse.Namespace) -> int:
    from devmap_shims.compat_matrix import row_to_dict
    from devmap_shims.shims.catalog import shim_of_rows
    from devmap_shims.versions import installed_versions

    if args.markdown:
        if args.library or args.applicable:
            raise UsageError("--markdown writes the whole matrix (COMPAT.md); --library and --applicable "
                             "filter the table and --json only")
        print(builtin_markdown(), end="")
        return EXIT_OK
    matrix, shims = known()
    shim_of = shim_of_rows(shims)
    rows = list(matrix.rows)
    if args.library:
        libraries = {r.library for r in rows}
        if args.library not in libraries:
            raise UsageError(f"--library {args.library!r} matches no row; libraries: {', '.join(sorted(libraries))}")
        rows = [r for r in rows if r.library == args.library]
    if args.applicable:
        versions = installed_versions(sorted({d for r in rows for d in r.affected}))
        rows = [r for r in rows if r.applies(versions)]
    if args.json:
        print_json({"schema_version": SCHEMA_VERSION, "rows": [row_to_dict(r, shim_of.get(r.id)) for r in rows]})
        return EXIT_OK
    print(matrix_text(rows, shim_of))
    print(f"\n{len(rows)} row(s). `devmap-shims explain ID` shows one in full.")
    return EXIT_OK


def matrix_text(rows: List[Any], shim_of: Dict[str, str], width: int = WIDTH) -> str:
    """The rows in two lines each, within ``width`` columns: the id and the shim that works around
    it (or ``workaround``: see ``explain``), then, indented, the affected range and its fix.
    A range is never broken across lines (see ``_output.wrap``)."""
    id_width = max([len("id")] + [len(r.id) for r in rows])
    shims = [shim_of.get(r.id) or "workaround" for r in rows]
    shim_width = max([len("shim")] + [len(s) for s in shims])
    id_width = min(id_width, max(width - 2 - shim_width, width // 2))
    lines = [f"{'id':{id_width}s}  shim", "    affected -> fixed in", "-" * min(width, id_width + 2 + shim_width)]
    for row, shim in zip(rows, shims):
        head = f"{row.id:{id_width}s}  {shim}"
        lines += [head] if len(head) <= width else [row.id[:width], f"{'':{id_width}s}  {shim}"[-width:]]
        lines += wrap(f"{row.affected_text} -> {row.fixed_in_text}", width, indent="    ", hang="      ")
    return "\n".join(lines)


def run_explain(args: argparse.Namespace) -> int:
    from devmap_shims.shims.catalog import shim_of_rows

    matrix, shims = known()
    by_id = {s.id: s for s in shims}
    if args.id in by_id and args.id not in matrix:
        return _explain_shim(by_id[args.id], matrix, args.json)
    try:
        row = matrix.get(args.id)
    except KeyError:
        raise UsageError(no_such_id(args.id, [r.id for r in matrix.rows] + list(by_id))) from None
    shim = shim_of_rows(shims).get(row.id)
    return _explain_row(row, shim, args.json, warns_only=shim is not None and not by_id[shim].repairs)


def _here(row: Any) -> Tuple[bool, str]:
    from devmap_shims.versions import installed_versions

    return row.applicability(installed_versions(sorted(row.affected)))


def _explain_row(row: Any, shim: Optional[str], as_json: bool, warns_only: bool = False) -> int:
    from devmap_shims.compat_matrix import row_to_dict

    applies, why = _here(row)
    if as_json:
        data = {"schema_version": SCHEMA_VERSION, **row_to_dict(row, shim)}
        data["applies_here"] = applies
        data["applicability"] = why
        print_json(data)
        return EXIT_OK
    print(fit(f"{row.id}: {row.title}", hang="  "))
    _field("library", row.library)
    _field("affected", row.affected_text)
    _field("here", f"{'AFFECTED' if applies else 'not affected'} ({why})")
    _field("fixed in", row.fixed_in_text)
    if shim:
        _field("shim", f"{shim}{', which warns only' if warns_only else ''} (`devmap-shims explain {shim}`)")
    _field("workaround", row.workaround)
    _field("symptom", row.symptom)
    _field("root cause", row.root_cause)
    for url in row.upstream_urls:
        _field("upstream", url)
    if isinstance(row.fixed_in, dict) and row.fixed_in:
        upgrades = ", ".join(f"{k}>={v}" for k, v in row.fixed_in.items())
        what = "drop this shim" if shim else "drop the workaround"
        print(fit(f"fixed in {row.fixed_in_text}: upgrade ({upgrades}) to {what}.", indent="  ", hang="    "))
    else:
        keep = "workaround" if not shim or warns_only else "shim"
        print(fit(f"{row.fixed_in_text}: keep the {keep}.", indent="  ", hang="    "))
    return EXIT_OK


def _explain_shim(shim: Any, matrix: Any, as_json: bool) -> int:
    """A shim: where it lives, what it wraps, and the range of each row it fixes (from the matrix)."""
    rows = []
    for bug_id in shim.fixes:
        row = matrix.get(bug_id) if bug_id in matrix else None
        applies, why = _here(row) if row is not None else (False, "no such row in the compat matrix")
        rows.append({
            "id": bug_id,
            "affected": dict(row.affected) if row is not None else None,
            "fixed_in": row.fixed_in_text if row is not None else None,
            "applies_here": applies,
            "applicability": why,
        })
    data = {
        "shim": shim.id,
        "summary": shim.summary,
        "source": shim.source,
        "module": _module_of(shim),
        "targets": [t.key + (f" (when {dict(t.when)})" if t.when else "") for t in shim.targets],
        "repairs": shim.repairs,
        "rows": rows,
    }
    from devmap_shims.shims.catalog import armed_here

    data["armed_here"], data["armed_reason"], _switch = armed_here(shim, any(r["applies_here"] for r in rows))
    if as_json:
        print_json({"schema_version": SCHEMA_VERSION, **data})
        return EXIT_OK
    print(fit(f"{shim.id}: {shim.summary}", hang="  "))
    _field("module", data["module"])
    for target in data["targets"]:
        _field("wraps", target)
    for row in rows:
        rng = "; ".join(f"{d} {s}" for d, s in (row["affected"] or {}).items()) or "?"
        _field("fixes" if shim.repairs else "warns about", f"{row['id']}: {rng}; fixed in {row['fixed_in']}")
        _field("", f"here: {'AFFECTED' if row['applies_here'] else 'not affected'} ({row['applicability']})")
    _field("armed here", f"{'yes' if data['armed_here'] else 'no'} ({data['armed_reason']})")
    return EXIT_OK


def _field(label: str, value: str) -> None:
    """``  label:     value``, the value wrapped to the width under its first column; a value of
    several lines (an error message) keeps its lines."""
    first = f"  {label + ':' if label else '':12s} "
    hang = " " * len(first)
    for i, paragraph in enumerate(value.splitlines() or [""]):
        print(fit(paragraph, indent=first if i == 0 else hang, hang=hang))


def _module_of(shim: Any) -> str:
    """The module that declares ``shim`` (its wrapper's, or the first target wrapper's)."""
    refs = [shim.wrapper] + [t.wrapper for t in shim.targets]
    for ref in refs:
        if ref is None:
            continue
        if isinstance(ref, str):
            return ref.partition(":")[0]
        module = getattr(ref, "__module__", None)
        if module:
            return str(module)
    return "?"
