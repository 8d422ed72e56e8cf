"""A shim whose repair raises must leave the user's call exactly as the unpatched library makes it.

Every shim is forced on (so this runs on every stack) with its repair replaced by one that raises,
before or after calling the original, and each matrix scenario is replayed: the outcome must equal
the outcome without shims, one warning per shim must be logged (not one per call), status() must
say failed; in strict mode the error must surface.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from devmap_shims.scenarios import all_scenarios
from devmap_shims.scenarios.replay import replay
from devmap_shims.shims import arming, catalog
from devmap_shims.shims.engine import ENGINE

SHIM_OF = catalog.shim_of_rows(catalog.builtin_shims()[0])
CASES = [
    pytest.param(SHIM_OF[bug_id], item, id=f"{SHIM_OF[bug_id]}/{item.name}")
    for bug_id, items in all_scenarios().items()
    if bug_id in SHIM_OF
    for item in items
]


class Injected(RuntimeError):
    pass


def raise_before(wrapped, instance, args, kwargs):
    raise Injected("repair failed before the call")


def raise_after(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    raise Injected("repair failed after the call")


@pytest.fixture
def broken_repairs(monkeypatch):
    def use(repair):
        monkeypatch.setattr(arming, "wrapper_of", lambda shim, target: repair)

    ENGINE.reset()
    yield use
    ENGINE.reset()


@pytest.mark.parametrize("repair", [raise_before, raise_after], ids=["before", "after"])
@pytest.mark.parametrize("shim_id, item", CASES)
def test_failing_repair_falls_back_to_the_library(shim_id, item, repair, broken_repairs, monkeypatch):
    reference = replay(item, shims=False)
    if reference.unavailable:
        pytest.skip(reference.detail)
    broken_repairs(repair)
    monkeypatch.setenv("DEVMAP_SHIMS_FORCE", shim_id)
    outcome = replay(item, shims=True, shim_id=shim_id)
    assert (outcome.ok, outcome.detail.split(" in ")[0][:80]) == (reference.ok, reference.detail.split(" in ")[0][:80])
    warnings = [w for w in ENGINE.registry.warnings if f"shim {shim_id!r}" in w]
    if "failed" in outcome.shim_states:
        assert len(warnings) == 1, warnings  # once per shim, however many calls
        assert "Injected" in warnings[0]
    else:
        assert warnings == []  # the scenario never reached the target


@pytest.mark.parametrize("shim_id, item", CASES)
def test_strict_mode_surfaces_the_failure(shim_id, item, broken_repairs, monkeypatch, caplog):
    reference = replay(item, shims=False)
    if reference.unavailable:
        pytest.skip(reference.detail)
    broken_repairs(raise_before)
    monkeypatch.setenv("DEVMAP_SHIMS_FORCE", shim_id)
    monkeypatch.setenv("DEVMAP_SHIMS_STRICT", "1")
    # transformers 5 catches errors raised while it converts weights, logs them in its load report
    # and raises its own RuntimeError: there the ShimError surfaces in that report
    library_loggers = [logging.getLogger(name) for name in ("transformers", "diffusers")]
    for library_logger in library_loggers:
        library_logger.addHandler(caplog.handler)
    try:
        outcome = replay(item, shims=True, shim_id=shim_id)
    finally:
        for library_logger in library_loggers:
            library_logger.removeHandler(caplog.handler)
    if "failed" in outcome.shim_states or not outcome.ok:
        assert not outcome.ok, outcome.detail
        assert "ShimError" in outcome.detail or f"shim '{shim_id}'" in caplog.text, outcome.detail


def test_failing_post_import_hook_does_not_break_import_accelerate():
    pytest.importorskip("accelerate")
    code = (
        "import devmap_shims\n"
        "from devmap_shims.shims import arming\n"
        "def broken(*a, **k):\n    raise RuntimeError('hook exploded')\n"
        "arming._arm = broken\n"
        "devmap_shims.install()\n"
        "import accelerate.utils.modeling as m\n"
        "states = [t['state'] for s in devmap_shims.status()['shims'] for t in s['targets'] "
        "if t['target'].startswith('accelerate.utils.modeling')]\n"
        "print('IMPORTED', m.infer_auto_device_map.__name__, sorted(set(states)))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "IMPORTED infer_auto_device_map ['failed']" in proc.stdout
    assert "hook exploded" in proc.stderr


def test_strict_install_after_import_accelerate_raises_when_a_target_cannot_be_wrapped():
    """accelerate imported first: install() loads the built-in shims at once. In strict mode the
    target that cannot be wrapped is install()'s ShimError, and no shim stays on; without strict
    mode the others are armed."""
    pytest.importorskip("accelerate")
    code = (
        "import sys\n"
        "import accelerate.big_modeling as bm\n"
        "import devmap_shims\n"
        "from devmap_shims.shims import arming\n"
        "real = arming.wrapper_of\n"
        "def wrapper_of(shim, target):\n"
        "    if shim.id == 'device-map-balance':\n"
        "        raise ImportError('wrapper exploded')\n"
        "    return real(shim, target)\n"
        "arming.wrapper_of = wrapper_of\n"
        "strict = sys.argv[1] == 'strict'\n"
        "try:\n"
        "    print('INSTALLED', devmap_shims.install(strict=strict, force=['hooks-follow-moved-weights']))\n"
        "except devmap_shims.ShimError as exc:\n"
        "    print('RAISED', exc)\n"
        "print('ON', devmap_shims.is_installed(), type(bm.dispatch_model).__name__ != 'function')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    outputs = {}
    for mode in ("strict", "lenient"):
        proc = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs[mode] = proc.stdout
    assert "RAISED shim 'device-map-balance' could not wrap" in outputs["strict"]
    assert "ON False False" in outputs["strict"]
    assert "INSTALLED True" in outputs["lenient"] and "ON True True" in outputs["lenient"]
