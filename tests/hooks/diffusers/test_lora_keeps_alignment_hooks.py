"""The lora-keeps-alignment-hooks shim: diffusers' own offload check of this stack (the function or
classmethod ``load_lora_weights`` calls) run with and without the wrapper, on models hooked by
accelerate's real ``dispatch_model``, ``cpu_offload`` and ``cpu_offload_with_hook``."""

from __future__ import annotations

import importlib
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
accelerate = pytest.importorskip("accelerate")

from devmap_shims.devices.accelerate_hooks import any_offloading, hooks_of  # noqa: E402
from devmap_shims.hooks.diffusers import lora_keeps_alignment_hooks as hook  # noqa: E402
from devmap_shims.shims import wrapping  # noqa: E402
from devmap_shims.versions import installed_version, version_in  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)


def _diffusers_check():
    """diffusers' own offload check that ``load_lora_weights`` calls on this stack, unwrapped and
    bound as it is called; None where it is written inline. Resolved at import, before any
    simulation: importing diffusers' loaders imports bitsandbytes, which probes the real machine."""
    version = installed_version("diffusers")
    for target in hook.SHIM.targets:
        if target.wrapper is None and all(version_in(version, spec) for spec in target.when.values()):
            try:
                owner, name, raw = wrapping.resolve(importlib.import_module(target.module), target.qualname)
            except (ImportError, AttributeError):
                continue
            raw = wrapping.owned_original(raw) or raw
            return raw.__get__(None, owner) if isinstance(raw, classmethod) else raw
    return None


CHECK = _diffusers_check()


def diffusers_check():
    if CHECK is None:
        pytest.skip(f"diffusers {installed_version('diffusers')} checks inline in load_lora_weights")
    return CHECK


def two_linears():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))


def pipeline(**components):
    return types.SimpleNamespace(hf_device_map=None, components=dict(components, scheduler=object()))


def hook_ids(model):
    return [(name, id(h)) for name, m in model.named_modules() for h in hooks_of(m)]


def run(check, pipe, wrapped):
    if wrapped:
        return hook.keep_alignment_hooks(check, None, (), {"_pipeline": pipe})
    return check(pipe)


@pytest.mark.simulated_gpus(n=2, memory="1GiB")
@pytest.mark.parametrize("wrapped", [False, True], ids=["diffusers", "with-the-wrapper"])
def test_a_model_split_over_two_gpus_keeps_its_hooks_only_with_the_wrapper(no_shim, wrapped):
    split = accelerate.dispatch_model(two_linears(), device_map={"0": 0, "1": 1})
    before = hook_ids(split)
    assert before and not any_offloading(split)
    result = run(diffusers_check(), pipeline(transformer=split, text_encoder=two_linears()), wrapped)
    if wrapped:
        assert tuple(result[:2]) == (False, False)
        assert hook_ids(split) == before
        assert {str(p.device) for p in split.parameters()} == {"cuda:0", "cuda:1"}
    else:  # the bug, on every diffusers the row covers: taken for sequential offload, hooks stripped
        assert tuple(result[:2]) == (False, True)
        assert not hook_ids(split)


@pytest.mark.simulated_gpus(n=2, memory="1GiB")
@pytest.mark.parametrize("wrapped", [False, True], ids=["diffusers", "with-the-wrapper"])
def test_sequential_offload_is_still_found_and_its_hooks_removed(no_shim, wrapped):
    offloaded = accelerate.cpu_offload(two_linears(), execution_device=torch.device("cuda", 0))
    split = accelerate.dispatch_model(two_linears(), device_map={"0": 0, "1": 1})
    assert any_offloading(offloaded)
    result = run(diffusers_check(), pipeline(transformer=offloaded), wrapped)
    assert tuple(result[:2]) == (False, True)
    assert not hook_ids(offloaded)
    # next to a split component, the offloaded one is found; the split one keeps its hooks with the wrapper
    offloaded = accelerate.cpu_offload(two_linears(), execution_device=torch.device("cuda", 0))
    before = hook_ids(split)
    result = run(diffusers_check(), pipeline(transformer=split, text_encoder=offloaded), wrapped)
    assert tuple(result[:2]) == (False, True)
    assert not hook_ids(offloaded)
    assert (hook_ids(split) == before) is wrapped


@pytest.mark.simulated_gpus(n=2, memory="1GiB")
@pytest.mark.parametrize("wrapped", [False, True], ids=["diffusers", "with-the-wrapper"])
def test_model_cpu_offload_is_found_as_before(no_shim, wrapped):
    model, _ = accelerate.cpu_offload_with_hook(two_linears(), execution_device=torch.device("cuda", 0))
    result = run(diffusers_check(), pipeline(unet=model), wrapped)
    assert tuple(result[:2]) == (True, False)


@pytest.mark.simulated_gpus(n=2, memory="1GiB")
def test_the_hooks_come_back_when_the_check_raises_and_nothing_is_hidden_without_cause(no_shim):
    split = accelerate.dispatch_model(two_linears(), device_map={"0": 0, "1": 1})
    root = vars(split)["_hf_hook"]
    seen = []

    def raises(_pipeline):
        seen.append("_hf_hook" in vars(split))
        raise LookupError("raised by diffusers")

    with pytest.raises(LookupError):
        hook.keep_alignment_hooks(raises, None, (pipeline(transformer=split),), {})
    assert seen == [False] and vars(split)["_hf_hook"] is root
    # a device-mapped pipeline (diffusers skips its check), no pipeline, or no hook: nothing is hidden
    mapped = types.SimpleNamespace(hf_device_map={"transformer": 0}, components={"transformer": split})
    for pipe in (mapped, None, pipeline(transformer=two_linears())):
        seen.clear()
        assert hook.alignment_only_components(pipe) == []
        with pytest.raises(LookupError):
            hook.keep_alignment_hooks(raises, None, (pipe,), {})
        assert seen == [True]


def test_the_copies_imported_by_name_call_the_wrapper(shim):
    if not version_in(installed_version("diffusers"), ">=0.32.2"):
        pytest.skip("diffusers < 0.32.2 checks in classmethods, wrapped where they are defined")
    lora_base = importlib.import_module("diffusers.loaders.lora_base")
    layer = vars(lora_base)["_func_optionally_disable_offloading"]
    assert wrapping.is_ours(layer)
    for name in ("diffusers.loaders.peft", "diffusers.loaders.unet"):
        assert vars(importlib.import_module(name))["_func_optionally_disable_offloading"] is layer, name
