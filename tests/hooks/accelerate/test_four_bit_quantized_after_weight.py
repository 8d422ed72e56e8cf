"""four-bit-quantized-after-weight: which ``set_module_tensor_to_device`` calls leave a 4-bit weight
unquantized, and that every other call goes through untouched.

Real ``accelerate.utils.set_module_tensor_to_device`` on simulated GPUs with the shim forced on (so
every stack checks the wrapper; fixed accelerate releases already skip a weight on meta themselves).
"""

from __future__ import annotations

import importlib
import inspect

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("bitsandbytes")

from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.hooks.accelerate import four_bit_quantized_after_weight as hook  # noqa: E402
from devmap_shims.shims import wrapping  # noqa: E402
from devmap_shims.shims.engine import ENGINE  # noqa: E402
from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.versions import installed_versions  # noqa: E402

# modules that import the function by name (loaders call it through them)
ALIASES = ("accelerate.utils", "accelerate.hooks", "accelerate.utils.bnb", "accelerate.big_modeling")
for _name in ALIASES:
    importlib.import_module(_name)


@pytest.fixture
def gpus():
    with simulated_gpus(2, memory="1GiB"):
        yield


def empty_4bit_model():
    """A biased Linear made 4-bit on meta, as ``load_and_quantize_model`` prepares it before loading."""
    from accelerate import init_empty_weights
    from accelerate.utils import BnbQuantizationConfig
    from accelerate.utils.bnb import replace_with_bnb_layers

    with init_empty_weights():
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        model = replace_with_bnb_layers(model, BnbQuantizationConfig(load_in_4bit=True))
    assert type(model[0]).__name__ == "Linear4bit"
    return model


def set_tensor(*args, **kwargs):
    from accelerate.utils import set_module_tensor_to_device

    return set_module_tensor_to_device(*args, **kwargs)


def test_the_bias_set_first_lands_on_the_gpu_and_the_weight_waits_unquantized(shim, gpus):
    model = empty_4bit_model()
    bias = torch.arange(64, dtype=torch.float32)
    set_tensor(model, "0.bias", 0, value=bias)
    layer = model[0]
    assert layer.bias.device == torch.device("cuda:0") and torch.equal(layer.bias.detach().cpu(), bias)
    assert str(layer.weight.device) == "meta" and layer.weight.quant_state is None
    assert type(layer.weight).__name__ == "Params4bit" and not layer.weight.bnb_quantized


def test_the_weight_is_unmarked_when_the_library_raises(shim, gpus):
    model = empty_4bit_model()
    with pytest.raises(ValueError, match="shape"):
        set_tensor(model, "0.bias", 0, value=torch.zeros(32))  # the library's own shape check
    assert model[0].weight.quant_state is None and str(model[0].bias.device) == "meta"


def test_names_accelerate_imports_elsewhere_are_the_wrapped_function(shim):
    layer = vars(importlib.import_module("accelerate.utils.modeling"))["set_module_tensor_to_device"]
    assert wrapping.is_ours(layer)
    holders = [name for name in ALIASES if "set_module_tensor_to_device" in vars(importlib.import_module(name))]
    assert "accelerate.utils" in holders
    for name in holders:
        assert vars(importlib.import_module(name))["set_module_tensor_to_device"] is layer, name


def _linear4bit(device="meta"):
    import bitsandbytes as bnb

    with torch.device(device):
        return bnb.nn.Linear4bit(8, 8, bias=True)


@pytest.mark.parametrize("case, expected", [
    ("bias of a 4-bit layer on meta, to cuda:0", True),
    ("bias of a 4-bit layer on meta, to 1", True),
    ("the weight itself", False),
    ("bias, to the cpu", False),
    ("bias, to meta", False),
    ("bias of a 4-bit layer whose weight is on the cpu", False),
    ("bias of a 4-bit layer whose weight has a quant state", False),
    ("bias of a plain Linear on meta", False),
    ("a path that does not exist", False),
])
def test_which_calls_leave_the_weight_waiting(case, expected):
    model = torch.nn.Sequential(_linear4bit("cpu" if "on the cpu" in case else "meta"))
    name, device = "0.bias", "cuda:0"
    if case.endswith("to 1"):
        device = 1
    elif case == "the weight itself":
        name = "0.weight"
    elif case == "bias, to the cpu":
        device = "cpu"
    elif case == "bias, to meta":
        device = "meta"
    elif "quant state" in case:
        model[0].weight.quant_state = object()
    elif "plain Linear" in case:
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    elif "does not exist" in case:
        name = "3.bias"
    found = hook.waiting_weight(model, name, device)
    assert (found is model[0].weight) if expected else found is None


def test_the_mark_is_set_only_during_the_call_and_arguments_pass_unchanged(direct):
    from accelerate.utils.modeling import set_module_tensor_to_device as real

    wrapper = direct(hook.SHIM, hook.quantize_after_weight)
    model = torch.nn.Sequential(_linear4bit())
    seen = []

    def library(*args, **kwargs):
        seen.append((args, kwargs, model[0].weight.quant_state))
        return "result"

    library.__signature__ = inspect.signature(real)
    value = torch.zeros(8)
    assert wrapper(library, None, (model, "0.bias", "cuda:0"), {"value": value}) == "result"
    assert wrapper(library, None, (model, "0.bias"), {"device": "cpu", "value": value}) == "result"
    assert seen[0][:2] == ((model, "0.bias", "cuda:0"), {"value": value}) and seen[0][2] is hook.AWAITING_WEIGHT
    assert seen[1][:2] == ((model, "0.bias"), {"device": "cpu", "value": value}) and seen[1][2] is None
    assert model[0].weight.quant_state is None


def test_the_shim_arms_only_where_its_row_applies(no_shim):
    row = load_matrix().get(hook.BUG_ID)
    applies = row.applies(installed_versions(sorted(row.affected)))
    ENGINE.install(only=[hook.SHIM.id])
    status = next(s for s in ENGINE.status()["shims"] if s["id"] == hook.SHIM.id)
    states = {t["state"] for t in status["targets"]}
    assert states == ({"active"} if applies else {"skipped"}), status
