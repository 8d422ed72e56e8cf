"""devmap-shims: keep the Hugging Face stack placing tensors on the right GPU.

>>> import devmap_shims
>>> devmap_shims.install()        # before or after importing transformers & co.

``install()`` registers post-import hooks for the modules that define the buggy functions; a shim
is armed when its module is imported *and* the compat matrix says its bug applies to the installed
versions. Nothing here imports torch, transformers, accelerate, bitsandbytes or diffusers.

With no code change: ``DEVMAP_SHIMS=1 python serve.py`` or ``devmap-shims run -- python serve.py``.

PYTEST_DONT_REWRITE (with DEVMAP_SHIMS=1 this package is imported before pytest starts)
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
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


def _engine() -> Any:
    from devmap_shims.shims.engine import ENGINE

    return ENGINE


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

    only:    shim ids to consider (default: all). Ids come as a list of strings or as one string
             separated by commas, as the variables take them.
    exclude: shim ids to leave off (adds to ``DEVMAP_SHIMS_DISABLE``); ``"*"``: every one.
    force:   shim ids to arm even where the matrix says the bug is absent (adds to
             ``DEVMAP_SHIMS_FORCE``).
    strict:  raise :class:`ShimError` when a shim fails instead of logging once and running the
             library unpatched (default: ``DEVMAP_SHIMS_STRICT``).
    plugins: load shims and matrix rows from other distributions' entry points (default: yes
             unless ``DEVMAP_SHIMS_NO_PLUGINS=1``).

    ``strict`` and ``plugins`` take a bool or the variables' words (``"false"``, ``"on"``...);
    an argument of another type raises TypeError naming it.

    Returns True when the shims are installed after the call. A second call is a no-op (with a
    warning when its arguments differ: ``uninstall()`` first), except after the start-up install
    of ``DEVMAP_SHIMS=1``: the program's own call replaces that one when it asks for other
    arguments or loads plugins start-up left out (an INFO line says what changed).
    ``DEVMAP_SHIMS=0`` in the environment turns every call into a no-op (kill switch).
    Unknown ids give a warning (a ValueError in strict mode).
    """
    return _engine().install(only, exclude, force, strict, plugins=plugins, auto=_auto)


def uninstall() -> bool:
    """Remove every devmap_shims layer and undo every by-name rebinding.

    Only our own layer is taken off: a wrapper another tool put on top of ours stays, now wrapping
    the original directly. Objects built while the shims were active keep what was done to them.
    Every shim's own state is dropped. Returns False when nothing was installed.
    """
    return _engine().uninstall()


def is_installed() -> bool:
    return bool(_engine().installed)


def register(shim: Shim, matrix_rows: Iterable[Dict[str, Any]] = ()) -> None:
    """Add a shim of your own, with the matrix rows it fixes (same fields as ``known_bugs.toml``).

    For shims that do not come from a plugin distribution. If the shims are already installed it is
    armed at once; otherwise at the next ``install()``.
    """
    _engine().register(shim, matrix_rows)


def status() -> Dict[str, Any]:
    """The registry's state as plain data, the part of ``devmap-shims doctor --json`` that doctor
    reads from it (doctor installs first; before ``install()`` the list of shims is empty)."""
    return _engine().status()


def check_devices(obj: Any) -> List[Dict[str, Any]]:
    """Every tensor of ``obj`` (a model or pipeline) not on the device its module runs on."""
    from devmap_shims.checks import check_devices as _check

    return _check(obj)
