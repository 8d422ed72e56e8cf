"""Shim ``vision-embeddings-on-pixel-device``: the vision embeddings of Idefics2, Idefics3 and SmolVLM
make their position buckets on the device of the pixel values, as transformers 4.55.1 does.

In transformers 4.55.0 ``Idefics3VisionEmbeddings.forward`` (and its copies in Idefics2 and SmolVLM)
computes the patches' fractional coordinates on the pixel values' device but still builds the
``boundaries`` it bucketizes them with by ``torch.arange`` on the CPU, so the first image on a GPU
fails with "Expected all tensors to be on the same device, but got boundaries is on cpu".

When ``pixel_values`` is on an accelerator, the wrapper runs the forward inside
``with torch.device(pixel_values.device):``, so the tensors it creates without a device
(``boundaries``, the ``position_ids`` table) are made there, as 4.55.1 makes them; the result is then
moved to the position embedding's device by the forward itself. With pixel values on the CPU the
forward runs unchanged.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    transformers-4550-bucketize-boundaries-cpu
        affected: transformers ==4.55.0
        fixed in: transformers 4.55.1
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.calls import argument
from devmap_shims.scenarios import BugObserved, ScenarioUnavailable, import_before_simulation, scenario
from devmap_shims.shims import Shim, Target

BUG_ID = "transformers-4550-bucketize-boundaries-cpu"

HOST_DEVICE_TYPES = ("cpu", "meta")


def on_pixel_device(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``*VisionEmbeddings.forward`` with its new tensors made on the pixel values' device."""
    _, pixel_values = argument(wrapped, "pixel_values", args, kwargs)
    device = getattr(pixel_values, "device", None)
    if getattr(device, "type", "cpu") in HOST_DEVICE_TYPES:
        return wrapped(*args, **kwargs)
    import torch

    with torch.device(device):
        return wrapped(*args, **kwargs)


def _target(model: str, cls: str) -> Target:
    return Target(
        f"transformers.models.{model}.modeling_{model}",
        f"{cls}.forward",
        expect_params=("pixel_values", "patch_attention_mask"),
    )


SHIM = Shim(
    id="vision-embeddings-on-pixel-device",
    fixes=(BUG_ID,),
    targets=(
        _target("idefics2", "Idefics2VisionEmbeddings"),
        _target("idefics3", "Idefics3VisionEmbeddings"),
        _target("smolvlm", "SmolVLMVisionEmbeddings"),
    ),
    wrapper=on_pixel_device,
    summary="run the Idefics2/Idefics3/SmolVLM vision embeddings under torch.device(pixel_values.device), "
    "so the bucketize boundaries are made next to the pixels",
)


# -- scenario ---------------------------------------------------------------------------------------
@scenario(
    BUG_ID,
    "a tiny Idefics3 moved to the GPU with .to('cuda') and run on an image whose pixel values are on the GPU",
    needs=("torch", "transformers"),
)
def idefics3_image_on_gpu() -> str:
    import_before_simulation("transformers")
    import torch

    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import UnsupportedArchError
    from devmap_shims.testing.models.vision_language import sample_vision_language_inputs, tiny_vision_language_model

    try:
        model = tiny_vision_language_model("idefics3")
    except UnsupportedArchError as exc:
        raise ScenarioUnavailable(str(exc)) from exc
    inputs = sample_vision_language_inputs(model.config)
    with torch.no_grad():
        reference = model(**inputs).logits
    with simulated_gpus(1, memory="1GiB"), torch.no_grad():
        model.to("cuda")
        try:
            logits = model(**{name: value.to("cuda") for name, value in inputs.items()}).logits
        except RuntimeError as exc:
            if "boundaries is on cpu" in str(exc) or "argument boundaries" in str(exc):
                raise BugObserved(f"the vision embeddings bucketize against CPU boundaries: {exc}") from exc
            raise
        device = str(logits.device)
        logits = logits.cpu()
    if not torch.equal(logits, reference):
        raise AssertionError(f"logits on {device} differ from the CPU run's by {(logits - reference).abs().max():.3g}")
    return f"image run on {device}: logits equal to the CPU run's"
