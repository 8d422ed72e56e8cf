"""Shims and matrix rows from other distributions (entry points).

Plugins register under two entry-point groups:

``devmap_shims.shims``   an object that is a :class:`Shim`, an iterable of them, or a callable
                         returning either;
``devmap_shims.matrix``  matrix rows: a list of row dicts (same fields as ``known_bugs.toml``), a
                         path to a TOML file with ``[[bug]]`` tables, or a callable returning either.

Plugin shim ids and row ids are prefixed with the distribution name (``acme-shims:my-fix``) so they
never collide with built-in ones.

A plugin is somebody else's code running inside every process that enables the shims, so loading
one is contained: each entry point is loaded, its callable called and what it gives read (an
iterable, a TOML file, the shims' attributes) in a thread of its own, given :data:`LOAD_BUDGET`
seconds, with what that thread prints kept out of the host's streams, also after its budget; a plugin
that raises anything (``SystemExit`` and ``KeyboardInterrupt`` included), runs over its budget or
prints is skipped or reported with a warning naming it, and the host goes on. At interpreter
start-up (``DEVMAP_SHIMS=1``) plugins load only when the operator names their distributions in
``DEVMAP_SHIMS_PLUGINS`` (or ``*``). A named distribution that is not on ``sys.path`` then (its
path added by a ``.pth`` file that sorts after ``devmap_shims.pth``, or by the user site) is said
in a warning; ``devmap_shims.install()`` called from the program, after start-up, sees every path.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Set, Tuple

import functools

from devmap_shims.shims.containment import contained
from devmap_shims.shims.record import Shim

SHIM_GROUP = "devmap_shims.shims"
MATRIX_GROUP = "devmap_shims.matrix"

#: Seconds a plugin's entry point may take to load (and its callable to run) before start-up goes
#: on without it.
LOAD_BUDGET = 5.0
#: Seconds all the entry points together may take at one ``install()``: those not loaded by then
#: are skipped, each named in a warning (five hanging plugins do not hold start-up for 25 s).
TOTAL_BUDGET = 10.0


def _group_declared(group: str) -> bool:
    """Whether any installed distribution declares entry points in ``group``.

    A plain scan of ``*.dist-info/entry_points.txt`` on ``sys.path``: importing
    ``importlib.metadata`` costs about 30 ms, more than ``install()``'s whole start-up budget, and
    almost no machine has a devmap_shims plugin.
    """
    import os
    import sys

    from devmap_shims.cache import read_regular_file

    needle = f"[{group}]".encode()
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            # never blocks: an entry_points.txt that is a FIFO (a folder on sys.path, the working
            # directory included, is anybody's) is not read
            text = read_regular_file(os.path.join(entry or ".", name, "entry_points.txt"), 65536, whole=False)
            if text is not None and needle in text:
                return True
    return False


def entry_points(group: str) -> List[Tuple[str, Any]]:
    """``(distribution name, entry point)`` for every entry point in ``group``.

    Read through the distributions rather than ``EntryPoint.dist``, which Python 3.9 lacks: there
    the prefix would be the module's name, and ``DEVMAP_SHIMS_DISABLE=dist:id`` could not match.
    """
    if not _group_declared(group):
        return []
    from importlib import metadata

    found = []
    seen = set()
    from devmap_shims.versions import metadata_readable

    for dist in metadata.distributions():
        if not metadata_readable(dist):  # a FIFO there would block the host
            continue
        try:
            name = dist.metadata["Name"]
            eps = [ep for ep in dist.entry_points if ep.group == group]
        except Exception:  # a broken dist-info must not stop the others
            continue
        for ep in eps:
            if (name, ep.name) not in seen:  # a distribution seen twice on sys.path
                seen.add((name, ep.name))
                found.append((str(name), ep))
    return found


def distributions() -> Set[str]:
    """The distributions that declare shims or matrix rows here."""
    return {dist for group in (SHIM_GROUP, MATRIX_GROUP) for dist, _ in entry_points(group)}


def _prefixed(dist: str, ident: str) -> str:
    return ident if ident.startswith(f"{dist}:") else f"{dist}:{ident}"


def missing(names: Optional[Collection[str]]) -> List[str]:
    """A problem message naming the distributions in ``names`` that declare no plugin here (one
    message, however many)."""
    if not names or "*" in names:
        return []
    from devmap_shims.shims.config import listed

    found = {canonical(dist) for dist in distributions()}
    absent = [name for name in dict.fromkeys(names) if canonical(name) not in found]
    if not absent:
        return []
    which = f"names {listed(absent)}, but no distribution of that name declares" if len(absent) == 1 else (
        f"names {len(absent)} distributions, {listed(absent)}, that declare no"
    )
    return [
        f"DEVMAP_SHIMS_PLUGINS {which} devmap_shims plugins on sys.path at start-up (a path added "
        "later, by a .pth file sorted after devmap_shims.pth or the user site, is not seen then); call "
        "devmap_shims.install() from the program instead"
    ]


def canonical(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503): case, and runs of ``-``, ``_``
    and ``.``, do not count (``Acme_Shims`` is ``acme-shims``, as its dist-info folder spells it).
    ``packaging.utils.canonicalize_name`` says the same, but importing it imports
    ``packaging.tags`` too: about 90 ms at start-up."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def named(dist: str, names: Collection[str]) -> bool:
    """Whether ``names`` (``DEVMAP_SHIMS_PLUGINS``' entries) name ``dist``, spelled any way PEP 503 allows."""
    return canonical(dist) in {canonical(name) for name in names}


def _wanted(dist: str, names: Optional[Collection[str]]) -> bool:
    return names is None or "*" in names or named(dist, names)


def _called(ep: Any, want: Callable[[Any], bool]) -> Any:
    obj = ep.load()
    return obj() if callable(obj) and want(obj) else obj


def deadline() -> float:
    """When the entry points of an ``install()`` starting now must have loaded (:data:`TOTAL_BUDGET`)."""
    import time

    return time.monotonic() + TOTAL_BUDGET


def _budget(until: Optional[float]) -> float:
    """What one entry point may take: :data:`LOAD_BUDGET`, or what is left before ``until``."""
    if until is None:
        return LOAD_BUDGET
    import time

    return min(LOAD_BUDGET, until - time.monotonic())


def _out_of_time(dist: str, kind: str, ep: Any) -> str:
    return (f"plugin {dist}: {kind} entry point {ep.name!r} ({ep.value}) not loaded: the plugins used up "
            f"their {TOTAL_BUDGET:g} s together")


def _error_within(error: Optional[str], budget: float) -> Optional[str]:
    """``error``, said of the overall budget where that, not :data:`LOAD_BUDGET`, was what ran out."""
    if error and error.startswith("still running") and budget < LOAD_BUDGET:
        return (f"still running when the plugins' {TOTAL_BUDGET:g} s together ran out ({budget:.3g} s were "
                "left for it); start-up went on without it")
    return error


def load_all(
    builtin_ids: List[str], names: Optional[Collection[str]] = None
) -> Tuple[List[Dict[str, Any]], List[Shim], List[str]]:
    """The matrix rows and shims of every plugin of the distributions in ``names`` (None: all),
    loaded within one :data:`TOTAL_BUDGET`, and the problems met."""
    until = deadline()
    rows, row_problems = plugin_rows(names, until)
    shims, shim_problems = plugin_shims(builtin_ids, [r["id"] for r in rows], names, until)
    return rows, shims, row_problems + shim_problems


def _each_loaded(
    group: str, kind: str, names: Optional[Collection[str]], until: Optional[float],
    read: Callable[[str, Any], Any], skipped: str, problems: List[str],
) -> Iterator[Tuple[str, Any]]:
    """For each entry point of ``group`` from the distributions in ``names`` (None: all):
    ``read(dist, ep)``, run :func:`contained` within what is left before ``until``, and
    ``(dist, what it gave)``; what went wrong is added to ``problems``, ending with ``skipped``."""
    for dist, ep in entry_points(group):
        if not _wanted(dist, names):
            continue
        budget = _budget(until)
        if budget <= 0:
            problems.append(_out_of_time(dist, kind, ep))
            continue
        loaded, error, output = contained(functools.partial(read, dist, ep), budget)
        error = _error_within(error, budget)
        if output:
            problems.append(f"plugin {dist}: {kind} entry point {ep.name!r} {output}")
        if error is not None:
            problems.append(
                f"plugin {dist}: {kind} entry point {ep.name!r} ({ep.value}) failed to load ({error}); {skipped}"
            )
            continue
        yield dist, loaded


def plugin_rows(
    names: Optional[Collection[str]] = None, until: Optional[float] = None
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Matrix rows from ``devmap_shims.matrix`` entry points (ids prefixed), from the distributions
    in ``names`` (None: all), loaded before ``until`` (:func:`deadline`; None: no overall limit)."""

    def read(dist: str, ep: Any) -> List[Dict[str, Any]]:
        # all of the plugin's code runs here, in the contained thread: its callable, and the
        # iterable or the TOML file it gives (a generator that never ends, a FIFO)
        obj = _called(ep, lambda obj: True)
        loaded = []
        for row in _read_toml_rows(obj) if isinstance(obj, str) else obj:
            row = dict(row)
            row["id"] = _prefixed(dist, str(row.get("id", "")))
            row.setdefault("source", f"plugin {dist} ({ep.value})")
            loaded.append(row)
        return loaded

    rows: List[Dict[str, Any]] = []
    problems: List[str] = []
    skipped = "its rows are ignored"
    for _dist, loaded in _each_loaded(MATRIX_GROUP, "matrix", names, until, read, skipped, problems):
        rows.extend(loaded)
    return rows, problems


def _read_toml_rows(path: str) -> List[Dict[str, Any]]:
    from devmap_shims.cache import read_regular_file
    from devmap_shims.compat_matrix import read_toml

    data = read_regular_file(path, 1 << 20)
    if data is None:
        raise ValueError(f"{path!r:.200} is not a regular file of at most 1 MiB")
    return list(read_toml(data, path).get("bug", []))


def plugin_shims(
    builtin_ids: List[str],
    plugin_row_ids: List[str],
    names: Optional[Collection[str]] = None,
    until: Optional[float] = None,
) -> Tuple[List[Shim], List[str]]:
    """Shims from ``devmap_shims.shims`` entry points, ids (and their own row ids) prefixed, from the
    distributions in ``names`` (None: all), loaded before ``until`` (as :func:`plugin_rows`)."""

    def read(dist: str, ep: Any) -> Tuple[List[Tuple[str, Shim]], List[str]]:
        # in the contained thread: the plugin's callable, its iterable, and every attribute of
        # the shims it gives (a property is the plugin's code too); what leaves is plain Shims
        obj = _called(ep, lambda obj: not isinstance(obj, Shim))
        found: List[Tuple[str, Shim]] = []
        wrong: List[str] = []
        for shim in [obj] if isinstance(obj, Shim) else list(obj):
            if not isinstance(shim, Shim):
                wrong.append(
                    f"plugin {dist}: entry point {ep.name!r} gave {shim!r:.100}, not a devmap_shims Shim; skipped"
                )
                continue
            fixes = tuple(
                _prefixed(dist, bug) if _prefixed(dist, bug) in plugin_row_ids else bug for bug in shim.fixes
            )
            own_id = str(shim.id)
            plain = shim.replace(id=_prefixed(dist, own_id), fixes=fixes, source=f"plugin {dist}")
            found.append((own_id, plain))
        return found, wrong

    shims: List[Shim] = []
    problems: List[str] = []
    seen = set(builtin_ids)
    skipped = "it is skipped"
    for dist, (found, wrong) in _each_loaded(SHIM_GROUP, "shim", names, until, read, skipped, problems):
        problems.extend(wrong)
        for own_id, shim in found:
            if own_id in builtin_ids:
                problems.append(
                    f"plugin {dist}: shim id {own_id!r} is the id of a built-in shim; it is registered "
                    f"as {shim.id!r} and the built-in one is unchanged"
                )
            if shim.id in seen:
                problems.append(
                    f"plugin {dist}: shim id {shim.id!r} is declared twice; the second one is skipped"
                )
                continue
            seen.add(shim.id)
            shims.append(shim)
    return shims, problems
