"""Fixtures shared by the shims' own tests. Each test module imports its shim module as ``hook``."""

from __future__ import annotations

import pytest

from devmap_shims.shims import ShimContext
from devmap_shims.shims.engine import ENGINE
from devmap_shims.shims.guard import bind_context


@pytest.fixture
def shim(request):
    """The module's shim forced on, so its repairs are exercised on every stack (fixed ones included)."""
    shim_id = request.module.hook.SHIM.id
    ENGINE.uninstall()
    assert ENGINE.install(only=[shim_id], force=[shim_id])
    yield
    ENGINE.uninstall()


@pytest.fixture
def no_shim():
    ENGINE.uninstall()
    yield
    ENGINE.uninstall()


def _direct(shim_record, *wrappers):
    context = ShimContext(shim_record)
    bound = [bind_context(w, context) for w in wrappers]
    return bound[0] if len(bound) == 1 else bound


@pytest.fixture
def direct():
    """``direct(SHIM, wrapper, ...)``: the shim's wrappers as the engine calls them (wrapt's four
    arguments), sharing one fresh context, for calling them by hand around the real library
    functions."""
    return _direct
