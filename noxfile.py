"""Test sessions: one virtualenv per pinned library stack, and the engine on every supported Python.

    nox                      # every session (what CI runs)
    nox -s current           # the newest release of each target library
    nox -s legacy-2024       # transformers 4.45.1 / accelerate 0.34.2 / bitsandbytes 0.44.1 / torch 2.4.1
    nox -s engine-3.9        # the engine, matrix, CLI and hardening tests on Python 3.9

Each stack is pinned completely in ``stacks/<name>.txt`` (compiled from ``stacks/<name>.in`` with
``uv pip compile``), so a run next month installs the same thing. ``nox -s lock`` recompiles them.
``stacks/test.txt`` is one lock for every supported Python (3.9-3.13); ``legacy-2024-py3.10`` is
the legacy-2024 stack on Python 3.10, the Python its users run. Virtualenvs are made with uv, whose
cache keeps the multi-GB CUDA wheels of torch between runs. Interpreters are found on PATH or, where
pyenv keeps them, under ``$PYENV_ROOT/versions`` (default ``~/.pyenv``).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
PYTHONS = ("3.9", "3.10", "3.11", "3.12", "3.13")
STACKS = ("current", "legacy-2024", "mid-2025", "late-2025", "legacy-2023")
#: (session, lock file, Python): stacks run on another Python than PYTHON.
OTHER_PYTHON_STACKS = (("legacy-2024-py3.10", "legacy-2024-py3.10", "3.10"),)
#: (session, matrix rows): a full stack with one pin changed, for rows whose range holds only that
#: release; it runs those rows' scenarios and the shim contract, not the whole suite.
POINT_STACKS = (
    ("point-accelerate-1.2.0", ("accelerate-infer-map-maxmem-none", "accelerate-tied-size-overcount"),
     ("tests/hooks/accelerate/test_tied_sizes_counted_once.py",)),
    ("point-transformers-4.44.0", ("transformers-static-cache-multigpu",), ()),
    ("point-transformers-4.54.0", ("transformers-4540-cache-layers-on-last-gpu", "transformers-cache-built-without-layer-map"),
     ("tests/hooks/transformers/test_cache_follows_layer.py",)),
    ("point-bitsandbytes-0.48.0", ("bnb-int8params-move-regression", "bnb-int8-stats-stay-on-old-device"),
     ("tests/hooks/bitsandbytes/test_int8_cb_follows_data.py", "tests/hooks/bitsandbytes/test_int8_state_follows_weight.py")),
    ("point-transformers-4.55.0", ("transformers-4550-bucketize-boundaries-cpu",), ()),
)
ENGINE_TESTS = (
    "tests/engine", "tests/hardening", "tests/test_compat_matrix.py", "tests/test_versions.py",
    "tests/test_shim_contract.py",
)

nox.options.sessions = (
    [f"engine-{version}" for version in PYTHONS] + list(STACKS) + [name for name, _, _ in OTHER_PYTHON_STACKS]
    + [name for name, _, _ in POINT_STACKS]
)


def interpreter(version: str) -> str:
    """A working ``pythonX.Y``: on PATH when it runs (a pyenv shim may not), else pyenv's."""
    name = f"python{version}"
    found = shutil.which(name)
    if found and subprocess.run([found, "-c", "pass"], capture_output=True).returncode == 0:
        return found
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates = sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", name)))
    return candidates[-1] if candidates else name


def _install_stack(session: nox.Session, stack: str) -> None:
    session.install("-r", f"stacks/{stack}.txt")
    session.install("--no-deps", "-e", ".")


