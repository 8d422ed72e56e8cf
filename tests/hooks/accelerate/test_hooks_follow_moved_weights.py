"""The hooks-follow-moved-weights shim with a tiny Llama that accelerate splits over two simulated
GPUs. Where the matrix says the bug applies, the tests first show it without the shim."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.devices.accelerate_hooks import hooks_of  # noqa: E402
from devmap_shims.hooks.accelerate import hooks_follow_moved_weights as hook  # noqa: E402
from devmap_shims.scenarios.checkpoints import tiny_checkpoint  # noqa: E402
from devmap_shims.testing.models import greedy_generate, sample_input_ids, two_gpu_split  # noqa: E402
from devmap_shims.versions import installed_versions  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

MATRIX = load_matrix()
BUG_HERE = MATRIX.get(hook.BUG_ID).applies(installed_versions(MATRIX.distributions()))
SIM = pytest.mark.simulated_gpus(n=2, memory="2GiB")
PATH = tiny_checkpoint("llama", "fp32")
DEVICE_MAP = two_gpu_split(transformers.AutoModelForCausalLM.from_pretrained(PATH))


@pytest.fixture(autouse=True)
def inference():
    with torch.no_grad():  # the simulator runs inference only
        yield


def split_model():
    return transformers.AutoModelForCausalLM.from_pretrained(PATH, device_map=DEVICE_MAP)


def hook_devices(model):
    return {name: str(hook.as_device(h.execution_device)) for name, m in model.named_modules()
            for h in hooks_of(m) if getattr(h, "execution_device", None) is not None}


@SIM
def test_without_the_shim_the_moved_model_fails_where_the_matrix_says(no_shim):
    model = split_model()
    model.to("cuda:0")
    if BUG_HERE:
        with pytest.raises(RuntimeError, match="same device"):
            greedy_generate(model, sample_input_ids().to("cuda:0"), 4)


@SIM
def test_with_the_shim_the_model_generates_where_it_was_moved_and_back(shim):
    ids = sample_input_ids()
    model = split_model()
    reference = greedy_generate(model, ids.to("cuda:0"), 6).cpu()
    assert set(hook_devices(model).values()) == {"cuda:0", "cuda:1"}
    for device in ("cuda:1", "cuda:0"):
        model.to(device)
        tokens = greedy_generate(model, ids.to("cuda:0"), 6)
        assert torch.equal(tokens.cpu(), reference)
        assert set(hook_devices(model).values()) == {device}
        logits = model(ids.to("cuda:0")).logits
        assert str(logits.device) == "cuda:0"  # the root hook still returns outputs on the inputs' device
    assert model.hf_device_map == DEVICE_MAP  # left as it was


@SIM
def test_a_split_model_that_was_not_moved_keeps_its_hooks_devices(shim):
    model = split_model()
    before = hook_devices(model)
    greedy_generate(model, sample_input_ids().to("cuda:0"), 4)
    assert hook_devices(model) == before


@SIM
def test_after_uninstall_the_guards_put_earlier_pass_through(shim):
    import devmap_shims

    model = split_model()
    assert getattr(vars(model)["to"], "__devmap_follows__", False)
    devmap_shims.uninstall()
    import gc

    gc.collect()
    before = hook_devices(model)
    model.to("cuda:0")
    assert hook_devices(model) == before  # accelerate's own behaviour again


@SIM
def test_only_a_whole_move_retargets_and_offloading_hooks_stay(no_shim):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = torch.nn.Sequential(torch.nn.Linear(2, 2).to("cuda:1"), torch.nn.Linear(2, 2).to("cuda:0"))
    add_hook_to_module(model[0], AlignDevicesHook(execution_device=1))
    add_hook_to_module(model[1], AlignDevicesHook(execution_device=0))
    assert hook.retarget_hooks(model) == 0  # spread over two GPUs: not a whole move
    model[0].to("cuda:0")
    assert hook.retarget_hooks(model) == 1
    assert hook.as_device(model[0]._hf_hook.execution_device) == torch.device("cuda", 0)
    offloading = types.SimpleNamespace(offload=True, execution_device=1, io_same_device=False)
    model[1]._hf_hook = offloading
    model.to("cuda:1")
    assert hook.retarget_hooks(model) == 1 and offloading.execution_device == 1


@SIM
@pytest.mark.parametrize("strict", [False, True], ids=["fails-open", "strict"])
def test_a_failing_retarget_leaves_accelerates_move_and_switches_the_shim_off(strict, monkeypatch, caplog):
    import logging

    import devmap_shims
    from devmap_shims import ShimError

    calls = []

    def broken(model):
        calls.append(model)
        raise ValueError("a hook that cannot be pointed anywhere")

    monkeypatch.setattr(hook, "retarget_hooks", broken)
    devmap_shims.uninstall()
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id], strict=strict)
    try:
        model = split_model()
        before = hook_devices(model)
        with caplog.at_level(logging.WARNING, logger="devmap_shims"):
            if strict:
                with pytest.raises(ShimError, match="LlamaForCausalLM.to") as refused:
                    model.to("cuda:0")
                assert "the call itself had run, and what it did stands" in str(refused.value)
                assert {str(p.device) for p in model.parameters()} == {"cuda:0"}  # as the message says
                return
            assert model.to("cuda:0") is model  # accelerate's guard moved it and its result comes back
            model.to("cuda:1")
        assert {str(p.device) for p in model.parameters()} == {"cuda:1"}
        assert hook_devices(model) == before and len(calls) == 1  # off after the first failure
        warnings = [r.getMessage() for r in caplog.records if hook.SHIM.id in r.getMessage()]
        assert len(warnings) == 1 and "failed inside LlamaForCausalLM.to (the guard accelerate's" in warnings[0]
        assert "ValueError: a hook that cannot be pointed anywhere" in warnings[0]
        assert "The call had run; what it did stands without the repair and this shim is now off" in warnings[0]
        (entry,) = [s for s in devmap_shims.status()["shims"] if s["id"] == hook.SHIM.id]
        assert {t["state"] for t in entry["targets"]} == {"failed"}
    finally:
        devmap_shims.uninstall()


def test_every_method_dispatch_model_guards_is_one_the_shim_follows():
    """dispatch_model guards `to` and the one device method of the machine (cuda, npu, mlu, sdaa,
    musa, xpu, neuron...): the shim and remove_hooks must know each name the installed accelerate
    uses, or a model dispatched on that machine keeps hooks that the move left behind."""
    import inspect
    import re

    import accelerate.big_modeling
    import accelerate.hooks

    from devmap_shims.devices.accelerate_hooks import GUARDED_METHODS

    guarded = set(re.findall(r"model\.(\w+) = add_warning\(", inspect.getsource(accelerate.big_modeling)))
    guarded |= set(getattr(accelerate.hooks, "_accelerate_added_attributes", ()))
    assert {"to", "cuda"} <= guarded, "dispatch_model no longer guards model.to / model.cuda this way"
    assert guarded <= set(GUARDED_METHODS), sorted(guarded - set(GUARDED_METHODS))
