"""Running a scenario once, without the shims or with them, as production would."""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Optional

from devmap_shims.scenarios import Scenario, ScenarioUnavailable


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


def replay(item: Scenario, *, shims: bool, shim_id: Optional[str] = None) -> Outcome:
    """Run ``item`` once, with the shims installed (``only=[shim_id]`` when given) or with none.

    The matrix decides whether the shim arms, exactly as in production: no ``force``.
    """
    from devmap_shims.shims.engine import ENGINE
    from devmap_shims.versions import installed_version

    missing = [d for d in item.needs if installed_version(d) is None]
    if missing:
        return Outcome(True, f"needs {', '.join(missing)}, not installed", 0.0, unavailable=True)
    ENGINE.uninstall()
    if shims:
        ENGINE.install(only=[shim_id] if shim_id else None)
    start = time.perf_counter()
    try:
        detail = item.func()
        outcome = Outcome(True, str(detail or "ok"), time.perf_counter() - start)
    except ScenarioUnavailable as exc:
        outcome = Outcome(True, str(exc), time.perf_counter() - start, unavailable=True)
    except Exception as exc:
        if _model_missing(exc):  # e.g. Llama on transformers 4.27: the scenario cannot run here
            outcome = Outcome(True, str(exc), time.perf_counter() - start, unavailable=True)
        else:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            outcome = Outcome(False, f"{type(exc).__name__}: {message}"[:400], time.perf_counter() - start)
    try:
        if shims:
            outcome.shim_states = [
                target["state"]
                for shim in ENGINE.status()["shims"]
                if shim_id is None or shim["id"] == shim_id
                for target in shim["targets"]
            ]
    finally:
        ENGINE.uninstall()
    return outcome


def _model_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says the installed transformers cannot build the scenario's model (the
    tiny-model builder is loaded when it raised that; nothing is imported here)."""
    builder = sys.modules.get("devmap_shims.testing.models.causal_lm")
    return builder is not None and isinstance(exc, builder.UnsupportedArchError)
