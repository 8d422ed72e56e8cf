"""``status()``: the registry's state as plain data, stable enough to print as JSON.

Evaluating applicability here may read installed versions and the compat matrix (a few tens of
milliseconds); nothing is imported from the target libraries.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Dict, List

from devmap_shims.shims import registry as reg
from devmap_shims.shims.arming import displaced

SCHEMA_VERSION = 1


def _shim_state(targets: List[Dict[str, Any]]) -> str:
    states = [t["state"] for t in targets]
    for state in (reg.FAILED, reg.ACTIVE, reg.PENDING):
        if state in states:
            return state
    return reg.SKIPPED


def collect(engine: Any) -> Dict[str, Any]:
    """The state of ``engine`` (a :class:`devmap_shims.shims.engine.Engine`) as plain data: a
    :class:`~devmap_shims.shims.summary.Status`, a dict whose ``str()`` is a short summary."""
    from devmap_shims.shims.summary import Status
    from devmap_shims.versions import TARGET_DISTRIBUTIONS

    registry = engine.registry
    with registry.lock:
        shims: List[Dict[str, Any]] = []
        for shim_id, entry in registry.shims.items():
            try:
                applies, why = registry.decide(entry)
                not_present = registry.not_present(entry)
            except Exception as exc:  # a broken matrix must not break status()
                applies, why = False, f"could not evaluate: {type(exc).__name__}: {exc}"
                not_present = None
            targets = []
            for target_entry in entry.targets:
                data = target_entry.as_dict()
                if target_entry.state == reg.PENDING and not_present:  # decided already, armed never
                    data["state"], data["reason"] = reg.SKIPPED, not_present
                elif target_entry.state == reg.ACTIVE:
                    gone = displaced(target_entry)
                    if gone:  # armed, but the name now calls something else: not active for its callers
                        data.update(state=reg.FAILED, reason="replaced after arming", error=gone)
                targets.append(data)
            state = _shim_state(targets)
            shims.append(
                {
                    "id": shim_id,
                    "fixes": list(entry.shim.fixes),
                    "summary": entry.shim.summary,
                    "source": entry.shim.source,
                    "repairs": entry.shim.repairs,
                    "selected": entry.selected,
                    "forced": entry.forced,
                    "applies": applies,
                    "applicability": why,
                    "state": state,
                    "call_failures": entry.call_failures,
                    "targets": targets,
                }
            )
        versions = dict(registry.versions()) if engine.installed else _versions_only()
        return Status({
            "schema_version": SCHEMA_VERSION,
            "installed": engine.installed,
            "strict": registry.strict,
            "killed": engine.killed,
            "auto_enabled": bool(engine.options.get("auto")),
            "environment": {k: v for k, v in os.environ.items() if k.startswith("DEVMAP_SHIMS")},
            "versions": versions,
            "imported_before_install": list(engine.imported_before_install),
            "imported_now": sorted(m for m in TARGET_DISTRIBUTIONS if m in sys.modules),
            "shims": shims,
            "warnings": list(registry.warnings),
        })


def _versions_only() -> Dict[str, Any]:
    from devmap_shims.versions import installed_versions

    return installed_versions()
