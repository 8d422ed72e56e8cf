"""Why a row of the matrix does not apply to the installed versions, in a few words a person reads
("fixed in transformers 4.46.0", "introduced in accelerate 1.15.0"), where
:meth:`Row.applicability <devmap_shims.compat_matrix.Row.applicability>` names the range that
decided it."""

from __future__ import annotations

from typing import Any, Dict, Optional

from packaging.specifiers import SpecifierSet

from devmap_shims.compat_matrix import requirement_text
from devmap_shims.versions import release_tuple, version_in


def _side(version: str, spec: str) -> Optional[str]:
    """``"above"`` when ``version`` is past the upper end of ``spec``, ``"below"`` when it comes
    before its lower end, None otherwise (an excluded version such as ``!=4.49.*``)."""
    have = release_tuple(version)
    for item in SpecifierSet(spec):
        if version_in(version, str(item)):
            continue
        if item.operator == "!=" or item.version.endswith(".*"):
            return None
        bound = release_tuple(item.version)
        if item.operator in (">=", ">", "~="):
            return "below"
        if item.operator in ("<", "<="):
            return "above"
        if item.operator in ("==", "==="):
            return "above" if have > bound else "below"
    return None


def _lower_bound(spec: str) -> Optional[str]:
    for item in SpecifierSet(spec):
        if item.operator in (">=", "==", "~=") and not item.version.endswith(".*"):
            return item.version
    return None


def not_affected_reason(row: Any, versions: Dict[str, Optional[str]]) -> Optional[str]:
    """Why ``row`` does not apply to ``versions``, in a few words; None when it applies.

    Installed past the range: ``"fixed in transformers 4.46.0"`` (from ``fixed_in``); before it:
    ``"introduced in accelerate 1.15.0"`` for the library the bug lives in, ``"needs bitsandbytes
    >=0.48.0"`` for another; ``"diffusers is not installed"``; for a version the range excludes
    (``!=4.49.*``): ``"transformers 4.49.0 is left out of >=4.45.0,<4.51.0,!=4.49.*"``.
    """
    for dist, spec in row.affected.items():
        version = versions.get(dist)
        if version is None:
            return f"{dist} is not installed"
        try:
            if version_in(version, spec):
                continue
            side = _side(version, spec)
        except ValueError:
            return f"{dist} {version} is not a comparable version"
        if side == "above":
            fixed = None if row.unfixed else row.fixed_in.get(dist)
            if fixed and release_tuple(fixed) <= release_tuple(version):
                return f"fixed in {dist} {fixed}"
            return f"affects {requirement_text(dist, spec)} only"
        if side == "below":
            lower = _lower_bound(spec)
            if lower and dist == row.library:
                return f"introduced in {dist} {lower}"
            return f"needs {requirement_text(dist, spec)}"
        return f"{dist} {version} is left out of {spec}"  # an exclusion such as !=4.49.*
    return None
