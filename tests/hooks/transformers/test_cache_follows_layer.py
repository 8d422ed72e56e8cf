"""The cache-follows-layer repair, called directly around a stand-in ``update`` on simulated GPUs
(the whole generate and forward paths are the rows' scenarios in tests/scenarios)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from devmap_shims.hooks.transformers import cache_follows_layer as hook  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

SIM = pytest.mark.simulated_gpus(n=2, memory="1GiB")


def update(key_states, value_states, layer_idx, cache_kwargs=None):
    return key_states.device


def cache(device):
    return types.SimpleNamespace(key_cache=[torch.zeros(1, device=device), torch.zeros(1, device=device)],
                                 value_cache=[torch.zeros(1, device=device), torch.zeros(1, device=device)])


@SIM
def test_the_layers_tensors_move_to_the_key_states_device_once():
    c = cache("cuda:0")
    states = torch.ones(1, device="cuda:1")
    assert hook.move_layer_cache(update, c, (states, states, 1), {}) == torch.device("cuda", 1)
    assert [str(t.device) for t in c.key_cache] == ["cuda:0", "cuda:1"]
    assert [str(t.device) for t in c.value_cache] == ["cuda:0", "cuda:1"]
    moved = c.key_cache[1]
    hook.move_layer_cache(update, c, (states, states, 1), {})
    assert c.key_cache[1] is moved  # already there: not copied again


@SIM
def test_unknown_layouts_and_indices_are_left_to_the_library():
    states = torch.ones(1, device="cuda:1")
    other = types.SimpleNamespace(layers=[])
    assert hook.move_layer_cache(update, other, (states, states, 0), {}) == torch.device("cuda", 1)
    c = cache("cuda:0")
    hook.move_layer_cache(update, c, (states, states, 5), {})
    hook.move_layer_cache(update, c, (states, states, None), {})
    assert {str(t.device) for t in c.key_cache + c.value_cache} == {"cuda:0"}


def layer_update(key_states, value_states, cache_kwargs=None):
    return key_states.device


@SIM
def test_a_cache_layer_follows_its_key_states_once():
    layer = types.SimpleNamespace(keys=torch.zeros(1, device="cuda:1"), values=torch.zeros(1, device="cuda:1"),
                                  device=torch.device("cuda", 1))
    states = torch.ones(1, device="cuda:0")
    assert hook.move_layer_tensors(layer_update, layer, (states, states), {}) == torch.device("cuda", 0)
    assert (str(layer.keys.device), str(layer.values.device), str(layer.device)) == ("cuda:0",) * 3
    keys = layer.keys
    hook.move_layer_tensors(layer_update, layer, (states, states), {})
    assert layer.keys is keys  # already there: not copied again


@SIM
def test_a_layer_without_tensors_is_left_to_the_library():
    states = torch.ones(1, device="cuda:0")
    lazy = types.SimpleNamespace(keys=None, values=None)
    hook.move_layer_tensors(layer_update, lazy, (states, states), {})
    assert lazy.keys is None and lazy.values is None


@SIM
def test_meta_placeholders_are_left_for_update_to_make():
    # transformers 4.49 builds generate's static and hybrid caches on meta; update() gives the layer
    # real tensors on its key states' device (a meta tensor cannot be copied: .to() would raise)
    c = cache("meta")
    states = torch.ones(1, device="cuda:1")
    assert hook.move_layer_cache(update, c, (states, states, 1), {}) == torch.device("cuda", 1)
    assert {t.device.type for t in c.key_cache + c.value_cache} == {"meta"}
    layer = types.SimpleNamespace(keys=torch.zeros(1, device="meta"), values=torch.zeros(1, device="meta"))
    assert hook.move_layer_tensors(layer_update, layer, (states, states), {}) == torch.device("cuda", 1)
    assert (layer.keys.device.type, layer.values.device.type) == ("meta", "meta")


@pytest.mark.parametrize("arch, options", [("llama", {"cache_implementation": "static"}), ("gemma2", {})])
def test_generate_with_the_librarys_own_cache_keeps_the_shim_on(shim, arch, options):
    # Gemma-2's default cache is a HybridCache; on 4.49 both are built on meta: the shim stays
    # armed (a failed repair would switch it off for the rest of the process) and changes no token
    if not hasattr(pytest.importorskip("transformers.cache_utils"), "StaticCache"):
        pytest.skip("this transformers has no static cache")
    from devmap_shims import status
    from devmap_shims.testing.models import PAD_ID, sample_input_ids, supported_archs, tiny_causal_lm

    if arch not in supported_archs():
        pytest.skip(f"this transformers cannot build {arch}")
    model = tiny_causal_lm(arch)
    ids = sample_input_ids()
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD_ID, **options)
    (entry,) = [s for s in status()["shims"] if s["id"] == hook.SHIM.id]
    assert entry["state"] == "active" and entry["call_failures"] == 0, entry
    assert tokens.shape == (1, ids.shape[1] + 3)
