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
lookup per import of any module; a hook runs once, right after its module executes.
:func:`before_first_import` runs a callback once, just before the first of some top-level packages
is imported: the engine imports the built-in shim modules there, not at ``install()``. A hook that
raises ``Exception`` never breaks the user's import: the error goes to the hook's ``on_error``
(logged when none was given), which may raise to make the import fail on purpose (strict mode).
"""

from __future__ import annotations

import sys
import threading
TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

    Hook = Callable[[Any], None]
    ErrorHandler = Callable[[str, Hook, BaseException], None]
    TriggerErrorHandler = Callable[[Callable[[], None], BaseException], None]


_lock = threading.RLock()
_hooks: Dict[str, List[Tuple[Hook, ErrorHandler]]] = {}
# top-level package name -> (callback, on_error), until it fires
_triggers: Dict[str, Tuple[Callable[[], None], Optional[TriggerErrorHandler]]] = {}
_finder: _PostImportFinder | None = None


def _log_hook_error(module_name: str, hook: Hook, exc: BaseException) -> None:
    import logging

    logging.getLogger("devmap_shims").warning(
        "post-import hook %r for %s failed (%s: %s); the import itself went on unchanged",
        getattr(hook, "__qualname__", hook), module_name, type(exc).__name__, exc,
    )


def _run_hooks(module: Any) -> None:
    name = getattr(module, "__name__", None)
    with _lock:
        hooks = _hooks.pop(name, [])
    for hook, on_error in hooks:
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
        #: the names this finder is looking up, each with the thread doing it (a fork keeps only
        #: the forking thread's: see :func:`reinit_after_fork`)
        self._in_progress: Dict[str, int] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if _triggers and path is None:  # a top-level name: the first import of a watched package
            trigger = _triggers.get(fullname)
            if trigger is not None:
                _fire(*trigger)
        if fullname not in _hooks or fullname in self._in_progress:
            return None
        with _lock:
            if fullname in self._in_progress:
                return None
            self._in_progress[fullname] = threading.get_ident()
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
                self._in_progress.pop(fullname, None)

    def invalidate_caches(self) -> None:
        pass


def _fire(callback: Callable[[], None], on_error: Optional[TriggerErrorHandler] = None) -> None:
    cancel_before_first_import(callback)
    try:
        callback()
    except Exception as exc:  # never break the user's import (on_error decides; strict mode raises)
        if on_error is None:
            _log_hook_error("(before import)", callback, exc)
        else:
            on_error(callback, exc)


def before_first_import(
    names: Tuple[str, ...], callback: Callable[[], None], on_error: Optional[TriggerErrorHandler] = None
) -> None:
    """Call ``callback()`` once, just before the first of the top-level packages ``names`` is
    imported (now, if one of them already is). It may register :func:`when_imported` hooks for
    modules of those packages: they are in place before the package runs. ``on_error(callback,
    exception)`` gets what the callback raises, as a hook's does (logged when none is given)."""
    if any(name in sys.modules for name in names):
        _fire(callback, on_error)
        return
    with _lock:
        for name in names:
            _triggers[name] = (callback, on_error)
        _install_finder()


def cancel_before_first_import(callback: Callable[[], None]) -> None:
    """Forget ``callback``'s triggers (compared with ``==``: a bound method read twice is two
    objects, equal to each other)."""
    with _lock:
        for name in [n for n, (c, _e) in _triggers.items() if c == callback]:
            del _triggers[name]


def _install_finder() -> None:
    global _finder
    if _finder is None or _finder not in sys.meta_path:
        _finder = _finder or _PostImportFinder()
        sys.meta_path.insert(0, _finder)


def when_imported(module_name: str, hook: Hook, on_error: Optional[ErrorHandler] = None) -> None:
    """Call ``hook(module)`` once ``module_name`` has been imported (now, if it already is).

    ``on_error(module name, hook, exception)`` is called when the hook raises ``Exception``; it
    may raise in turn to fail the import. By default the error is logged and the import goes on.
    """
    handler = on_error or _log_hook_error
    module = sys.modules.get(module_name)
    if module is not None and not _is_initialising(module):
        try:
            hook(module)
        except Exception as exc:
            handler(module_name, hook, exc)
        return
    with _lock:
        _hooks.setdefault(module_name, []).append((hook, handler))
        _install_finder()
    if module is not None:  # being imported right now, its loader found before the hook existed
        _after_import_in_progress(module_name, module)


def _after_import_in_progress(module_name: str, module: Any) -> None:
    """Run ``module_name``'s hooks once the import now running (in this thread or another) has
    finished ``module``; nothing when it failed (the module left ``sys.modules``). A thread watches
    the import without importing anything itself: importing again after a failure would run the
    module's code a second time, behind the program's back."""

    spec = getattr(module, "__spec__", None)

    def current() -> Any:
        # the module, or what it put in its place (transformers' and diffusers' _LazyModule keep
        # the spec); None once a failed import took it out of sys.modules
        found = sys.modules.get(module_name)
        if found is module or (spec is not None and getattr(found, "__spec__", None) is spec):
            return found
        return None

    def wait_then_run() -> None:
        import time

        found = current()
        while found is not None and _is_initialising(found):
            time.sleep(0.005)
            found = current()
        if found is not None:
            _run_hooks(found)

    threading.Thread(target=wait_then_run, name=f"devmap-shims waits for {module_name}", daemon=True).start()


def reinit_after_fork() -> None:
    """A fork while another thread held the lock leaves it held forever in the child, and the
    names that thread was looking up marked as in progress: their imports in the child would not
    be hooked. Only the forking thread goes on in the child."""
    global _lock
    _lock = threading.RLock()
    if _finder is not None:
        me = threading.get_ident()
        _finder._in_progress = {name: thread for name, thread in _finder._in_progress.items() if thread == me}


def cancel(hook: Hook) -> None:
    """Forget a hook that has not fired yet (used by ``uninstall``)."""
    with _lock:
        for name in list(_hooks):
            _hooks[name] = [(h, e) for h, e in _hooks[name] if h is not hook]
            if not _hooks[name]:
                del _hooks[name]


def waiting() -> int:
    """How many hooks and triggers wait for their module (0 after a complete ``uninstall``)."""
    with _lock:
        return sum(len(hooks) for hooks in _hooks.values()) + len(_triggers)


def _is_initialising(module: Any) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
