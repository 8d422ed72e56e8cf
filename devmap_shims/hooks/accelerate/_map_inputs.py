"""What the library computed for a device map, read while the device-map-balance shim judges it.

accelerate's and transformers' placers compute every module's size and the tied-weight groups
before they place anything; the shim needs the same numbers to judge the map they return.
Computing them again costs as much as the library's own step on a large model, so while a map
call the shim judges runs on a thread (:meth:`SeenInputs.start` ... :meth:`SeenInputs.stop`), the
wrappers here keep what the library returns from:

* ``_init_infer_auto_device_map`` (accelerate >= 1.2, transformers >= 5): module sizes and tied
  groups, one call per map;
* ``compute_module_sizes`` and ``find_tied_parameters`` (older accelerate).

Each wrapper calls the original unchanged and only keeps a reference to its result (never
changed). The shim's state (``context.state``) holds the per-thread record as ``seen``.
"""

from __future__ import annotations

import threading

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable

from devmap_shims.calls import bind
from devmap_shims.shims import with_context


class SeenInputs(threading.local):
    """Per thread, while the library computes a map the shim judges: the module sizes (with the
    arguments they were computed with) and the tied groups the library computed on the way."""

    model: Any = None
    sizes: Any = ()
    tied: Any = None

    def start(self, model: Any) -> None:
        self.model, self.sizes, self.tied = model, [], None

    def stop(self) -> None:
        self.model, self.sizes, self.tied = None, (), None

    def sizes_for(self, **expected: Any) -> Any:
        """The sizes the library computed with these arguments (compared by identity or
        equality), or None when it computed none such."""
        for arguments, result in self.sizes:
            if all(_same(arguments.get(k), v) for k, v in expected.items()):
                return result
        return None


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # tensors and such: only identity counts
        return False


@with_context
def remember_module_sizes(context: Any, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Call accelerate's ``compute_module_sizes`` (before 1.2) unchanged; inside a map call the
    shim judges, keep its result."""
    result = wrapped(*args, **kwargs)
    seen = context.state.seen
    if seen.model is not None and not kwargs.get("buffers_only"):  # the buffers, once per module
        arguments = bind(wrapped, args, kwargs)
        if arguments.get("model") is seen.model and not arguments.get("buffers_only"):
            seen.sizes.append((arguments, result))
    return result


@with_context
def remember_map_inputs(context: Any, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Call the library's ``_init_infer_auto_device_map`` (accelerate >= 1.2, transformers >= 5)
    unchanged; inside a map call the shim judges, keep the module sizes and tied groups it
    returns. One call per map, where wrapping ``compute_module_sizes`` would also see the call
    the placer makes for every module's buffers."""
    result = wrapped(*args, **kwargs)
    seen = context.state.seen
    # (devices, max_memory, main_devices, gpus, module_sizes, tied_parameters, ...): 8 items; accelerate
    # 1.2.0 returned 7, without max_memory
    at = {8: 4, 7: 3}.get(len(result), 0) if type(result) is tuple else 0
    if seen.model is not None and at and isinstance(result[at], dict) and isinstance(result[at + 1], list):
        arguments = bind(wrapped, args, kwargs)
        if arguments.get("model") is seen.model:
            seen.sizes.append((arguments, result[at]))
            seen.tied = result[at + 1]
    return result


@with_context
def remember_tied_parameters(context: Any, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Call accelerate's ``find_tied_parameters`` unchanged; inside a map call the shim judges,
    keep the groups it found for the model (not those of its own recursive calls on children)."""
    result = wrapped(*args, **kwargs)
    seen = context.state.seen
    if seen.model is not None and not kwargs and len(args) == 1 and args[0] is seen.model:
        seen.tied = result
    return result
