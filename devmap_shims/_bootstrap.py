"""Auto-enable at interpreter start.

``_devmap_shims_start.run`` (a small module at the root of site-packages, called by
``devmap_shims.pth`` when ``DEVMAP_SHIMS`` is set, and by ``devmap_shims.start`` on Python 3.15+)
calls :func:`run_from_startup` when the variable is set to something other than ``0`` or the
empty string. With the variable unset the whole cost is one environment lookup; the ``.pth``
line is kept as short as it can be because ``site`` compiles it at every interpreter start,
twice in a virtualenv. Nothing here may raise: a failing ``.pth`` line would print a traceback
in every Python process on the machine.
"""

from __future__ import annotations

import os


def run_from_startup() -> None:
    value = os.environ.get("DEVMAP_SHIMS", "").strip()
    if value in ("", "0"):
        return
    from devmap_shims.shims.config import flag

    try:
        enabled = flag(value)
        if enabled is False:
            return
        if enabled is None:
            _warn_bad(value)
            return
        from devmap_shims import install

        install(_auto=True)
    except Exception as exc:  # pragma: no cover - last resort, keep the interpreter alive
        if flag(os.environ.get("DEVMAP_SHIMS_STRICT")):
            raise
        import sys

        print(f"devmap_shims: auto-enable failed ({type(exc).__name__}: {exc}); running without shims", file=sys.stderr)


_warned = False


def _warn_bad(value: str) -> None:
    # Once per process, whoever calls first (the .pth import, a .start entry, a test).
    global _warned
    if _warned:
        return
    _warned = True
    import logging

    logging.getLogger("devmap_shims").warning(
        "devmap_shims: DEVMAP_SHIMS=%r is not understood; use 1 to install the shims at start-up or 0 "
        "to turn them off. Running without shims.",
        value,
    )
