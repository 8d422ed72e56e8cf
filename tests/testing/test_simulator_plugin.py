"""The pytest plugin: ``@pytest.mark.simulated_gpus`` and the ``simulated_gpus`` fixture."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if torch.version.cuda is None:  # pragma: no cover
    pytest.skip("the simulator needs a CUDA build of torch", allow_module_level=True)

pytest_plugins = ["pytester"]


@pytest.mark.simulated_gpus(n=3, memory="512MiB", name="NVIDIA L4")
def test_marker_wraps_the_test(simulated_gpus):
    assert torch.cuda.device_count() == 3 == simulated_gpus.device_count
    assert simulated_gpus.capacity(2) == 512 * 2**20
    assert torch.cuda.get_device_name(0) == "NVIDIA L4"
    assert torch.ones(1, device="cuda:2").device == torch.device("cuda:2")


def test_fixture_defaults(simulated_gpus):
    assert simulated_gpus.device_count == 2 and simulated_gpus.capacity(1) == 2**30
    assert torch.cuda.mem_get_info(0) == (2**30, 2**30)


@pytest.mark.simulated_gpus(4)
def test_marker_without_fixture():
    assert torch.cuda.device_count() == 4


def test_no_simulation_without_marker_or_fixture():
    from devmap_shims.testing import active_machine

    assert active_machine() is None
    assert "device" not in torch.Tensor.__dict__


def test_plugin_in_a_fresh_session(pytester):
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.simulated_gpus(n=2, memory="1GiB")
        def test_marked():
            assert torch.cuda.device_count() == 2

        def test_fixture(simulated_gpus):
            assert simulated_gpus.device_count == 2
            t = torch.zeros(3, device="cuda:1")
            assert simulated_gpus.allocated(1) == 512

        def test_after():
            from devmap_shims.testing import active_machine
            assert active_machine() is None

        @pytest.mark.simulated_gpus(2)
        def test_failure_still_restores():
            raise AssertionError("expected")

        def test_restored_after_failure():
            from devmap_shims.testing import active_machine
            assert active_machine() is None
        """
    )
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: expected*"])


def test_marker_is_registered(pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["*@pytest.mark.simulated_gpus(n=2, memory='1GiB'*"])


def test_plugin_import_does_not_import_torch(pytester):
    pytester.makepyfile(
        """
        import subprocess, sys

        def test_cheap():
            code = "import sys, devmap_shims.testing.pytest_plugin; print('torch' in sys.modules)"
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            assert out.stdout.strip() == "False"
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
