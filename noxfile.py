"""Test sessions: one virtualenv per pinned library stack, and the engine on every supported Python.

    nox                      # every session (what CI runs)
    nox -s current           # the newest release of each target library
    nox -s legacy-2024       # transformers 4.45.1 / accelerate 0.34.2 / bitsandbytes 0.44.1 / torch 2.4.1
    nox -s engine-3.9        # the engine, matrix, CLI and hardening tests on Python 3.9

Each stack is pinned completely in ``stacks/<name>.txt`` (compiled from ``stacks/<name>.in`` with
``uv pip compile``), so a run next month installs the same thing. ``nox -s lock`` recompiles them.
``stacks/current-runtime.txt`` (what the README's quick start installs) is ``current.txt`` less the
test tools; ``stacks/package.txt`` pins the build backend and twine of the ``package`` session.
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
     ("tests/hooks/accelerate/test_tied_sizes_counted_once.py", "tests/hooks/accelerate/test_device_map_balance.py")),
    ("point-transformers-4.44.0", ("transformers-static-cache-multigpu",), ()),
    ("point-transformers-4.54.0", ("transformers-4540-cache-layers-on-last-gpu", "transformers-cache-built-without-layer-map"),
     ("tests/hooks/transformers/test_cache_follows_layer.py",)),
    ("point-bitsandbytes-0.48.0", ("bnb-int8params-move-regression", "bnb-int8-stats-stay-on-old-device"),
     ("tests/hooks/bitsandbytes/test_int8_cb_follows_data.py", "tests/hooks/bitsandbytes/test_int8_state_follows_weight.py")),
    ("point-transformers-4.55.0", ("transformers-4550-bucketize-boundaries-cpu",), ()),
    ("point-transformers-4.27.1", ("transformers-balanced-maxmem-discarded",),
     ("tests/hooks/transformers/test_balanced_budgets_reach_the_map.py", "tests/scenarios/test_replay.py")),
    ("point-transformers-4.27.2", ("transformers-user-maxmem-ignored-balanced",),
     ("tests/hooks/transformers/test_balanced_budgets_reach_the_map.py", "tests/scenarios/test_replay.py")),
)
ENGINE_TESTS = (
    "tests/engine", "tests/hardening", "tests/test_compat_matrix.py", "tests/test_versions.py",
    "tests/test_shim_contract.py",
)

nox.options.sessions = (
    [f"engine-{version}" for version in PYTHONS] + ["engine-lowest"] + list(STACKS)
    + [name for name, _, _ in OTHER_PYTHON_STACKS]
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


@nox.session(name="engine-lowest", python=interpreter(PYTHONS[0]))
def engine_lowest(session: nox.Session) -> None:
    """The engine tests with wrapt, packaging and tomli at the lowest releases pyproject.toml accepts."""
    _install_stack(session, "engine-lowest")
    _pytest(session, "engine", *ENGINE_TESTS)


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


nox.options.sessions.append("package")
#: the matrix row ``nox -s package`` replays with the installed wheel: quick, and it applies on current
PACKAGE_DEMO_ROW = "bnb-int8-stats-stay-on-old-device"
#: run with DEVMAP_SHIMS=1 and no import of devmap_shims: the .pth line must have installed the wheel's shims
_AUTO_ENABLE_CHECK = """
import os, sys
engine = sys.modules.get("devmap_shims")
assert engine is not None, "DEVMAP_SHIMS=1 did not load devmap_shims at start-up"
assert engine.__file__.startswith(os.path.realpath(sys.argv[1])), engine.__file__
status = engine.status()
assert engine.is_installed() and status["auto_enabled"], status
print("DEVMAP_SHIMS=1: shims installed at start-up from", os.path.dirname(engine.__file__))
"""
#: run without the variable: start-up must not have imported any devmap_shims module
_NO_AUTO_ENABLE_CHECK = "import sys; on = [m for m in sys.modules if 'devmap_shims' in m]; assert not on, on"


@nox.session(python=interpreter(PYTHON))
def package(session: nox.Session) -> None:
    """Release check: build the sdist and the wheel from it, check both, install the wheel, run it.

    The wheel (not the checkout) goes into a fresh virtualenv with stacks/current-runtime.txt; the
    demo and the DEVMAP_SHIMS=1 auto-enable run from there."""
    session.install("-r", "stacks/package.txt")  # hatchling, twine and uv, pinned
    tmp = os.path.abspath(session.create_tmp())
    dist, venv = os.path.join(tmp, "dist"), os.path.join(tmp, "wheel-venv")
    for path in (dist, venv):
        shutil.rmtree(path, ignore_errors=True)
    # the sdist, then the wheel built from the sdist; hatchling pinned as a build constraint
    session.run("uv", "build", "-q", "--build-constraint", "stacks/package.txt", "-o", dist)
    built = sorted(glob.glob(os.path.join(dist, "devmap_shims-*")))
    if not built and session._runner.global_config.install_only:  # nothing is built or run
        return
    session.run("twine", "check", "--strict", *built)
    session.run("python", "scripts/check_dist.py", dist)
    (wheel,) = (path for path in built if path.endswith(".whl"))
    python = os.path.join(venv, "bin", "python")
    session.run("uv", "venv", "-q", "--python", interpreter(PYTHON), venv)
    session.run("uv", "pip", "install", "-q", "--python", python, "-r", "stacks/current-runtime.txt", wheel)
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": None, "DEVMAP_SHIMS": None}
    with session.chdir(tmp):  # away from the checkout: only the installed wheel can be imported
        devmap_shims = os.path.join(venv, "bin", "devmap-shims")
        session.run(devmap_shims, "demo", PACKAGE_DEMO_ROW, env=env, external=True)
        session.run(python, "-c", _AUTO_ENABLE_CHECK, venv, env=dict(env, DEVMAP_SHIMS="1"), external=True)
        session.run(python, "-c", _NO_AUTO_ENABLE_CHECK, env=env, external=True)


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
    """Recompile stacks/*.txt from stacks/*.in (current-runtime.txt from current.txt's versions)."""
    platform = ("--python-platform", "x86_64-manylinux_2_28")
    session.run("uv", "pip", "compile", "-q", "--universal", "--python-version", PYTHONS[0], "stacks/test.in",
                "-o", "stacks/test.txt", external=True)
    stacks = tuple((s, s, PYTHON) for s in STACKS) + OTHER_PYTHON_STACKS + tuple((s, s, PYTHON) for s, _, _ in POINT_STACKS)
    for name, lock_name, version in stacks:
        source = f"stacks/{name.split('-py')[0]}.in"
        session.run("uv", "pip", "compile", "-q", "--python-version", version, *platform, source,
                    "-o", f"stacks/{lock_name}.txt", external=True)
    session.run("uv", "pip", "compile", "-q", "--python-version", PYTHON, *platform, "stacks/package.in",
                "-o", "stacks/package.txt", external=True)
    # the quick start's runtime stack: current.txt's versions, less the test tools, so the two cannot drift
    session.run("uv", "pip", "compile", "-q", "--python-version", PYTHON, *platform,
                "stacks/current-runtime.in", "-c", "stacks/current.txt", "-o", "stacks/current-runtime.txt",
                external=True)
