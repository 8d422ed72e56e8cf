"""The int8-models-move shim with a real 8-bit diffusers Flux transformer on simulated GPUs.

The transformer is quantized to 8-bit on load (bitsandbytes >= 0.46 does that without its CUDA
library). Where the matrix says the bug applies, the tests first show diffusers refusing the move.
The shim is tested alone: its move must leave a model that runs, without the bitsandbytes shim.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")  # imported before any simulation starts (it probes CUDA)
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.devices.accelerate_hooks import hooks_of  # noqa: E402
from devmap_shims.devices.int8_state import int8_state_off_device, is_int8_linear  # noqa: E402
from devmap_shims.hooks.diffusers import int8_models_move as hook  # noqa: E402
from devmap_shims.scenarios import ScenarioUnavailable, flux  # noqa: E402
from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.versions import installed_versions  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)
if not hook.bnb_moves_8bit():
    pytest.skip("bitsandbytes before 0.48 cannot move 8-bit weights", allow_module_level=True)
try:
    BASE = flux.prepare()
except ScenarioUnavailable as exc:  # pragma: no cover - diffusers without Flux
    pytest.skip(str(exc), allow_module_level=True)

MATRIX = load_matrix()
BUG_HERE = MATRIX.get(hook.BUG_ID).applies(installed_versions(MATRIX.distributions()))
PATH = flux.transformer_dir(BASE.transformer)


@pytest.fixture
def pipeline_log(caplog):
    """The records of diffusers' pipeline logger (diffusers' loggers do not propagate to the root)."""
    pipeline_logger = logging.getLogger("diffusers.pipelines.pipeline_utils")
    pipeline_logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING)
    yield caplog
    pipeline_logger.removeHandler(caplog.handler)


def components_on(pipe):
    return {name: sorted({str(p.device) for p in module.parameters()})
            for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}


def int8_layers(model):
    return [m for m in model.modules() if is_int8_linear(m)]


def test_without_the_shim_diffusers_refuses_where_the_matrix_says(no_shim, pipeline_log):
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = flux.load_8bit_transformer(PATH)
        pipe = flux.pipeline_with(BASE, transformer)
        pipe.to("cuda:1")
        if BUG_HERE:
            assert components_on(pipe)["transformer"] == ["cuda:0"]
            assert any(hook.PIPELINE_WARNING in r.getMessage() for r in pipeline_log.records)
            with pytest.raises(ValueError, match="8-bit"):
                transformer.to("cuda:1")
        else:
            assert components_on(pipe)["transformer"] == ["cuda:1"]


def test_with_the_shim_a_used_pipeline_moves_and_gives_the_same_image(shim, pipeline_log):
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        pipe = flux.pipeline_with(BASE, flux.load_8bit_transformer(PATH))
        pipe.to("cuda:0")
        reference = flux.tiny_image(pipe)
        pipe.to("cuda:1")
        assert not any(hook.PIPELINE_WARNING in r.getMessage() for r in pipeline_log.records)
        assert set(map(tuple, components_on(pipe).values())) == {("cuda:1",)}
        transformer = pipe.transformer
        assert not any(hooks_of(m) for m in transformer.modules())
        assert int8_layers(transformer) and not any(int8_state_off_device(m) for m in int8_layers(transformer))
        assert torch.equal(flux.tiny_image(pipe), reference)


@pytest.mark.parametrize("how", ["to", "cuda"])
def test_with_the_shim_model_to_moves_instead_of_raising(shim, how):
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = flux.load_8bit_transformer(PATH)
        moved = transformer.to("cuda:1") if how == "to" else transformer.cuda(1)
        assert moved is transformer
        assert {str(p.device) for p in transformer.parameters()} == {"cuda:1"}
        assert not any(int8_state_off_device(m) for m in int8_layers(transformer))
        with pytest.raises(ValueError):
            transformer.to(torch.float16)  # a dtype still cannot be cast


def test_with_the_shim_model_to_keeps_non_blocking(shim):
    """``model.to("cuda:1", non_blocking=True)`` copies the weights as the caller asked (bitsandbytes
    moves ``SCB`` itself with a blocking copy, and so does the shim when it re-points one)."""
    from torch.overrides import TorchFunctionMode

    class NonBlockingCopies(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to:
                _device, _dtype, non_blocking, _format = torch._C._nn._parse_to(*args[1:], **kwargs)
                self.seen.append(non_blocking)
            return func(*args, **kwargs)

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = flux.load_8bit_transformer(PATH)
        with NonBlockingCopies() as copies:
            transformer.to("cuda:1", non_blocking=True)
        assert {str(p.device) for p in transformer.parameters()} == {"cuda:1"}
        assert sum(copies.seen) >= len(list(transformer.parameters())), copies.seen


def test_with_the_shim_model_to_keeps_memory_format(shim):
    """``unet.to("cuda:1", memory_format=torch.channels_last)``: an 8-bit model's unquantized 4-D
    weights (a UNet's convolutions; here one added to the Flux transformer) take the format asked."""
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        transformer = flux.load_8bit_transformer(PATH)
        transformer.conv = torch.nn.Conv2d(4, 8, 3)
        transformer.to("cuda:1", memory_format=torch.channels_last)
        assert {str(p.device) for p in transformer.parameters()} == {"cuda:1"}
        assert transformer.conv.weight.is_contiguous(memory_format=torch.channels_last)
        assert not any(int8_state_off_device(m) for m in int8_layers(transformer))


def test_an_offloaded_model_is_left_to_diffusers():
    class Hook:
        offload = True

    module = torch.nn.Linear(2, 2)
    module.is_loaded_in_8bit = True
    module._hf_hook = Hook()
    assert hook.is_8bit_model(module) and not hook.movable(module)
    assert not hook.movable(torch.nn.Linear(2, 2))


def test_pipe_to_leaves_an_8bit_transformers_component_to_transformers():
    # transformers' 8-bit models set is_loaded_in_8bit too; a text encoder is not the shim's to move
    with simulated_gpus(2, memory="1GiB"):
        encoder = torch.nn.Linear(2, 2, device="cuda:0")
        encoder.is_loaded_in_8bit = True
        transformer = diffusers.models.modeling_utils.ModelMixin()
        transformer.proj = torch.nn.Linear(2, 2, device="cuda:0")
        transformer.is_loaded_in_8bit = True
        pipe = type("Pipe", (), {"components": {"text_encoder": encoder, "transformer": transformer}})()
        assert hook.move_pipeline_to(lambda *a, **k: pipe, pipe, ("cuda:1",), {}) is pipe
        assert str(encoder.weight.device) == "cuda:0" and str(transformer.proj.weight.device) == "cuda:1"


def test_the_warning_filter_drops_only_the_moved_classes():
    keep = hook._drop_warning_for(["FluxTransformer2DModel"])

    def record(message):
        return logging.LogRecord("diffusers", logging.WARNING, __file__, 1, message, None, None)

    moved = "The module 'FluxTransformer2DModel' has been loaded in `bitsandbytes` 8bit and moving it to cuda:1 via `.to()` is not supported."
    other = moved.replace("FluxTransformer2DModel", "T5EncoderModel")
    assert not keep(record(moved)) and keep(record(other)) and keep(record("something else"))
