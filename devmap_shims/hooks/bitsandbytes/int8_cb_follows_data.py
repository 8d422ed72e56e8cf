"""Shim ``int8-cb-follows-data``: a quantized ``Int8Params`` moved with ``.to()`` keeps ``CB``
pointing at its int8 data.

``Linear8bitLt`` takes its int8 weights from ``weight.CB``; when ``CB`` is None it treats the weight
as unquantized and quantizes it again in every forward. bitsandbytes 0.48.0 set ``CB`` on the moved
parameter only when the old one had a ``CB`` and a device was given, so a pre-quantized checkpoint
(transformers builds ``Int8Params(int8 data).to(device)``, with no ``CB``) generates garbage. After
``Int8Params.to`` the wrapper sets ``CB`` to the result's data whenever the parameter was already
int8, which is what 0.48.1 does. An unquantized parameter (quantized by this very move) is left to
the library.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    bnb-int8params-move-regression
        affected: bitsandbytes ==0.48.0
        fixed in: bitsandbytes 0.48.1
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.scenarios import ScenarioUnavailable, import_before_simulation, scenario
from devmap_shims.shims import Shim, Target

BUG_ID = "bnb-int8params-move-regression"


def keep_cb(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``Int8Params.to``, then ``CB`` is the moved parameter's own int8 data."""
    import torch

    was_int8 = getattr(getattr(instance, "data", None), "dtype", None) == torch.int8
    result = wrapped(*args, **kwargs)
    if was_int8 and result is not instance and getattr(getattr(result, "data", None), "dtype", None) == torch.int8:
        result.CB = result.data
    return result


SHIM = Shim(
    id="int8-cb-follows-data",
    fixes=(BUG_ID,),
    targets=(Target("bitsandbytes.nn.modules", "Int8Params.to", wrapper=keep_cb),),
    summary="point a moved int8 parameter's CB at its data, so Linear8bitLt does not quantize it twice",
)


# -- scenario ---------------------------------------------------------------------------------------
NEW_TOKENS = 8


@scenario(BUG_ID, "a tiny Llama quantized to 8-bit on cuda:0, saved, and loaded back pre-quantized: generate",
          needs=("torch", "bitsandbytes", "transformers", "accelerate"))
def prequantized_int8_checkpoint_generates() -> str:
    import os

    from devmap_shims.versions import installed_version, version_in

    if not version_in(installed_version("bitsandbytes") or "0", ">=0.46.0"):
        raise ScenarioUnavailable("bitsandbytes before 0.46 quantizes to 8-bit with its CUDA library only")
    import_before_simulation("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from devmap_shims.scenarios.checkpoints import same_tokens, scratch_dir, tiny_checkpoint
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import greedy_generate, sample_input_ids

    path = tiny_checkpoint("llama", "int8")
    saved = os.path.join(scratch_dir("int8-prequantized"), "llama")
    ids = sample_input_ids()
    with simulated_gpus(1, memory="2GiB"):
        quantized = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map={"": 0})
        reference = greedy_generate(quantized, ids.to("cuda:0"), NEW_TOKENS)
        quantized.save_pretrained(saved)
        loaded = AutoModelForCausalLM.from_pretrained(saved, device_map={"": 0})
        tokens = greedy_generate(loaded, ids.to("cuda:0"), NEW_TOKENS)
    return same_tokens(tokens, reference, "pre-quantized 8-bit checkpoint on cuda:0, against the model quantized on load")
