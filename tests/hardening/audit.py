"""Checks run inside a subprocess after an import/install/uninstall sequence (ddtrace's PatchTestCase idea).

Prints one JSON object: the problems found (empty when every active target adds exactly one layer, no
by-name copy of an original is left behind, and ``status()`` agrees with what is really in place).
"""

from __future__ import annotations

import json
import sys


def _layers(obj):
    from devmap_shims.shims import wrapping

    count, seen = 0, 0
    while obj is not None and seen < 16:
        seen += 1
        if wrapping.is_ours(obj):
            count += 1
        try:
            obj = obj.__wrapped__
        except Exception:
            obj = getattr(obj, "__func__", None)
    return count


def audit(expect_installed: bool) -> dict:
    import devmap_shims
    from devmap_shims.shims import wrapping
    from devmap_shims.shims.engine import ENGINE

    problems = []
    status = {s["id"]: s for s in devmap_shims.status()["shims"]}
    active = 0
    # several shims may wrap one attribute (two fix different rows of infer_auto_device_map):
    # each active target adds exactly one layer there
    expected: dict = {}
    for entry in ENGINE.registry.shims.values():
        for target in entry.targets:
            if target.state == "active":
                key = (id(target.owner), target.name)
                expected[key] = expected.get(key, 0) + 1
    for shim_id, entry in ENGINE.registry.shims.items():
        for index, target in enumerate(entry.targets):
            reported = status[shim_id]["targets"][index]["state"]
            if target.state == "active":
                active += 1
                current = vars(target.owner)[target.name]
                layers = _layers(current)
                want = expected[(id(target.owner), target.name)]
                if layers != want:
                    problems.append(f"{target.target.key}: {layers} devmap layers, {want} active shims")
                if not isinstance(target.owner, type):
                    for name, module in list(sys.modules.items()):
                        if name.startswith("devmap_shims") or module is None:
                            continue
                        for key, value in list(getattr(module, "__dict__", {}).items()):
                            if value is target.original:
                                problems.append(f"stale by-name copy {name}.{key} of {target.target.key}")
            elif target.layer is not None and target.enabled and _layers(vars(target.owner).get(target.name)):
                problems.append(f"{target.target.key}: wrapped but status says {target.state}")
            if reported != target.state and not (target.state == "pending" and reported == "skipped"):
                problems.append(f"{target.target.key}: status() says {reported}, registry {target.state}")
    if not expect_installed:
        if wrapping.layers_in_place():
            problems.append(f"{wrapping.layers_in_place()} devmap layer(s) still in place after uninstall")
        if devmap_shims.is_installed():
            problems.append("is_installed() is True after uninstall")
    return {"problems": problems, "active": active, "installed": devmap_shims.is_installed()}


def main(expect_installed: bool) -> None:
    print("AUDIT " + json.dumps(audit(expect_installed)))
