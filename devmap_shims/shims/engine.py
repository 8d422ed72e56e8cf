"""The engine's lifecycle: ``install``, ``uninstall``, ``register`` and ``reset`` on one object.

:data:`ENGINE` is the process's engine; ``devmap_shims.install()`` and friends call its methods.
An install selects shims (built-in, plugin and registered ones) into a fresh :class:`Registry`
(each with a fresh :class:`ShimContext`), then registers post-import hooks; uninstall takes every
layer off and drops the registry's entries, and so every shim's state.

The built-in shim modules are imported only when they can matter: at ``install()`` if a target
library (torch & co., or one with a folder under ``hooks/``) is already imported, else just before
the first one is (a process that never imports them never pays for the shims), or when
``status()`` asks.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Dict, Iterable, List, Optional, Tuple

from devmap_shims.shims.record import Shim
from devmap_shims.shims.registry import Registry, ShimError, logger
from devmap_shims.versions import TARGET_DISTRIBUTIONS


class Engine:
    """Process-wide state behind ``install()``, ``uninstall()``, ``register()`` and ``status()``."""

    def __init__(self) -> None:
        self.registry = Registry()
        self.installed = False
        self.killed = False
        self.options: Dict[str, Any] = {}
        self.imported_before_install: List[str] = []
        #: shims and rows given to :meth:`register`, kept across install/uninstall
        self.registered: List[Shim] = []
        self.registered_rows: List[Dict[str, Any]] = []
        self._selection: Dict[str, Any] = {}  # how install() selects, kept for the built-in shims
        self._builtins_loaded = False
        self._generation = 0  # one more at each install and uninstall

    @property
    def lock(self) -> Any:
        return self.registry.lock

    # -- install -----------------------------------------------------------------------------------
    def install(
        self,
        only: Optional[Iterable[str]] = None,
        exclude: Optional[Iterable[str]] = None,
        force: Optional[Iterable[str]] = None,
        strict: Optional[bool] = None,
        *,
        plugins: Optional[bool] = None,
        auto: bool = False,
    ) -> bool:
        """See :func:`devmap_shims.install`."""
        from devmap_shims.shims import catalog, config, importhook, logs

        settings = config.read_settings()
        logs.configure(settings.log_level)
        registry = self.registry
        strict, plugins = config.install_switch("strict", strict), config.install_switch("plugins", plugins)
        only, exclude = config.install_ids("only", only), config.install_ids("exclude", exclude)
        force = config.install_ids("force", force)
        strict_mode = settings.strict if strict is None else strict
        with registry.lock:
            for problem in settings.problems:
                registry.warn(problem, logged=problem in config.LOGGED_AT_START_UP)
            if settings.killed:
                self.killed = True
                if self.uninstall():  # set after an install (start-up's): the switch turns it off
                    logger().warning("DEVMAP_SHIMS=0: the shims installed before are removed")
                else:
                    logger().info("DEVMAP_SHIMS=0, shims not installed")
                return False
            requested = {
                "only": only,
                "exclude": exclude or (),
                "force": force or (),
                "strict": strict_mode,
                "plugins": plugins,
            }
            use_plugins = (not settings.no_plugins) if plugins is None else bool(plugins)
            # At interpreter start-up only the plugins the operator names load.
            names = (settings.plugins or None) if auto else None
            load_plugins = use_plugins and (names is not None or not auto)
            if self.installed:
                if auto:  # the start-up line again (site read the .pth file twice)
                    return True
                if not self.options.get("auto"):
                    if requested != self.options.get("requested"):
                        registry.warn(
                            "install() was already called with other arguments; call "
                            "devmap_shims.uninstall() first to change them"
                        )
                    return True
                # the program's own call after the start-up install: its arguments are the ones meant
                changes = self._changes_from_start_up(requested, load_plugins)
                if not changes:
                    return True
            generation = self._generation
        # Plugins are the operator's code, loaded without our lock held: one that imports or only
        # probes a target library (importlib.util.find_spec("torch")) fires the start-up install's
        # trigger, which takes this lock while holding the interpreter's import lock.
        builtin_ids = list(catalog.builtin_ids())
        others, rows, problems = self._plugins(load_plugins, builtin_ids, names)
        registry.lock.acquire()
        if self._generation != generation:  # another install, uninstall or reset meanwhile: decide again
            registry.lock.release()
            return self.install(only, exclude, force, strict, plugins=plugins, auto=auto)
        try:
            others, rows = self._with_registered(builtin_ids, others, rows)
            known = builtin_ids + [s.id for s in others]
            id_problems = config.unknown_id_problems(settings, known, ignored=not strict_mode)
            id_problems += _id_problems(known, requested)
            if id_problems and strict_mode:  # strict: a shim id that names nothing is an error
                # (raised before anything changes: a start-up install this call would replace stays)
                raise config.UnknownShimId(
                    "; ".join(id_problems) + " (strict mode, DEVMAP_SHIMS_STRICT=1 or install(strict=True), "
                    "refuses ids that name no shim)"
                )
            if self.installed:
                logger().info(
                    "install() from the program replaces the start-up install (DEVMAP_SHIMS=1): %s",
                    "; ".join(changes),
                )
                self.uninstall()
            self._selection = {
                "only": None if requested["only"] is None else set(requested["only"]),
                "exclude": set(requested["exclude"]) | set(settings.disable),
                "force": set(requested["force"]) | set(settings.force),
                # what switched every shim off, if anything: the variable or the argument
                "disable_all": "DEVMAP_SHIMS_DISABLE=*" if settings.disable_all else (
                    "install(exclude='*')" if "*" in requested["exclude"] else None),
            }
            for problem in problems + id_problems:
                registry.warn(problem)
            registry.strict = strict_mode
            registry.extra_rows = rows
            registry.shims = {}
            registry.reset_knowledge()
            for shim in others:
                self._add(shim)
            self.options = {
                "requested": requested,
                "auto": auto,
                "settings": settings.as_dict(),
                # the distributions whose plugins this install loaded: None all, () none
                "plugins_loaded": (None if names is None or "*" in names else names) if load_plugins else (),
            }
            self.installed = True
            self._generation += 1
            self.killed = False
            self._builtins_loaded = False
            try:
                if registry.shims:
                    self._watch()
                # the built-in shims target these packages' modules (the contract test holds them to it)
                triggers = tuple(TARGET_DISTRIBUTIONS) + tuple(catalog.libraries())
                importhook.before_first_import(triggers, self.load_builtins, _raise_shim_errors)
            except ShimError:
                # strict mode, a target already imported that could not be wrapped: nothing stays
                # installed, so the error is the whole outcome (a second call answers the same)
                self.uninstall()
                raise
            self.imported_before_install = self._imported_targets()
        finally:
            registry.lock.release()
        return True

    def _changes_from_start_up(self, requested: Dict[str, Any], load_plugins: bool) -> List[str]:
        """What a program's ``install()`` asks for that the start-up install did otherwise: its
        arguments, and the plugins it loads (every one found, where start-up loads only those
        ``DEVMAP_SHIMS_PLUGINS`` names)."""
        before = self.options.get("requested") or {}
        changes = [
            f"{key}={requested[key]!r}" for key in ("only", "exclude", "force", "strict")
            if requested[key] != before.get(key)
        ]
        loaded = self.options.get("plugins_loaded", ())  # None: all; (): none; else those named
        loads = None if load_plugins else ()
        if loads != loaded:  # the distributions found decide whether that loads anything else
            from devmap_shims.shims import plugins

            found = plugins.distributions()
            before = found if loaded is None else {dist for dist in found if plugins.named(dist, loaded)}
            after = found if loads is None else set()
            if after - before:
                changes.append(f"plugins of {', '.join(sorted(after - before))} loaded")
            elif before - after:
                changes.append("no plugins")
        return changes

    def load_builtins(self) -> None:
        """Import the built-in shim modules and arm their shims (once per install). Called just
        before a target library is first imported, at ``install()`` if one already is, and by
        :meth:`status`. A shim module that fails to import is reported and skipped; in strict mode a
        target already imported that cannot be wrapped raises ShimError."""
        from devmap_shims.shims import catalog

        registry = self.registry
        with registry.lock:
            if not self.installed or self._builtins_loaded:
                return
            self._builtins_loaded = True
            try:
                shims, problems = catalog.builtin_shims()
            except Exception as exc:  # pragma: no cover - the catalog itself broken
                shims, problems = [], [f"the built-in shims could not be listed ({type(exc).__name__}: {exc})"]
            for problem in problems:
                registry.warn(problem)
            others = registry.shims
            registry.shims = {}
            for shim in shims:
                self._add(shim)
            registry.shims.update(others)  # built-in shims first, as status() lists them
            registry.reset_knowledge()
            self._watch()

    def _watch(self) -> None:
        from devmap_shims.shims import arming

        arming.watch(self.registry)

    def _imported_targets(self) -> List[str]:
        import sys

        modules = sorted({t.target.module for t in self.registry.target_entries()})
        return [m for m in modules if m in sys.modules]

    def _plugins(
        self, use_plugins: bool, builtin_ids: List[str], names: Optional[Tuple[str, ...]] = None
    ) -> Tuple[List[Shim], List[Dict[str, Any]], List[str]]:
        """The plugins' shims and matrix rows (from the distributions in ``names``, None: all), and
        the problems met loading them."""
        if not use_plugins:
            return [], [], []
        from devmap_shims.shims import plugins

        rows, shims, problems = plugins.load_all(builtin_ids, names)
        return shims, rows, problems + plugins.missing(names)

    def _with_registered(
        self, builtin_ids: List[str], shims: List[Shim], rows: List[Dict[str, Any]]
    ) -> Tuple[List[Shim], List[Dict[str, Any]]]:
        """``shims`` and ``rows`` with the registered ones added (read under the registry lock: a
        ``register()`` while the plugins loaded counts)."""
        known = set(builtin_ids) | {s.id for s in shims}
        return (shims + [s for s in self.registered if s.id not in known],
                rows + [dict(r) for r in self.registered_rows])

    def _add(self, shim: Shim) -> None:
        """A registry entry for ``shim``, selected as install() was asked to."""
        selection = self._selection
        why_not = ""
        if selection.get("disable_all"):
            why_not = f"disabled by {selection['disable_all']}"
        elif selection.get("only") is not None and shim.id not in selection["only"]:
            why_not = "not in install(only=...)"
        elif shim.id in selection.get("exclude", ()):
            why_not = "excluded by the user"
        self.registry.add(shim, selected=not why_not, why_not=why_not, forced=shim.id in selection.get("force", ()))

    # -- uninstall / register / reset ---------------------------------------------------------------
    def uninstall(self) -> bool:
        """See :func:`devmap_shims.uninstall`."""
        from devmap_shims.shims import arming, importhook

        registry = self.registry
        with registry.lock:
            if not self.installed:
                return False
            importhook.cancel_before_first_import(self.load_builtins)
            arming.unwatch_and_unwrap(registry)
            self.installed = False
            self._generation += 1
            registry.shims = {}  # drops every shim's context, and so its state
            self.options = {}
            self.imported_before_install = []
        return True

    def register(self, shim: Shim, matrix_rows: Iterable[Dict[str, Any]] = ()) -> None:
        """See :func:`devmap_shims.register`."""
        if not isinstance(shim, Shim):
            raise TypeError(f"register() takes a devmap_shims.Shim, not {type(shim).__name__}")
        registry = self.registry
        with registry.lock:
            if any(s.id == shim.id for s in self.registered) or shim.id in registry.shims:
                raise ValueError(f"a shim with id {shim.id!r} is already registered")
            from devmap_shims.shims import catalog

            if shim.id in catalog.builtin_ids():  # before install() too: it would be dropped there
                raise ValueError(f"{shim.id!r} is the id of a built-in shim; give this shim another id")
            for target in shim.targets:  # here, not when the target is armed in some later import
                shim.wrapper_for(target)
            if shim.source == "builtin":  # Shim()'s default: say where it came from
                shim = shim.replace(source="register()")
            rows = [dict(r, source=r.get("source", f"register({shim.id!r})")) for r in matrix_rows]
            self.registered.append(shim)
            self.registered_rows.extend(rows)
            if self.installed:
                registry.extra_rows = registry.extra_rows + [dict(r) for r in rows]
                registry.reset_knowledge()
                self._add(shim)
                self._watch()

    def reset(self) -> None:
        """Back to a fresh process's state: uninstalled, nothing registered, no warnings, no kill
        switch, not strict. For tests of code that installs shims."""
        with self.registry.lock:
            self.uninstall()
            self.registered.clear()
            self.registered_rows.clear()
            self.registry = Registry()
            self.killed = False
            self._generation += 1

    def status(self) -> Dict[str, Any]:
        """See :func:`devmap_shims.status`."""
        from devmap_shims.shims.status import collect

        self.load_builtins()
        return collect(self)


def _raise_shim_errors(callback: Any, exc: BaseException) -> None:
    """A before-import trigger's error handler: strict mode's ShimError reaches the caller (the
    ``install()``, or the import that fired it), anything else is logged and the import goes on."""
    if isinstance(exc, ShimError):
        raise exc
    logger().warning(
        "loading the built-in shims before the first import of a target library failed (%s: %s); "
        "the import went on without them", type(exc).__name__, exc,
    )


def _id_problems(known: List[str], requested: Dict[str, Any]) -> List[str]:
    """A message for each of install(only/exclude/force=...) that names ids of no shim: one per
    id, or, past a few, one per argument."""
    from devmap_shims.shims.config import SHOWN_NAMES, unknown_ids

    problems = []
    for name in ("only", "exclude", "force"):
        unknown = list(dict.fromkeys(str(i) for i in requested[name] or ()
                                     if i not in known and not (name == "exclude" and i == "*")))
        groups = [unknown] if len(unknown) > SHOWN_NAMES else [[shim_id] for shim_id in unknown]
        problems.extend(unknown_ids(f"install({name}=...)", group, known) for group in groups if group)
    return problems


ENGINE = Engine()


def _after_fork_in_child() -> None:
    """A fork while another thread held one of our locks (an import arming a target, a repair
    keeping state, a plugin loading) would leave it held forever in the child: give the child new
    ones, and the streams of a plugin load that is not there."""
    import sys
    import threading

    from devmap_shims.shims import importhook

    registry = ENGINE.registry
    registry.lock = threading.RLock()
    importhook.reinit_after_fork()
    containment = sys.modules.get("devmap_shims.shims.containment")
    if containment is not None:  # only once the plugins module is imported
        containment.reinit_after_fork()
    for entry in registry.shims.values():
        if entry.shim.state is not None:
            try:
                entry.context.state = entry.shim.state()
            except Exception:  # the shim's first call fails and switches it off, with one warning
                entry.context.state = None


def _register_at_fork() -> None:
    import os

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)


_register_at_fork()
