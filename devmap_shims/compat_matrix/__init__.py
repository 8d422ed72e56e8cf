"""The compat matrix: known device-placement bugs as data, and the queries on it.

``known_bugs.toml`` next to this file holds one ``[[bug]]`` row per bug: which versions it
affects, what the user sees, why it happens, the upstream threads, and what a user can do about
it without devmap-shims. A row applies when *every* ``affected`` range holds for the installed
versions; shims are armed from rows, never on their own judgement. Which shim fixes a row is said
once, by the shim (``Shim.fixes``); listings take it from there.

>>> from devmap_shims.compat_matrix import load_matrix
>>> matrix = load_matrix()
>>> row = matrix.get("bnb-quantstate-code-not-moved")
>>> row.applicability({"bitsandbytes": "0.45.2"})
(True, 'bitsandbytes 0.45.2 in >=0.41.2,<0.45.3')

Importing this package reads no file and imports neither a TOML parser nor ``packaging``; the
built-in file is parsed on the first :func:`load_matrix` call and cached.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from devmap_shims.compat_matrix._schema import (
    FIELDS,
    UNFIXED,
    VERIFICATION_GRADES,
    MatrixError,
    parse_document,
    parse_row,
)
from devmap_shims._text import ANY_VERSION
from devmap_shims.versions import satisfies

__all__ = [
    "BUILTIN_PATH",
    "BUILTIN_SOURCE",
    "FIELDS",
    "UNFIXED",
    "VERIFICATION_GRADES",
    "BugRow",
    "Matrix",
    "MatrixError",
    "load_matrix",
    "load_matrix_skipping_bad_rows",
    "read_toml",
    "render_markdown",
    "row_to_dict",
]

#: The built-in matrix file.
BUILTIN_PATH = Path(__file__).with_name("known_bugs.toml")
#: ``BugRow.source`` of the built-in rows (plugin rows carry their distribution's name).
BUILTIN_SOURCE = "devmap-shims"
_BUILTIN_LABEL = "devmap_shims/compat_matrix/known_bugs.toml"

Versions = Mapping[str, Optional[str]]


@dataclass(frozen=True)
class BugRow:
    """One known bug. Field meanings are documented at the top of ``known_bugs.toml``."""

    id: str
    title: str
    library: str
    affected: dict[str, str]
    fixed_in: dict[str, str] | str
    symptom: str
    root_cause: str
    upstream: tuple[str, ...]
    verification: tuple[str, ...]
    workaround: str
    last_checked: str | None = None
    no_scenario: str | None = None
    notes: str | None = None
    source: str = BUILTIN_SOURCE

    def __post_init__(self) -> None:
        # own plain-dict copies (callers test ``isinstance(row.fixed_in, dict)``); tuples for lists
        object.__setattr__(self, "affected", dict(self.affected))
        if self.fixed_in != UNFIXED:
            object.__setattr__(self, "fixed_in", dict(self.fixed_in))
        object.__setattr__(self, "upstream", tuple(self.upstream))
        object.__setattr__(self, "verification", tuple(self.verification))

    def __hash__(self) -> int:
        return hash((self.source, self.id))

    @property
    def unfixed(self) -> bool:
        """True when no release fixes the bug (as of ``last_checked``)."""
        return self.fixed_in == UNFIXED

    def applicability(self, versions: Versions) -> tuple[bool, str]:
        """Whether the row applies to ``versions`` (``{distribution: version or None}``), and why.

        The reason names the version and range that decided it, e.g.
        ``"bitsandbytes 0.50.2 is outside >=0.41.2,<0.45.3"`` or ``"diffusers is not installed"``.
        """
        return satisfies(versions, self.affected)

    def applies(self, versions: Versions) -> bool:
        """True when every ``affected`` range holds for ``versions``."""
        return self.applicability(versions)[0]

    @property
    def affected_text(self) -> str:
        """``"accelerate >=0.20.0; transformers >=4.30.0,<4.41.0"``."""
        return "; ".join(requirement_text(dist, spec) for dist, spec in self.affected.items())

    @property
    def fixed_in_text(self) -> str:
        """``"bitsandbytes 0.45.3"`` or ``"unfixed (last checked 2026-11-01)"``."""
        if self.unfixed:
            return f"unfixed (last checked {self.last_checked})"
        return "; ".join(f"{dist} {version}" for dist, version in self.fixed_in.items())

    @property
    def upstream_urls(self) -> tuple[str, ...]:
        """The ``upstream`` links as GitHub URLs (``/issues/N`` also redirects to pull requests)."""
        return tuple(upstream_url(link) for link in self.upstream)


def requirement_text(dist: str, spec: str) -> str:
    """``"bitsandbytes >=0.41.2,<0.45.3"``; ``"*"`` reads ``"bitsandbytes (any version)"``."""
    return f"{dist} {ANY_VERSION}" if spec.strip() in ("", "*", "any") else f"{dist} {spec}"


def upstream_url(link: str) -> str:
    """``"huggingface/accelerate#3244"`` -> ``"https://github.com/huggingface/accelerate/issues/3244"``."""
    repo, number = link.split("#", 1)
    return f"https://github.com/{repo}/issues/{number}"


class Matrix:
    """Rows in file order (built-in rows first, then plugin rows), with lookups."""

    def __init__(self, rows: Iterable[BugRow]) -> None:
        self.rows: tuple[BugRow, ...] = tuple(rows)
        self._by_id: dict[str, BugRow] = {row.id: row for row in self.rows}

    def __iter__(self) -> Iterator[BugRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, bug_id: object) -> bool:
        return bug_id in self._by_id

    def __repr__(self) -> str:
        return f"<Matrix of {len(self.rows)} known bugs>"

    def ids(self) -> tuple[str, ...]:
        return tuple(row.id for row in self.rows)

    def get(self, bug_id: str) -> BugRow:
        """The row with id ``bug_id``; KeyError suggesting close ids when there is none."""
        try:
            return self._by_id[bug_id]
        except KeyError:
            close = difflib.get_close_matches(bug_id, list(self._by_id), n=3, cutoff=0.5)
            hint = (
                f"did you mean {', '.join(repr(c) for c in close)}?"
                if close
                else "`devmap-shims matrix` lists them"
            )
            raise KeyError(f"no bug {bug_id!r} in the compat matrix; {hint}") from None

    def applicable(self, versions: Versions | None = None) -> list[BugRow]:
        """Rows that apply to ``versions`` (default: the installed versions, read from metadata)."""
        if versions is None:
            from devmap_shims.versions import installed_versions

            versions = installed_versions(self.distributions())
        return [row for row in self.rows if row.applies(versions)]

    def for_library(self, library: str) -> list[BugRow]:
        """Rows whose bug lives in ``library`` (case-insensitive)."""
        wanted = library.lower()
        return [row for row in self.rows if row.library.lower() == wanted]

    def libraries(self) -> tuple[str, ...]:
        """The libraries bugs live in, sorted."""
        return tuple(sorted({row.library for row in self.rows}))

    def distributions(self) -> tuple[str, ...]:
        """Every distribution an ``affected`` range names, sorted (the versions worth reading)."""
        return tuple(sorted({dist for row in self.rows for dist in row.affected}))



# -- loading ------------------------------------------------------------------------------------
def read_toml(data: bytes, label: str) -> Any:
    """The TOML document in ``data``; MatrixError naming ``label`` (a file or plugin) when it is not
    valid TOML."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise MatrixError(label, f"not valid TOML: {exc}") from None


