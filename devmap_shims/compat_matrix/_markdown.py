"""COMPAT.md: the compat matrix rendered as Markdown (``devmap-shims matrix --markdown``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from devmap_shims.compat_matrix import BugRow, Matrix

GENERATED_NOTE = (
    "Generated from `devmap_shims/compat_matrix/known_bugs.toml` by `devmap-shims matrix --markdown`; "
    "do not edit by hand."
)

GRADES_NOTE = (
    "Evidence grades: **V-code** read in the library's code at a release; **V-run** reproduced by running "
    "the library's code; **V-thread** stated in the upstream issue or pull request; **I** inferred, "
    "not verified."
)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _paragraphs(text: str) -> str:
    return "\n\n".join(line.strip() for line in text.splitlines() if line.strip())


def _fence(text: str) -> str:
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}text\n{text}\n{fence}"


def _requirements(row: BugRow) -> list[str]:
    from devmap_shims.compat_matrix import requirement_text

    return [requirement_text(dist, spec) for dist, spec in row.affected.items()]


def _affected_cell(row: BugRow) -> str:
    return "<br>".join(f"`{_cell(part)}`" for part in _requirements(row))


def _summary(matrix: Matrix, shim_of: Mapping[str, str]) -> list[str]:
    lines = [
        "| id | library | affected | fixed in | shim or workaround |",
        "|---|---|---|---|---|",
    ]
    for row in matrix:
        shim = shim_of.get(row.id)
        fix = f"shim `{shim}`" if shim else f"no shim: [workaround](#{row.id})"
        lines.append(
            f"| [`{row.id}`](#{row.id}) | {_cell(row.library)} | {_affected_cell(row)} "
            f"| {_cell(row.fixed_in_text)} | {fix} |"
        )
    return lines


def _section(row: BugRow, shim: str | None) -> list[str]:
    from devmap_shims.compat_matrix import BUILTIN_SOURCE, upstream_url

    facts = [
        f"- **Library:** {row.library}",
        f"- **Affected:** {', '.join(f'`{part}`' for part in _requirements(row))}",
        f"- **Fixed in:** {row.fixed_in_text}",
        f"- **Shim:** `{shim}`" if shim else "- **Shim:** none (see the workaround)",
        f"- **Verification:** {', '.join(row.verification)}",
    ]
    if row.source != BUILTIN_SOURCE:
        facts.append(f"- **Source:** {row.source}")
    lines = [f'<a id="{row.id}"></a>', f"### `{row.id}`", "", f"**{row.title}**", "", *facts, ""]
    lines += ["**Symptom**", "", _fence(row.symptom), ""]
    lines += ["**Root cause**", "", _paragraphs(row.root_cause), ""]
    for heading, text in (
        ("Workaround", row.workaround),
        ("Why there is no reproducible scenario", row.no_scenario),
        ("Notes", row.notes),
    ):
        if text:
            lines += [f"**{heading}**", "", _paragraphs(text), ""]
    links = ", ".join(f"[{link}]({upstream_url(link)})" for link in row.upstream) or "none"
    lines += [f"**Upstream:** {links}", ""]
    return lines


def render(matrix: Matrix, shim_of: Mapping[str, str]) -> str:
    lines = [
        "# Compatibility matrix: known device-placement bugs",
        "",
        GENERATED_NOTE,
        "",
        (
            f"{len(matrix)} known bugs. A row applies when every range under *affected* holds for the "
            "installed versions; pre-release, dev and local builds (`2.6.0rc1`, `2.6.0.dev20241112+cu124`, "
            "`2.6.0a0+ecf3bae40a.nv25.01`) count as their release. `devmap-shims doctor` lists the rows that "
            "apply to this machine and `devmap-shims explain ID` shows one row."
        ),
        "",
        GRADES_NOTE,
        "",
        "## Summary",
        "",
        *_summary(matrix, shim_of),
        "",
        "## Bugs",
        "",
    ]
    for row in matrix:
        lines += _section(row, shim_of.get(row.id))
    return "\n".join(lines).rstrip("\n") + "\n"
