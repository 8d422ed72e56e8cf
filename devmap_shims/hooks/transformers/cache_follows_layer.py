"""Shim ``cache-follows-layer``: a layer's static-cache tensors follow the device of that layer's
key/value states.

Before ``StaticCache.update`` (and ``HybridCache.update`` on 4.45-4.49, ``SlidingWindowCache.update``
on 4.42-4.53) writes layer *i*'s new keys and values, the wrapper moves that layer's cached tensors
to the device of ``key_states`` if they are elsewhere (once: afterwards they are there), which is
what transformers 4.44.1 does inside ``StaticCache.update`` (``SlidingWindowCache.update`` never
did). A cache whose layout it does not know (no ``key_cache`` list), and a layer whose tensors
are still ``meta`` placeholders (4.49's generate), are left to the library.
On 4.54.0, where a cache is a list of layer objects, the same move wraps ``update`` of the static,
sliding-window and chunked layers, as 4.54.1 does inside them.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    transformers-static-cache-multigpu
        affected: transformers >=4.41.0,<4.44.1
        fixed in: transformers 4.44.1
    transformers-cache-built-without-layer-map
        affected: transformers >=4.45.0,<4.54.1
        fixed in: transformers 4.54.1
    transformers-4540-cache-layers-on-last-gpu
        affected: transformers ==4.54.0
        fixed in: transformers 4.54.1
    transformers-sliding-window-cache-one-device
        affected: transformers >=4.42.0,<4.54.1
        fixed in: transformers 4.54.1
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.calls import argument
from devmap_shims.scenarios import scenario
from devmap_shims.shims import Shim, Target

STATIC_BUG = "transformers-static-cache-multigpu"
CACHE_MAP_BUG = "transformers-cache-built-without-layer-map"
LAST_GPU_BUG = "transformers-4540-cache-layers-on-last-gpu"
SLIDING_BUG = "transformers-sliding-window-cache-one-device"
#: 4.54.0's cache layers: the one release with layer objects that do not follow their states' device
LAYER_RELEASE = {"transformers": "==4.54.0"}


def move_layer_cache(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``StaticCache.update`` with layer ``layer_idx``'s cache on the device of ``key_states``."""
    _, key_states = argument(wrapped, "key_states", args, kwargs)
    _, layer_idx = argument(wrapped, "layer_idx", args, kwargs)
    keys = getattr(instance, "key_cache", None)
    values = getattr(instance, "value_cache", None)
    if (
        isinstance(layer_idx, int) and isinstance(keys, list) and isinstance(values, list)
        and 0 <= layer_idx < min(len(keys), len(values)) and hasattr(key_states, "device")
    ):
        device = key_states.device
        if _elsewhere(keys[layer_idx], device):
            keys[layer_idx] = keys[layer_idx].to(device)
        if _elsewhere(values[layer_idx], device):
            values[layer_idx] = values[layer_idx].to(device)
    return wrapped(*args, **kwargs)


def _elsewhere(cached: Any, device: Any) -> bool:
    """Whether a layer's cached tensor has data on a device other than ``device``. A placeholder on
    ``meta`` has none: transformers 4.49 builds generate's static and hybrid caches that way, and
    ``update`` makes the layer's tensors on the device of its key states itself."""
    return cached.device != device and cached.device.type != "meta"