def _rows_from_file(path: Path, label: str, origin: str) -> tuple[BugRow, ...]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise MatrixError(label, f"cannot read the matrix file: {exc}") from None
    tables = parse_document(read_toml(data, label), source=label)
    rows = tuple(
        parse_row(table, source=label, index=i, row_type=BugRow, origin=origin)
        for i, table in enumerate(tables, 1)
    )
    _check_unique(rows, {origin: label})
    return rows


@lru_cache(maxsize=1)
def _builtin_rows() -> tuple[BugRow, ...]:
    return _rows_from_file(BUILTIN_PATH, _BUILTIN_LABEL, BUILTIN_SOURCE)


def _rows_from_dicts(extra_rows: Iterable[Mapping[str, Any]]) -> tuple[list[BugRow], dict[str, str]]:
    rows: list[BugRow] = []
    counts: dict[str, int] = {}
    labels: dict[str, str] = {}
    for item in extra_rows:
        data = dict(item)
        source = str(data.pop("source", None) or "extra_rows")
        counts[source] = counts.get(source, 0) + 1
        labels[source] = f"matrix rows from {source}"
        rows.append(
            parse_row(data, source=labels[source], index=counts[source], row_type=BugRow, origin=source)
        )
    return rows, labels


def _check_unique(rows: Iterable[BugRow], labels: Mapping[str, str]) -> None:
    """Raise MatrixError at the second row that reuses an id."""
    seen: dict[str, tuple[str, int]] = {}
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.source] = counts.get(row.source, 0) + 1
        label = labels.get(row.source, row.source)
        if row.id in seen:
            first_label, first_index = seen[row.id]
            raise MatrixError(
                label,
                f"duplicate id {row.id!r}, first defined in {first_label} bug row {first_index}; "
                "ids must be unique",
                index=counts[row.source],
                row_id=row.id,
                field="id",
            )
        seen[row.id] = (label, counts[row.source])


