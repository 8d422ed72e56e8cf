"""The vlm-inputs-follow-embeddings repair, called directly around a stand-in VLM ``forward`` on
simulated GPUs (the split Qwen2-VL generating with an image is the row's scenario in tests/scenarios),
and the class wrapper reaching a model that accelerate dispatches after the shim is installed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from devmap_shims.hooks.transformers import vlm_inputs_follow_embeddings as hook  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

SIM = pytest.mark.simulated_gpus(n=2, memory="1GiB")


class StandIn:
    """A VLM with its token embeddings on ``device``; ``forward`` reports where its inputs arrived."""

    def __init__(self, device):
        self.embeddings = torch.nn.Embedding(8, 2).to(device)

    def get_input_embeddings(self):
        return self.embeddings

    @staticmethod
    def forward(input_ids=None, attention_mask=None, pixel_values=None, image_grid_thw=None, **kwargs):
        given = dict(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                     image_grid_thw=image_grid_thw, **kwargs)
        return {name: None if value is None else str(value.device) for name, value in given.items()}


def transformers_version():
    from devmap_shims.versions import installed_versions

    return installed_versions(["transformers"]).get("transformers") or "0"


def call(model, *args, **kwargs):
    return hook.inputs_follow_embeddings(StandIn.forward, model, args, kwargs)


@SIM
def test_with_pixel_values_the_ids_and_mask_move_to_the_embeddings_gpu():
    model = StandIn("cuda:1")
    ids = torch.ones(1, 4, dtype=torch.long, device="cuda:0")
    seen = call(model, ids, torch.ones_like(ids), pixel_values=torch.ones(2, 3, device="cuda:0"),
                image_grid_thw=torch.tensor([[1, 2, 2]]))
    assert seen == {"input_ids": "cuda:1", "attention_mask": "cuda:1", "pixel_values": "cuda:0",
                    "image_grid_thw": "cpu"}
    seen = call(model, input_ids=ids, pixel_values=torch.ones(2, 3, device="cuda:0"))
    assert seen["input_ids"] == "cuda:1" and seen["attention_mask"] is None
    seen = call(model, input_ids=ids, pixel_values=torch.ones(2, 3), cache_position=torch.arange(4, device="cuda:0"))
    assert seen["input_ids"] == "cuda:1" and seen["cache_position"] == "cuda:0"  # nothing else moves


@SIM
def test_without_vision_inputs_or_with_ids_in_place_nothing_moves():
    model = StandIn("cuda:1")
    ids = torch.ones(1, 4, dtype=torch.long, device="cuda:0")
    assert call(model, ids, torch.ones_like(ids))["input_ids"] == "cuda:0"  # a decode step: no image
    on_gpu1 = ids.to("cuda:1")
    seen = call(model, on_gpu1, torch.ones_like(ids), pixel_values=torch.ones(2, 3))
    assert seen["input_ids"] == "cuda:1" and seen["attention_mask"] == "cuda:0"  # left to the library
    assert call(model, pixel_values=torch.ones(1))["input_ids"] is None  # inputs_embeds instead of ids


@SIM
def test_a_model_without_input_embeddings_is_left_alone():
    class NoEmbeddings:
        def get_input_embeddings(self):
            raise NotImplementedError

    ids = torch.ones(1, 4, dtype=torch.long, device="cuda:0")
    assert call(NoEmbeddings(), ids, pixel_values=torch.ones(1))["input_ids"] == "cuda:0"


@SIM
def test_a_model_dispatched_after_install_calls_the_wrapped_forward(shim, caplog):
    """accelerate keeps the ``forward`` it finds at dispatch in ``_old_forward``: with the shim
    installed first, that is the class's wrapped ``forward``."""
    pytest.importorskip("accelerate")
    from devmap_shims.versions import version_in

    if not version_in(transformers_version(), hook.FORWARDS_OF["transformers"]):
        pytest.skip(f"the shim wraps the forwards of transformers {hook.FORWARDS_OF['transformers']} only")
    qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
    from accelerate import dispatch_model

    from devmap_shims.testing.models.vlm import qwen2_vl_image_prompt, tiny_qwen2_vl, vision_text_split

    model = tiny_qwen2_vl()
    assert isinstance(model, qwen2_vl.Qwen2VLForConditionalGeneration)
    prompt = qwen2_vl_image_prompt()
    with torch.no_grad():
        reference = model(**prompt).logits
        dispatch_model(model, device_map=vision_text_split(model))
        inputs = {name: value.to("cuda:0") for name, value in prompt.items()}
        with caplog.at_level("DEBUG", logger=hook.__name__):
            logits = model(**inputs).logits
    assert [r.getMessage() for r in caplog.records if r.name == hook.__name__] == [
        "vlm-inputs-follow-embeddings moved input_ids (cuda:0), attention_mask (cuda:0) to cuda:1, "
        "the device of Qwen2VLForConditionalGeneration's input embeddings"
    ]
    assert str(logits.device) == "cuda:0"  # the root hook still brings the outputs back
    assert torch.allclose(logits.cpu(), reference, atol=1e-5)
