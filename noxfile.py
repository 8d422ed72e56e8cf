"""Test sessions: one virtualenv per pinned library stack.

    nox                      # every session (what CI runs)
    nox -s current           # the newest release of each target library
    nox -s legacy-2024       # transformers 4.45.1 / accelerate 0.34.2 / bitsandbytes 0.44.1 / torch 2.4.1

Each stack is pinned completely in ``stacks/<name>.txt`` (compiled from ``stacks/<name>.in`` with
``uv pip compile``), so a run next month installs the same thing. ``nox -s lock`` recompiles them.
Virtualenvs are made with uv, whose cache keeps the multi-GB CUDA wheels of torch between runs.
"""

from __future__ import annotations


import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["engine", "current", "legacy-2024", "mid-2025", "late-2025", "legacy-2023"]

PYTHON = "3.11"
STACKS = ("current", "legacy-2024", "mid-2025", "late-2025", "legacy-2023")


def _install_stack(session: nox.Session, stack: str) -> None:
    session.install("-r", f"stacks/{stack}.txt")
    session.install("--no-deps", "-e", ".")


def _pytest(session: nox.Session, stack: str, *paths: str) -> None:
    # tiny models run 10-30x faster single-threaded on a busy 2-core machine
    env = {"DEVMAP_STACK": stack, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    session.run("python", "-m", "pytest", *(session.posargs or paths), env=env)


@nox.session(python=PYTHON)
def engine(session: nox.Session) -> None:
    """The engine, matrix, CLI and packaging tests: no target library installed."""
    _install_stack(session, "test")
    _pytest(
        session, "engine", "tests/engine", "tests/test_compat_matrix.py", "tests/test_versions.py",
        "tests/test_shim_contract.py",
    )


def _stack_session(stack: str):
    @nox.session(name=stack, python=PYTHON)
    def run(session: nox.Session) -> None:
        _install_stack(session, stack)
        _pytest(session, stack, "tests")

    run.__doc__ = f"The whole suite on the {stack} stack (stacks/{stack}.in)."
    return run


for _stack in STACKS:
    globals()[f"session_{_stack.replace('-', '_')}"] = _stack_session(_stack)


@nox.session(python=PYTHON, venv_backend="none")
def lock(session: nox.Session) -> None:
    """Recompile stacks/*.txt from stacks/*.in."""
    for name in ("test",) + STACKS:
        session.run(
            "uv", "pip", "compile", "-q", "--python-version", PYTHON,
            "--python-platform", "x86_64-manylinux_2_28", f"stacks/{name}.in", "-o", f"stacks/{name}.txt",
            external=True,
        )
