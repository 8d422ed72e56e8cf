"""The generate-override cache: what a hostile or broken cache folder cannot do to the host.

Each case plants something at the cache path (a FIFO, a link to /dev/zero, a huge file, a link to
a file that must survive, forged or torn content) and checks that start-up neither blocks, nor
reads it, nor writes through it, and still gets the right list from the installed files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from devmap_shims import cache
from devmap_shims.hooks.transformers import _generate_overrides as overrides

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX file types")


@pytest.fixture
def fake_transformers(tmp_path):
    root = tmp_path / "transformers"
    (root / "generation").mkdir(parents=True)
    (root / "generation" / "utils.py").write_text("class GenerationMixin:\n    def generate(self): pass\n")
    (root / "__init__.py").write_text("")
    (root / "models" / "toy").mkdir(parents=True)
    (root / "models" / "toy" / "modeling_toy.py").write_text("class ToyForX:\n    def generate(self):\n        pass\n")
    return str(root)


EXPECTED = [("transformers.models.toy.modeling_toy", "ToyForX")]


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home / "devmap_shims"


def cache_path(root):
    key = overrides._cache_key(root)
    return os.path.join(cache.cache_dir(), f"generate-overrides-{cache.fnv1a(key)}.txt")


def in_time(func, seconds=20):
    """func() in a thread; fail (instead of hanging the suite) when it blocks."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", func()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    return result["value"]


def test_a_fifo_at_the_cache_path_does_not_block(fake_transformers, cache_home):
    cache_home.mkdir(parents=True, mode=0o700)
    os.mkfifo(cache_path(fake_transformers))
    assert in_time(lambda: overrides.generate_overrides(fake_transformers)) == EXPECTED


def test_a_link_to_dev_zero_is_not_followed(fake_transformers, cache_home):
    cache_home.mkdir(parents=True, mode=0o700)
    os.symlink("/dev/zero", cache_path(fake_transformers))
    assert in_time(lambda: overrides.generate_overrides(fake_transformers)) == EXPECTED
    assert not os.path.islink(cache_path(fake_transformers))  # replaced by a real cache file


def test_a_huge_file_is_not_read(fake_transformers, cache_home, monkeypatch):
    cache_home.mkdir(parents=True, mode=0o700)
    with open(cache_path(fake_transformers), "wb") as handle:
        handle.truncate(3 << 30)  # sparse: 3 GB that cost nothing on disk
    reads = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    assert overrides.generate_overrides(fake_transformers) == EXPECTED
    assert sum(reads) <= cache.MAX_BYTES + 65536


def test_a_link_planted_at_the_cache_path_is_replaced_not_written_through(fake_transformers, cache_home, tmp_path):
    cache_home.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, cache_path(fake_transformers))
    assert overrides.generate_overrides(fake_transformers) == EXPECTED
    assert victim.read_text() == "precious"
    assert not os.path.islink(cache_path(fake_transformers))
    assert [p for p in os.listdir(cache_home) if p.endswith(".tmp")] == []


def test_a_folder_others_can_write_to_is_not_written(fake_transformers, cache_home):
    cache_home.mkdir(parents=True)
    os.chmod(cache_home, 0o777)
    assert overrides.generate_overrides(fake_transformers) == EXPECTED
    assert os.listdir(cache_home) == []


def test_forged_lines_are_refused_and_the_list_rescanned(fake_transformers, cache_home):
    assert overrides.generate_overrides(fake_transformers) == EXPECTED
    path = cache_path(fake_transformers)
    lines = open(path).read().split("\n")
    forged = lines[:2] + ["os:system"]  # a module the scan could never produce
    content = "\n".join(forged + [cache._end_line(forged)]) + "\n"
    with open(path, "w") as handle:
        handle.write(content)
    assert overrides.generate_overrides(fake_transformers) == EXPECTED
    assert "os:system" not in open(path).read()


def test_a_torn_file_is_refused(fake_transformers, cache_home):
    assert overrides.generate_overrides(fake_transformers) == EXPECTED
    path = cache_path(fake_transformers)
    text = open(path).read()
    with open(path, "w") as handle:
        handle.write(text.split("\n")[0] + "\n" + text.split("\n")[1] + "\n")  # header only: cut short
    assert cache.read(os.path.basename(path), "\n".join(text.split("\n")[:2]), lambda line: True) is None
    assert overrides.generate_overrides(fake_transformers) == EXPECTED


@pytest.mark.parametrize("variables, expected", [
    ({"XDG_CACHE_HOME": "relative/dir", "HOME": "/home/u"}, "/home/u/.cache/devmap_shims"),
    ({"XDG_CACHE_HOME": "", "HOME": "/home/u"}, "/home/u/.cache/devmap_shims"),
    ({"XDG_CACHE_HOME": "/abs/cache", "HOME": ""}, "/abs/cache/devmap_shims"),
    ({"HOME": ""}, None),
    ({"HOME": "relative"}, None),
    ({"HOME": "/"}, None),
])
def test_cache_folder_follows_the_xdg_rules(variables, expected, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert cache.cache_dir() == expected


def test_relative_xdg_cache_home_writes_nothing_in_the_working_directory(fake_transformers, tmp_path):
    code = textwrap.dedent(f"""
        from devmap_shims.hooks.transformers import _generate_overrides as o
        print(o.generate_overrides({fake_transformers!r}))
    """)
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "home").mkdir()
    env = dict(os.environ, XDG_CACHE_HOME="relative/dir", HOME=str(tmp_path / "home"))
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(work) == []
    assert os.listdir(tmp_path / "home" / ".cache" / "devmap_shims")


def test_a_home_that_names_no_folder_is_not_created(fake_transformers, tmp_path, monkeypatch):
    # system users get HOME=/nonexistent; a process of theirs (or root with their environment)
    # must not make that folder to keep a cache in it
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "nonexistent" / "deep"))
    assert overrides.generate_overrides(fake_transformers) == EXPECTED
    assert not (tmp_path / "nonexistent").exists()


def test_another_users_home_gets_no_folder_of_ours(fake_transformers, tmp_path, monkeypatch):
    # root with a user's HOME (sudo -E, a service): a root-owned ~/.cache would keep that user
    # from making any cache folder there afterwards (the Hugging Face hub's included)
    if not hasattr(os, "geteuid"):
        pytest.skip("POSIX users")
    home = tmp_path / "alice"
    home.mkdir()
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(home).st_uid + 1)  # this process is someone else
    assert overrides.generate_overrides(fake_transformers) == EXPECTED
    assert os.listdir(home) == []
    monkeypatch.undo()
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    assert overrides.generate_overrides(fake_transformers) == EXPECTED  # the owner gets the cache
    assert os.listdir(home / ".cache" / "devmap_shims")


def test_a_non_utf8_install_path_is_cached_and_leaves_no_temporary_file(tmp_path, cache_home):
    root = tmp_path / os.fsdecode(b"site_\xe9") / "transformers"
    (root / "generation").mkdir(parents=True)
    (root / "generation" / "utils.py").write_text("class GenerationMixin:\n    def generate(self): pass\n")
    (root / "models" / "toy").mkdir(parents=True)
    (root / "models" / "toy" / "modeling_toy.py").write_text("class ToyForX:\n    def generate(self):\n        pass\n")
    assert overrides.generate_overrides(str(root)) == EXPECTED
    assert os.listdir(cache_home) == [os.path.basename(cache_path(str(root)))]  # stored, nothing left over
    assert overrides.generate_overrides(str(root)) == EXPECTED