def _pytest(session: nox.Session, stack: str, *paths: str) -> None:
    # tiny models run 10-30x faster single-threaded on a busy 2-core machine
    env = {"DEVMAP_STACK": stack, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    session.run("python", "-m", "pytest", *(session.posargs or paths), env=env)


def _engine_session(version: str):
    @nox.session(name=f"engine-{version}", python=interpreter(version))
    def run(session: nox.Session) -> None:
        _install_stack(session, "test")
        _pytest(session, "engine", *ENGINE_TESTS)

    run.__doc__ = f"The engine, matrix, CLI, contract and hardening tests on Python {version}: no target library."
    return run


def _stack_session(name: str, lock: str, version: str):
    @nox.session(name=name, python=interpreter(version))
    def run(session: nox.Session) -> None:
        _install_stack(session, lock)
        _pytest(session, name, "tests")

    run.__doc__ = f"The whole suite on stacks/{lock}.txt, Python {version}."
    return run


def _point_session(name: str, rows: tuple, hook_tests: tuple):
    @nox.session(name=name, python=interpreter(PYTHON))
    def run(session: nox.Session) -> None:
        _install_stack(session, name)
        stems = tuple(os.path.splitext(os.path.basename(path))[0] for path in hook_tests)
        selection = " or ".join(rows + ("test_shim_contract",) + stems)
        _pytest(session, name, "tests/scenarios/test_matrix_rows.py", "tests/test_shim_contract.py", *hook_tests,
                "-k", selection)

    run.__doc__ = f"stacks/{name}.txt: the scenarios of {', '.join(rows)}, the shim contract" + (
        f" and {', '.join(hook_tests)}" if hook_tests else "") + "."
    return run


for _name, _rows, _hook_tests in POINT_STACKS:
    globals()[f"session_{_name.replace('-', '_').replace('.', '_')}"] = _point_session(_name, _rows, _hook_tests)
for _version in PYTHONS:
    globals()[f"session_engine_{_version.replace('.', '_')}"] = _engine_session(_version)
for _name, _lock, _version in tuple((s, s, PYTHON) for s in STACKS) + OTHER_PYTHON_STACKS:
    globals()[f"session_{_name.replace('-', '_').replace('.', '_')}"] = _stack_session(_name, _lock, _version)


#: Stacks whose accelerate has an expectations file, tests/upstream/accelerate-<version>.toml.
UPSTREAM_STACKS = ("current", "late-2025")
#: The upstream tests' one extra dependency; pip downloads accelerate's sdist (its tests).
UPSTREAM_TOOLS = ("parameterized==0.9.0", "pip")


def _upstream_session(stack: str):
    @nox.session(name=f"upstream-{stack}", python=interpreter(PYTHON))
    def run(session: nox.Session) -> None:
        _install_stack(session, stack)
        session.install(*UPSTREAM_TOOLS)
        env = {"DEVMAP_STACK": stack, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        for shims in ((), ("--devmap-shims",)):
            session.run("python", "scripts/upstream_tests.py", "accelerate", *shims,
                        *(("--", *session.posargs) if session.posargs else ()), env=env)

    run.__doc__ = (f"accelerate's own GPU tests (sdist) on a simulated 2-GPU machine, stacks/{stack}.txt, "
                   "without and with the shims.")
    return run


for _stack in UPSTREAM_STACKS:
    globals()[f"session_upstream_{_stack.replace('-', '_')}"] = _upstream_session(_stack)
nox.options.sessions = [*nox.options.sessions, *(f"upstream-{stack}" for stack in UPSTREAM_STACKS)]


@nox.session(python=PYTHON, venv_backend="none")
def lock(session: nox.Session) -> None:
    """Recompile stacks/*.txt from stacks/*.in."""
    platform = ("--python-platform", "x86_64-manylinux_2_28")
    session.run("uv", "pip", "compile", "-q", "--universal", "--python-version", PYTHONS[0], "stacks/test.in",
                "-o", "stacks/test.txt", external=True)
    stacks = tuple((s, s, PYTHON) for s in STACKS) + OTHER_PYTHON_STACKS + tuple((s, s, PYTHON) for s, _, _ in POINT_STACKS)
    for name, lock_name, version in stacks:
        source = f"stacks/{name.split('-py')[0]}.in"
        session.run("uv", "pip", "compile", "-q", "--python-version", version, *platform, source,
                    "-o", f"stacks/{lock_name}.txt", external=True)
