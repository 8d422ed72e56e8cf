"""Validation of compat-matrix rows: from TOML tables (or plugin dicts) to :class:`BugRow` values.

Every problem raises :class:`MatrixError` naming where the row came from (file or plugin), the
row (1-based position and id) and the field, with what was expected instead.
"""

from __future__ import annotations

import datetime
import difflib
import re
from collections.abc import Mapping
from typing import Any, Callable

from devmap_shims.versions import check_spec, release_tuple, version_in

#: Evidence grades a row may cite.
VERIFICATION_GRADES = ("V-code", "V-run", "V-thread", "I")

#: ``fixed_in`` value of a bug no release fixes yet.
UNFIXED = "unfixed"

#: Field name -> required. ``last_checked`` is required when ``fixed_in = "unfixed"`` (checked after
#: the per-field checks). A row does not name the shim that fixes it: a shim names its rows
#: (``Shim.fixes``), and listings derive the other direction from the shims.
FIELDS: dict[str, bool] = {
    "id": True,
    "title": True,
    "library": True,
    "affected": True,
    "fixed_in": True,
    "last_checked": False,
    "symptom": True,
    "root_cause": True,
    "upstream": True,
    "verification": True,
    "workaround": True,
    "no_scenario": False,
    "notes": False,
}

# A slug; plugin ids may carry a ``dist.`` / ``dist:`` prefix, hence '.' and ':' as separators.
ID_PATTERN = re.compile(r"^[A-Za-z0-9]+(?:[-_.:][A-Za-z0-9]+)*$")
DIST_PATTERN = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
UPSTREAM_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9._-]+#[1-9][0-9]*$")
DATE_PATTERN = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class MatrixError(ValueError):
    """A compat-matrix file or row is malformed.

    Attributes name the place: ``source`` (file path or plugin name), ``index`` (1-based row
    position within that source, or None for a file-level problem), ``row_id`` and ``field``.
    """

    def __init__(
        self,
        source: str,
        problem: str,
        *,
        index: int | None = None,
        row_id: str | None = None,
        field: str | None = None,
    ) -> None:
        self.source = source
        self.index = index
        self.row_id = row_id
        self.field = field
        self.problem = problem
        where = source
        if index is not None:
            where += f": bug row {index}"
            where += f" (id {row_id!r})" if row_id else " (no id)"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {problem}")


class _RowContext:
    """Where a row came from, to build errors that point at it."""

    def __init__(self, source: str, index: int, row_id: str | None = None) -> None:
        self.source = source
        self.index = index
        self.row_id = row_id

    def error(self, field: str | None, problem: str) -> MatrixError:
        return MatrixError(self.source, problem, index=self.index, row_id=self.row_id, field=field)


def _type_name(value: Any) -> str:
    return {dict: "table", list: "array", str: "string", bool: "boolean", int: "integer"}.get(
        type(value), type(value).__name__
    )


def _text(ctx: _RowContext, field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ctx.error(field, f"expected a string, got {_type_name(value)} {value!r}")
    if not value.strip():
        raise ctx.error(field, "expected a non-empty string")
    return value.strip()


def _slug(ctx: _RowContext, field: str, value: Any) -> str:
    text = _text(ctx, field, value)
    if not ID_PATTERN.match(text):
        raise ctx.error(
            field,
            f"expected a slug of letters, digits and '-', '_' (like 'bnb-quantstate-code-not-moved'), "
            f"got {text!r}",
        )
    return text


def _dist_table(
    ctx: _RowContext, field: str, value: Any, check_value: Callable[[str, str], None]
) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ctx.error(
            field, f'expected a table {{distribution = "..."}}, got {_type_name(value)} {value!r}'
        )
    if not value:
        raise ctx.error(field, "expected at least one distribution, got an empty table")
    table: dict[str, str] = {}
    for dist, item in value.items():
        if not DIST_PATTERN.match(dist):
            raise ctx.error(field, f"{dist!r} is not a distribution name")
        if not isinstance(item, str):
            raise ctx.error(field, f"expected a string for {dist}, got {_type_name(item)} {item!r}")
        check_value(dist, item.strip())
        table[dist] = item.strip()
    return table


def _affected(ctx: _RowContext, value: Any) -> dict[str, str]:
    def check(dist: str, spec: str) -> None:
        try:
            check_spec(spec)
        except ValueError as exc:
            raise ctx.error(
                "affected",
                f'bad specifier {spec!r} for {dist} (expected PEP 440, e.g. ">=0.41.2,<0.45.3"): {exc}',
            ) from None

    return _dist_table(ctx, "affected", value, check)


def _fixed_in(ctx: _RowContext, value: Any) -> Any:
    if value == UNFIXED:
        return UNFIXED

    def check(dist: str, version: str) -> None:
        try:
            release_tuple(version)
        except ValueError:
            raise ctx.error(
                "fixed_in", f'expected a version for {dist} (e.g. "0.45.3"), got {version!r}'
            ) from None

    if isinstance(value, str):
        raise ctx.error(
            "fixed_in", f'expected a table {{distribution = "version"}} or "unfixed", got {value!r}'
        )
    return _dist_table(ctx, "fixed_in", value, check)


def _last_checked(ctx: _RowContext, value: Any) -> str:
    if isinstance(value, datetime.date) and not isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, str) and DATE_PATTERN.match(value.strip()):
        try:
            return datetime.date.fromisoformat(value.strip()).isoformat()
        except ValueError:
            pass
    raise ctx.error("last_checked", f'expected a date "YYYY-MM-DD", got {value!r}')


