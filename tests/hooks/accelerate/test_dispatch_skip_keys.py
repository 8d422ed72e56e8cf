"""dispatch-skip-keys: dispatch gets the model's own skip_keys, child hooks get them too.

Real accelerate dispatch on simulated GPUs. Behaviour tests force the shim, so they run on every
stack; where the upstream bug is absent the outputs must not change.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

from accelerate import init_empty_weights, load_checkpoint_and_dispatch  # noqa: E402
from packaging.version import Version  # noqa: E402

from devmap_shims.devices.accelerate_hooks import hooks_of  # noqa: E402
from devmap_shims.hooks.accelerate import dispatch_skip_keys as hook  # noqa: E402
from devmap_shims.scenarios.checkpoints import cpu_greedy_tokens  # noqa: E402
from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.testing.models import greedy_generate, sample_input_ids  # noqa: E402

ACCELERATE_1 = Version(accelerate.__version__).release >= (1, 0)
GPU_MEMORY = "2GiB"


def _dispatch(*args, **kwargs):
    """accelerate's ``dispatch_model`` as the library's callers reach it (through the module)."""
    import accelerate.big_modeling as big_modeling

    return big_modeling.dispatch_model(*args, **kwargs)


def _hooks(model):
    return {name: h for name, module in model.named_modules() for h in hooks_of(module) if hasattr(h, "skip_keys")}


def _qwen_on_meta():
    config = transformers.AutoConfig.from_pretrained(hook.fp16_checkpoint())
    with init_empty_weights():
        return transformers.AutoModelForCausalLM.from_config(config, **hook.dtype_kwargs())


def _split_map(model):
    names = [name for name, _ in model.model.named_children() if name != "layers"]
    device_map = {f"model.{n}": 0 for n in names if n == "embed_tokens"}
    device_map.update({"model.layers.0": 0, "model.layers.1": 1, "lm_head": 1})
    device_map.update({f"model.{n}": 1 for n in names if n != "embed_tokens"})
    return device_map


# -- skip_keys given as from_pretrained gives them -------------------------------------------------------


@pytest.mark.parametrize("how", ["keyword-absent", "keyword-none", "positional-none"])
def test_missing_skip_keys_become_the_models_own(shim, how):
    model = _qwen_on_meta()
    device_map = _split_map(model)
    with simulated_gpus(2, memory=GPU_MEMORY):
        if how == "keyword-absent":
            model = load_checkpoint_and_dispatch(model, hook.fp16_checkpoint(), device_map=device_map)
        elif how == "keyword-none":
            model = load_checkpoint_and_dispatch(model, hook.fp16_checkpoint(), device_map=device_map, skip_keys=None)
        else:
            from accelerate import load_checkpoint_in_model

            load_checkpoint_in_model(model, hook.fp16_checkpoint(), device_map=device_map)
            model = _dispatch(model, device_map, None, None, None, None, False, None)
    assert model._hf_hook.skip_keys == model._skip_keys_device_placement
    assert all(h.skip_keys == model._skip_keys_device_placement for h in _hooks(model).values())


def test_without_the_shim_the_root_hook_has_no_skip_keys(no_shim):
    model = _qwen_on_meta()
    with simulated_gpus(2, memory=GPU_MEMORY):
        model = load_checkpoint_and_dispatch(model, hook.fp16_checkpoint(), device_map=_split_map(model))
    assert model._hf_hook.skip_keys is None


@pytest.mark.parametrize("explicit", [[], ["attention_mask"], "past_key_values"])
def test_explicit_skip_keys_are_the_callers_choice(shim, explicit):
    model = _qwen_on_meta()
    with simulated_gpus(2, memory=GPU_MEMORY):
        model = load_checkpoint_and_dispatch(
            model, hook.fp16_checkpoint(), device_map=_split_map(model), skip_keys=explicit
        )
    assert model._hf_hook.skip_keys == explicit


def test_models_that_declare_nothing_are_dispatched_as_before(shim):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with simulated_gpus(2, memory=GPU_MEMORY), torch.no_grad():
        net = _dispatch(net, {"0": 0, "1": 1})
        out = net(torch.ones(1, 4))
    assert net._hf_hook.skip_keys is None
    assert out.device == torch.device("cpu")


# -- the report end to end (QwenLM/Qwen3#327) ------------------------------------------------------------


def test_the_report_generates_the_cpu_tokens_with_the_shim_on_every_stack(shim):
    assert "equal to the CPU reference" in hook.qwen_split_by_load_checkpoint_and_dispatch()


def test_from_pretrained_path_is_unchanged(checkpoint_tokens, shim):
    """from_pretrained already passes skip_keys: the shim must not change its tokens or devices."""
    path = hook.fp16_checkpoint()
    with simulated_gpus(2, memory=GPU_MEMORY):
        meta = _qwen_on_meta()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, device_map=_split_map(meta), **hook.dtype_kwargs()
        )
        tokens = greedy_generate(model, sample_input_ids().to("cuda:0"), max_new_tokens=hook.NEW_TOKENS)
        devices = {str(p.device) for p in model.parameters()}
    assert torch.equal(tokens, checkpoint_tokens)
    assert devices == {"cuda:0", "cuda:1"}


@pytest.fixture(scope="module")
def checkpoint_tokens():
    return cpu_greedy_tokens(hook.fp16_checkpoint(), hook.NEW_TOKENS, **hook.dtype_kwargs())


# -- accelerate-skip-keys-not-propagated (accelerate#3088) ---------------------------------------------


def _run_state_model(**dispatch_kwargs):
    """The scenario's model: a mapped block whose inner layer reads ``state``, kept on cuda:1."""
    with simulated_gpus(2, memory=GPU_MEMORY), torch.no_grad():
        model = _dispatch(hook.state_model(), {"block": 0, "head": 1}, **dispatch_kwargs)
        model(torch.ones(1, 4, device="cuda:0"), state=torch.zeros(4, device="cuda:1"))
        return model, str(model.block.inner.state_device)


def test_child_hooks_leave_the_skipped_keyword_alone_with_the_shim(shim):
    model, seen = _run_state_model()  # skip_keys from _skip_keys_device_placement
    assert seen == "cuda:1"
    assert all(h.skip_keys == "state" for h in _hooks(model).values())


def test_without_the_shim_child_hooks_follow_the_accelerate_release(no_shim):
    """Precondition of the test above: accelerate < 1.0 moves the skipped keyword inside the block."""
    _, seen = _run_state_model()
    assert seen == "cuda:0"  # nobody passes skip_keys: even the root hook moves it
    _, seen = _run_state_model(skip_keys="state")
    assert seen == ("cuda:1" if ACCELERATE_1 else "cuda:0")


def test_propagation_is_a_no_op_on_hooks_that_have_skip_keys():
    class Hook:
        skip_keys = ["mine"]

    module = torch.nn.Linear(1, 1)
    module._hf_hook = Hook()
    assert hook.propagate_skip_keys(module, "past_key_values") == 0
    assert module._hf_hook.skip_keys == ["mine"]
