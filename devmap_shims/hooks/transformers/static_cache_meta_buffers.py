"""Shim ``static-cache-meta-buffers``: a ``StaticCache`` made on the ``meta`` device registers no
meta buffers, so moving it (accelerate's hooks do, before every layer of a split model) cannot fail.

transformers 4.49 creates ``generate``'s static cache on ``meta`` and lets ``update`` give each
layer real tensors on that layer's device; the cache is still a ``torch.nn.Module`` whose buffers
are the meta placeholders. accelerate's ``AlignDevicesHook`` moves a layer's keyword arguments to
the layer's device with ``.to()``, the cache among them, and ``Module.to`` on a meta buffer raises.
After ``StaticCache.__init__`` the wrapper drops the ``key_cache_<i>`` / ``value_cache_<i>``
buffers that are on ``meta``: nothing reads them (the cache reads and replaces its
``key_cache`` / ``value_cache`` lists), and ``.to()`` then has nothing to copy. A cache made on a
real device (``torch.export``, offloaded caches) keeps its buffers. transformers 4.50 makes
``Cache`` a plain class, which accelerate's hooks leave alone.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    transformers-static-cache-meta-init
        affected: transformers >=4.49.0,<4.50.0
        fixed in: transformers 4.50.0
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Tuple

from devmap_shims.scenarios import scenario
from devmap_shims.shims import Shim, Target

META_BUG = "transformers-static-cache-meta-init"
PLACEHOLDER_PREFIXES = ("key_cache_", "value_cache_")


def drop_meta_buffers(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``StaticCache.__init__``, then the cache's meta placeholder buffers are unregistered."""
    result = wrapped(*args, **kwargs)
    buffers = getattr(instance, "_buffers", None)
    if isinstance(buffers, dict):
        for name in [n for n, b in buffers.items() if n.startswith(PLACEHOLDER_PREFIXES) and _is_meta(b)]:
            del buffers[name]
    return result


def _is_meta(tensor: Any) -> bool:
    return getattr(getattr(tensor, "device", None), "type", None) == "meta"


SHIM = Shim(
    id="static-cache-meta-buffers",
    fixes=(META_BUG,),
    targets=(Target("transformers.cache_utils", "StaticCache.__init__", wrapper=drop_meta_buffers),),
    summary="unregister a meta-initialised static cache's placeholder buffers so moving the cache cannot fail",
)


# -- scenario ---------------------------------------------------------------------------------------
@scenario(META_BUG, "a tiny Llama split over two GPUs generates with cache_implementation='static'",
          needs=("torch", "transformers", "accelerate"))
def meta_static_cache_on_a_split_model() -> str:
    from devmap_shims.scenarios import static_cache, unavailable_where

    unavailable_where("transformers-4540-cache-layers-on-last-gpu")  # 4.54.0 fails on its layers' devices first
    return static_cache.generate_on_a_split_model()
