"""Planning tests: figures for the reader (the fuzzed placements', the corpus' balance ratios) go
to pytest's terminal summary, shown without -s, rather than between the progress dots."""

from __future__ import annotations

from typing import Callable, Dict, List

import pytest

_SECTIONS = pytest.StashKey[Dict[str, List[str]]]()


@pytest.fixture
def summary_section(request) -> Callable[[str, List[str]], None]:
    """``add(title, lines)``: lines printed under ``title`` in the terminal summary."""
    sections = request.config.stash.setdefault(_SECTIONS, {})

    def add(title: str, lines: List[str]) -> None:
        sections[title] = list(lines)

    return add


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import sys

    checks = sys.modules.get("device_map_checks")
    lines = getattr(checks, "SUMMARY_LINES", None)
    if lines:
        terminalreporter.write_sep("-", "device-map placement fuzzing")
        for line in lines:
            terminalreporter.write_line(line)
    for title, lines in config.stash.get(_SECTIONS, {}).items():
        terminalreporter.write_sep("-", title)
        for line in lines:
            terminalreporter.write_line(line)
