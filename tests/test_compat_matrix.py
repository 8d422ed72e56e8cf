"""The compat matrix: the built-in data, the loader's validation, applicability and COMPAT.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from devmap_shims.compat_matrix import (
    BUILTIN_SOURCE,
    BugRow,
    Matrix,
    MatrixError,
    load_matrix,
    render_markdown,
    row_to_dict,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

SLUG = re.compile(r"^[a-z0-9]+(?:[-_.][a-z0-9]+)*$")


@pytest.fixture(scope="module")
def matrix() -> Matrix:
    return load_matrix()


# -- the built-in data ----------------------------------------------------------------------------
def test_builtin_matrix_loads_with_at_least_15_rows(matrix: Matrix) -> None:
    assert len(matrix) >= 15
    assert all(isinstance(row, BugRow) and row.source == BUILTIN_SOURCE for row in matrix)


def test_builtin_ids_are_unique_lowercase_slugs(matrix: Matrix) -> None:
    ids = matrix.ids()
    assert len(set(ids)) == len(ids)
    assert [i for i in ids if not SLUG.match(i)] == []


def test_every_builtin_row_cites_upstream_and_evidence(matrix: Matrix) -> None:
    for row in matrix:
        assert row.upstream, row.id
        assert row.verification, row.id
        assert row.workaround, row.id
        assert not row.unfixed or row.last_checked, row.id
        for url in row.upstream_urls:
            assert re.match(r"^https://github\.com/[\w.-]+/[\w.-]+/issues/[1-9]\d*$", url), url


def test_launcher_guard_row_says_the_hang_is_not_reproduced(matrix: Matrix) -> None:
    row = matrix.get("device-map-auto-generate-hang-grpo")
    assert row.no_scenario and "not reproduced" in row.no_scenario
    assert "not known" in (row.notes or "")


def test_fixed_versions_are_outside_their_affected_range(matrix: Matrix) -> None:
    checked = 0
    for row in matrix:
        if row.unfixed:
            continue
        for dist, version in row.fixed_in.items():
            if dist in row.affected:
                versions = {d: version if d == dist else None for d in row.affected}
                ok, why = row.applicability(versions)
                assert not ok, (row.id, why)
                checked += 1
    assert checked >= 10


# -- queries ------------------------------------------------------------------------------------------
def test_get_unknown_id_suggests_close_matches(matrix: Matrix) -> None:
    with pytest.raises(KeyError, match="bnb-quantstate-code-not-moved"):
        matrix.get("bnb-quantstate-code-not-move")
    with pytest.raises(KeyError, match="devmap-shims matrix"):
        matrix.get("zzzz")


def test_libraries_and_for_library_partition_the_rows(matrix: Matrix) -> None:
    libraries = matrix.libraries()
    assert list(libraries) == sorted(set(libraries))
    assert sum(len(matrix.for_library(lib)) for lib in libraries) == len(matrix)
    assert matrix.for_library("BitsAndBytes") == matrix.for_library("bitsandbytes")


def test_builtin_file_is_parsed_once(matrix: Matrix) -> None:
    assert load_matrix().rows[0] is matrix.rows[0]


# -- applicability with real version strings -----------------------------------------------------------
@pytest.mark.parametrize(
    "version, applies",
    [("0.41.1", False), ("0.41.2", True), ("0.44.1", True), ("0.45.2", True), ("0.45.3", False), ("0.50.2", False)],
)
def test_bitsandbytes_code_not_moved_range(matrix: Matrix, version: str, applies: bool) -> None:
    row = matrix.get("bnb-quantstate-code-not-moved")
    ok, why = row.applicability({"bitsandbytes": version})
    assert ok is applies
    assert f"bitsandbytes {version}" in why
    assert (" in " if applies else " is outside ") + ">=0.41.2,<0.45.3" in why


def test_missing_distribution_never_applies(matrix: Matrix) -> None:
    row = matrix.get("bnb-quantstate-code-not-moved")
    assert row.applicability({"bitsandbytes": None}) == (False, "bitsandbytes is not installed")
    assert row.applies({}) is False


def test_all_affected_entries_must_hold(matrix: Matrix) -> None:
    row = matrix.get("dispatch-without-skip-keys-moves-kv-cache")
    assert row.applies({"accelerate": "0.29.3", "transformers": "4.40.0"})
    ok, why = row.applicability({"accelerate": "0.29.3", "transformers": "4.45.1"})
    assert not ok and "transformers 4.45.1 is outside" in why
    ok, why = row.applicability({"accelerate": "0.19.0", "transformers": "4.40.0"})
    assert not ok and "accelerate 0.19.0" in why
    # a dev build of the fixed release carries the fix: outside <4.42.0
    assert not row.applies({"accelerate": "0.29.3", "transformers": "4.42.0.dev0"})


def test_any_version_requirement_needs_the_distribution_installed(matrix: Matrix) -> None:
    row = matrix.get("accelerate-bnb-forced-hooks")
    assert row.applies({"accelerate": "0.34.2", "bitsandbytes": "0.44.1"})
    assert not row.applies({"accelerate": "0.34.2", "bitsandbytes": None})
    assert not row.applies({"accelerate": "1.2.0", "bitsandbytes": "0.44.1"})


@pytest.mark.parametrize(
    "torch_version, in_2_5, in_2_6_up",
    [
        ("2.5.1+cu121", True, False),
        ("2.6.0a0+ecf3bae40a.nv25.01", False, True),
        ("2.6.0.dev20241112+cu124", False, True),
        ("2.6.0rc1", False, True),
        ("2.6.0", False, True),
    ],
)
def test_torch_build_strings_land_on_their_release(torch_version: str, in_2_5: bool, in_2_6_up: bool) -> None:
    rows = [
        _plugin_row(id="torch-2-5-only", affected={"torch": ">=2.5,<2.6"}),
        _plugin_row(id="torch-2-6-up", affected={"torch": ">=2.6"}),
    ]
    matrix = load_matrix(extra_rows=rows)
    versions = {"torch": torch_version}
    assert matrix.get("torch-2-5-only").applies(versions) is in_2_5
    assert matrix.get("torch-2-6-up").applies(versions) is in_2_6_up


def test_applicable_on_the_pinned_stacks(matrix: Matrix) -> None:
    legacy = {
        "torch": "2.4.1",
        "transformers": "4.45.1",
        "accelerate": "0.34.2",
        "bitsandbytes": "0.44.1",
        "diffusers": "0.31.0",
    }
    current = {
        "torch": "2.15.0",
        "transformers": "5.24.0",
        "accelerate": "1.15.0",
        "bitsandbytes": "0.50.2",
        "diffusers": "0.42.1",
    }
    legacy_ids = {row.id for row in matrix.applicable(legacy)}
    current_ids = {row.id for row in matrix.applicable(current)}
    assert {"bnb-quantstate-code-not-moved", "diffusers-quantized-load-on-current-device"} <= legacy_ids
    assert "transformers-generate-logits-device" in legacy_ids
    assert "bnb-quantstate-code-not-moved" not in current_ids
    assert "balanced-memory-large-unquantized-embedding-collapse" in legacy_ids & current_ids
    for row in matrix:
        assert (row.id in current_ids) is row.applies(current)


# -- malformed rows -----------------------------------------------------------------------------------
_DELETE = object()

_VALID = {
    "id": "good-row",
    "title": "A bug",
    "library": "bitsandbytes",
    "affected": {"bitsandbytes": ">=0.41.2,<0.45.3"},
    "fixed_in": {"bitsandbytes": "0.45.3"},
    "symptom": "RuntimeError: boom",
    "root_cause": "because",
    "upstream": ["bitsandbytes-foundation/bitsandbytes#1527"],
    "verification": ["V-code"],
    "workaround": "Upgrade to bitsandbytes>=0.45.3.",
}


def _toml_value(value: object) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def _toml_row(**changes: object) -> str:
    row = {**_VALID, **changes}
    lines = ["[[bug]]"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in row.items() if value is not _DELETE]
    return "\n".join(lines) + "\n"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bugs.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _plugin_row(**changes: object) -> dict:
    return {**_VALID, "source": "example-plugin", **changes}


MALFORMED = [
    ("unknown field", {"symptomm": "x"}, "symptomm", "did you mean 'symptom'"),
    ("missing field", {"root_cause": _DELETE}, "root_cause", "missing required field"),
    ("wrong type: title", {"title": 3}, "title", "expected a string, got integer"),
    ("wrong type: affected", {"affected": ">=1.0"}, "affected", "expected a table"),
    ("wrong type: upstream", {"upstream": "a/b#1"}, "upstream", "expected an array"),
    ("empty affected", {"affected": {}}, "affected", "at least one distribution"),
    ("bad specifier", {"affected": {"bitsandbytes": ">>0.45"}}, "affected", "bad specifier '>>0.45'"),
    ("bad distribution", {"affected": {"bits and bytes": ">=1"}}, "affected", "not a distribution name"),
    ("bad fixed_in", {"fixed_in": "someday"}, "fixed_in", '"unfixed"'),
    ("bad fixed version", {"fixed_in": {"bitsandbytes": "soon"}}, "fixed_in", "expected a version"),
    ("fix inside range", {"fixed_in": {"bitsandbytes": "0.45.0"}}, "fixed_in", "inside the affected range"),
    ("unfixed without date", {"fixed_in": "unfixed"}, "last_checked", 'fixed_in = "unfixed"'),
    ("bad date", {"fixed_in": "unfixed", "last_checked": "2026-13-01"}, "last_checked", "YYYY-MM-DD"),
    ("no workaround", {"workaround": _DELETE}, "workaround", "missing required field"),
    ("several missing", {"verification": _DELETE, "workaround": _DELETE, "symptom": _DELETE}, "symptom",
     "missing required field (also missing: verification, workaround)"),
    ("upstream without number", {"upstream": ["huggingface/accelerate/3244"]}, "upstream", "owner/repo#N"),
    ("upstream without owner", {"upstream": ["accelerate#3244"]}, "upstream", "owner/repo#N"),
    ("unknown grade", {"verification": ["verified"]}, "verification", "unknown grade 'verified'"),
    ("no grade", {"verification": []}, "verification", "non-empty"),
    ("bad id", {"id": "Bad Id!"}, "id", "slug"),
    ("row names a shim", {"shim": "device-map-balance"}, "shim", "the shim lists the rows it fixes"),
    ("empty symptom", {"symptom": "  "}, "symptom", "non-empty"),
]


@pytest.mark.parametrize("changes, field, expected", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_row_names_file_row_and_field(tmp_path: Path, changes: dict, field: str, expected: str) -> None:
    path = _write(tmp_path, "schema_version = 1\n\n" + _toml_row(id="first-row") + _toml_row(**changes))
    with pytest.raises(MatrixError) as caught:
        load_matrix(path)
    error = caught.value
    assert (error.source, error.index, error.field) == (str(path), 2, field)
    message = str(error)
    assert message.startswith(f"{path}: bug row 2")
    assert f"field {field!r}" in message
    assert expected in message
    row_id = changes.get("id", _VALID["id"])
    if field != "id":
        assert error.row_id == row_id and f"(id {row_id!r})" in message


def test_duplicate_id_names_both_rows(tmp_path: Path) -> None:
    path = _write(tmp_path, "schema_version = 1\n" + _toml_row() + _toml_row(title="again"))
    with pytest.raises(MatrixError, match=r"bug row 2 \(id 'good-row'\), field 'id': duplicate id .* bug row 1"):
        load_matrix(path)


def test_row_without_id_is_named_by_position(tmp_path: Path) -> None:
    path = _write(tmp_path, "schema_version = 1\n" + _toml_row(id=_DELETE))
    with pytest.raises(MatrixError, match=r"bug row 1 \(no id\), field 'id': missing required field"):
        load_matrix(path)


@pytest.mark.parametrize(
    "text, field, expected",
    [
        (_toml_row(), "schema_version", "expected schema_version = 1, got None"),
        ("schema_version = 2\n" + _toml_row(), "schema_version", "got 2"),
        ("schema_version = 1\nbugs = []\n", "bugs", "unknown top-level key 'bugs'"),
        ("schema_version = 1\nbug = 3\n", "bug", "array of tables"),
    ],
)
def test_malformed_file_level(tmp_path: Path, text: str, field: str, expected: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(MatrixError) as caught:
        load_matrix(path)
    assert (caught.value.index, caught.value.field) == (None, field)
    assert expected in str(caught.value) and str(path) in str(caught.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "schema_version = 1\n[[bug]]\nid = \n")
    with pytest.raises(MatrixError, match=re.escape(f"{path}: not valid TOML")):
        load_matrix(path)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match="cannot read"):
        load_matrix(tmp_path / "nope.toml")


def test_toml_date_and_multiline_text_are_accepted(tmp_path: Path) -> None:
    text = 'schema_version = 1\n[[bug]]\nid = "dated"\ntitle = "t"\nlibrary = "accelerate"\n'
    text += 'affected = { accelerate = "*" }\nfixed_in = "unfixed"\nlast_checked = 2026-11-01\n'
    text += 'symptom = """\nline one\nline two"""\nroot_cause = "r"\nupstream = []\nverification = ["I"]\n'
    text += 'workaround = "w"\n'
    row = load_matrix(_write(tmp_path, text)).get("dated")
    assert row.last_checked == "2026-11-01"
    assert row.symptom == "line one\nline two"
    assert row.fixed_in_text == "unfixed (last checked 2026-11-01)"
    assert row.affected_text == "accelerate (any version)"


# -- plugin rows ----------------------------------------------------------------------------------------
def test_extra_rows_follow_the_builtin_rows_with_their_source(matrix: Matrix) -> None:
    extended = load_matrix(extra_rows=[_plugin_row(id="example-plugin.bug")])
    assert extended.rows[: len(matrix)] == matrix.rows
    row = extended.rows[-1]
    assert (row.id, row.source) == ("example-plugin.bug", "example-plugin")
    assert len(load_matrix()) == len(matrix)  # the cached built-in rows are not extended


def test_malformed_extra_row_names_the_plugin(matrix: Matrix) -> None:
    rows = [_plugin_row(id="p-one"), _plugin_row(id="p-two", upstream=["nope"])]
    with pytest.raises(MatrixError) as caught:
        load_matrix(extra_rows=rows)
    assert "example-plugin" in caught.value.source
    assert (caught.value.index, caught.value.row_id, caught.value.field) == (2, "p-two", "upstream")


def test_extra_row_reusing_a_builtin_id_is_rejected(matrix: Matrix) -> None:
    with pytest.raises(MatrixError, match="first defined in devmap_shims/compat_matrix/known_bugs.toml bug row 3"):
        load_matrix(extra_rows=[_plugin_row(id=matrix.rows[2].id)])


# -- output ---------------------------------------------------------------------------------------------
def test_row_to_dict_is_json_ready_with_stable_keys(matrix: Matrix) -> None:
    dicts = [row_to_dict(row) for row in matrix]
    assert len({tuple(d) for d in dicts}) == 1  # same keys, same order, for every row
    assert json.loads(json.dumps(dicts)) == dicts
    unfixed = row_to_dict(matrix.get("balanced-memory-large-unquantized-embedding-collapse"))
    assert unfixed["fixed_in"] == "unfixed" and unfixed["last_checked"]
    fixed = row_to_dict(matrix.get("bnb-quantstate-code-not-moved"))
    assert fixed["fixed_in"] == {"bitsandbytes": "0.45.3"} and fixed["last_checked"] is None
    assert fixed["upstream_urls"][0] == "https://github.com/bitsandbytes-foundation/bitsandbytes/issues/1527"


def test_markdown_has_every_row_and_link(matrix: Matrix) -> None:
    text = render_markdown(matrix)
    assert "generated" in text.lower() and "devmap-shims matrix --markdown" in text
    assert text == render_markdown(load_matrix())
    for row in matrix:
        assert f'<a id="{row.id}"></a>' in text
        assert f"| [`{row.id}`](#{row.id}) |" in text
        for url in row.upstream_urls:
            assert f"({url})" in text
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_markdown_shows_plugin_source() -> None:
    text = render_markdown(load_matrix(extra_rows=[_plugin_row(id="example-plugin.bug")]))
    assert "- **Source:** example-plugin" in text


def test_compat_md_and_shim_docstrings_are_not_stale() -> None:
    """COMPAT.md and the row lines of every built-in shim's docstring are generated from the matrix."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "regenerate.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}run `python scripts/regenerate.py`"


def test_the_rows_of_a_shim_module_are_read_from_its_file_as_generated() -> None:
    """What demo and doctor name when a shim module fails to import (the file is read, not imported)."""
    import importlib

    from devmap_shims.shims import catalog

    for name in catalog.builtin_modules():
        assert catalog.rows_in_source(name) == list(importlib.import_module(name).SHIM.fixes), name
    assert catalog.rows_in_source("devmap_shims.hooks.accelerate.no_such_module") == []


def test_markdown_names_the_shim_of_each_row_from_the_shims(matrix: Matrix) -> None:
    text = render_markdown(matrix, {"bnb-quantstate-code-not-moved": "some-shim"})
    assert "| shim `some-shim` |" in text and "- **Shim:** `some-shim`" in text
    assert "- **Shim:** none (see the workaround)" in text


# -- start-up cost ----------------------------------------------------------------------------------
def test_import_reads_nothing_heavy() -> None:
    code = (
        "import sys, devmap_shims.compat_matrix as m; "
        "heavy = ['tomllib', 'tomli', 'packaging', 'torch', 'transformers', 'accelerate', 'bitsandbytes', "
        "'diffusers']; print([h for h in heavy if h in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
