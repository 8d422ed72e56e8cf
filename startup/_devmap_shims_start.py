"""Interpreter start-up entry of devmap-shims, installed at the root of site-packages.

Importing this module runs :func:`run`. ``devmap_shims.pth`` imports it only when
``DEVMAP_SHIMS`` is set (the shortest line ``site`` can compile at every start; ``0`` and the
empty string are left to :func:`run`, which costs this small import, not the package's);
Python 3.15+ (PEP 829) ignores that line because ``devmap_shims.start`` exists, and imports this
module and calls :func:`run` at every start instead. Living outside the package, it costs one
small import there, not an import of ``devmap_shims``; with the variable unset, empty or ``0``,
:func:`run` returns after one environment lookup. A second call is a no-op. Nothing raised
here, ``SystemExit`` included, may reach ``site``.

PYTEST_DONT_REWRITE (imported before pytest starts, which must not ask to rewrite it)
"""

import os

_RAN = []  # not empty once run() has run: importing it and calling it (3.15+) is one run


def run():
    value = os.environ.get("DEVMAP_SHIMS", "0")
    if value in ("", "0") or _RAN:
        return
    _RAN.append(True)
    try:
        from devmap_shims._bootstrap import run_from_startup
    except BaseException as exc:  # a half-removed install must not break every interpreter start
        import sys

        if sys.stderr is not None:  # no console (pythonw, fd 2 closed): print() would pick stdout
            try:
                sys.stderr.write(f"devmap_shims: DEVMAP_SHIMS={value[:100]!r} but devmap_shims cannot be "
                                 f"imported ({exc}); running without shims\n")
            except BaseException:
                pass
        return
    try:
        run_from_startup()
    except BaseException:  # run_from_startup catches everything; this only guards the guard
        pass


run()
