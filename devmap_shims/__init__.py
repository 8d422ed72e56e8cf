"""devmap-shims: keep the Hugging Face stack placing tensors on the right GPU.

>>> import devmap_shims
>>> devmap_shims.install()        # before or after importing transformers & co.

``install()`` registers post-import hooks for the modules that define the buggy functions; a shim
is armed when its module is imported *and* the compat matrix says its bug applies to the installed
versions. Nothing here imports torch, transformers, accelerate, bitsandbytes or diffusers.

With no code change: ``DEVMAP_SHIMS=1 python serve.py`` or ``devmap-shims run -- python serve.py``.
"""

from __future__ import annotations

# typing costs ~20 ms to import; annotations are strings here, so it is only needed by type checkers
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, Iterable, List, Optional

from devmap_shims.shims.record import Shim, Target

__version__ = "0.1.0"
__all__ = [
    "Shim",
    "ShimError",
    "Target",
    "check_devices",
    "install",
    "is_installed",
    "register",
    "status",
    "uninstall",
]


def __getattr__(name: str) -> Any:
    if name == "ShimError":
        from devmap_shims.shims.registry import ShimError

        return ShimError
    raise AttributeError(f"module 'devmap_shims' has no attribute {name!r}")


_EXTRA_SHIMS: List[Shim] = []
_EXTRA_ROWS: List[Dict[str, Any]] = []


def _as_tuple(ids: Optional[Iterable[str]]) -> Optional[tuple]:
    if ids is None:
        return None
    if isinstance(ids, str):
        return (ids,)
    return tuple(ids)


def install(
    only: Optional[Iterable[str]] = None,
    exclude: Optional[Iterable[str]] = None,
    force: Optional[Iterable[str]] = None,
    strict: Optional[bool] = None,
    *,
    plugins: Optional[bool] = None,
    _auto: bool = False,
) -> bool:
    """Arm the shims whose bugs apply to the installed versions.

    only:    shim ids to consider (default: all).
    exclude: shim ids to leave off (adds to ``DEVMAP_SHIMS_DISABLE``).
    force:   shim ids to arm even where the matrix says the bug is absent (adds to
             ``DEVMAP_SHIMS_FORCE``).
    strict:  raise :class:`ShimError` when a shim fails instead of logging once and running the
             library unpatched (default: ``DEVMAP_SHIMS_STRICT``).
    plugins: load shims and matrix rows from other distributions' entry points (default: yes
             unless ``DEVMAP_SHIMS_NO_PLUGINS=1``).

    Returns True when the shims are installed after the call. A second call is a no-op.
    ``DEVMAP_SHIMS=0`` in the environment turns every call into a no-op (kill switch).
    Unknown ids give a warning (a ValueError in strict mode).
    """
    from devmap_shims.shims import catalog, config, registry as reg

    settings = config.read_settings()
    _configure_logging(settings.log_level)
    registry = reg.REGISTRY
    strict_mode = settings.strict if strict is None else bool(strict)
    with registry.lock:
        for problem in settings.problems:
            if problem not in registry.warnings:
                registry.warn(problem)
        if settings.killed:
            registry.killed = True
            reg._logger().info("devmap_shims: DEVMAP_SHIMS=0, shims not installed")
            return False
        requested = {
            "only": _as_tuple(only),
            "exclude": _as_tuple(exclude) or (),
            "force": _as_tuple(force) or (),
            "strict": strict_mode,
            "plugins": plugins,
        }
        if registry.installed:
            if not _auto and not registry.options.get("auto") and requested != registry.options.get("requested"):
                registry.warn(
                    "install() was already called with other arguments; call devmap_shims.uninstall() "
                    "first to change them"
                )
            return True
        registry.strict = strict_mode
        use_plugins = (not settings.no_plugins) if plugins is None else bool(plugins)
        shims, problems = catalog.builtin_shims()
        registry.extra_rows = []
        if use_plugins:
            rows, row_problems = catalog.plugin_rows()
            registry.extra_rows = rows
            more, shim_problems = catalog.plugin_shims([s.id for s in shims], [r["id"] for r in rows])
            shims.extend(more)
            problems += row_problems + shim_problems
        registry.extra_rows = registry.extra_rows + [dict(r) for r in _EXTRA_ROWS]
        shims.extend(s for s in _EXTRA_SHIMS if s.id not in {x.id for x in shims})
        problems += config.unknown_id_problems(settings, [s.id for s in shims])
        id_problems = reg.select(
            registry,
            shims,
            only=requested["only"],
            exclude=tuple(requested["exclude"]) + settings.disable,
            force=tuple(requested["force"]) + settings.force,
            disable_all=settings.disable_all,
        )
        if id_problems and strict_mode:
            registry.shims = {}
            raise ValueError("; ".join(id_problems))
        for problem in problems + id_problems:
            registry.warn(problem)
        registry.reset_knowledge()
        registry.options = {"requested": requested, "auto": _auto, "settings": settings.as_dict()}
        registry.imported_before_install = reg.imported_targets(registry)
        registry.installed = True
        registry.killed = False
        reg.watch(registry)
    return True


