"""The int8-cb-follows-data shim with the real ``Int8Params`` of the installed bitsandbytes.

A parameter that already holds int8 data but no ``CB`` is what transformers builds for a
pre-quantized checkpoint. Moving it is enough to show the bug: on 0.48.0 the moved parameter has no
``CB`` (so ``Linear8bitLt`` quantizes the int8 weights again), from 0.48.1 on ``CB`` is its data. The
whole load-and-generate replay is the row's scenario (tests/scenarios).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")

from bitsandbytes.nn import Int8Params  # noqa: E402

from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.hooks.bitsandbytes import int8_cb_follows_data as hook  # noqa: E402
from devmap_shims.versions import installed_version, installed_versions, version_in  # noqa: E402

MATRIX = load_matrix()
BUG_HERE = MATRIX.get(hook.BUG_ID).applies(installed_versions(MATRIX.distributions()))
FIXED_HERE = version_in(installed_version("bitsandbytes") or "0", ">=0.48.1")


def int8_param(rows=6, cols=8):
    data = torch.randint(-127, 128, (rows, cols), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    return Int8Params(data, requires_grad=False, has_fp16_weights=False)


def test_without_the_shim_a_moved_int8_parameter_has_cb_where_the_matrix_says(no_shim):
    param = int8_param()
    assert param.CB is None
    moved = param.to("cpu")
    assert moved is not param and moved.dtype == torch.int8
    if BUG_HERE:
        assert moved.CB is None, "bnb-int8params-move-regression applies here but CB was set"
    elif FIXED_HERE:
        assert moved.CB is not None and moved.CB.data_ptr() == moved.data.data_ptr()


def test_with_the_shim_cb_is_the_moved_data(shim):
    param = int8_param()
    param.SCB = torch.ones(6)
    moved = param.to("cpu")
    assert moved.CB is not None and moved.CB.data_ptr() == moved.data.data_ptr()
    assert torch.equal(moved.CB, param.data)
    assert moved.SCB is not None and torch.equal(moved.SCB, torch.ones(6))  # left to the library


def test_the_wrapper_called_directly_sets_cb_only_on_a_new_int8_parameter():
    original = getattr(Int8Params.to, "__wrapped__", Int8Params.to)
    param = int8_param()
    moved = hook.keep_cb(original.__get__(param), param, ("cpu",), {})
    assert moved.CB is not None and moved.CB.data_ptr() == moved.data.data_ptr()
    assert param.CB is None  # the source parameter is not changed

    fp16 = Int8Params(torch.ones(4, 4), requires_grad=False, has_fp16_weights=True)
    half = hook.keep_cb(original.__get__(fp16), fp16, (torch.float16,), {})
    assert half.dtype == torch.float16 and half.CB is None

    def returns_self(*_args, **_kwargs):
        return param

    assert hook.keep_cb(returns_self, param, ("cpu",), {}) is param and param.CB is None
