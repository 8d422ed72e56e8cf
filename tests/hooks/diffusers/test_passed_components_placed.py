"""The passed-components-placed shim's decisions, with the wrapper called directly around a stub
``from_pretrained`` that returns a pipeline-like object, on simulated GPUs. The real
``DiffusionPipeline.from_pretrained`` path is the row's scenario (tests/scenarios)."""

from __future__ import annotations

import logging
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from accelerate import dispatch_model  # noqa: E402

from devmap_shims.devices.accelerate_hooks import execution_device, hooks_of  # noqa: E402
from devmap_shims.hooks.diffusers import passed_components_placed as hook  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

on_two_gpus = pytest.mark.simulated_gpus(n=2, memory="1GiB")


def model():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return layers.requires_grad_(False)


def devices(module):
    return sorted({str(t.device) for t in list(module.parameters()) + list(module.buffers())})


def load(direct, components, planned, **kwargs):
    """The wrapper around a ``from_pretrained`` that returns a pipeline holding ``components``
    with ``hf_device_map = planned``; ``kwargs`` are the call's keyword arguments."""
    pipe = types.SimpleNamespace(components=dict(components), hf_device_map=planned)
    wrapper = direct(hook.SHIM, hook.place_passed_components)
    assert wrapper(lambda *a, **k: pipe, None, ("path",), kwargs) is pipe
    return pipe


@on_two_gpus
def test_an_unquantized_cpu_component_is_dispatched_to_its_planned_gpu(direct):
    transformer, vae = model(), model()
    load(direct, {"transformer": transformer, "vae": vae}, {"transformer": 1, "vae": 0},
         transformer=transformer, device_map="balanced")
    assert devices(transformer) == ["cuda:1"]
    assert execution_device(transformer) == torch.device("cuda", 1)
    # the hook brings inputs from the pipeline's execution device, as for the components diffusers loads
    out = transformer(torch.ones(1, 4, device="cuda:0"))
    assert out.device == torch.device("cuda", 0)
    assert devices(vae) == ["cpu"]  # not passed: the pipeline's own business


@on_two_gpus
def test_a_component_on_its_gpu_without_hooks_gets_the_hook_and_stays(direct):
    transformer = model().to("cuda:1")
    weight = transformer[0].weight
    load(direct, {"transformer": transformer}, {"transformer": 1},
         transformer=transformer, device_map="balanced")
    assert transformer[0].weight is weight and devices(transformer) == ["cuda:1"]
    assert execution_device(transformer) == torch.device("cuda", 1)
    transformer(torch.ones(1, 4, device="cuda:0"))


@on_two_gpus
def test_a_component_already_dispatched_to_its_planned_gpu_is_untouched(direct):
    transformer = dispatch_model(model(), device_map={"": 1}, force_hooks=True)
    before = [(m, h) for m in transformer.modules() for h in hooks_of(m)]
    load(direct, {"transformer": transformer}, {"transformer": 1},
         transformer=transformer, device_map="balanced")
    assert [(m, h) for m in transformer.modules() for h in hooks_of(m)] == before
    assert devices(transformer) == ["cuda:1"]


@on_two_gpus
def test_without_device_map_nothing_moves(direct):
    transformer = model()
    load(direct, {"transformer": transformer}, {"transformer": 1}, transformer=transformer)
    load(direct, {"transformer": transformer}, {"transformer": 1}, transformer=transformer, device_map=None)
    assert devices(transformer) == ["cpu"] and not hooks_of(transformer)


@on_two_gpus
def test_cpu_string_and_missing_entries_and_other_objects_are_left(direct):
    transformer, text_encoder, other = model(), model(), model()
    load(direct, {"transformer": transformer, "text_encoder": text_encoder, "vae": other},
         {"transformer": "cpu"}, transformer=transformer, text_encoder=text_encoder, vae=model(),
         device_map="balanced")
    load(direct, {"transformer": transformer}, "cuda", transformer=transformer, device_map="cuda")
    for module in (transformer, text_encoder, other):
        assert devices(module) == ["cpu"] and not hooks_of(module)


@on_two_gpus
def test_hooks_elsewhere_are_left_with_a_warning_naming_the_component_and_device(direct, caplog):
    transformer = dispatch_model(model(), device_map={"": 0}, force_hooks=True)
    with caplog.at_level(logging.WARNING):
        load(direct, {"transformer": transformer}, {"transformer": 1}, transformer=transformer,
             device_map="balanced")
    assert devices(transformer) == ["cuda:0"] and execution_device(transformer) == torch.device("cuda", 0)
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "'transformer'" in message and "cuda:1" in message and "accelerate hooks" in message


