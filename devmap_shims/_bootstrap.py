"""Auto-enable at interpreter start.

``devmap_shims.pth`` (and, on Python 3.15+, ``devmap_shims.start``) in site-packages call
:func:`run_from_startup` only when ``DEVMAP_SHIMS`` is set to something other than ``0``; with the
variable unset the whole cost is one environment lookup. Nothing here may raise: a failing ``.pth``
line would print a traceback in every Python process on the machine.
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
    # Virtualenvs with a lib64 -> lib symlink make site.py read the same .pth twice: warn once.
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
