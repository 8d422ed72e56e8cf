"""Replayable bug scenarios: the user code of each compat-matrix row, run on simulated GPUs.

A scenario is a function that does what the user in the upstream report did (load, move,
generate ...) on the simulated multi-GPU machine and either returns a one-line summary of what
happened ("spread over cuda:0-3; tokens equal to CPU") or raises when the bug shows (the real
error, or :class:`BugObserved` describing a bad placement). The same scenarios drive the test-suite
(each row with a shim must fail without it and pass with it where the matrix says the bug applies,
and pass with the shim staying off elsewhere) and ``devmap-shims demo``.

Scenario modules (one per hooked area, like ``devmap_shims.hooks``) register with
:func:`scenario`; nothing here imports torch until a scenario runs.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

#: One module per hooked area; each registers its scenarios with @scenario when imported.
SCENARIO_MODULES = (
    "devmap_shims.scenarios.device_map",
    "devmap_shims.scenarios.quant_state",
    "devmap_shims.scenarios.generate",
    "devmap_shims.scenarios.dispatch",
    "devmap_shims.scenarios.launcher",
)


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

    def __repr__(self) -> str:
        return f"Scenario({self.bug_id!r})"


class Outcome:
    """What one replay gave: ``ok`` (no bug seen), the summary or the error, and the time taken."""

    __slots__ = ("ok", "detail", "seconds", "unavailable", "shim_states")

    def __init__(self, ok: bool, detail: str, seconds: float, unavailable: bool = False) -> None:
        self.ok = ok
        self.detail = detail
        self.seconds = seconds
        self.unavailable = unavailable
        #: state of each target of the shim right after the run ("active", "skipped" ...)
        self.shim_states: List[str] = []

    @property
    def shim_active(self) -> bool:
        return "active" in self.shim_states

    def as_dict(self) -> Dict[str, Any]:
        return {
            "ok": self.ok,
            "detail": self.detail,
            "seconds": round(self.seconds, 3),
            "unavailable": self.unavailable,
            "shim_states": list(self.shim_states),
        }

    def __repr__(self) -> str:
        return f"Outcome(ok={self.ok}, detail={self.detail!r})"


_SCENARIOS: Dict[str, List[Scenario]] = {}


def scenario(bug_id: str, title: str, needs: Tuple[str, ...] = ("torch",)) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Register the decorated function as a scenario for matrix row ``bug_id``.

    ``needs`` names the distributions it imports; it is reported unavailable where one is missing.
    """

    def register(func: Callable[[], str]) -> Callable[[], str]:
        _SCENARIOS.setdefault(bug_id, []).append(Scenario(bug_id, title, func, tuple(needs)))
        return func

    return register


# -- tiny checkpoints the scenarios share, built once per process -------------------------------
_ONCE: Dict[Any, Any] = {}


def scratch_dir(prefix: str) -> str:
    """A fresh temporary folder ``devmap-shims-<prefix>-*`` for checkpoints a scenario writes,
    removed when the process that made it exits (not when a forked child of it does), so that
    ``demo`` and test runs leave nothing behind in the temporary directory."""
    import atexit
    import os
    import tempfile

    folder = tempfile.mkdtemp(prefix=f"devmap-shims-{prefix}-")
    atexit.register(_remove_scratch, folder, os.getpid())
    return folder


def _remove_scratch(folder: str, owner: int) -> None:
    import os
    import shutil

    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


def tiny_checkpoint(arch: str, prefix: str, **overrides: Any) -> str:
    """A tiny ``arch`` checkpoint (safetensors) written to a fresh temporary folder once per
    process and set of ``overrides`` (``save_tiny_causal_lm`` arguments)."""
    import os

    key = ("checkpoint", arch, tuple(sorted(overrides.items(), key=lambda item: item[0])))
    path = _ONCE.get(key)
    if path is None or not os.path.isdir(path):
        from devmap_shims.testing.models import save_tiny_causal_lm

        folder = os.path.join(scratch_dir(prefix), arch)
        path = _ONCE[key] = str(save_tiny_causal_lm(arch, folder, **overrides))
    return path


def cpu_greedy_tokens(path: str, new_tokens: int, **load_kwargs: Any) -> Any:
    """Greedy tokens of the checkpoint at ``path`` on the CPU, for the sample prompt (once per process)."""
    key = ("tokens", path, new_tokens, tuple(sorted(load_kwargs.items(), key=lambda item: item[0])))
    if key not in _ONCE:
        from transformers import AutoModelForCausalLM

        from devmap_shims.testing.models import greedy_generate, sample_input_ids

        model = AutoModelForCausalLM.from_pretrained(path, **load_kwargs)
        _ONCE[key] = greedy_generate(model, sample_input_ids(), max_new_tokens=new_tokens)
    return _ONCE[key]


def load_all() -> Dict[str, List[Scenario]]:
    """Every registered scenario by bug id (imports the scenario modules, not the target libraries)."""
    for name in SCENARIO_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    return dict(_SCENARIOS)


def scenarios_for(bug_id: str) -> List[Scenario]:
    return list(load_all().get(bug_id, []))


def replay(item: Scenario, *, shims: bool, shim_id: Optional[str] = None) -> Outcome:
    """Run ``item`` once, with the shims installed (``only=[shim_id]`` when given) or with none.

    The matrix decides whether the shim arms, exactly as in production: no ``force``.
    """
    from devmap_shims.versions import installed_version

    missing = [d for d in item.needs if installed_version(d) is None]
    if missing:
        return Outcome(True, f"needs {', '.join(missing)}, not installed", 0.0, unavailable=True)
    import devmap_shims

    devmap_shims.uninstall()
    if shims:
        devmap_shims.install(only=[shim_id] if shim_id else None)
    start = time.perf_counter()
    try:
        detail = item.func()
        outcome = Outcome(True, str(detail or "ok"), time.perf_counter() - start)
    except ScenarioUnavailable as exc:
        outcome = Outcome(True, str(exc), time.perf_counter() - start, unavailable=True)
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        outcome = Outcome(False, f"{type(exc).__name__}: {message}"[:400], time.perf_counter() - start)
    try:
        if shims:
            outcome.shim_states = [
                target["state"]
                for shim in devmap_shims.status()["shims"]
                if shim_id is None or shim["id"] == shim_id
                for target in shim["targets"]
            ]
    finally:
        devmap_shims.uninstall()
    return outcome
