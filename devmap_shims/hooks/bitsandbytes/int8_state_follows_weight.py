"""Shim ``int8-state-follows-weight``: a ``Linear8bitLt`` moved by its parent module's ``.to()`` runs
on the device its weight moved to.

``torch.nn.Module.to`` on a model replaces each parameter's ``.data``; it never calls
``Linear8bitLt.to``, the only place bitsandbytes moves the layer's int8 weights and scales kept
outside the parameter (``state.CB``/``state.SCB`` after the first forward, ``weight.CB``/``weight.SCB``
before it). The next forward multiplies with the old GPU's copy: "Expected all tensors to be on the
same device". Before ``Linear8bitLt.forward`` runs, the wrapper points ``CB`` at the weight's int8
data and moves ``SCB`` to its device when ``CB`` is elsewhere (otherwise one device comparison per
call).

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    bnb-int8-stats-stay-on-old-device
        affected: bitsandbytes >=0.41.0
        fixed in: unfixed (last checked 2026-11-28)
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.devices.int8_state import align_int8_state, is_int8_linear
from devmap_shims.scenarios import BugObserved, ScenarioUnavailable, import_before_simulation, scenario
from devmap_shims.shims import Shim, Target

BUG_ID = "bnb-int8-stats-stay-on-old-device"


def realign_before_forward(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``Linear8bitLt.forward`` with ``CB``/``SCB`` on the weight's device. The healthy path reads one
    ``CB`` and compares two devices; the full check runs only when that ``CB`` is elsewhere."""
    weight = getattr(instance, "weight", None)
    cb = getattr(getattr(instance, "state", None), "CB", None)
    if cb is None:
        cb = getattr(weight, "CB", None)
    if cb is not None and weight is not None and cb.device != weight.device and is_int8_linear(instance):
        align_int8_state(instance)
    return wrapped(*args, **kwargs)


SHIM = Shim(
    id="int8-state-follows-weight",
    fixes=(BUG_ID,),
    targets=(Target("bitsandbytes.nn.modules", "Linear8bitLt.forward", wrapper=realign_before_forward),),
    compile_reachable=True,  # a module's forward: plain function layer, and no wrapt binding per call
    summary="move an 8-bit layer's int8 weights and scales to where its parent's .to() moved the weight",
)


# -- scenario ---------------------------------------------------------------------------------------
@scenario(BUG_ID, "a model holding an 8-bit Linear8bitLt, run on cuda:0, moved with model.to('cuda:1'), run again",
          needs=("torch", "bitsandbytes"))
def int8_layer_moved_by_its_parent() -> str:
    from devmap_shims.versions import installed_version, version_in

    if not version_in(installed_version("bitsandbytes") or "0", ">=0.46.0"):
        raise ScenarioUnavailable("bitsandbytes before 0.46 quantizes to 8-bit with its CUDA library only")
    import_before_simulation("bitsandbytes")
    import torch
    from bitsandbytes.nn import Linear8bitLt

    from devmap_shims.testing import simulated_gpus

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Linear8bitLt(64, 32, has_fp16_weights=False), torch.nn.ReLU())
        x = torch.randn(4, 64).half()
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        model.to("cuda:0")  # quantizes on the way
        reference = model(x.to("cuda:0")).cpu()
        model.to("cuda:1")
        out = model(x.to("cuda:1"))
        if str(out.device) != "cuda:1":
            raise BugObserved(f"after model.to('cuda:1') the output is on {out.device}")
        out = out.cpu()
    if not torch.equal(out, reference):
        raise BugObserved(f"the output on cuda:1 differs from the one on cuda:0 by {(out - reference).abs().max():.3g}")
    return "Linear8bitLt run on cuda:0, moved by model.to('cuda:1'): same output on cuda:1"
