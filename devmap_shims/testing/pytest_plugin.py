"""pytest plugin (entry point ``devmap_shims``): the ``simulated_gpus`` marker and fixture.

    @pytest.mark.simulated_gpus(n=4, memory="23GiB")
    def test_placement():
        assert torch.cuda.device_count() == 4

    def test_memory(simulated_gpus):          # the running SimulatedMachine
        assert simulated_gpus.device_count == 2

The marker wraps the test (its fixtures' setup and teardown included) in a simulation; the
fixture yields the machine, using the marker's arguments when the test has the marker and
``n=2, memory="1GiB"`` otherwise. Importing this plugin does not import torch.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import pytest

MARKER = "simulated_gpus"
DEFAULTS: Dict[str, Any] = {"n": 2, "memory": "1GiB"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(n=2, memory='1GiB', name='NVIDIA A10G'): run the test on a simulated multi-GPU CUDA "
        "machine (devmap_shims.testing.simulated_gpus)",
    )


def _marker_args(item: pytest.Item) -> Tuple[bool, Dict[str, Any]]:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return False, dict(DEFAULTS)
    kwargs = dict(DEFAULTS)
    names = ("n", "memory", "name")
    if len(marker.args) > len(names):
        raise pytest.UsageError(f"@pytest.mark.{MARKER} takes at most {names}, got {marker.args!r}")
    kwargs.update(zip(names, marker.args))
    kwargs.update(marker.kwargs)
    return True, kwargs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    marked, kwargs = _marker_args(item)
    if marked or MARKER in getattr(item, "fixturenames", ()):
        from devmap_shims.testing.simulator import simulated_gpus

        cm = simulated_gpus(**kwargs)
        item._devmap_sim_cm = cm  # type: ignore[attr-defined]
        item._devmap_sim_machine = cm.__enter__()  # type: ignore[attr-defined]
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    yield
    cm = getattr(item, "_devmap_sim_cm", None)
    if cm is not None:
        del item._devmap_sim_cm  # type: ignore[attr-defined]
        item._devmap_sim_machine = None  # type: ignore[attr-defined]
        cm.__exit__(None, None, None)


@pytest.fixture(name=MARKER)
def simulated_gpus_fixture(request: pytest.FixtureRequest) -> Any:
    """The running SimulatedMachine (marker arguments, else n=2, memory="1GiB")."""
    machine = getattr(request.node, "_devmap_sim_machine", None)
    if machine is None:  # pragma: no cover - setup hook always runs first
        raise RuntimeError("the simulated_gpus fixture needs the devmap_shims pytest plugin's setup hook")
    return machine
