"""The upstream-test plugin (devmap_upstream): an upstream-style test module whose skip decorators
read the device count at import sees the simulated GPUs, and the expectations fail the run when a
multi-GPU test skips, a pass is missing or an entry is stale; the expectations files parse."""

from __future__ import annotations

import glob
import os
import re

import pytest

# imported here, before pytester's snapshot of sys.modules: torch cannot be imported twice
import devmap_shims.testing.simulator  # noqa: F401
import torch  # noqa: F401

pytest_plugins = ["pytester"]

HERE = os.path.dirname(os.path.abspath(__file__))

UPSTREAM_STYLE = """
import unittest
import torch

device_count = torch.cuda.device_count()          # read at import, as accelerate's test_utils does
torch_device = "cuda" if torch.cuda.is_available() else "cpu"


class T(unittest.TestCase):
    @unittest.skipUnless(device_count > 1, "test requires multiple hardware accelerators")
    def test_two_devices(self):
        with torch.no_grad():
            a = torch.ones(2, device="cuda:0")
            assert a.to(1).device == torch.device("cuda", 1)

    def test_inference(self):
        layer = torch.nn.Linear(2, 2).to(torch_device)
        out = layer(torch.ones(1, 2, device=torch_device))
        assert out.shape == (1, 2)

    @unittest.skip("test is slow")
    def test_slow(self):
        pass

    def test_compile(self):
        raise AssertionError("deselected, never runs")
"""


def _expect(pytester: pytest.Pytester, gpus: int = 2, passed: int = 2) -> str:
    path = pytester.path / "expect.toml"
    path.write_text(
        'files = ["test_up.py"]\n'
        f'gpus = {gpus}\nmemory = "64MiB"\npassed = {passed}\n'
        'upstream_skips = ["test is slow"]\n'
        'multi_gpu = ["test_up.py::T::test_two_devices"]\n'
        '[deselect]\n"test_up.py::T::test_compile" = "simulator: torch.compile runs eagerly"\n'
    )
    return str(path)


@pytest.fixture
def upstream(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.syspath_prepend(HERE)
    pytester.makepyfile(test_up=UPSTREAM_STYLE)
    return pytester


def _run(pytester: pytest.Pytester, expect: str, *args: str) -> pytest.RunResult:
    return pytester.runpytest_inprocess("-p", "devmap_upstream", f"--upstream-expect={expect}", "-p",
                                        "no:cacheprovider", "test_up.py", *args)


def test_multi_gpu_test_runs_on_the_simulated_machine(upstream):
    result = _run(upstream, _expect(upstream))
    result.assert_outcomes(passed=2, skipped=1, deselected=1)
    result.stdout.fnmatch_lines([
        "simulated machine: 2 x NVIDIA A10G, 64MiB each*",
        "  test_up.py::T::test_compile",
        "    simulator: torch.compile runs eagerly",
        "passed 2 (expected 2; multi-GPU 1), failed 0, skipped by upstream 1, deselected 1",
    ])
    assert result.ret == 0


def test_one_gpu_fails_the_run(upstream):
    result = _run(upstream, _expect(upstream, gpus=1))
    result.stdout.fnmatch_lines([
        "EXPECTATION NOT MET: multi-GPU test did not pass: test_up.py::T::test_two_devices",
        "EXPECTATION NOT MET: skipped for a reason the expectations do not allow: "
        "test_up.py::T::test_two_devices: test requires multiple hardware accelerators",
    ])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_missing_pass_fails_the_run(upstream):
    result = _run(upstream, _expect(upstream, passed=3))
    result.stdout.fnmatch_lines(["EXPECTATION NOT MET: 2 tests passed, the expectations say 3 *"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_subset_is_not_held_to_the_count(upstream):
    result = _run(upstream, _expect(upstream), "-k", "inference")  # the multi-GPU test not selected
    result.assert_outcomes(passed=1, deselected=3)
    result.stdout.no_fnmatch_line("EXPECTATION NOT MET*")
    assert result.ret == 0


def test_a_stale_entry_is_an_error(upstream):
    expect = _expect(upstream)
    with open(expect) as f:
        text = f.read().replace("T::test_two_devices", "T::test_gone")
    with open(expect, "w") as f:
        f.write(text)
    result = _run(upstream, expect)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*names tests that were not collected: test_up.py::T::test_gone*"])


SEEDED = """
import random
import torch

DRAWS = []


def test_first():
    DRAWS.append((random.random(), torch.rand(()).item(), torch.rand((), device="cuda").item()))


def test_second():
    DRAWS.append((random.random(), torch.rand(()).item(), torch.rand((), device="cuda").item()))
    assert DRAWS[0] == DRAWS[1]
"""


def test_each_test_starts_from_the_same_seed(upstream):
    # upstream tests draw unseeded inputs; a rare draw can fail a float tolerance (accelerate's
    # test_pre_forward_hook_is_executed, one seed in 3000), so a run must not depend on the draw
    upstream.makepyfile(test_seeded=SEEDED)
    expect = upstream.path / "seeded.toml"
    expect.write_text('files = ["test_seeded.py"]\ngpus = 2\nmemory = "64MiB"\npassed = 2\n')
    result = upstream.runpytest_inprocess("-p", "devmap_upstream", f"--upstream-expect={expect}",
                                          "-p", "no:cacheprovider", "test_seeded.py")
    result.assert_outcomes(passed=2)
    assert result.ret == 0


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(HERE, "*-*.toml"))), ids=os.path.basename)
def test_expectations_file(path, monkeypatch):
    monkeypatch.syspath_prepend(HERE)
    from devmap_upstream import Expectations  # checks the deselection reasons

    expect = Expectations(path)
    with open(path, encoding="utf-8") as f:
        assert re.search(r'^sdist_sha256 = "[0-9a-f]{64}"$', f.read(), re.M)
    assert expect.passed > 0 and expect.gpus >= 2
    listed = list(expect.deselect) + list(expect.changed_by_shims) + expect.multi_gpu
    assert all(nodeid.split("::")[0] in expect.files for nodeid in listed)
    from devmap_shims.shims.catalog import builtin_shims

    shim_ids = {shim.id for shim in builtin_shims()[0]}
    for nodeid, reason in expect.changed_by_shims.items():  # each names the shim that changes it
        assert reason.split(":")[0] in shim_ids, (nodeid, reason)
    assert len(set(expect.multi_gpu)) == len(expect.multi_gpu)
