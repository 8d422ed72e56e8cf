"""``status()``: the registry's state as plain data, stable enough to print as JSON.

Evaluating applicability here may read installed versions and the compat matrix (a few tens of
milliseconds); nothing is imported from the target libraries.
"""

from __future__ import annotations

import os
import sys
# typing costs ~20 ms to import; annotations are strings here, so it is only needed by type checkers
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List

from devmap_shims.shims import registry as reg

SCHEMA_VERSION = 1


def _shim_state(entry: reg.ShimEntry) -> str:
    states = [t.state for t in entry.targets]
    for state in (reg.FAILED, reg.ACTIVE, reg.PENDING):
        if state in states:
            return state
    return reg.SKIPPED


def collect() -> Dict[str, Any]:
    registry = reg.REGISTRY
    with registry.lock:
        shims: List[Dict[str, Any]] = []
        for shim_id, entry in registry.shims.items():
            try:
                applies, why = registry.decide(entry)
            except Exception as exc:  # a broken matrix must not break status()
                applies, why = False, f"could not evaluate: {type(exc).__name__}: {exc}"
            targets = []
            for target_entry in entry.targets:
                data = target_entry.as_dict()
                if target_entry.state == reg.PENDING and not applies and not entry.forced:
                    data["state"], data["reason"] = reg.SKIPPED, f"bug not present here: {why}"
                targets.append(data)
            state = _shim_state(entry)
            if state == reg.PENDING and not applies and not entry.forced:
                state = reg.SKIPPED
            shims.append(
                {
                    "id": shim_id,
                    "fixes": list(entry.shim.fixes),
                    "summary": entry.shim.summary,
                    "source": entry.shim.source,
                    "selected": entry.selected,
                    "forced": entry.forced,
                    "applies": applies,
                    "applicability": why,
                    "state": state,
                    "call_failures": entry.call_failures,
                    "targets": targets,
                }
            )
        versions = dict(registry.versions()) if registry.installed else _versions_only()
        return {
            "schema_version": SCHEMA_VERSION,
            "installed": registry.installed,
            "strict": registry.strict,
            "killed": registry.killed,
            "auto_enabled": bool(registry.options.get("auto")),
            "environment": {k: v for k, v in os.environ.items() if k.startswith("DEVMAP_SHIMS")},
            "versions": versions,
            "imported_before_install": list(registry.imported_before_install),
            "imported_now": sorted(m for m in ("torch", "transformers", "accelerate", "bitsandbytes", "diffusers") if m in sys.modules),
            "shims": shims,
            "warnings": list(registry.warnings),
        }


def _versions_only() -> Dict[str, Any]:
    from devmap_shims.versions import installed_versions

    return installed_versions()
