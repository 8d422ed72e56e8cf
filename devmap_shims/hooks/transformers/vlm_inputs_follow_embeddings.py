"""Shim ``vlm-inputs-follow-embeddings``: a VLM's ``input_ids`` and ``attention_mask`` go to the
device of its token embeddings when images or videos come with them.

transformers 4.45 builds the image placeholder mask of Qwen2-VL and of the LLaVA family from
``input_ids`` (``(input_ids == image_token_id).unsqueeze(-1).expand_as(inputs_embeds)``) and scatters
the image features into ``inputs_embeds`` with it. On a model split over GPUs, ``input_ids`` sit
where accelerate's root hook put them (the first GPU of the map, which holds the vision tower) and
``inputs_embeds`` on the GPU of ``embed_tokens``, so ``masked_scatter`` fails. The wrapper, on the
VLM class's ``forward``, moves ``input_ids`` and ``attention_mask`` to the device of
``get_input_embeddings()`` when pixel values are given and ``input_ids`` are elsewhere (4.46 moves
the mask itself); the vision inputs stay where they are, and what the forward returns is unchanged
(the root hook still brings the outputs back to the caller's device). Even forced, the shim wraps
only the forwards of 4.45 and 4.46 (where the forward moves the mask itself, and the repair changes
nothing): from 4.47 Qwen2-VL's forward reads ``input_ids`` together with other inputs
(``attention_mask`` moved first, later ``image_grid_thw``, ``mm_token_type_ids``) that must share
their device.

accelerate's ``dispatch_model`` keeps the ``forward`` it finds on each module (``_old_forward``), so
the shim must be installed before the model is loaded (``devmap_shims.install()`` first, or
``DEVMAP_SHIMS=1``): a model dispatched earlier keeps calling the unwrapped ``forward``.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    transformers-vlm-placeholder-mask-device
        affected: transformers >=4.45.0,<4.46.0
        fixed in: transformers 4.46.0
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.calls import argument, with_argument
from devmap_shims.devices.embeddings import input_embedding_device
from devmap_shims.devices.tensors import tensor_type
from devmap_shims.scenarios import BugObserved, ScenarioUnavailable, scenario
from devmap_shims.shims import LazyLogger, Shim, Target

BUG_ID = "transformers-vlm-placeholder-mask-device"

logger = LazyLogger(__name__)

#: The vision inputs whose presence makes the forward build a placeholder mask from ``input_ids``.
VISION_INPUTS = ("pixel_values", "pixel_values_videos", "pixel_values_images")
#: What is moved to the embeddings' device.
MOVED = ("input_ids", "attention_mask")

#: The 4.45 VLMs that scatter image (or video) features with a mask built from ``input_ids``
#: without moving it: (module under transformers.models, class). The 4.46 forwards read their inputs
#: the same way, with the mask moved; later ones differ (see the module docstring).
FORWARDS_OF = {"transformers": ">=4.45.0,<4.47.0"}
VLM_CLASSES = (
    ("qwen2_vl.modeling_qwen2_vl", "Qwen2VLForConditionalGeneration"),
    ("llava.modeling_llava", "LlavaForConditionalGeneration"),
    ("llava_next.modeling_llava_next", "LlavaNextForConditionalGeneration"),
    ("llava_next_video.modeling_llava_next_video", "LlavaNextVideoForConditionalGeneration"),
    ("vipllava.modeling_vipllava", "VipLlavaForConditionalGeneration"),
    ("video_llava.modeling_video_llava", "VideoLlavaForConditionalGeneration"),
    ("blip_2.modeling_blip_2", "Blip2ForConditionalGeneration"),
)


def inputs_follow_embeddings(
    wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """The VLM's ``forward`` with ``input_ids`` and ``attention_mask`` on its embeddings' device
    when vision inputs are given."""
    tensor = tensor_type()
    given, input_ids = argument(wrapped, "input_ids", args, kwargs)
    if not (given and isinstance(input_ids, tensor)):
        return wrapped(*args, **kwargs)
    if not any(isinstance(argument(wrapped, name, args, kwargs)[1], tensor) for name in VISION_INPUTS):
        return wrapped(*args, **kwargs)
    target = input_embedding_device(instance)
    if target is None or input_ids.device == target:
        return wrapped(*args, **kwargs)
    moved = []
    for name in MOVED:
        given, value = argument(wrapped, name, args, kwargs)
        if given and isinstance(value, tensor) and value.device != target:
            args, kwargs = with_argument(wrapped, name, value.to(target), args, kwargs)
            moved.append(f"{name} ({value.device})")
    logger.debug("%s moved %s to %s, the device of %s's input embeddings", SHIM.id, ", ".join(moved), target,
                 type(instance).__name__)
    return wrapped(*args, **kwargs)


SHIM = Shim(
    id="vlm-inputs-follow-embeddings",
    fixes=(BUG_ID,),
    targets=tuple(
        Target(f"transformers.models.{module}", f"{cls}.forward", expect_params=MOVED, when=FORWARDS_OF)
        for module, cls in VLM_CLASSES
    ),
    wrapper=inputs_follow_embeddings,
    summary="move a VLM's input_ids and attention_mask to its token embeddings' device when images come with them",
)


# -- scenario ---------------------------------------------------------------------------------------
NEW_TOKENS = 6
GPU_MEMORY = "2GiB"  # transformers 5's allocator warm-up assumes at least 1.2 GiB per GPU


def _checkpoint_and_reference() -> Any:
    """The tiny Qwen2-VL's checkpoint, its vision/text split and its greedy tokens on the CPU."""
    from devmap_shims.scenarios.checkpoints import once, scratch_dir

    def make() -> Any:
        import os

        import torch

        from devmap_shims.testing.models.vlm import (
            qwen2_vl_image_prompt,
            save_tiny_qwen2_vl,
            tiny_qwen2_vl,
            vision_text_split,
        )

        model = tiny_qwen2_vl()
        path = save_tiny_qwen2_vl(os.path.join(scratch_dir("vlm"), "qwen2-vl"))
        with torch.no_grad():
            tokens = model.generate(**qwen2_vl_image_prompt(), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=0)
        return str(path), vision_text_split(model), tokens[:, -NEW_TOKENS:], type(model)

    def still_valid(value: Any) -> bool:
        import os

        return os.path.isdir(value[0])

    return once("tiny-qwen2-vl", make, still_valid)


