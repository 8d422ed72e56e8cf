"""Every wrapped target keeps its signature, pickles by reference and, where compiled code can reach it, is a plain function."""

from __future__ import annotations

import importlib
import inspect
import pickle

import pytest

import devmap_shims
from devmap_shims.shims import wrapping
from devmap_shims.shims.registry import REGISTRY

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def armed():
    from devmap_shims.shims.catalog import builtin_shims

    shims, _ = builtin_shims()
    devmap_shims.uninstall()
    devmap_shims.install(force=[s.id for s in shims])
    for entry in REGISTRY.shims.values():
        for target in entry.targets:
            try:
                importlib.import_module(target.target.module)
            except ImportError:
                pass
    active = [t for e in REGISTRY.shims.values() for t in e.targets if t.state == "active"]
    yield active
    devmap_shims.uninstall()


def test_some_targets_are_active(armed):
    assert armed, "no target could be wrapped on this stack"


def test_signatures_are_the_originals(armed):
    for target in armed:
        layer = vars(target.owner)[target.name]
        assert inspect.signature(wrapping.callable_of(layer)) == inspect.signature(
            wrapping.callable_of(target.original)
        ), target.target.key


def test_compile_reachable_targets_are_plain_functions(armed):
    import wrapt

    for target in armed:
        layer = vars(target.owner)[target.name]
        if target.shim_entry.shim.compile_reachable:
            assert inspect.isfunction(wrapping.callable_of(layer)), target.target.key
            assert not isinstance(layer, wrapt.ObjectProxy if not hasattr(wrapt, "BaseObjectProxy") else wrapt.BaseObjectProxy)


def test_module_level_targets_pickle_by_reference(armed):
    for target in armed:
        if isinstance(target.owner, type):
            continue
        layer = vars(target.owner)[target.name]
        assert pickle.loads(pickle.dumps(layer)) is layer, target.target.key
