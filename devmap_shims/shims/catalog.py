"""The built-in shims: one module per shim, found by listing ``devmap_shims/hooks/<library>/``.

There is no hand-kept list: a module (or a package) in a library folder whose name does not start
with ``_`` is a shim module and declares ``SHIM``, a :class:`Shim` whose id is the module name
with ``-`` for ``_`` (``hooks/bitsandbytes/quant_state_follows_weight.py`` declares
``quant-state-follows-weight``). Adding a shim is adding its module (and its matrix row).
Modules starting with ``_`` hold helpers the shims of that folder share.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Dict, Iterable, List, Tuple

from devmap_shims.shims.record import Shim

HOOKS_PACKAGE = "devmap_shims.hooks"
HOOKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hooks")


def _listing(folder: str) -> List[str]:
    try:
        return sorted(name for name in os.listdir(folder) if not name.startswith(("_", ".")))
    except OSError:
        return []


def libraries() -> List[str]:
    """The library folders under ``hooks/`` (each named after the library whose bugs it fixes)."""
    return [name for name in _listing(HOOKS_DIR) if os.path.isfile(os.path.join(HOOKS_DIR, name, "__init__.py"))]


def builtin_modules() -> List[str]:
    """Dotted names of the shim modules, library folder by library folder, in name order."""
    modules = []
    for library in libraries():
        folder = os.path.join(HOOKS_DIR, library)
        for name in _listing(folder):
            if name.endswith(".py"):
                modules.append(f"{HOOKS_PACKAGE}.{library}.{name[:-3]}")
            elif os.path.isfile(os.path.join(folder, name, "__init__.py")):
                modules.append(f"{HOOKS_PACKAGE}.{library}.{name}")
    return modules


def builtin_ids() -> Dict[str, str]:
    """Shim id -> module name of the built-in shims, from the file names alone (nothing imported)."""
    return {name.rpartition(".")[2].replace("_", "-"): name for name in builtin_modules()}


def builtin_shims() -> Tuple[List[Shim], List[str]]:
    """The shims the built-in modules declare, and problems met while importing them."""
    import importlib

    shims: List[Shim] = []
    problems: List[str] = []
    for module_name in builtin_modules():
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            problems.append(f"built-in shim module {module_name} failed to import: {type(exc).__name__}: {exc}")
            continue
        shim = getattr(module, "SHIM", None)
        if isinstance(shim, Shim):
            shims.append(shim)
        else:
            problems.append(f"built-in shim module {module_name} declares no SHIM")
    return shims, problems


def shim_of_rows(shims: Iterable[Shim]) -> Dict[str, str]:
    """Row id -> id of the (first) shim that fixes it: the direction the rows do not store."""
    found: Dict[str, str] = {}
    for shim in shims:
        for bug_id in shim.fixes:
            found.setdefault(bug_id, shim.id)
    return found