@scenario(
    BUG_ID,
    "a Qwen2-VL with its vision tower on cuda:0 and the rest on cuda:1, generate with an image: the CPU's tokens",
    needs=("torch", "transformers", "accelerate"),
)
def qwen2_vl_split_generates_with_an_image() -> str:
    """A tiny Qwen2-VL loaded with ``device_map={"visual": 0, "model": 1, "lm_head": 1}`` (on 4.52+:
    ``model.visual`` / ``model.language_model``), the processor's outputs moved to ``cuda:0`` as
    ``inputs.to(model.device)`` does, greedy ``generate``; the summary when the tokens equal the CPU's."""
    import torch

    from devmap_shims.scenarios.checkpoints import same_tokens
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import UnsupportedArchError
    from devmap_shims.testing.models.vlm import qwen2_vl_image_prompt
    from devmap_shims.versions import installed_versions, version_in

    try:
        path, device_map, reference, model_cls = _checkpoint_and_reference()
    except UnsupportedArchError as exc:
        raise ScenarioUnavailable(str(exc)) from None
    transformers_version = installed_versions(["transformers"]).get("transformers")
    if transformers_version and version_in(transformers_version, ">=4.47.0,<4.53.0"):
        # checked by reading the 4.47-4.52 wheels; see the row's notes
        raise ScenarioUnavailable(
            "on transformers 4.47-4.52 Qwen2-VL's forward moves attention_mask to the embeddings' GPU and then "
            "indexes position ids built on input_ids' GPU with it (get_rope_index), another bug this user code "
            "meets first"
        )
    prompt = qwen2_vl_image_prompt()
    with simulated_gpus(2, memory=GPU_MEMORY), torch.no_grad():
        model = model_cls.from_pretrained(path, device_map=device_map)
        inputs = {name: value.to(model.device) for name, value in prompt.items()}
        if inputs["input_ids"].device == model.get_input_embeddings().weight.device:
            raise BugObserved(f"the scenario needs input_ids off the embeddings' GPU, got {model.hf_device_map}")
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
        vision = next(module for name, module in model.named_modules() if name.split(".")[-1] == "visual")
        where = (f"vision tower on {next(vision.parameters()).device}, embeddings on "
                 f"{model.get_input_embeddings().weight.device}, inputs on {inputs['input_ids'].device}")
        return same_tokens(out[:, -NEW_TOKENS:], reference, where)