def move_layer_tensors(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``StaticLayer.update`` (4.54.0) with the layer's keys and values on the device of ``key_states``."""
    _, key_states = argument(wrapped, "key_states", args, kwargs)
    keys = getattr(instance, "keys", None)
    values = getattr(instance, "values", None)
    device = getattr(key_states, "device", None)
    if device is not None and hasattr(keys, "device") and hasattr(values, "device") and _elsewhere(keys, device):
        instance.keys = keys.to(device)
        instance.values = values.to(device)
        if hasattr(instance, "device"):
            instance.device = device
    return wrapped(*args, **kwargs)


def _layer_target(name: str) -> Target:
    return Target("transformers.cache_utils", f"{name}.update", expect_params=("key_states",), when=LAYER_RELEASE,
                  wrapper=move_layer_tensors)


SHIM = Shim(
    id="cache-follows-layer",
    fixes=(STATIC_BUG, CACHE_MAP_BUG, LAST_GPU_BUG, SLIDING_BUG),
    targets=(
        Target("transformers.cache_utils", "StaticCache.update", expect_params=("key_states", "layer_idx"),
               wrapper=move_layer_cache),
        Target("transformers.cache_utils", "HybridCache.update", expect_params=("key_states", "layer_idx"),
               when={"transformers": ">=4.45.0,<4.50.0"}, wrapper=move_layer_cache),
        Target("transformers.cache_utils", "SlidingWindowCache.update", expect_params=("key_states", "layer_idx"),
               when={"transformers": ">=4.42.0,<4.54.0"}, wrapper=move_layer_cache),
        _layer_target("StaticLayer"),
        _layer_target("SlidingWindowLayer"),
        _layer_target("ChunkedSlidingLayer"),
    ),
    summary="move a layer's static- or hybrid-cache tensors to the device of its key/value states before writing them",
)


# -- scenario ---------------------------------------------------------------------------------------
@scenario(STATIC_BUG, "a tiny Llama split over two GPUs generates with cache_implementation='static'",
          needs=("torch", "transformers", "accelerate"))
def static_cache_on_a_split_model() -> str:
    from devmap_shims.scenarios import static_cache, unavailable_where

    unavailable_where("transformers-static-cache-meta-init")  # 4.49 fails on its meta cache first
    unavailable_where(LAST_GPU_BUG)  # 4.54.0 fails on its layers' devices: that row's scenario
    return static_cache.generate_on_a_split_model()


@scenario(CACHE_MAP_BUG, "a tiny Gemma-2 split over two GPUs: model(input_ids) builds its own hybrid cache",
          needs=("torch", "transformers", "accelerate"))
def gemma2_forward_on_a_split_model() -> str:
    from devmap_shims.scenarios import ScenarioUnavailable, static_cache
    from devmap_shims.testing.models import supported_archs
    from devmap_shims.versions import installed_version, version_in

    if "gemma2" not in supported_archs():
        raise ScenarioUnavailable("this transformers cannot build Gemma-2")
    if not version_in(installed_version("transformers") or "0", "<4.49.0"):
        raise ScenarioUnavailable("from 4.49 the model builds its cache with the layers' devices; user-built caches remain")
    return static_cache.forward_on_a_split_model("gemma2")


@scenario(CACHE_MAP_BUG, "a tiny Llama split over two GPUs generates with a StaticCache the user built on cuda:0",
          needs=("torch", "transformers", "accelerate"))
def user_static_cache_on_a_split_model() -> str:
    from devmap_shims.scenarios import ScenarioUnavailable, static_cache
    from devmap_shims.versions import installed_version, version_in

    if not version_in(installed_version("transformers") or "0", ">=4.45.0"):
        raise ScenarioUnavailable("before 4.45 this is the path of transformers-static-cache-multigpu")
    return static_cache.generate_with_a_user_static_cache()


@scenario(LAST_GPU_BUG, "a tiny Llama split over two GPUs generates with cache_implementation='static'",
          needs=("torch", "transformers", "accelerate"))
def static_cache_layers_on_a_split_model() -> str:
    from devmap_shims.scenarios import static_cache, unavailable_where

    unavailable_where("transformers-static-cache-meta-init")  # 4.49 fails on its meta cache first
    return static_cache.generate_on_a_split_model()


@scenario(SLIDING_BUG, "a tiny Mistral split over two GPUs generates with a SlidingWindowCache the user built on cuda:0",
          needs=("torch", "transformers", "accelerate"))
def user_sliding_window_cache_on_a_split_model() -> str:
    from devmap_shims.scenarios import static_cache

    return static_cache.generate_with_a_user_sliding_window_cache()
