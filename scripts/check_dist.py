"""Check a built sdist and wheel of devmap-shims: what ``nox -s package`` runs after ``uv build``.

    python scripts/check_dist.py dist/

The wheel must hold every file of the package that the sdist holds, byte for byte, the start-up
files at the root of site-packages (``devmap_shims.pth``, ``devmap_shims.start``,
``_devmap_shims_start.py``), ``py.typed``, the console script and pytest plugin entry points, and
LICENSE as license-file metadata (PEP 639), and nothing else at its root. The sdist must hold what
a build from it needs. Prints one line per archive; exits 1 with one line per problem.
Standard library only.
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Dict, List

STARTUP = ("devmap_shims.pth", "devmap_shims.start", "_devmap_shims_start.py")
SDIST_NEEDS = ("pyproject.toml", "PKG-INFO", "README.md", "LICENSE", "devmap_shims/__init__.py",
               "devmap_shims/py.typed", "devmap_shims/compat_matrix/known_bugs.toml") + tuple(
                   f"startup/{name}" for name in STARTUP)
WHEEL_NEEDS = STARTUP + (
    "devmap_shims/__init__.py", "devmap_shims/py.typed", "devmap_shims/compat_matrix/known_bugs.toml")
ENTRY_POINTS = ("devmap-shims = devmap_shims.cli:main", "devmap_shims = devmap_shims.testing.pytest_plugin")
LICENSE_EXPRESSION = "Apache-2.0"


def sdist_files(path: Path) -> Dict[str, bytes]:
    """The sdist's regular files by their path inside its top folder."""
    with tarfile.open(path) as archive:
        files = {}
        for member in archive.getmembers():
            if member.isfile():
                _top, _, name = member.name.partition("/")
                files[name] = archive.extractfile(member).read()
        return files


def wheel_files(path: Path) -> Dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist() if not name.endswith("/")}


def check(sdist: Path, wheel: Path) -> List[str]:
    problems = []
    source = sdist_files(sdist)
    built = wheel_files(wheel)
    problems += [f"{sdist.name}: {name} is missing (a build from the sdist needs it)"
                 for name in SDIST_NEEDS if name not in source]
    problems += [f"{wheel.name}: {name} is missing" for name in WHEEL_NEEDS if name not in built]

    info = {name.split("/")[0] for name in built if name.split("/")[0].endswith(".dist-info")}
    if len(info) != 1:
        return problems + [f"{wheel.name}: {len(info)} .dist-info folders"]
    (info,) = info
    tops = {name.split("/")[0] for name in built} - {info, "devmap_shims"}
    if tops != set(STARTUP):
        problems.append(f"{wheel.name}: at the root of site-packages: {sorted(tops)}, "
                        f"expected {sorted(STARTUP)}")

    for name, data in source.items():  # what the sdist has, the wheel built from it installs unchanged
        if name.startswith("devmap_shims/") and "__pycache__" not in name and built.get(name) != data:
            state = "is missing" if name not in built else "differs from the sdist's"
            problems.append(f"{wheel.name}: {name} {state}")
        if name.startswith("startup/") and built.get(name[len("startup/"):]) != data:
            problems.append(f"{wheel.name}: {name[len('startup/'):]} differs from the sdist's {name}")

    metadata = Parser().parsestr(built.get(f"{info}/METADATA", b"").decode())
    pkg_info = Parser().parsestr(source.get("PKG-INFO", b"").decode())
    version = metadata["Version"]
    if version != pkg_info["Version"] or not wheel.name.startswith(f"devmap_shims-{version}-"):
        problems.append(f"versions differ: wheel {version}, sdist {pkg_info['Version']}, file {wheel.name}")
    if metadata["License-Expression"] != LICENSE_EXPRESSION:
        problems.append(f"{wheel.name}: License-Expression is {metadata['License-Expression']!r}, "
                        f"not {LICENSE_EXPRESSION!r}")
    if metadata.get_all("License-File") != ["LICENSE"]:
        problems.append(f"{wheel.name}: License-File is {metadata.get_all('License-File')}, not ['LICENSE']")
    license_text = built.get(f"{info}/licenses/LICENSE")
    if license_text is None or license_text != source.get("LICENSE"):
        problems.append(f"{wheel.name}: {info}/licenses/LICENSE is missing or differs from the sdist's")
    elif b"Apache License" not in license_text or b"Version 2.0" not in license_text:
        problems.append(f"{wheel.name}: LICENSE is not the Apache License 2.0")
    entry_points = built.get(f"{info}/entry_points.txt", b"").decode()
    problems += [f"{wheel.name}: entry point {line!r} is missing"
                 for line in ENTRY_POINTS if line not in entry_points]
    return problems


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/check_dist.py DIST_FOLDER", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    sdists, wheels = sorted(folder.glob("*.tar.gz")), sorted(folder.glob("*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        found = [path.name for path in sdists + wheels]
        print(f"{folder}: expected one sdist and one wheel, found {found}", file=sys.stderr)
        return 1
    problems = check(sdists[0], wheels[0])
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{sdists[0].name}: {len(sdist_files(sdists[0]))} files; {wheels[0].name}: "
              f"{len(wheel_files(wheels[0]))} files, start-up files, py.typed and LICENSE present")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
