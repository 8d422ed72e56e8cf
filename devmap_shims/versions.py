"""Installed versions of the target libraries, read without importing them.

Versions come from ``importlib.metadata`` (the installed distribution's metadata), so asking
"which transformers is installed?" never pays the seconds that ``import transformers`` costs and
never runs a target library's import-time code.

Comparisons are *normalised*: a version is compared by its release number only. PEP 440 keeps
pre-releases, dev builds and local tags out of plain ranges, which silently drops the torch builds
people actually run:

* ``2.6.0a0+ecf3bae40a.nv25.01`` (NVIDIA NGC containers) is in neither ``<2.6`` nor ``>=2.6``;
* ``2.6.0.dev20241112+cu124`` (nightlies) and ``2.6.0rc1`` likewise;
* ``2.5.1+cu121`` (local tag) already compares as 2.5.1.

Here each of them counts as its release (2.6.0, 2.6.0, 2.6.0, 2.5.1): an NGC ``2.6.0a0`` ships the
2.6 code, and a nightly of 2.6 has what 2.6 has.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Iterable, Mapping

#: The libraries whose device placement this package repairs (their top-level package names too).
TARGET_DISTRIBUTIONS = ("torch", "transformers", "accelerate", "bitsandbytes", "diffusers")

_RELEASE = r"^\s*v?(?:\d+!)?(\d+(?:\.\d+)*)"


def installed_version(distribution: str) -> str | None:
    """The installed version string of ``distribution``, or None when it is not installed.

    As ``importlib.metadata.version`` (the first distribution of that name on ``sys.path``), except
    that one whose metadata files are not regular files is passed over (:func:`metadata_readable`):
    a ``*.dist-info`` FIFO in the working directory must not hold the host at ``install()``."""
    from importlib import metadata

    if not distribution:  # distributions(name="") matches every distribution
        return None
    try:
        for dist in metadata.distributions(name=distribution):
            if metadata_readable(dist):
                return dist.version
    except Exception:  # a broken dist-info must not break the caller
        return None
    return None


#: The files of a distribution that reading its name, version and entry points opens.
METADATA_FILES = ("METADATA", "PKG-INFO", "entry_points.txt")


def metadata_readable(dist: object) -> bool:
    """Whether the metadata files of ``dist`` (:data:`METADATA_FILES`) are regular files, or absent.

    ``importlib.metadata`` opens them with a plain ``open()``, which blocks on a FIFO for as long as
    nothing writes to it, and a ``*.dist-info`` folder in the working directory (on ``sys.path``,
    and anybody's) can hold one. A distribution that does not live in a folder (a custom finder's)
    is read as ``importlib.metadata`` reads it."""
    import os
    import stat

    folder = getattr(dist, "_path", None)  # PathDistribution's folder, in every release from 3.8
    if not isinstance(folder, (str, os.PathLike)):
        return True
    try:
        mode = os.stat(folder).st_mode
    except (OSError, ValueError):
        return True  # gone, or inside a zip archive: nothing there blocks
    if stat.S_ISREG(mode):
        return True  # an egg-info file: it is the metadata
    if not stat.S_ISDIR(mode):
        return False  # the *.dist-info itself a FIFO: importlib.metadata would open it
    for name in METADATA_FILES:
        try:
            mode = os.stat(os.path.join(folder, name)).st_mode
        except (OSError, ValueError):
            continue  # absent (or inside a zip archive, which never blocks)
        if not stat.S_ISREG(mode):
            return False
    return True


def installed_versions(distributions: Iterable[str] = TARGET_DISTRIBUTIONS) -> dict[str, str | None]:
    """``{distribution: version or None}`` for each name, read from metadata only."""
    return {name: installed_version(name) for name in distributions}


def release_tuple(version: str) -> tuple[int, ...]:
    """The release part of a version string: ``"2.6.0a0+nv25.01"`` -> ``(2, 6, 0)``.

    Raises ValueError when the string does not start with a release number.
    """
    import re

    match = re.match(_RELEASE, version)
    if not match:
        raise ValueError(f"not a version number: {version!r}")
    parts = tuple(int(p) for p in match.group(1).split("."))
    # 2.6 and 2.6.0 are the same release
    while len(parts) > 1 and parts[-1] == 0:
        parts = parts[:-1]
    return parts


def normalize(version: str) -> str:
    """The release of ``version`` as a plain public version string (``"2.6.0.dev1+cu124"`` -> ``"2.6"``)."""
    return ".".join(str(p) for p in release_tuple(version))


_SPECIFIER_SETS: dict = {}


def _specifier_set(spec: str):
    found = _SPECIFIER_SETS.get(spec)
    if found is None:
        from packaging.specifiers import SpecifierSet

        found = _SPECIFIER_SETS[spec] = SpecifierSet(spec.strip() if spec.strip() not in ("*", "any") else "")
    return found


def version_in(version: str, spec: str) -> bool:
    """True when ``version``'s release lies in the PEP 440 specifier set ``spec``.

    ``"*"`` or ``""`` matches every version. Pre-release, dev and local parts of ``version`` are
    ignored (see the module docstring), so ``version_in("2.6.0rc1", ">=2.6")`` is True and
    ``version_in("2.6.0rc1", "<2.6")`` is False.

    Raises ValueError (packaging's InvalidSpecifier) for a malformed ``spec``.
    """
    return _specifier_set(spec).contains(normalize(version), prereleases=True)


def check_spec(spec: str) -> None:
    """Raise ValueError with packaging's explanation when ``spec`` is not a valid specifier set."""
    _specifier_set(spec)


def satisfies(versions: Mapping[str, str | None], requirements: Mapping[str, str]) -> tuple[bool, str]:
    """Whether installed ``versions`` meet every ``{distribution: specifier}`` in ``requirements``.

    Returns ``(ok, reason)``; the reason names the first requirement that is not met, or lists the
    versions that matched. A distribution that is not installed never satisfies a requirement.
    """
    matched = []
    for dist, spec in requirements.items():
        version = versions.get(dist)
        if version is None:
            return False, f"{dist} is not installed"
        try:
            ok = version_in(version, spec)
        except ValueError:
            try:
                check_spec(spec)
            except ValueError:
                return False, f"{spec!r:.60} is not a version specifier (for {dist})"
            return False, f"{dist} {version} is not a comparable version"
        if not ok:
            return False, f"{dist} {version} is outside {spec}"
        matched.append(f"{dist} {version} in {spec}" if spec.strip() not in ("", "*", "any") else f"{dist} {version}")
    return True, "; ".join(matched)
