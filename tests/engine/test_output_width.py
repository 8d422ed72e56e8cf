"""Text fitted to the terminal: broken between words, never inside a version range or a bracketed
group, at most ``WIDTH`` columns, and a table that falls back to records when it cannot fit."""

from __future__ import annotations

import re

import pytest

from devmap_shims.cli._output import GROUP_WIDTH, WIDTH, atoms, elide, fit, table, wrap

SENTENCE = (
    "bnb-quantstate-code-not-moved applies: bitsandbytes is in >=0.41.2,<0.45.3 and the shim "
    "[quant-state-follows-weight] moves the quant state (bitsandbytes-foundation/bitsandbytes#1342) "
    "(when a Params4bit or an Int8Params is moved) "
    "whenever a Params4bit is moved with .to(), on diffusers >=0.31.0,<0.33.0; accelerate <1.2.0"
)
RANGES = [">=0.41.2,<0.45.3", ">=0.31.0,<0.33.0;", "<1.2.0"]
GROUPS = ["[quant-state-follows-weight]", "(bitsandbytes-foundation/bitsandbytes#1342)"]


def test_default_width_is_100():
    assert WIDTH == 100
    assert all(len(line) <= 100 for line in wrap(SENTENCE * 3))


def test_atoms_keep_groups_and_bind_specifiers_to_the_word_before():
    assert atoms("accelerate <1.2.0; bitsandbytes (any version) [no shim: pass max_memory]") == [
        "accelerate <1.2.0;", "bitsandbytes (any version)", "[no shim: pass max_memory]"]
    assert atoms("  a\n\tb  ") == ["a", "b"]
    assert atoms("bitsandbytes 0.45.3 is the fix") == ["bitsandbytes 0.45.3", "is", "the", "fix"]
    # an opener never closed does not swallow the rest of the text
    assert atoms("x (unclosed and more words") == ["x", "(unclosed", "and", "more", "words"]
    # a long parenthesis is prose: broken between its words like the rest
    prose = "(taken by matmul_4bit for single-row inputs without grad)"
    assert len(prose) > GROUP_WIDTH and atoms(prose) == prose.split()


@pytest.mark.parametrize("width", range(60, 131, 7))
def test_wrap_breaks_only_between_pieces(width):
    lines = wrap(SENTENCE, width, indent="  ", hang="      ")
    assert all(len(line) <= width for line in lines)
    assert " ".join(line.strip() for line in lines) == " ".join(SENTENCE.split())  # nothing lost
    for piece in RANGES + GROUPS:  # each whole on one line, never a fragment on two
        assert any(piece in line for line in lines), (piece, lines)
    assert sum(len(atoms(line)) for line in lines) == len(atoms(SENTENCE))
    assert lines[0].startswith("  ") and not lines[0].startswith("   ")
    assert all(line.startswith("      ") for line in lines[1:])


def test_a_range_is_kept_with_its_library():
    lines = wrap("x" * 80 + " bitsandbytes >=0.41.2,<0.45.3", 100)
    assert lines == ["x" * 80, "bitsandbytes >=0.41.2,<0.45.3"]


@pytest.mark.parametrize("width", range(40, 180, 3))
def test_elide_ends_at_a_piece_boundary_with_a_marker(width):
    line = elide(SENTENCE, width)
    assert len(line) <= width
    pieces = atoms(SENTENCE)
    if len(" ".join(pieces)) <= width:
        assert line == " ".join(pieces)
        return
    assert line.endswith(" ...")
    kept = atoms(line[: -len(" ...")])
    assert kept == pieces[: len(kept)]  # whole pieces only: no fragment of a range or group
    # and as many as fit
    assert len(" ".join(pieces[: len(kept) + 1])) + len(" ...") > width


def test_elide_short_text_is_unchanged():
    assert elide("short text", 100) == "short text"
    assert elide("short text", 100, indent="  x: ") == "  x: short text"
    assert len(elide(SENTENCE, 60, indent=" " * 20)) <= 60


def test_max_lines_elides_the_last_line():
    lines = wrap(SENTENCE, 60, max_lines=2)
    assert len(lines) == 2 and lines[-1].endswith("...") and all(len(line) <= 60 for line in lines)
    assert wrap(SENTENCE, 1000, max_lines=1) == [" ".join(SENTENCE.split())]
    assert fit(SENTENCE, 60) == "\n".join(wrap(SENTENCE, 60))


def test_a_piece_wider_than_the_line_is_broken_at_its_spaces_commas_or_slashes():
    lines = wrap("[" + "word " * 40 + "]", 50)
    assert all(len(line) <= 50 for line in lines) and not any(line.endswith("wor") for line in lines)
    specs = ",".join(f"!={i}.0.{i}" for i in range(30))
    lines = wrap(specs, 40)
    assert all(len(line) <= 40 for line in lines) and "".join(lines) == specs
    assert all(re.fullmatch(r"(!=\d+\.0\.\d+,)*(!=\d+\.0\.\d+)?", line) for line in lines)  # cut after commas
    target = "transformers.models.musicgen_melody.modeling_musicgen_melody:MusicgenMelodyForConditionalGeneration.generate"
    lines = wrap(target, 100)
    assert "".join(lines) == target and all(len(line) <= 100 for line in lines)
    assert lines[0].endswith((":", ".")) and lines[1] == "generate"  # between names, not inside one
    assert wrap("x" * 250, 100) == ["x" * 100, "x" * 100, "x" * 50]
    assert wrap("", 100) == [""]


def test_table_fits_by_wrapping_the_widest_column():
    rows = [["a", "accelerate >=0.20.0; transformers >=4.30.0,<4.42.0 " * 2, "ok"], ["bb", "x", "fine"]]
    text = table(rows, ["id", "affected", "verdict"], width=60)
    lines = text.splitlines()
    assert all(len(line) <= 60 for line in lines)
    assert lines[0].split() == ["id", "affected", "verdict"]
    assert "transformers >=4.30.0,<4.42.0" in text and text.count("\n") > 3
    assert table(rows, ["id", "affected", "verdict"], width=None).count("\n") == 3  # header, rule, 2 rows


def test_table_that_fits_is_unchanged():
    text = table([["a", "b"], ["ccc", "d"]], ["x", "y"])
    assert text.splitlines() == ["x    y", "---  -", "a    b", "ccc  d"]


def test_table_too_wide_for_columns_becomes_records():
    long_id = "balanced-memory-large-unquantized-embedding-collapse"
    rows = [[long_id, "accelerate", "accelerate >=0.12.0", "unfixed (last checked 2026-11-01)", "device-map-balance" * 3]]
    lines = table(rows, ["id", "library", "affected", "fixed in", "shim"], width=80).splitlines()
    assert lines[0] == long_id
    assert all(len(line) <= 80 for line in lines)
    assert any("affected: accelerate >=0.12.0" in line for line in lines)
    assert any("fixed in: unfixed (last checked 2026-11-01)" in line for line in lines)
