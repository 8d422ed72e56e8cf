"""Fake target libraries for the engine tests: no torch needed.

``fake_stack`` writes a package ``fakelib`` (version 1.2.0, with real dist-info metadata so
``importlib.metadata`` sees it) into a temporary folder on ``sys.path``, plus ``fakeconsumer``, a
module that copies functions by name the way transformers copies accelerate's.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from devmap_shims.shims.engine import ENGINE

FAKELIB_CORE = '''
def compute(x, scale=2):
    """Multiply x by scale."""
    return x * scale

def fragile(x):
    raise ValueError(f"fakelib refuses {x}")

class Thing:
    def __init__(self, device="cpu"):
        self.device = device

    def to(self, device, *, copy=False):
        return Thing(device)

    @classmethod
    def make(cls, device):
        return cls(device)

    @staticmethod
    def describe(x):
        return f"thing {x}"

class SubThing(Thing):
    pass
'''


def fake_row(bug_id: str = "fake-bug", spec: str = ">=1.0,<2.0", **extra):
    row = {
        "id": bug_id,
        "title": "fakelib computes the wrong value",
        "library": "fakelib",
        "affected": {"fakelib": spec},
        "fixed_in": {"fakelib": "2.0.0"},
        "symptom": "compute(3) returns 6, expected 7",
        "root_cause": "off by one",
        "upstream": ["acme/fakelib#1"],
        "verification": ["I"],
        "workaround": "upgrade fakelib",
    }
    row.update(extra)
    return row


def add_one(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1


@pytest.fixture(autouse=True)
def _clean_devmap_state(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("DEVMAP_SHIMS"):
            monkeypatch.delenv(name)
    ENGINE.reset()
    yield
    ENGINE.reset()


@pytest.fixture
def fake_stack(tmp_path: Path, monkeypatch):
    """Path of a folder holding fakelib 1.2.0 (not imported yet) and fakeconsumer."""

    def write(version: str) -> Path:
        root = tmp_path / "site"
        pkg = root / "fakelib"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("from fakelib.core import compute, Thing\n")
        (pkg / "core.py").write_text(textwrap.dedent(FAKELIB_CORE))
        (root / "fakeconsumer.py").write_text(
            "from fakelib.core import compute\nfrom fakelib import compute as compute_again\n"
            "def use(x):\n    return compute(x)\n"
        )
        dist = root / f"fakelib-{version}.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakelib\nVersion: {version}\n")
        return root

    root = write("1.2.0")
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in list(sys.modules):
        if name.split(".")[0] in ("fakelib", "fakeconsumer"):
            del sys.modules[name]