def uninstall() -> bool:
    """Remove every devmap_shims layer and undo every by-name rebinding.

    Only our own layer is taken off: a wrapper another tool put on top of ours stays, now wrapping
    the original directly. Objects built while the shims were active keep what was done to them.
    Returns False when nothing was installed.
    """
    from devmap_shims.shims import registry as reg

    registry = reg.REGISTRY
    with registry.lock:
        if not registry.installed:
            return False
        reg.unwatch_and_unwrap(registry)
        registry.installed = False
        registry.shims = {}
        registry.options = {}
        registry.imported_before_install = []
    return True


def is_installed() -> bool:
    from devmap_shims.shims import registry as reg

    return reg.REGISTRY.installed


def register(shim: Shim, matrix_rows: Iterable[Dict[str, Any]] = ()) -> None:
    """Add a shim of your own, with the matrix rows it fixes (same fields as ``known_bugs.toml``).

    For shims that do not come from a plugin distribution. If the shims are already installed it is
    armed at once; otherwise at the next ``install()``.
    """
    from devmap_shims.shims import registry as reg

    if not isinstance(shim, Shim):
        raise TypeError(f"register() takes a devmap_shims.Shim, not {type(shim).__name__}")
    registry = reg.REGISTRY
    with registry.lock:
        if any(s.id == shim.id for s in _EXTRA_SHIMS) or shim.id in registry.shims:
            raise ValueError(f"a shim with id {shim.id!r} is already registered")
        _EXTRA_SHIMS.append(shim)
        _EXTRA_ROWS.extend(dict(r, source=r.get("source", f"register({shim.id!r})")) for r in matrix_rows)
        if registry.installed:
            registry.extra_rows = registry.extra_rows + [dict(r) for r in _EXTRA_ROWS if r not in registry.extra_rows]
            registry.reset_knowledge()
            entry = reg.ShimEntry(shim)
            entry.targets = [reg.TargetEntry(entry, t) for t in shim.targets]
            registry.shims[shim.id] = entry
            reg.watch(registry)


def status() -> Dict[str, Any]:
    """The registry's state as plain data (what ``devmap-shims doctor --json`` prints)."""
    from devmap_shims.shims.status import collect

    return collect()


def check_devices(obj: Any) -> List[Dict[str, Any]]:
    """Every tensor of ``obj`` (a model or pipeline) not on the device its module runs on."""
    from devmap_shims.checks import check_devices as _check

    return _check(obj)


def _configure_logging(level: Optional[str]) -> None:
    if not level:
        return
    import logging

    logger = logging.getLogger("devmap_shims")
    logger.setLevel(level.upper())
    if not any(getattr(h, "_devmap_shims", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler._devmap_shims = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
