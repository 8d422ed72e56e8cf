"""main-device-in-map-order: dispatch_model's main device is the map's first GPU, in map order.

Real accelerate dispatch on simulated GPUs. Behaviour tests force the shim, so they run on every
stack; accelerate < 1.15 already takes the first GPU in map order, so there the results must be the
same with and without it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

from packaging.version import Version  # noqa: E402

from devmap_shims.devices.accelerate_hooks import execution_device  # noqa: E402
from devmap_shims.hooks.accelerate import main_device_in_map_order as hook  # noqa: E402
from devmap_shims.shims.engine import ENGINE  # noqa: E402
from devmap_shims.testing import simulated_gpus  # noqa: E402

SET_ORDER = Version(accelerate.__version__).release >= (1, 15)


def _dispatch(*args, **kwargs):
    """accelerate's ``dispatch_model`` as its callers reach it (through the module)."""
    import accelerate.big_modeling as big_modeling

    return big_modeling.dispatch_model(*args, **kwargs)


def _run(device_map, *args, **kwargs):
    """Dispatch the scenario's three-layer model, run it once; the root hook's device and the device
    the cpu-mapped middle layer ran on."""
    first = next(d for d in device_map.values() if d not in ("cpu", "disk"))
    first = f"cuda:{first}" if isinstance(first, int) else str(first)
    with simulated_gpus(hook.GPUS, memory="1GiB"), torch.no_grad():
        model = _dispatch(hook.offload_model(), device_map, *args, **kwargs)
        model(torch.ones(2, 8, device=first))
        return str(execution_device(model)), model[1].ran_on


# -- the map's first GPU, whatever the set order -----------------------------------------------------


@pytest.mark.parametrize("order", ["against-the-set", "reversed"])
def test_string_values_give_the_first_gpu_of_the_map(shim, order):
    disagreeing = hook.disagreeing_map()
    a, b = disagreeing["0"], disagreeing["2"]
    device_map = {"0": a, "1": "cpu", "2": b} if order == "against-the-set" else {"0": b, "1": "cpu", "2": a}
    assert _run(device_map) == (device_map["0"], device_map["0"])


def test_integer_values_give_the_first_gpu_of_the_map(shim):
    assert _run({"0": 1, "1": "cpu", "2": 0}) == ("cuda:1", "cuda:1")


def test_disk_offload_runs_on_the_first_gpu(shim, tmp_path):
    device_map = hook.disagreeing_map()
    device_map["1"] = "disk"
    assert _run(device_map, offload_dir=str(tmp_path)) == (device_map["0"], device_map["0"])


@pytest.mark.skipif(not SET_ORDER, reason="accelerate < 1.15 takes the first GPU in map order")
def test_without_the_shim_accelerate_takes_the_set_order(no_shim):
    device_map = hook.disagreeing_map()
    theirs = hook.set_order_pick(device_map)
    assert theirs != device_map["0"]
    assert _run(device_map) == (theirs, theirs)
    # integer GPU indices: the lowest wins, wherever it sits in the map
    assert _run({"0": 1, "1": "cpu", "2": 0}) == ("cuda:0", "cuda:0")


@pytest.mark.skipif(SET_ORDER, reason="accelerate >= 1.15 takes the set order")
def test_before_1_15_accelerate_already_takes_map_order(no_shim):
    device_map = hook.disagreeing_map()
    assert _run(device_map) == (device_map["0"], device_map["0"])


# -- the caller's choice and calls that cannot differ are left alone -------------------------------------


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_an_explicit_main_device_is_kept(shim, how):
    device_map = hook.disagreeing_map()
    theirs = hook.set_order_pick(device_map)
    if how == "keyword":
        assert _run(device_map, main_device=theirs) == (theirs, theirs)
    else:
        assert _run(device_map, theirs) == (theirs, theirs)


def _recorder():
    calls = []

    def dispatch_model(model, device_map, main_device=None, state_dict=None, offload_dir=None):
        calls.append({"device_map": device_map, "main_device": main_device})
        return model

    return dispatch_model, calls


@pytest.mark.parametrize(
    "device_map",
    [
        {"0": "cuda:1", "1": "cpu", "2": "cuda:1"},  # one GPU
        {"0": "cpu", "1": "disk"},  # none
        {"": "cuda:1"},
        {"0": ["cuda:0"], "1": "cuda:1"},  # unhashable: accelerate's own error
        "auto",  # not a map
    ],
    ids=["one-gpu", "no-gpu", "whole-model", "unhashable", "string"],
)
def test_calls_where_the_set_cannot_differ_are_unchanged(direct, device_map):
    original, calls = _recorder()
    wrapper = direct(hook.SHIM, hook.choose_in_map_order)
    wrapper(original, None, ("model", device_map), {})
    assert calls == [{"device_map": device_map, "main_device": None}]


def test_main_device_goes_where_the_caller_put_the_other_arguments(direct):
    original, calls = _recorder()
    wrapper = direct(hook.SHIM, hook.choose_in_map_order)
    device_map = {"a": "cuda:1", "b": "cpu", "c": "cuda:0"}
    wrapper(original, None, ("model", device_map, None, {"w": 1}), {})
    wrapper(original, None, ("model",), {"device_map": device_map, "main_device": None})
    assert [c["main_device"] for c in calls] == ["cuda:1", "cuda:1"]


def test_first_in_map_order_compares_as_accelerate_does():
    assert hook.first_in_map_order({"a": "cpu", "b": "disk", "c": 3, "d": 1}) == 3
    assert hook.first_in_map_order({"a": "cpu"}) is None
    assert hook.first_in_map_order({"a": torch.device("cuda", 1), "b": "cuda:0"}) == torch.device("cuda", 1)


# -- composition with the other dispatch_model shim -------------------------------------------------


def test_composes_with_hooks_follow_moved_weights():
    from devmap_shims.hooks.accelerate import hooks_follow_moved_weights as follow

    ids = [hook.SHIM.id, follow.SHIM.id]
    ENGINE.uninstall()
    try:
        assert ENGINE.install(only=ids, force=ids)
        device_map = hook.disagreeing_map()
        first = device_map["0"]
        with simulated_gpus(hook.GPUS, memory="1GiB"), torch.no_grad():
            model = _dispatch(hook.offload_model(), device_map)
            assert str(execution_device(model)) == first
            assert getattr(vars(model)["to"], "__devmap_follows__", False)  # the other shim's guard is on
            model(torch.ones(2, 8, device=first))
            assert model[1].ran_on == first
    finally:
        ENGINE.uninstall()
