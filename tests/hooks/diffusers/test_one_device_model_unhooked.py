"""The one-device-model-unhooked shim: a real diffusers Flux transformer loaded with a one-GPU
``device_map`` on simulated GPUs, and the wrapper called directly on small hooked models."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.hooks import AlignDevicesHook, add_hook_to_module  # noqa: E402

from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.devices.accelerate_hooks import hooks_of  # noqa: E402
from devmap_shims.hooks.diffusers import one_device_model_unhooked as hook  # noqa: E402
from devmap_shims.scenarios import ScenarioUnavailable, flux  # noqa: E402
from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.versions import installed_versions  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

MATRIX = load_matrix()
BUG_HERE = MATRIX.get(hook.BUG_ID).applies(installed_versions(MATRIX.distributions()))


def hooked(model):
    return any(hooks_of(m) for m in model.modules())


@pytest.fixture(scope="module")
def transformer_path():
    try:
        base = flux.prepare()
    except ScenarioUnavailable as exc:
        pytest.skip(str(exc))
    return flux.transformer_dir(base.transformer)


def load(path):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(path, device_map={"": 0})


def test_without_the_shim_a_one_gpu_map_leaves_hooks_where_the_matrix_says(no_shim, transformer_path):
    with simulated_gpus(2, memory="1GiB"):
        model = load(transformer_path)
        assert hooked(model) is BUG_HERE


def test_with_the_shim_the_model_has_no_hooks_or_guards_and_moves(shim, transformer_path):
    with simulated_gpus(2, memory="1GiB"):
        model = load(transformer_path)
        assert not hooked(model)
        assert not any(hasattr(vars(model).get(name), "__wrapped__") for name in ("to", "cuda"))
        assert {str(p.device) for p in model.parameters()} == {"cuda:0"}
        model.to("cuda:1")
        assert {str(p.device) for p in model.parameters()} == {"cuda:1"}


def _hooked_pair(devices, offload=False):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for module, device in zip(model, devices):
        add_hook_to_module(module, AlignDevicesHook(execution_device=device, offload=offload))
    model.hf_device_map = {"0": devices[0], "1": devices[1]}
    return model


@pytest.mark.simulated_gpus(n=2, memory="1GiB")
def test_only_a_one_gpu_map_without_offload_or_unmovable_weights_loses_its_hooks(monkeypatch):
    def returns(model):
        return lambda *args, **kwargs: model

    split = _hooked_pair([0, 1])
    assert hooked(hook.unhook_one_device_model(returns(split), None, (), {}))
    on_cpu = _hooked_pair(["cpu", "cpu"])
    assert hooked(hook.unhook_one_device_model(returns(on_cpu), None, (), {}))
    offloading = _hooked_pair([0, 0], offload=True)
    assert hooked(hook.unhook_one_device_model(returns(offloading), None, (), {}))
    monkeypatch.setattr(hook, "bnb_movable", lambda model: False)
    unmovable = _hooked_pair([0, 0])
    assert hooked(hook.unhook_one_device_model(returns(unmovable), None, (), {}))
    monkeypatch.undo()
    one_gpu = _hooked_pair([0, 0])
    assert not hooked(hook.unhook_one_device_model(returns(one_gpu), None, (), {}))
    plain = types.SimpleNamespace(hf_device_map={"": 0})  # not a torch module: returned as it is
    assert hook.unhook_one_device_model(returns(plain), None, (), {}) is plain
