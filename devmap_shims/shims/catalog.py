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
#: The line of a shim module's docstring after which scripts/regenerate.py writes the rows it fixes.
ROWS_HEADING = "Rows (generated from known_bugs.toml by scripts/regenerate.py):"


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
            rows = rows_in_source(module_name)
            fixes = f" (so nothing fixes {', '.join(rows)})" if rows else ""
            error = f"{type(exc).__name__}: {exc}"
            problems.append(f"built-in shim module {module_name} failed to import: {error}{fixes}")
            continue
        shim = getattr(module, "SHIM", None)
        if isinstance(shim, Shim):
            shims.append(shim)
        else:
            problems.append(f"built-in shim module {module_name} declares no SHIM")
    return shims, problems


def rows_in_source(module_name: str) -> List[str]:
    """The rows a built-in shim module fixes, as its docstring lists them under :data:`ROWS_HEADING`,
    read from its file without importing it (for a module that fails to import); [] when the file
    or the heading cannot be read."""
    parts = module_name[len(HOOKS_PACKAGE) + 1:].split(".")
    base = os.path.join(HOOKS_DIR, *parts)
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        try:
            with open(path, encoding="utf-8") as source:
                lines = source.read().splitlines()
        except (OSError, ValueError):
            continue
        rows: List[str] = []
        listing = False
        for line in lines:
            if listing and line.strip() == '"""':
                return rows
            if listing and line.startswith("    ") and not line.startswith("     "):
                rows.append(line.strip())
            listing = listing or line.strip() == ROWS_HEADING
        return []
    return []


def shim_of_rows(shims: Iterable[Shim]) -> Dict[str, str]:
    """Row id -> id of the (first) shim that fixes it: the direction the rows do not store."""
    found: Dict[str, str] = {}
    for shim in shims:
        for bug_id in shim.fixes:
            found.setdefault(bug_id, shim.id)
    return found


def armed_here(shim: Shim, applies: bool) -> Tuple[bool, str, str]:
    """Would ``install()`` arm ``shim`` in this environment? ``(armed, why, switch)``: ``why`` says
    what decides it (the switches ``DEVMAP_SHIMS=0``, ``DEVMAP_SHIMS_DISABLE`` and
    ``DEVMAP_SHIMS_FORCE``; ``applies``, whether a row it fixes (or warns about) applies here; the
    versions its targets are limited to), and ``switch`` names the variable that keeps it off, or
    is empty.
    ``plan`` and ``explain`` ask; ``install()`` itself decides target by target as it arms."""
    from devmap_shims.shims.config import read_settings
    from devmap_shims.versions import installed_versions, satisfies

    settings = read_settings()
    off = settings.switched_off(shim.id)
    if off:
        return False, f"{off} switches it off", off
    limits = [t.when for t in shim.targets if t.when]
    if limits and len(limits) == len(shim.targets):  # every target limited to some versions
        versions = installed_versions(sorted({d for when in limits for d in when}))
        outside = [satisfies(versions, when) for when in limits]
        if not any(ok for ok, _why in outside):
            return False, f"its targets are for other versions: {outside[0][1]}", ""
    forced = f"DEVMAP_SHIMS_FORCE={shim.id}"
    if shim.id in settings.force:
        return True, f"{forced} arms it{'' if applies else ' though none of its rows applies'}", ""
    if not applies:
        return False, f"none of its rows applies to the installed versions ({forced} arms it anyway)", ""
    return True, f"a row it {'fixes' if shim.repairs else 'warns about'} applies", ""
