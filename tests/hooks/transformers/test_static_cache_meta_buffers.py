"""static-cache-meta-buffers: only a cache's meta placeholder buffers are unregistered.

The wrapper called by hand around a constructor that registers buffers the way transformers 4.49's
``StaticCache`` does, and, where the installed transformers makes generate's cache on ``meta``, the
real ``StaticCache`` through the engine.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from devmap_shims.hooks.transformers import static_cache_meta_buffers as hook  # noqa: E402


class CacheLike(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.key_cache = []
        for idx in range(2):
            self.register_buffer(f"key_cache_{idx}", torch.zeros(1, 2, device=device))
            self.register_buffer(f"value_cache_{idx}", torch.zeros(1, 2, device=device))
            self.key_cache.append(getattr(self, f"key_cache_{idx}"))
        self.register_buffer("other_meta", torch.zeros(1, device="meta"))


def construct(direct, device):
    instance = CacheLike.__new__(CacheLike)
    repair = direct(hook.SHIM, hook.drop_meta_buffers)
    assert repair(lambda *a, **k: CacheLike.__init__(instance, *a, **k), instance, (device,), {}) is None
    return instance


def test_meta_placeholders_are_unregistered_and_the_cache_then_moves(direct):
    cache = construct(direct, "meta")
    assert sorted(dict(cache.named_buffers())) == ["other_meta"]  # a buffer of another name is not ours
    del cache._buffers["other_meta"]
    assert cache.to("cpu") is cache
    assert [t.device.type for t in cache.key_cache] == ["meta", "meta"]  # the lists are the cache's to fill


def test_without_the_repair_moving_the_meta_cache_raises():
    with pytest.raises(NotImplementedError, match="meta"):
        CacheLike("meta").to("cpu")


def test_a_cache_on_a_real_device_keeps_its_buffers(direct):
    cache = construct(direct, "cpu")
    assert sorted(n for n in dict(cache.named_buffers()) if n != "other_meta") == [
        "key_cache_0", "key_cache_1", "value_cache_0", "value_cache_1"]


def test_the_real_meta_static_cache_moves_once_the_shim_is_on(shim):
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.cache_utils import StaticCache

    if not isinstance(StaticCache, type) or not issubclass(StaticCache, torch.nn.Module):
        pytest.skip("this transformers' Cache is not a torch.nn.Module")
    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=2, intermediate_size=32)
    try:
        cache = StaticCache(config=config, max_batch_size=1, max_cache_len=4, dtype=torch.float32)
    except TypeError as exc:  # no device default before 4.49: nothing made on meta
        pytest.skip(f"this transformers' StaticCache needs a device ({exc})")
    if cache.key_cache[0].device.type != "meta":
        pytest.skip(f"transformers {transformers.__version__} makes the cache on {cache.key_cache[0].device}")
    assert not [n for n, b in cache.named_buffers() if b.device.type == "meta"]
    assert cache.to("cpu") is cache
