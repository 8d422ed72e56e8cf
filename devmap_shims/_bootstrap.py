"""Auto-enable at interpreter start.

``_devmap_shims_start.run`` (a small module at the root of site-packages, called by
``devmap_shims.pth`` when ``DEVMAP_SHIMS`` is set, and by ``devmap_shims.start`` on Python 3.15+)
calls :func:`run_from_startup` when the variable is set to something other than ``0`` or the
empty string. With the variable unset the whole cost is one environment lookup; the ``.pth``
line is kept as short as it can be because ``site`` compiles it at every interpreter start,
twice in a virtualenv.

Nothing here may escape: an exception from a ``.pth`` line prints a traceback in every Python
process on the machine, and ``SystemExit`` or ``KeyboardInterrupt`` would stop the interpreter.
Strict mode (``DEVMAP_SHIMS_STRICT=1``) cannot stop a process from a ``.pth`` line either: at
start-up it means that a problem with the install (an unknown shim id in ``DEVMAP_SHIMS_DISABLE``,
say) is one line on stderr and the process runs without any shim, instead of a warning and the
shims that remain. Either way the line is printed once per process, however often ``site`` calls.

PYTEST_DONT_REWRITE (this module runs before pytest, which must not ask to rewrite it)
"""

from __future__ import annotations

import os

_ran = False


def run_from_startup() -> None:
    global _ran
    if _ran:  # site processes site-packages twice in a virtualenv, and 3.15 has the .start file too
        return
    _ran = True
    value = os.environ.get("DEVMAP_SHIMS", "").strip()
    if value in ("", "0"):
        return
    try:
        from devmap_shims.shims.config import flag

        enabled = flag(value)
        if enabled is False:
            return
        if enabled is None:
            _warn_bad(os.environ.get("DEVMAP_SHIMS", ""))
            return
        from devmap_shims import install

        install(_auto=True)
    except BaseException as exc:  # SystemExit from a plugin, KeyboardInterrupt, strict mode: the same
        strict = " (strict mode)" if _strict() else ""
        _say(
            f"devmap_shims: the shims could not be installed at start-up{strict}: {type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:500]}; this process runs without shims"
        )
        try:
            from devmap_shims import uninstall

            uninstall()
        except BaseException:
            pass


def _strict() -> bool:
    try:
        from devmap_shims.shims.config import flag

        return bool(flag(os.environ.get("DEVMAP_SHIMS_STRICT")))
    except BaseException:
        return False


def _say(line: str) -> None:
    import sys

    if sys.stderr is None:  # no console (pythonw, fd 2 closed): print(file=None) would write to stdout
        return
    try:
        sys.stderr.write(line + "\n")
    except BaseException:
        pass


def _warn_bad(raw: str) -> None:
    """Say once that ``DEVMAP_SHIMS`` is not understood (in the words a program's ``install()``
    would use, which then does not say it again)."""
    import logging

    from devmap_shims.shims import config

    message = config.not_understood(config.ENV_ENABLE, raw)
    logging.getLogger("devmap_shims").warning("%s Running without shims.", message)
    config.LOGGED_AT_START_UP.add(message)
