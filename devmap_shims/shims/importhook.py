"""Post-import hooks: run a callback right after a named module finishes executing.

Same idea as ``wrapt.register_post_import_hook`` (PEP 369): a finder on ``sys.meta_path`` wraps
the loader of each watched module and calls the hooks after ``exec_module``. It is written here
rather than taken from wrapt because ``import wrapt`` alone costs more than the whole start-up
budget of ``install()`` (about 100 ms on a 2-core machine); wrapt is imported only once a target
module is actually being imported, next to the seconds that torch costs anyway.

Hooking the *defining* submodule (``accelerate.utils.modeling``) matters: its hook runs before the
parent package's ``from .modeling import infer_auto_device_map`` executes, so every later by-name
copy binds the wrapper.

Import time versus call time: :func:`when_imported` costs a dict insert; the finder costs one dict
lookup per import of any module; a hook runs once, right after its module executes. A hook that
raises never breaks the user's import: the error goes to ``on_error``.
"""

from __future__ import annotations

import sys
import threading
# typing costs ~20 ms to import; annotations are strings here, so it is only needed by type checkers
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List

    Hook = Callable[[Any], None]


_lock = threading.RLock()
_hooks: Dict[str, List[Hook]] = {}
_finder: _PostImportFinder | None = None


def _report_hook_error(module_name: str, hook: Hook, exc: BaseException) -> None:
    import logging

    logging.getLogger("devmap_shims").warning(
        "devmap_shims: post-import hook %r for %s failed (%s: %s); the import itself went on unchanged",
        getattr(hook, "__qualname__", hook), module_name, type(exc).__name__, exc,
    )


#: Called with (module name, hook, exception) when a hook raises; replaced by the registry.
on_error: Callable[[str, Hook, BaseException], None] = _report_hook_error


def _run_hooks(module: Any) -> None:
    name = getattr(module, "__name__", None)
    with _lock:
        hooks = _hooks.pop(name, [])
    for hook in hooks:
        try:
            hook(module)
        except Exception as exc:  # never break the user's import (on_error decides; strict mode raises)
            on_error(name, hook, exc)


class _ChainedLoader:
    """Delegates to the real loader and runs the hooks after ``exec_module``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_code ...
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: Any) -> None:
        # The module must look as if the real loader had loaded it.
        if getattr(module, "__loader__", None) in (None, self):
            try:
                module.__loader__ = self._loader
            except AttributeError:
                pass
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "loader", None) is self:
            spec.loader = self._loader
        self._loader.exec_module(module)
        _run_hooks(sys.modules.get(module.__name__, module))

    def load_module(self, fullname: str) -> Any:  # legacy loaders
        module = self._loader.load_module(fullname)
        _run_hooks(module)
        return module


class _PostImportFinder:
    def __init__(self) -> None:
        self._in_progress: set = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _hooks or fullname in self._in_progress:
            return None
        with _lock:
            if fullname in self._in_progress:
                return None
            self._in_progress.add(fullname)
        try:
            from importlib.util import find_spec

            spec = find_spec(fullname)
            loader = getattr(spec, "loader", None)
            if loader is not None and not isinstance(loader, _ChainedLoader) and hasattr(loader, "exec_module"):
                spec.loader = _ChainedLoader(loader)
            return spec
        except Exception:
            return None  # let the normal machinery find (and report) it
        finally:
            with _lock:
                self._in_progress.discard(fullname)

    def invalidate_caches(self) -> None:
        pass


def when_imported(module_name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once ``module_name`` has been imported (now, if it already is)."""
    global _finder
    module = sys.modules.get(module_name)
    if module is not None and not _is_initialising(module):
        try:
            hook(module)
        except Exception as exc:
            on_error(module_name, hook, exc)
        return
    with _lock:
        _hooks.setdefault(module_name, []).append(hook)
        if _finder is None or _finder not in sys.meta_path:
            _finder = _finder or _PostImportFinder()
            sys.meta_path.insert(0, _finder)


def cancel(hook: Hook) -> None:
    """Forget a hook that has not fired yet (used by ``uninstall``)."""
    with _lock:
        for name in list(_hooks):
            _hooks[name] = [h for h in _hooks[name] if h is not hook]
            if not _hooks[name]:
                del _hooks[name]


def pending_modules() -> list:
    with _lock:
        return sorted(_hooks)


def _is_initialising(module: Any) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
