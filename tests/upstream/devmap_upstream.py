"""pytest plugin: run a library's own GPU tests on a simulated multi-GPU machine.

    python -m pytest -p devmap_upstream --upstream-expect tests/upstream/accelerate-1.15.0.toml \\
        tests/test_big_modeling.py ...          # from the unpacked sdist (scripts/upstream_tests.py)

accelerate's ``require_multi_device``-style decorators read ``torch.cuda.device_count()`` when the
test module is imported, so the simulation (``devmap_shims.testing.simulated_gpus``) starts in
``pytest_load_initial_conftests``, before any conftest.py or test module is imported, and lasts the
whole session. The expectations file (TOML)
says which upstream tests are deselected and why, which skips are upstream's own (slow tests,
missing extras), how many tests must pass, and which tests assert the very behaviour a shim
repairs (``[changed_by_shims]``): with ``--devmap-shims`` those must fail, and they do not count
as passes. Any other skip (``test requires a GPU``), failure, missing pass or stale entry fails
the session. ``--devmap-shims`` arms the shims (``devmap_shims.install``, strict) before the
simulation starts, as ``DEVMAP_SHIMS=1`` does at interpreter start.

Each test starts from seed 0 (``random``, numpy, torch's CPU and simulated GPU generators), as
pytest-randomly reseeds: upstream tests draw unseeded inputs, and a rare draw fails a float
tolerance (accelerate's ``test_pre_forward_hook_is_executed`` fails for one seed in about 3000,
with or without the shims), so a run with the shims and one without see the same inputs.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import pytest

from devmap_shims._text import wrap

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]


#: every test starts from this seed (see the module docstring)
SEED = 0


class Expectations:
    """The parsed expectations file (see the module docstring)."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        self.path = path
        self.gpus: int = int(data.get("gpus", 2))
        self.memory: str = str(data.get("memory", "512MiB"))
        self.files: List[str] = list(data["files"])
        self.passed: int = int(data["passed"])
        self.multi_gpu: List[str] = list(data.get("multi_gpu", ()))
        self.upstream_skips: List[str] = list(data.get("upstream_skips", ()))
        self.deselect: Dict[str, str] = dict(data.get("deselect", {}))
        for nodeid, reason in self.deselect.items():
            if not reason.startswith(("simulator:", "test:")):
                raise pytest.UsageError(
                    f"{path}: the reason for deselecting {nodeid} must start with 'simulator:' or 'test:' "
                    f"(whose limit it is), got {reason!r}")
        #: test -> "<shim id>: why upstream's assertion is the bug the shim repairs"
        self.changed_by_shims: Dict[str, str] = dict(data.get("changed_by_shims", {}))


class UpstreamRun:
    """The session's simulation, selection and outcome checks."""

    def __init__(self, expect: Expectations, want_shims: bool) -> None:
        self.expect = expect
        self.want_shims = want_shims
        self.cm: Any = None
        self.machine: Any = None
        self.shims: Optional[str] = None
        self.passed: List[str] = []
        self.failed: List[str] = []
        self.bad_skips: List[str] = []
        self.upstream_skipped: List[str] = []
        self.deselected: List[str] = []
        self.problems: List[str] = []
        self.collected: Set[str] = set()
        self.full = False

    # -- the machine -------------------------------------------------------------------------
    def start(self) -> None:
        if self.want_shims:
            import devmap_shims

            devmap_shims.install(strict=True)
            self.shims = f"installed (strict), {len(_applying_shims())} apply to this stack"
        from devmap_shims.testing.simulator import simulated_gpus

        self.cm = simulated_gpus(self.expect.gpus, memory=self.expect.memory)
        self.machine = self.cm.__enter__()

    def stop(self) -> None:
        if self.cm is not None:
            cm, self.cm = self.cm, None
            cm.__exit__(None, None, None)

    # -- outcomes ----------------------------------------------------------------------------
    def record(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed:
            self.passed.append(report.nodeid)
        elif report.failed:
            self.failed.append(report.nodeid)
        elif report.skipped:
            reason = _skip_reason(report)
            if any(allowed in reason for allowed in self.expect.upstream_skips):
                self.upstream_skipped.append(report.nodeid)
            else:
                self.bad_skips.append(f"{report.nodeid}: {reason}")

    def changed(self) -> List[str]:
        """The collected tests the armed shims are expected to make fail (none without shims)."""
        if not self.want_shims:
            return []
        return [nodeid for nodeid in self.expect.changed_by_shims if nodeid in self.collected]

    def check(self) -> None:
        changed = self.changed()
        for nodeid in changed:
            if nodeid in self.passed:
                self.problems.append(f"passed although the shims change what it asserts: {nodeid} "
                                     f"({self.expect.changed_by_shims[nodeid]})")
        for nodeid in self.failed:
            if nodeid not in changed:
                self.problems.append(f"failed: {nodeid}")
        missing = [nodeid for nodeid in self.expect.multi_gpu
                   if nodeid in self.collected and nodeid not in self.passed and nodeid not in changed]
        for nodeid in missing:
            self.problems.append(f"multi-GPU test did not pass: {nodeid}")
        for entry in self.bad_skips:
            self.problems.append(f"skipped for a reason the expectations do not allow: {entry}")
        expected = self.expected_passes()
        if self.full and len(self.passed) != expected:  # a -k or file subset has its own count
            self.problems.append(
                f"{len(self.passed)} tests passed, the expectations say {expected} ({self.expect.path})")

    def expected_passes(self) -> int:
        return self.expect.passed - len(self.changed())


def _applying_shims() -> List[str]:
    import devmap_shims

    return [f"{shim['id']} ({shim['state']})" for shim in devmap_shims.status()["shims"] if shim["applies"]]


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).replace("Skipped: ", "", 1)
    return str(longrepr)


