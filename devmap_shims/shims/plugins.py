"""Shims and matrix rows from other distributions (entry points).

Plugins register under two entry-point groups:

``devmap_shims.shims``   an object that is a :class:`Shim`, an iterable of them, or a callable
                         returning either;
``devmap_shims.matrix``  matrix rows: a list of row dicts (same fields as ``known_bugs.toml``), a
                         path to a TOML file with ``[[bug]]`` tables, or a callable returning either.

Plugin shim ids and row ids are prefixed with the distribution name (``acme-shims:my-fix``) so they
never collide with built-in ones. A plugin that fails to load is skipped with a warning.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Dict, List, Tuple

from devmap_shims.shims.record import Shim

SHIM_GROUP = "devmap_shims.shims"
MATRIX_GROUP = "devmap_shims.matrix"


def _group_declared(group: str) -> bool:
    """Whether any installed distribution declares entry points in ``group``.

    A plain scan of ``*.dist-info/entry_points.txt`` on ``sys.path``: importing
    ``importlib.metadata`` costs about 30 ms, more than ``install()``'s whole start-up budget, and
    almost no machine has a devmap_shims plugin.
    """
    import os
    import sys

    needle = f"[{group}]"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            try:
                with open(os.path.join(entry or ".", name, "entry_points.txt"), encoding="utf-8") as handle:
                    if needle in handle.read():
                        return True
            except OSError:
                continue
    return False


def _entry_points(group: str) -> List[Any]:
    if not _group_declared(group):
        return []
    from importlib import metadata

    try:
        return list(metadata.entry_points(group=group))
    except TypeError:  # Python 3.9
        return list(metadata.entry_points().get(group, ()))


def _dist_name(entry_point: Any) -> str:
    dist = getattr(entry_point, "dist", None)
    name = getattr(dist, "name", None) or getattr(entry_point, "module", "plugin").split(".")[0]
    return str(name)


def _prefixed(dist: str, ident: str) -> str:
    return ident if ident.startswith(f"{dist}:") else f"{dist}:{ident}"


def plugin_rows() -> Tuple[List[Dict[str, Any]], List[str]]:
    """Matrix rows from ``devmap_shims.matrix`` entry points (ids prefixed)."""
    rows: List[Dict[str, Any]] = []
    problems: List[str] = []
    for ep in _entry_points(MATRIX_GROUP):
        dist = _dist_name(ep)
        try:
            obj = ep.load()
            if callable(obj):
                obj = obj()
            if isinstance(obj, str):
                obj = _read_toml_rows(obj)
            for row in obj:
                row = dict(row)
                row["id"] = _prefixed(dist, str(row.get("id", "")))
                row.setdefault("source", f"plugin {dist} ({ep.value})")
                rows.append(row)
        except Exception as exc:
            problems.append(
                f"plugin {dist}: matrix entry point {ep.name!r} ({ep.value}) failed to load "
                f"({type(exc).__name__}: {exc}); its rows are ignored"
            )
    return rows, problems


def _read_toml_rows(path: str) -> List[Dict[str, Any]]:
    from devmap_shims.compat_matrix import read_toml

    with open(path, "rb") as handle:
        return list(read_toml(handle.read(), path).get("bug", []))


def plugin_shims(builtin_ids: List[str], plugin_row_ids: List[str]) -> Tuple[List[Shim], List[str]]:
    """Shims from ``devmap_shims.shims`` entry points, ids (and their own row ids) prefixed."""
    shims: List[Shim] = []
    problems: List[str] = []
    seen = set(builtin_ids)
    for ep in _entry_points(SHIM_GROUP):
        dist = _dist_name(ep)
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, Shim):
                obj = obj()
            declared = [obj] if isinstance(obj, Shim) else list(obj)
        except Exception as exc:
            problems.append(
                f"plugin {dist}: shim entry point {ep.name!r} ({ep.value}) failed to load "
                f"({type(exc).__name__}: {exc}); it is skipped"
            )
            continue
        for shim in declared:
            if not isinstance(shim, Shim):
                problems.append(f"plugin {dist}: entry point {ep.name!r} gave {shim!r}, not a devmap_shims Shim; skipped")
                continue
            new_id = _prefixed(dist, shim.id)
            if shim.id in builtin_ids:
                problems.append(
                    f"plugin {dist}: shim id {shim.id!r} is the id of a built-in shim; it is registered "
                    f"as {new_id!r} and the built-in one is unchanged"
                )
            if new_id in seen:
                problems.append(f"plugin {dist}: shim id {new_id!r} is declared twice; the second one is skipped")
                continue
            seen.add(new_id)
            fixes = tuple(
                _prefixed(dist, bug) if _prefixed(dist, bug) in plugin_row_ids else bug for bug in shim.fixes
            )
            shims.append(shim.replace(id=new_id, fixes=fixes, source=f"plugin {dist}"))
    return shims, problems