class Params4bit(torch.nn.Parameter):
    """Named like bitsandbytes' 4-bit parameter, which is all bnb_kinds reads."""


@on_two_gpus
def test_bitsandbytes_weights_the_release_cannot_move_are_left_with_a_warning(direct, caplog, monkeypatch):
    transformer = model()
    transformer[0].weight = Params4bit(transformer[0].weight.data)
    monkeypatch.setattr(hook, "bnb_movable", lambda module: False)
    with caplog.at_level(logging.WARNING):
        load(direct, {"transformer": transformer}, {"transformer": 1}, transformer=transformer,
             device_map="balanced")
    assert devices(transformer) == ["cpu"] and not hooks_of(transformer)
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "'transformer'" in message and "cuda:1" in message and "bitsandbytes" in message


@on_two_gpus
def test_bitsandbytes_weights_the_library_refuses_to_move_are_left_with_a_warning(
        direct, caplog, monkeypatch):
    transformer = model()
    transformer[0].weight = Params4bit(transformer[0].weight.data)
    monkeypatch.setattr(hook, "bnb_movable", lambda module: True)

    def refuses(*args, **kwargs):
        raise ValueError("`.to` is not supported for `8-bit` bitsandbytes models")

    monkeypatch.setattr(transformer, "to", refuses)
    with caplog.at_level(logging.WARNING):
        load(direct, {"transformer": transformer}, {"transformer": 1}, transformer=transformer,
             device_map="balanced")
    assert devices(transformer) == ["cpu"] and not hooks_of(transformer)
    assert "not supported for `8-bit`" in " ".join(r.getMessage() for r in caplog.records)


@on_two_gpus
def test_a_gpu_out_of_memory_while_moving_is_not_called_left_where_it_is(direct, monkeypatch):
    # the move may have taken some weights already: the error goes to the caller, as the fixed
    # release's own move would raise it, rather than a warning that the component did not move
    transformer = model()
    transformer[0].weight = Params4bit(transformer[0].weight.data)
    monkeypatch.setattr(hook, "bnb_movable", lambda module: True)
    out_of_memory = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

    def runs_out(*args, **kwargs):
        raise out_of_memory("CUDA out of memory. Tried to allocate 2.00 MiB (GPU 1; 1 GiB total capacity)")

    monkeypatch.setattr(transformer, "to", runs_out)
    with pytest.raises(out_of_memory):
        load(direct, {"transformer": transformer}, {"transformer": 1}, transformer=transformer,
             device_map="balanced")


@pytest.fixture
def all_shims():
    from devmap_shims.shims.engine import ENGINE

    ENGINE.uninstall()
    assert ENGINE.install()
    yield
    ENGINE.uninstall()


def test_a_4bit_transformer_quantized_on_cuda0_joins_the_gpu_the_plan_gives_it(all_shims):
    """The documented recipe: a bitsandbytes 4-bit transformer (on the current GPU, cuda:0) passed with
    device_map="balanced"; the plan (GPU 0 capped at 1 GiB) gives it GPU 1."""
    pytest.importorskip("diffusers")
    pytest.importorskip("bitsandbytes")
    from devmap_shims.checks import check_devices
    from devmap_shims.devices.bnb_params import bnb_moves_4bit
    from devmap_shims.scenarios import ScenarioUnavailable, flux
    from devmap_shims.versions import installed_version, version_in

    if not bnb_moves_4bit():
        pytest.skip("this bitsandbytes cannot move 4-bit weights")
    try:
        flux.prepare()
    except ScenarioUnavailable as exc:
        pytest.skip(str(exc))
    from diffusers import FluxPipeline

    from devmap_shims.testing import simulated_gpus

    path = hook._saved_flux_pipeline()
    with simulated_gpus(2, memory="4GiB"), torch.no_grad():
        transformer = flux.load_4bit_transformer()
        assert devices(transformer) == ["cuda:0"]
        pipe = FluxPipeline.from_pretrained(path, transformer=transformer,
                                            device_map="balanced", max_memory={0: "1GiB", 1: "3GiB"})
        assert pipe.hf_device_map["transformer"] == 1
        assert pipe.transformer is transformer and devices(transformer) == ["cuda:1"]
        assert check_devices(pipe) == []  # quantization state moved with the weights
        if version_in(installed_version("bitsandbytes") or "0", ">=0.46.0"):  # 4-bit kernels on the CPU
            assert flux.tiny_image(pipe).shape == (1, 3, 32, 32)
