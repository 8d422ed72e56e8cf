"""Fixtures shared by the hook tests. Each test module imports its hook module as ``hook``."""

from __future__ import annotations

import pytest

import devmap_shims


@pytest.fixture
def shim(request):
    """The module's shim forced on, so its repairs are exercised on every stack (fixed ones included)."""
    shim_id = request.module.hook.SHIM_ID
    devmap_shims.uninstall()
    assert devmap_shims.install(only=[shim_id], force=[shim_id])
    yield
    devmap_shims.uninstall()


@pytest.fixture
def no_shim():
    devmap_shims.uninstall()
    yield
    devmap_shims.uninstall()
