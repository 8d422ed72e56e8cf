"""Planning tests: the fuzzed placements' figures in pytest's terminal summary (shown without -s)."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import sys

    checks = sys.modules.get("device_map_checks")
    lines = getattr(checks, "SUMMARY_LINES", None)
    if lines:
        terminalreporter.write_sep("-", "device-map placement fuzzing")
        for line in lines:
            terminalreporter.write_line(line)