def load_matrix(path: str | Path | None = None, *, extra_rows: Iterable[Mapping[str, Any]] = ()) -> Matrix:
    """The compat matrix: the built-in file (or ``path``) plus ``extra_rows``.

    ``extra_rows`` are rows contributed by plugins, as dicts with the same fields as a TOML row
    plus ``source`` (the contributing distribution's name). The built-in file is parsed once per
    process; a ``path`` is read on every call. Raises :class:`MatrixError` naming the file or
    plugin, the row and the field when anything is malformed, or when an id repeats.
    """
    if path is None:
        base = _builtin_rows()
        labels = {BUILTIN_SOURCE: _BUILTIN_LABEL}
    else:
        label = str(path)
        base = _rows_from_file(Path(path), label, label)
        labels = {label: label}
    extra = list(extra_rows)
    if not extra:
        return Matrix(base)
    plugin_rows, plugin_labels = _rows_from_dicts(extra)
    labels.update(plugin_labels)
    rows = list(base) + plugin_rows
    _check_unique(rows, labels)
    return Matrix(rows)


def load_matrix_skipping_bad_rows(extra_rows: Iterable[Mapping[str, Any]]) -> tuple[Matrix, list[str]]:
    """The built-in matrix plus every row of ``extra_rows`` that is valid; a problem message for
    each row left out (malformed, or reusing an id), naming its plugin, row and field. One bad
    plugin row must not take the others, or the built-in rows, down with it."""
    base = _builtin_rows()
    rows = list(base)
    seen = {row.id: f"{_BUILTIN_LABEL} bug row {index}" for index, row in enumerate(base, 1)}
    problems: list[str] = []
    counts: dict[str, int] = {}
    for item in extra_rows:
        data = dict(item)
        source = str(data.pop("source", None) or "extra_rows")
        counts[source] = counts.get(source, 0) + 1
        label = f"matrix rows from {source}"
        try:
            row = parse_row(data, source=label, index=counts[source], row_type=BugRow, origin=source)
        except MatrixError as exc:
            problems.append(f"{exc}; the row is ignored")
            continue
        if row.id in seen:
            problems.append(
                f"{label}: bug row {counts[source]} (id {row.id!r}), field 'id': duplicate id, first defined in "
                f"{seen[row.id]}; the row is ignored"
            )
            continue
        seen[row.id] = f"{label} bug row {counts[source]}"
        rows.append(row)
    return Matrix(rows), problems


# -- output -------------------------------------------------------------------------------------
_DICT_KEYS = (
    "id",
    "title",
    "library",
    "affected",
    "fixed_in",
    "last_checked",
    "symptom",
    "root_cause",
    "upstream",
    "upstream_urls",
    "verification",
    "shim",
    "workaround",
    "no_scenario",
    "notes",
    "source",
)


def row_to_dict(row: BugRow, shim: str | None = None) -> dict[str, Any]:
    """Plain JSON-ready data for ``row``, with ``shim``, the id of the shim that fixes it (None:
    none does). Keys are always the same, in the same order; an absent optional field is None,
    ``fixed_in`` is ``{distribution: version}`` or ``"unfixed"``."""
    value: dict[str, Any] = {}
    for key in _DICT_KEYS:
        item = shim if key == "shim" else getattr(row, key)
        if isinstance(item, Mapping):
            item = dict(item)
        elif isinstance(item, tuple):
            item = list(item)
        value[key] = item
    return value


def render_markdown(matrix: Matrix, shim_of: Mapping[str, str] | None = None) -> str:
    """COMPAT.md: a summary table and one section per row, naming the shim of each row from
    ``shim_of`` (row id -> shim id). Deterministic for given arguments."""
    from devmap_shims.compat_matrix._markdown import render

    return render(matrix, shim_of or {})