_RUN: Optional[UpstreamRun] = None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("devmap_upstream", "upstream tests on a simulated multi-GPU machine")
    group.addoption("--upstream-expect", metavar="TOML",
                    help="expectations file (tests/upstream/<pkg>-<version>.toml)")
    group.addoption("--devmap-shims", action="store_true", help="arm devmap-shims (strict) before the run")


def _begin(options: Any) -> None:
    global _RUN
    if _RUN is not None:
        return
    path = getattr(options, "upstream_expect", None)
    if not path:
        raise pytest.UsageError("-p devmap_upstream needs --upstream-expect=<expectations .toml>")
    _RUN = UpstreamRun(Expectations(path), bool(getattr(options, "devmap_shims", False)))
    _RUN.start()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: List[str]) -> None:
    # before the test folders' conftest.py files, which may import the library's testing helpers
    # (diffusers' tests/conftest.py does) and so read the device count
    _begin(early_config.known_args_namespace)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    _begin(config.option)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _RUN
    if _RUN is not None:
        _RUN.stop()
        _RUN = None


def pytest_report_header(config: pytest.Config) -> List[str]:
    run = _RUN
    if run is None:
        return []
    lines = [
        f"simulated machine: {run.expect.gpus} x {run.machine.name}, {run.expect.memory} each "
        "(devmap_shims.testing.simulated_gpus)",
    ]
    if run.shims is not None:
        lines.append(f"devmap-shims: {run.shims}")
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    run = _RUN
    if run is None:
        return
    collected = {item.nodeid for item in items}
    # the files as listed, no -k/-m: the counts and the stale-entry check apply
    run.full = (set(config.args) == set(run.expect.files)
                and not config.option.keyword and not config.option.markexpr)
    listed = list(run.expect.deselect) + list(run.expect.changed_by_shims) + run.expect.multi_gpu
    stale = sorted({nodeid for nodeid in listed if nodeid not in collected}) if run.full else []
    if stale:
        raise pytest.UsageError(f"{run.expect.path} names tests that were not collected: {', '.join(stale)}")
    keep, drop = [], []
    for item in items:
        (drop if item.nodeid in run.expect.deselect else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        run.deselected = [item.nodeid for item in drop]
    items[:] = keep


def pytest_collection_finish(session: pytest.Session) -> None:
    if _RUN is not None:  # what runs after every plugin's selection (-k, -m, ours)
        _RUN.collected = {item.nodeid for item in session.items}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _RUN is None:
        return
    import random

    import torch

    random.seed(SEED)
    torch.manual_seed(SEED)  # the simulated GPUs' generators too
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(SEED)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _RUN is not None:
        _RUN.record(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run = _RUN
    if run is None or exitstatus not in (0, 1):
        return
    run.check()
    if run.problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif run.failed:  # only the failures the expectations name under [changed_by_shims]
        session.exitstatus = pytest.ExitCode.OK


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    run = _RUN
    if run is None:
        return
    tr = terminalreporter
    tr.section("upstream tests on the simulated machine")
    if run.deselected:
        tr.write_line(f"deselected ({len(run.deselected)}):")
        for nodeid in run.deselected:
            tr.write_line(f"  {nodeid}")
            for line in wrap(run.expect.deselect[nodeid], indent="    "):
                tr.write_line(line)
    tr.write_line(
        f"passed {len(run.passed)} (expected {run.expected_passes()}; multi-GPU {len(run.expect.multi_gpu)}), "
        f"failed {len(run.failed)}, skipped by upstream {len(run.upstream_skipped)}, "
        f"deselected {len(run.deselected)}")
    for nodeid in run.changed():
        outcome = "failed, as expected" if nodeid in run.failed else "did not fail"
        tr.write_line(f"changed by the shims ({outcome}): {nodeid}")
        for line in wrap(run.expect.changed_by_shims[nodeid], indent="    "):
            tr.write_line(line)
    if run.shims is not None:
        applying = _applying_shims()
        active = [shim for shim in applying if shim.endswith("(active)")]
        text = f"devmap-shims: {len(active)} of {len(applying)} applying shims hooked in: " + ", ".join(
            shim[: -len(" (active)")] for shim in active)
        for line in wrap(text, hang="  "):
            tr.write_line(line)
    for problem in run.problems:
        tr.write_line(f"EXPECTATION NOT MET: {problem}", red=True)