def _upstream(ctx: _RowContext, value: Any) -> tuple:
    if not isinstance(value, list):
        raise ctx.error(
            "upstream", f'expected an array of "owner/repo#N" strings, got {_type_name(value)} {value!r}'
        )
    links = []
    for item in value:
        if not isinstance(item, str) or not UPSTREAM_PATTERN.match(item.strip()):
            raise ctx.error(
                "upstream",
                f'malformed link {item!r}: expected "owner/repo#N", e.g. "huggingface/accelerate#3244"',
            )
        links.append(item.strip())
    return tuple(links)


def _verification(ctx: _RowContext, value: Any) -> tuple:
    if not isinstance(value, list) or not value:
        raise ctx.error(
            "verification", f"expected a non-empty array of grades {list(VERIFICATION_GRADES)}, got {value!r}"
        )
    for grade in value:
        if grade not in VERIFICATION_GRADES:
            raise ctx.error(
                "verification", f"unknown grade {grade!r}; expected one of {', '.join(VERIFICATION_GRADES)}"
            )
    if len(set(value)) != len(value):
        raise ctx.error("verification", f"grades repeat in {value!r}")
    return tuple(value)


def _check_fix_outside_range(ctx: _RowContext, affected: Mapping[str, str], fixed_in: Any) -> None:
    if fixed_in == UNFIXED:
        return
    for dist, version in fixed_in.items():
        spec = affected.get(dist)
        if spec is not None and version_in(version, spec):
            raise ctx.error(
                "fixed_in",
                f"{dist} {version} is inside the affected range {spec!r}: a fixed version cannot be affected",
            )


def parse_row(data: Any, *, source: str, index: int, row_type: Callable[..., Any], origin: str) -> Any:
    """Validate one row (a TOML table or plugin dict) and build ``row_type(**fields, source=origin)``.

    ``source`` names the place in errors (a file path or plugin); ``origin`` is who contributed the
    row (``"devmap-shims"`` for the built-in file, the plugin's name otherwise).
    """
    ctx = _RowContext(source, index)
    if not isinstance(data, dict):
        raise ctx.error(None, f"expected a table, got {_type_name(data)} {data!r}")
    raw_id = data.get("id")
    if isinstance(raw_id, str) and raw_id.strip():
        ctx.row_id = raw_id.strip()
    for field in data:
        if field == "shim":
            raise ctx.error(
                field,
                "rows do not name their shim: the shim lists the rows it fixes (Shim(fixes=...)); "
                "remove this field",
            )
        if field not in FIELDS:
            close = difflib.get_close_matches(field, FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(FIELDS)}"
            raise ctx.error(field, f"unknown field{hint}")
    missing = [field for field, required in FIELDS.items() if required and field not in data]
    if missing:  # all of them at once: a new row is written in one go, not one run per field
        also = f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise ctx.error(missing[0], f"missing required field{also}")

    values: dict[str, Any] = {
        "id": _slug(ctx, "id", data["id"]),
        "title": _text(ctx, "title", data["title"]),
        "library": _text(ctx, "library", data["library"]),
        "affected": _affected(ctx, data["affected"]),
        "fixed_in": _fixed_in(ctx, data["fixed_in"]),
        "symptom": _text(ctx, "symptom", data["symptom"]),
        "root_cause": _text(ctx, "root_cause", data["root_cause"]),
        "upstream": _upstream(ctx, data["upstream"]),
        "verification": _verification(ctx, data["verification"]),
    }
    if "last_checked" in data:
        values["last_checked"] = _last_checked(ctx, data["last_checked"])
    values["workaround"] = _text(ctx, "workaround", data["workaround"])
    for field in ("no_scenario", "notes"):
        if field in data:
            values[field] = _text(ctx, field, data[field])

    if values["fixed_in"] == UNFIXED and "last_checked" not in values:
        raise ctx.error(
            "last_checked", 'required when fixed_in = "unfixed": the date the bug was last seen unfixed'
        )
    _check_fix_outside_range(ctx, values["affected"], values["fixed_in"])
    return row_type(**values, source=origin)


def parse_document(document: Any, *, source: str) -> list:
    """The ``[[bug]]`` tables of a parsed matrix file, after checking its top level."""
    if not isinstance(document, dict):
        raise MatrixError(source, "expected a TOML document")
    unknown = sorted(set(document) - {"schema_version", "bug"})
    if unknown:
        raise MatrixError(
            source,
            f"unknown top-level key {unknown[0]!r}; expected 'schema_version' and [[bug]] tables",
            field=unknown[0],
        )
    version = document.get("schema_version")
    if version != 1 or isinstance(version, bool):
        raise MatrixError(source, f"expected schema_version = 1, got {version!r}", field="schema_version")
    bugs = document.get("bug", [])
    if not isinstance(bugs, list):
        raise MatrixError(source, "expected [[bug]] tables (an array of tables)", field="bug")
    return bugs
