"""Imported by ``devmap_shims.pth`` at interpreter start when ``DEVMAP_SHIMS`` is set and not ``0``.

Importing this module is the action. Python 3.11 reads every ``.pth`` file of a virtualenv twice
(once from ``site.venv()``, once from ``site.main()``); the import system runs a module body once,
so the shims are installed once however often the line runs.
"""

from devmap_shims._bootstrap import run_from_startup

run_from_startup()
