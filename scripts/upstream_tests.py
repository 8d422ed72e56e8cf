"""Run a library's own multi-GPU tests, from its PyPI sdist, on a simulated multi-GPU machine.

    python scripts/upstream_tests.py accelerate                 # the installed accelerate's tests
    python scripts/upstream_tests.py accelerate --devmap-shims  # the same with the shims armed
    python scripts/upstream_tests.py accelerate -- -k dispatch  # extra pytest arguments

The installed version's expectations file, ``tests/upstream/<package>-<version>.toml``, names the
test files, the sdist's sha256, the deselected tests with their reasons and the outcome that must
be met (see ``tests/upstream/devmap_upstream.py``). The sdist (``pip download --no-binary``, so
the machine needs a package index, not GitHub) is kept under ``.nox/upstream/``; only its
``tests/`` and ``LICENSE`` are unpacked. The tests need ``parameterized`` installed beside the stack.
Exit status: pytest's (0 when every expectation is met).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from typing import NoReturn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECT_DIR = os.path.join(ROOT, "tests", "upstream")
CACHE = os.path.join(ROOT, ".nox", "upstream")


def _fail(message: str) -> NoReturn:
    print(f"upstream_tests: {message}", file=sys.stderr)
    raise SystemExit(2)


def _expectations(package: str, version: str) -> str:
    path = os.path.join(EXPECT_DIR, f"{package}-{version}.toml")
    if not os.path.exists(path):
        pattern = os.path.join(EXPECT_DIR, f"{package}-*.toml")
        known = sorted(os.path.basename(p)[: -len(".toml")] for p in glob.glob(pattern))
        _fail(f"no expectations for {package} {version} ({path}); there are: {', '.join(known) or 'none'}. "
              "Install one of those versions, or write the file for this one.")
    return path


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip() -> list[str]:
    """This interpreter's pip, else the first pip on PATH (only the download needs it)."""
    import importlib.util

    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    found = shutil.which("pip3") or shutil.which("pip")
    if found is None:
        _fail(f"no pip in {sys.prefix} nor on PATH to download the sdist with")
    return [found]


def _sdist(package: str, version: str, sha256: str) -> str:
    """The verified sdist, downloaded once."""
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"{package}-{version}.tar.gz")
    if not os.path.exists(path) or _sha256(path) != sha256:
        print(f"upstream_tests: downloading the {package} {version} sdist", file=sys.stderr, flush=True)
        cmd = [*_pip(), "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"{package}=={version}", "-d", CACHE]
        if subprocess.run(cmd).returncode != 0:
            _fail(f"`{' '.join(cmd)}` failed (pip and a package index are needed)")
    got = _sha256(path)
    if got != sha256:
        _fail(f"{path} has sha256 {got}, the expectations file says {sha256}")
    return path


def _unpack(sdist: str, package: str, version: str) -> str:
    """``tests/`` and ``LICENSE`` of the sdist, in a folder of their own with an empty pytest.ini."""
    top = f"{package}-{version}"
    dest = os.path.join(CACHE, top)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if (m.name.startswith(f"{top}/tests/") or m.name == f"{top}/LICENSE")
                   and (m.isfile() or m.isdir())]
        for m in members:
            if ".." in m.name.split("/") or m.name.startswith("/"):
                _fail(f"{sdist}: unsafe member {m.name!r}")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(CACHE, members=members, **kwargs)
    with open(os.path.join(dest, "pytest.ini"), "w") as f:  # the rootdir: not this repository's config
        f.write("[pytest]\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", help="distribution whose tests to run (its installed version)")
    parser.add_argument("--devmap-shims", action="store_true",
                        help="arm devmap-shims (strict) before the run")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args(argv)
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        version = metadata.version(args.package)
    except metadata.PackageNotFoundError:
        _fail(f"{args.package} is not installed in {sys.prefix}")
    try:
        import parameterized  # noqa: F401
    except ImportError:
        _fail("the upstream tests need `parameterized` (pip install parameterized==0.9.0)")
    expect = _expectations(args.package, version)
    with open(expect, "rb") as f:
        data = tomllib.load(f)
    folder = _unpack(_sdist(args.package, version, data["sdist_sha256"]), args.package, version)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (EXPECT_DIR, env.get("PYTHONPATH")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("DEVMAP_SHIMS", None)  # the plugin arms the shims when asked, after pytest starts
    cmd = [sys.executable, "-m", "pytest", "-p", "devmap_upstream", f"--upstream-expect={expect}",
           "-p", "no:cacheprovider", "-rfEs", *(["--devmap-shims"] if args.devmap_shims else []),
           *data["files"], *args.pytest_args]
    print(f"upstream_tests: {args.package} {version}{' with devmap-shims' if args.devmap_shims else ''}: "
          f"{' '.join(data['files'])}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, cwd=folder, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
