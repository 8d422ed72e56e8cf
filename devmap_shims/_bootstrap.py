"""Auto-enable at interpreter start.

``devmap_shims.pth`` in site-packages reads ``DEVMAP_SHIMS`` and, only when it is set to something
other than ``0`` or the empty string, imports :mod:`devmap_shims._autostart`, which calls
:func:`run_from_startup` (on Python 3.15+, ``devmap_shims.start`` names it directly). With the
variable unset the whole cost is one environment lookup. The line is kept as short as it can be:
``site`` compiles it at every interpreter start, twice in a 3.11 virtualenv. Nothing here may
raise: a failing ``.pth`` line would print a traceback in every Python process on the machine.
"""

from __future__ import annotations

import os


def run_from_startup() -> None:
    value = os.environ.get("DEVMAP_SHIMS", "").strip()
    if value in ("", "0"):
        return
    try:
        from devmap_shims.shims.config import FALSE, TRUE

        if value.lower() in FALSE:
            return
        if value.lower() not in TRUE:
            _warn_bad(value)
            return
        from devmap_shims import install

        install(_auto=True)
    except Exception as exc:  # pragma: no cover - last resort, keep the interpreter alive
        if os.environ.get("DEVMAP_SHIMS_STRICT", "").strip().lower() in ("1", "true", "yes", "on"):
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
