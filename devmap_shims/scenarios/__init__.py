"""Replayable bug scenarios: the user code of each compat-matrix row, run on simulated GPUs.

A scenario is a function that does what the user in the upstream report did (load, move,
generate ...) on the simulated multi-GPU machine and either returns a one-line summary of what
happened ("spread over cuda:0-3; tokens equal to CPU") or raises when the bug shows (the real
error, or :class:`BugObserved` describing a bad placement). It lives in its shim's module, under
``@scenario(row id, title)``. The same scenarios drive the test-suite (inside a row's range the
scenario fails without its shim and passes with it; outside, it passes and the shim stays off)
and ``devmap-shims demo``; :mod:`devmap_shims.scenarios.replay` runs them.

Importing this package is cheap (the shims' modules import it at start-up): nothing here imports
torch, typing or the target libraries.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Callable, Dict, List, Tuple


class BugObserved(AssertionError):
    """The scenario ran to the end but the outcome is the bug (a collapsed map, a stray tensor ...)."""


class ScenarioUnavailable(Exception):
    """The scenario cannot run on this stack (a library or class it needs is absent); says why."""


class Scenario:
    __slots__ = ("bug_id", "title", "func", "needs")

    def __init__(self, bug_id: str, title: str, func: Callable[[], str], needs: Tuple[str, ...]) -> None:
        self.bug_id = bug_id
        self.title = title
        self.func = func
        self.needs = needs

    @property
    def name(self) -> str:
        return self.func.__name__

    def __repr__(self) -> str:
        return f"Scenario({self.bug_id!r}, {self.name!r})"


_SCENARIOS: Dict[str, List[Scenario]] = {}


def scenario(bug_id: str, title: str, needs: Tuple[str, ...] = ("torch",)) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Register the decorated function as a scenario for matrix row ``bug_id``.

    ``needs`` names the distributions it imports; it is reported unavailable where one is missing.
    """

    def register(func: Callable[[], str]) -> Callable[[], str]:
        found = _SCENARIOS.setdefault(bug_id, [])
        if not any(s.func.__qualname__ == func.__qualname__ and s.func.__module__ == func.__module__ for s in found):
            found.append(Scenario(bug_id, title, func, tuple(needs)))
        return func

    return register


def import_before_simulation(*names: str) -> None:
    """Import the libraries before a simulation starts (bitsandbytes probes CUDA, and triton, when
    first imported, which must see the real machine); ScenarioUnavailable when one cannot be."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ScenarioUnavailable(f"{name} cannot be imported here ({exc})") from exc


def unavailable_where(row_id: str) -> None:
    """ScenarioUnavailable when matrix row ``row_id`` applies to the installed versions: another bug
    on the same path fails first there, so this scenario proves nothing about its own row."""
    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.versions import installed_versions

    matrix = load_matrix()
    if matrix.get(row_id).applies(installed_versions(matrix.distributions())):
        raise ScenarioUnavailable(f"this stack fails first on {row_id} (see `devmap-shims explain {row_id}`)")


def all_scenarios() -> Dict[str, List[Scenario]]:
    """Every registered scenario by row id: the built-in shims' modules are imported (not the
    target libraries), and so are plugin modules that were imported before."""
    from devmap_shims.shims.catalog import builtin_shims

    builtin_shims()
    return {bug_id: list(items) for bug_id, items in _SCENARIOS.items()}


__all__ = [
    "BugObserved", "Scenario", "ScenarioUnavailable", "all_scenarios", "import_before_simulation", "scenario",
    "unavailable_where",
]
