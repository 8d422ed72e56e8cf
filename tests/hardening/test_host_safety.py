"""What the layer loads, reads or wraps cannot kill, hang or flood the host process.

Each probe runs in a fresh interpreter with ``DEVMAP_SHIMS=1`` (auto-enable through the ``.pth``
file) or with ``install()`` called from code, against a plugin distribution written here that
misbehaves on purpose, and checks that the process finishes, exits 0 and keeps its streams.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from devmap_shims.shims import containment, plugins

EVIL_PLUGIN = '''
import os, sys, time

MODE = os.environ.get("EVIL_MODE", "")
if os.environ.get("EVIL_MARKER"):
    open(os.environ["EVIL_MARKER"], "w").close()
if MODE == "import-exit":
    raise SystemExit(3)
if MODE == "import-interrupt":
    raise KeyboardInterrupt
if MODE == "probe-torch":  # an availability check, as plugins make them
    import importlib.util
    HAVE_TORCH = importlib.util.find_spec("torch") is not None
if MODE == "import-torch":
    import torch


def _forever():
    while True:
        time.sleep(1)
        yield None


def _exits():
    raise SystemExit(7)
    yield None


def shims():
    if MODE == "slow-both":
        time.sleep(float(os.environ["EVIL_SLEEP"]))
    if MODE == "gen-hang":
        return _forever()
    if MODE == "late":
        time.sleep(float(os.environ["EVIL_SLEEP"]))
        print("LATE FROM THE PLUGIN")
        sys.stderr.write("LATE ON STDERR" + chr(10))
        return []
    if MODE == "slow":
        time.sleep(1)
        return []
    if MODE == "shims-exit":
        raise SystemExit(4)
    if MODE == "shims-interrupt":
        raise KeyboardInterrupt
    if MODE == "hang":
        time.sleep(1000)
    if MODE == "print":
        sys.stdout.write("x" * 5_000_000)
        sys.stderr.write("y" * 1000)
    return []


def rows():
    if MODE == "slow-both":
        time.sleep(float(os.environ["EVIL_SLEEP"]))
    if MODE == "rows-exit":
        raise SystemExit(5)
    if MODE == "gen-exit":
        return _exits()
    if MODE == "fifo-rows":
        return os.environ["EVIL_FIFO"]
    return []
'''


def _python(code, *options, path=(), timeout=60, cwd=None, **env_extra):
    """``code`` run by this interpreter with this test run's sys.path (``path`` first) and no
    DEVMAP_SHIMS variables but those given; the process, with the seconds it took."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    env.update(PYTHONPATH=os.pathsep.join([*map(str, path), *sys.path]), **env_extra)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *options, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)
    proc.seconds = time.monotonic() - start
    return proc


@pytest.fixture
def evil(tmp_path):
    """A plugin distribution ``evil-plugin`` on PYTHONPATH; ``run(code, mode, **env)`` runs code."""
    site = tmp_path / "site"
    (site / "evilplug").mkdir(parents=True)
    (site / "evilplug" / "__init__.py").write_text(textwrap.dedent(EVIL_PLUGIN))
    dist = site / "evil_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[devmap_shims.shims]\nevil = evilplug:shims\n\n[devmap_shims.matrix]\nevil = evilplug:rows\n"
    )
    (site / "torch").mkdir()  # a stand-in for the first target library a program imports
    (site / "torch" / "__init__.py").write_text("")

    def run(code, mode="", timeout=60, **env_extra):
        return _python(code, path=[site], timeout=timeout, cwd=tmp_path, EVIL_MODE=mode, **env_extra)

    return run


STATUS = "import devmap_shims, torch; st = devmap_shims.status(); print('ALIVE', st['installed'])"


@pytest.mark.parametrize("mode", ["import-exit", "import-interrupt", "shims-exit", "shims-interrupt", "rows-exit"])
def test_a_plugin_that_raises_systemexit_or_keyboardinterrupt_is_skipped(evil, mode):
    at_start = evil(STATUS, mode, DEVMAP_SHIMS="1", DEVMAP_SHIMS_PLUGINS="evil-plugin")
    assert at_start.returncode == 0 and "ALIVE True" in at_start.stdout, at_start.stderr[-2000:]
    assert "plugin evil-plugin" in at_start.stderr and ("SystemExit" in at_start.stderr or "KeyboardInterrupt" in at_start.stderr)
    in_code = evil("import devmap_shims; devmap_shims.install(); print('ALIVE', devmap_shims.is_installed())", mode)
    assert in_code.returncode == 0 and "ALIVE True" in in_code.stdout, in_code.stderr[-2000:]


def test_what_a_plugin_returns_is_consumed_within_its_budget(evil, tmp_path):
    # a generator that never ends, one that raises SystemExit, a TOML "file" that is a FIFO: all
    # the plugin's doing, all inside the contained load
    fifo = tmp_path / "rows.toml"
    os.mkfifo(fifo)
    for mode, said in (("gen-hang", "still running after"), ("gen-exit", "SystemExit: 7"),
                       ("fifo-rows", "is not a regular file")):
        for code, env in ((STATUS, {"DEVMAP_SHIMS": "1", "DEVMAP_SHIMS_PLUGINS": "*"}),
                          ("import devmap_shims; devmap_shims.install(); print('ALIVE', devmap_shims.is_installed())", {})):
            proc = evil(code, mode, EVIL_FIFO=str(fifo), timeout=60, **env)
            assert proc.returncode == 0 and "ALIVE True" in proc.stdout, (mode, proc.stderr[-2000:])
            assert said in proc.stderr and "evil-plugin" in proc.stderr, (mode, proc.stderr[-2000:])
            assert proc.seconds < plugins.LOAD_BUDGET * 2 + 20


def test_a_plugin_that_prints_after_its_budget_stays_out_of_the_hosts_streams(evil):
    code = "import time; print('host start'); time.sleep({}); print('host end')".format(plugins.LOAD_BUDGET)
    proc = evil(code, "late", DEVMAP_SHIMS="1", DEVMAP_SHIMS_PLUGINS="*", EVIL_SLEEP=str(plugins.LOAD_BUDGET + 1))
    assert proc.returncode == 0 and proc.stdout.split("\n")[:2] == ["host start", "host end"], proc.stdout
    assert "LATE" not in proc.stdout and "LATE" not in proc.stderr
    assert "still running after" in proc.stderr


def test_the_hosts_other_threads_keep_their_output_while_a_plugin_loads(evil):
    code = textwrap.dedent("""
        import threading, time, devmap_shims
        def chatter():
            for i in range(30):
                print('host line', i, flush=True)
                time.sleep(0.05)
        t = threading.Thread(target=chatter)
        t.start()
        devmap_shims.install()
        t.join()
        print('WARNINGS', [w for w in devmap_shims.status()['warnings'] if 'host line' in w])
    """)
    proc = evil(code, "slow")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line for line in proc.stdout.splitlines() if line.startswith("host line")] == [
        f"host line {i}" for i in range(30)]
    assert "WARNINGS []" in proc.stdout


PRINTING_THROUGH_A_DROPPED_STAND_IN = """
import sys, threading
from devmap_shims.shims import containment

class Host:  # the host's stream: its first write waits until the plugin's load is over
    def __init__(self):
        self.parts, self.first, self.go = [], threading.Event(), threading.Event()
    def write(self, text):
        self.parts.append(text)
        if len(self.parts) == 1:
            self.first.set()
            self.go.wait(10)
        return len(text)
    def flush(self):
        pass

host = sys.stdout = Host()
printer = threading.Thread(target=lambda: print("a", "b", "c"))
def plugin():
    printer.start()  # a thread of the host's, printing through the stand-in
    host.first.wait(10)
containment.contained(plugin, budget=10)  # the stand-in leaves sys.stdout mid-print
host.go.set()
printer.join()
sys.stdout = sys.__stdout__
print(host.parts)
"""


def test_a_thread_printing_while_the_streams_go_back_keeps_its_stand_in():
    # print() holds sys.stdout borrowed between its writes (python/cpython#130163): a stand-in
    # freed then was used after free, a RecursionError in the printing thread or a segfault
    proc = _python(PRINTING_THROUGH_A_DROPPED_STAND_IN)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == repr(["a", " ", "b", " ", "c", "\n"]), proc.stderr[-2000:]
    assert "Error" not in proc.stderr


LOADING_FROM_A_FINALIZER_UNDER_THE_LOCK = """
import contextlib, gc, io, os, sys, time
from devmap_shims.shims import containment

if os.environ["WHEN"] == "while-choosing":  # an idle stand-in over another stream, for the outer load to pick
    with contextlib.redirect_stdout(io.StringIO()):
        containment.contained(lambda: 1, budget=5)
inner = []
class Finalized:  # a __del__ (or a signal handler) that loads a plugin: runs on the thread it interrupts
    def __del__(self):
        inner.append(containment.contained(lambda: print("INNER") or "inner", budget=5))

def collect():
    if not inner and not getattr(collect, "done", False):
        collect.done = True
        cycle = Finalized(); cycle.me = cycle; del cycle
        gc.collect()

# a garbage collection while the outer load holds the lock: before it picks a stand-in, or
# between counting an idle one's references and taking it up
name = "_stand_in" if os.environ["WHEN"] == "before-choosing" else "_references"
real = getattr(containment, name)
def collecting(*args):
    if name == "_stand_in":
        collect()
    result = real(*args)
    if name == "_references":
        collect()
    return result
setattr(containment, name, collecting)

def outer_plugin():
    time.sleep(0.3)  # the inner load has ended by now
    print("OUTER")
    return "outer"
outer = containment.contained(outer_plugin, budget=10)
setattr(containment, name, real)
print("RESULTS", outer[0], outer[1], outer[2] is not None, inner[0][0], inner[0][1])
print("STREAMS", sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__)
"""


@pytest.mark.parametrize("when", ["before-choosing", "while-choosing"])
def test_a_load_started_by_a_finalizer_under_the_lock_neither_hangs_nor_takes_the_outer_loads_streams(when):
    # the same thread asked for the lock again: it waited for itself for ever; a reentrant lock
    # let the inner load take up the stand-in the outer one had chosen, and give it back early
    proc = _python(LOADING_FROM_A_FINALIZER_UNDER_THE_LOCK, timeout=30, WHEN=when)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["INNER", "RESULTS outer None True inner None", "STREAMS True"]


def _pooled():
    return sum(len(pool) for pool in containment._MADE.values())


def test_stand_ins_kept_for_good_do_not_pile_up_nor_keep_the_hosts_streams():
    import contextlib
    import io
    import weakref

    before = _pooled()
    for _ in range(50):
        containment.contained(lambda: print("plugin"), budget=plugins.LOAD_BUDGET)
    streams = []
    for _ in range(50):  # a program loading plugins under a new sys.stdout each time
        stream = io.StringIO()
        streams.append(weakref.ref(stream))
        with contextlib.redirect_stdout(stream):
            containment.contained(lambda: print("plugin"), budget=plugins.LOAD_BUDGET)
        del stream
    assert _pooled() <= before + 2
    assert sum(ref() is not None for ref in streams) <= 1  # the last one may still be pointed at


def test_plugins_loading_in_two_threads_at_once_keep_their_output_and_the_hosts():
    import threading

    class Host:
        def __init__(self):
            self.parts = []

        def write(self, text):
            self.parts.append(text)
            return len(text)

        def flush(self):
            pass

    def loads(outputs):
        for _ in range(150):
            outputs.append(containment.contained(lambda: print("PLUGIN OUTPUT"), budget=10)[2])

    host, before = Host(), sys.stdout
    outputs = []
    sys.stdout = host
    try:
        threads = [threading.Thread(target=loads, args=(outputs,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for _ in range(300):
            print("HOST OUTPUT")
        for thread in threads:
            thread.join()
        after = sys.stdout
    finally:
        sys.stdout = before
    assert after is host  # the stand-ins left the streams
    assert "PLUGIN OUTPUT" not in host.parts and host.parts.count("HOST OUTPUT") == 300
    assert outputs == ["printed 14 characters, not shown to the host ('PLUGIN OUTPUT'...)"] * 300


def test_a_copy_of_a_stand_in_writes_where_the_stand_in_does():
    import copy
    import io

    host = io.StringIO()
    stand_in = containment._Routed(host, None, None)
    copy.copy(stand_in).write("through the copy")  # copy looks up __setstate__ before any state
    assert host.getvalue() == "through the copy"


def _depth(stream):
    depth = 0
    while isinstance(stream, containment._Routed):
        stream, depth = stream._host, depth + 1
    return depth


def test_overlapping_loads_and_redirects_do_not_stack_stand_ins_over_the_hosts_streams():
    # each stand-in left between sys.stdout and the host is a frame more on every print: a
    # thousand of them made every print of the program raise RecursionError
    import contextlib
    import io
    import threading

    before, deepest = sys.stdout, []
    loads = 120
    turn = [threading.Semaphore(1), threading.Semaphore(0)]
    started = [threading.Event() for _ in range(loads + 1)]
    started[loads].set()  # the last load waits for no other

    def host(k):  # two threads of the program, each load ending while the other's has begun
        for n in range(k, loads, 2):
            turn[k].acquire()

            def plugin(n=n):
                started[n].set()
                turn[1 - k].release()
                started[n + 1].wait(10)  # the next load's stand-in is on the streams now
                deepest.append(_depth(sys.stdout))

            containment.contained(plugin, budget=10)

    try:
        threads = [threading.Thread(target=host, args=(k,)) for k in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sys.stdout is before and len(deepest) == loads and max(deepest) <= 2, deepest

        for _ in range(60):  # the program redirects its output while a load ends
            loading, redirected = threading.Event(), threading.Event()

            def plugin():
                loading.set()
                redirected.wait(10)

            loader = threading.Thread(target=containment.contained, args=(plugin, 10))
            loader.start()
            loading.wait(10)
            with contextlib.redirect_stdout(io.StringIO()):  # gives back the stand-in on leaving
                redirected.set()
                loader.join()
            deepest.append(_depth(sys.stdout))
        assert max(deepest[loads:]) <= 1
    finally:
        sys.stdout = before


FORK_WHILE_A_PLUGIN_LOADS = """
import os, signal, sys, threading, time
import devmap_shims.shims.engine
from devmap_shims.shims import containment
loading, forked = threading.Event(), threading.Event()
def host_thread():
    loading.wait(10)
    read, write = os.pipe()
    if os.fork() == 0:
        signal.alarm(10)
        printer = threading.Thread(target=print, args=("CHILD THREAD LINE",))
        printer.start()
        printer.join()
        sys.stdout.flush()
        os.write(write, repr((type(sys.stdout).__name__, containment.contained(lambda: 1, 10))).encode())
        os._exit(0)
    os.close(write)
    print("CHILD SAID", os.read(read, 1000).decode(), flush=True)
    forked.set()
threading.Thread(target=host_thread).start()
def plugin():
    loading.set()
    forked.wait(20)
    with containment._LOCK:  # a fork while another thread holds the lock, too
        if os.fork() == 0:
            signal.alarm(10)
            os.write(1, repr(containment.contained(lambda: 2, 10)).encode())
            os._exit(0)
        os.wait()
containment.contained(plugin, budget=30)
"""


def test_a_child_forked_while_a_plugin_loads_has_the_hosts_streams_and_can_load_plugins():
    proc = _python(FORK_WHILE_A_PLUGIN_LOADS, "-W", "ignore")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CHILD THREAD LINE" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert "CHILD SAID ('TextIOWrapper', (1, None, None))" in proc.stdout, proc.stdout
    assert "(2, None, None)" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


def test_the_streams_come_back_when_a_late_loader_ends_under_another_loaders_streams():
    import threading

    before = sys.stdout, sys.stderr
    release = threading.Event()
    value, error, _ = containment.contained(lambda: release.wait(10), budget=0.1)
    assert value is None and "still running after 0.1 s" in error

    def second():
        release.set()  # the first loader ends now, while this loader's stand-ins are in place
        time.sleep(0.3)
        return "second"

    assert containment.contained(second, budget=10)[0] == "second"
    deadline = time.monotonic() + 10  # the first loader ends when the scheduler lets it
    while (sys.stdout, sys.stderr) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (sys.stdout, sys.stderr) == before  # no stand-in left behind, late or not


def test_a_loader_sees_only_the_capture_and_writes_every_way_into_it():
    def plugin():
        sys.stdout.writelines(["one\n", "two\n"])
        print("three", file=sys.stderr)
        streams = sys.stdout.encoding, sys.stderr.errors, sys.stdout.closed  # what printing code asks
        return hasattr(sys.stdout, "buffer"), hasattr(sys.stderr, "fileno"), streams

    value, error, output = containment.contained(plugin, budget=plugins.LOAD_BUDGET)
    assert error is None and value == (False, False, ("utf-8", "strict", False)), (error, value)
    assert output and "printed 14 characters" in output and "one two three" in output


def test_a_missing_console_stays_missing_while_a_plugin_loads(monkeypatch):
    import threading

    monkeypatch.setattr(sys, "stdout", None)  # pythonw, or a service with its streams closed
    monkeypatch.setattr(sys, "stderr", None)
    problems = []
    loading = threading.Event()

    def host_thread():
        loading.wait(10)
        try:
            print("the host, with no console")
        except Exception as exc:  # print() to a None stream does nothing; to a stand-in it raised
            problems.append(exc)

    thread = threading.Thread(target=host_thread)
    thread.start()

    def plugin():
        loading.set()
        thread.join(10)
        print("the plugin")

    value, error, output = containment.contained(plugin, budget=plugins.LOAD_BUDGET)
    assert error is None and problems == [] and sys.stdout is None and sys.stderr is None


def test_an_entry_points_file_that_is_a_fifo_is_not_read(tmp_path):
    # the working directory is on sys.path for `python -c`, and anybody may have made it; looking
    # for plugins must not block on it
    folder = tmp_path / "trap-0.1.dist-info"
    folder.mkdir()
    os.mkfifo(folder / "entry_points.txt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    proc = subprocess.run([sys.executable, "-c", "import devmap_shims; devmap_shims.install(); print('ALIVE')"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == "ALIVE\n", proc.stderr[-2000:]


@pytest.mark.parametrize("name", ["entry_points.txt", "METADATA", ""])
def test_with_a_plugin_installed_a_fifo_in_another_distribution_is_not_read(evil, tmp_path, name):
    # a real plugin makes the search read every distribution's files: one in the working directory
    # whose entry points or metadata are a FIFO, or that is one itself, is skipped, and the plugin
    # still loads
    folder = tmp_path / "trap-0.1.dist-info"
    if name:
        folder.mkdir()
    if name == "entry_points.txt":
        (folder / "METADATA").write_text("Metadata-Version: 2.1\nName: trap\nVersion: 0.1\n")
    os.mkfifo(folder / name if name else folder)
    marker = tmp_path / "plugin-imported"
    proc = evil("import devmap_shims; devmap_shims.install(); print('ALIVE')", EVIL_MARKER=str(marker))
    assert proc.returncode == 0 and proc.stdout == "ALIVE\n", proc.stderr[-2000:]
    assert marker.exists()  # the plugin was found and loaded


@pytest.mark.parametrize("fifo", ["torch-9.0.dist-info/METADATA", "torch-9.0.dist-info"])
def test_a_target_whose_metadata_is_a_fifo_is_passed_over(evil, tmp_path, fifo):
    # looking up the installed versions reads each target's METADATA: a torch-9.0.dist-info in the
    # working directory that is, or holds, a FIFO must not hold the program at its first import;
    # the next torch on sys.path (none, or this stack's) gives the version
    if fifo.endswith("METADATA"):
        (tmp_path / "torch-9.0.dist-info").mkdir()
    os.mkfifo(tmp_path / fifo)
    code = "import torch, devmap_shims; print('ALIVE', devmap_shims.status()['versions'].get('torch'))"
    proc = evil(code, DEVMAP_SHIMS="1")
    assert proc.returncode == 0 and "ALIVE" in proc.stdout and "9.0" not in proc.stdout, proc.stderr[-2000:]


def test_a_hanging_plugin_costs_its_budget_once_and_is_named(evil):
    proc = evil(STATUS, "hang", DEVMAP_SHIMS="1", DEVMAP_SHIMS_PLUGINS="*", timeout=120)
    assert proc.returncode == 0 and "ALIVE True" in proc.stdout, proc.stderr[-2000:]
    assert proc.seconds < plugins.LOAD_BUDGET * 2 + 20
    assert f"still running after {plugins.LOAD_BUDGET:g} s" in proc.stderr and "evil-plugin" in proc.stderr


def test_all_plugins_together_get_one_overall_budget(evil, tmp_path, monkeypatch):
    # two entry points that each take longer than the whole budget: the first runs out its share,
    # and the second is not started
    import time

    import devmap_shims

    evil("pass")  # writes the plugin distribution
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("EVIL_MODE", "slow-both")
    monkeypatch.setenv("EVIL_SLEEP", "3")  # the loader threads end soon after the test
    monkeypatch.setattr(plugins, "LOAD_BUDGET", 1.0)
    monkeypatch.setattr(plugins, "TOTAL_BUDGET", 1.0)
    start = time.monotonic()
    try:
        assert devmap_shims.install()
        seconds = time.monotonic() - start
        warnings = devmap_shims.status()["warnings"]
    finally:
        from devmap_shims.shims.engine import ENGINE

        ENGINE.reset()
    assert seconds < 10, seconds  # the loads never wait out the plugins' 3 s sleeps
    assert any("matrix entry point 'evil'" in w and "still running when the plugins' 1 s together ran out" in w
               for w in warnings), warnings
    assert any("shim entry point 'evil'" in w and "the plugins used up their 1 s together" in w
               for w in warnings), warnings


def test_what_a_plugin_prints_stays_out_of_the_hosts_streams(evil):
    proc = evil("import devmap_shims; devmap_shims.install(); print('ALIVE')", "print")
    assert proc.returncode == 0 and proc.stdout == "ALIVE\n"
    assert len(proc.stderr) < 5000 and "printed 5001000 characters" in proc.stderr


def test_at_start_up_only_the_plugins_the_operator_names_are_loaded(evil, tmp_path):
    marker = tmp_path / "imported"
    proc = evil(STATUS, DEVMAP_SHIMS="1", EVIL_MARKER=str(marker))
    assert proc.returncode == 0 and "ALIVE True" in proc.stdout
    assert not marker.exists(), "an unnamed plugin ran at start-up"
    proc = evil(STATUS, DEVMAP_SHIMS="1", DEVMAP_SHIMS_PLUGINS="evil-plugin", EVIL_MARKER=str(marker))
    assert proc.returncode == 0 and marker.exists()


@pytest.mark.parametrize("spelling", ["evil_plugin", "Evil.Plugin"])
def test_a_plugin_is_named_as_its_distribution_may_be_spelled(evil, tmp_path, spelling):
    # evil_plugin is how its dist-info folder spells it; distribution names ignore case and -_.
    marker = tmp_path / "imported"
    proc = evil(STATUS, DEVMAP_SHIMS="1", DEVMAP_SHIMS_PLUGINS=spelling, EVIL_MARKER=str(marker))
    assert proc.returncode == 0 and marker.exists() and "DEVMAP_SHIMS_PLUGINS names" not in proc.stderr, proc.stderr
    code = ("import os, devmap_shims; devmap_shims.install(); print('AFTER', os.path.exists(os.environ['EVIL_MARKER']))")
    proc = evil(code, DEVMAP_SHIMS="1", DEVMAP_SHIMS_PLUGINS=spelling, DEVMAP_SHIMS_LOG="info", EVIL_MARKER=str(marker))
    assert proc.returncode == 0 and "replaces" not in proc.stderr, proc.stderr  # start-up loaded it already


def test_the_programs_install_loads_the_plugins_start_up_left_out(evil, tmp_path):
    marker = tmp_path / "imported"
    code = ("import os, devmap_shims; print('BEFORE', os.path.exists(os.environ['EVIL_MARKER'])); "
            "devmap_shims.install(); print('AFTER', os.path.exists(os.environ['EVIL_MARKER']))")
    proc = evil(code, DEVMAP_SHIMS="1", DEVMAP_SHIMS_LOG="info", EVIL_MARKER=str(marker))
    assert proc.returncode == 0 and proc.stdout.split() == ["BEFORE", "False", "AFTER", "True"], proc.stderr
    assert "replaces the start-up install (DEVMAP_SHIMS=1): plugins of evil-plugin loaded" in proc.stderr
    # the plugins start-up loaded already: nothing to replace
    marker.unlink()
    proc = evil(code, DEVMAP_SHIMS="1", DEVMAP_SHIMS_PLUGINS="evil-plugin", DEVMAP_SHIMS_LOG="info",
                EVIL_MARKER=str(marker))
    assert proc.returncode == 0 and proc.stdout.split() == ["BEFORE", "True", "AFTER", "True"], proc.stderr
    assert "replaces" not in proc.stderr


@pytest.mark.parametrize("mode", ["probe-torch", "import-torch"])
def test_the_programs_install_after_start_up_loads_a_plugin_that_looks_for_a_target(evil, mode):
    """A plugin that probes or imports torch fires the start-up install's trigger while the program's
    install() loads it: that install must not wait for its own lock (it hung for good)."""
    code = ("import devmap_shims; devmap_shims.install(); import torch; "
            "st = devmap_shims.status(); print('ALIVE', st['installed'], st['warnings'])")
    proc = evil(code, mode, timeout=30, DEVMAP_SHIMS="1")
    assert proc.returncode == 0 and proc.stdout.startswith("ALIVE True []"), proc.stderr[-2000:]


def test_a_named_plugin_not_on_the_path_at_start_up_is_said(evil):
    proc = evil(STATUS, DEVMAP_SHIMS="1", DEVMAP_SHIMS_PLUGINS="later-plugin")
    assert proc.returncode == 0 and "ALIVE True" in proc.stdout
    assert "DEVMAP_SHIMS_PLUGINS names 'later-plugin'" in proc.stderr and "sorted after devmap_shims.pth" in proc.stderr


# -- switches ---------------------------------------------------------------------------------------
def test_the_kill_switch_beats_run(evil):
    code = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-m', 'devmap_shims', 'run', '--', sys.executable, '-c', 'import os, devmap_shims; print(os.environ[\"DEVMAP_SHIMS\"], devmap_shims.is_installed())']))"
    proc = evil(code, DEVMAP_SHIMS="0")
    assert proc.returncode == 0 and proc.stdout.split() == ["0", "False"], proc.stderr
    assert proc.stderr.count("kill switch") == 1


@pytest.mark.parametrize("command, code", [(["no-such-command-xyz"], 127), (["/etc/passwd"], 126)])
def test_run_of_a_missing_or_unexecutable_command_exits_like_a_shell(command, code):
    from devmap_shims.cli import main

    assert main(["run", "--", *command]) == code


def test_strict_mode_at_start_up_is_one_line_and_no_shims(evil):
    proc = evil("import devmap_shims; print('ALIVE', devmap_shims.is_installed())",
                DEVMAP_SHIMS="1", DEVMAP_SHIMS_STRICT="1", DEVMAP_SHIMS_DISABLE="no-such-shim")
    assert proc.returncode == 0 and proc.stdout.split() == ["ALIVE", "False"]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "strict mode" in lines[0] and "no-such-shim" in lines[0], proc.stderr


def test_unknown_ids_are_warned_once_each_and_long_values_are_cut(evil):
    long_id = "z" * 10_000
    proc = evil("import devmap_shims; devmap_shims.install(); devmap_shims.install(strict=True); print('ALIVE')",
                DEVMAP_SHIMS_DISABLE=f"no-such-shim,{long_id}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("no-such-shim") == 1 and "install(exclude" not in proc.stderr
    assert len(proc.stderr) < 3000 and "(10000 characters)" in proc.stderr


def test_warnings_stay_bounded():
    from devmap_shims.shims.registry import MAX_WARNINGS, Registry

    registry = Registry()
    for i in range(20_000):
        registry.warn(f"problem {i % 5000}")
    # the first MAX_WARNINGS messages are kept (their repeats ignored); the others only counted
    assert len(registry.warnings) == MAX_WARNINGS and registry.warnings_dropped == 20_000 - 4 * MAX_WARNINGS


def test_log_lines_print_once_when_the_program_configured_logging(evil):
    code = ("import logging; logging.basicConfig(); import devmap_shims; "
            "devmap_shims.install(exclude=['nope'])")
    proc = evil(code, DEVMAP_SHIMS_LOG="info")
    assert proc.returncode == 0
    lines = [line for line in proc.stderr.splitlines() if "names unknown shim 'nope'" in line]
    assert len(lines) == 1 and "devmap_shims: devmap_shims:" not in lines[0], proc.stderr


# -- pytest -------------------------------------------------------------------------------------------
def test_pytest_with_warnings_as_errors_runs_with_the_shims_enabled(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    env["DEVMAP_SHIMS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-W", "error", "-q", "-p", "no:cacheprovider", "test_one.py"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


# -- wrapping while the program runs -------------------------------------------------------------------
SLOW_LIBRARY = '''
import time
time.sleep(1.5)  # importing takes a while: install() comes in the middle of it


def compute(x):
    return x * 2
'''


@pytest.fixture
def fresh_engine(tmp_path, monkeypatch):
    from devmap_shims.shims.engine import ENGINE

    for name in [n for n in os.environ if n.startswith("DEVMAP_SHIMS")]:
        monkeypatch.delenv(name)
    monkeypatch.syspath_prepend(str(tmp_path))
    ENGINE.reset()
    yield ENGINE
    ENGINE.reset()
    for name in [n for n in sys.modules if n.startswith(("slowlib", "plainlib"))]:
        del sys.modules[name]


def _fix(module: str, bug: str = "race-bug"):
    from devmap_shims import Shim, Target

    row = dict(id=bug, title="t", library="x", affected={"wrapt": ">=0"}, fixed_in="unfixed", last_checked="2026-11-01",
               symptom="s", root_cause="r", upstream=["a/b#1"], verification=["I"], workaround="w")
    shim = Shim("add-one", (bug,), (Target(module, "compute"),),
                lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + 1)
    return shim, [row]


def test_install_while_another_thread_imports_the_target_still_wraps_it(tmp_path, fresh_engine):
    import threading

    (tmp_path / "slowlib.py").write_text(SLOW_LIBRARY)
    importer = threading.Thread(target=__import__, args=("slowlib",))
    importer.start()
    deadline = time.monotonic() + 10
    while "slowlib" not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "slowlib" in sys.modules and importer.is_alive(), "the import should still be running"
    fresh_engine.register(*_fix("slowlib"))
    fresh_engine.install(only=["add-one"])
    importer.join()
    state = None
    while time.monotonic() < deadline:
        state = next(s for s in fresh_engine.status()["shims"] if s["id"] == "add-one")["state"]
        if state == "active":
            break
        time.sleep(0.05)
    assert state == "active"
    assert sys.modules["slowlib"].compute(3) == 7


def test_a_fork_while_the_registry_lock_is_held_leaves_the_child_working(tmp_path):
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    script = textwrap.dedent("""
        import os, signal, sys, threading, time
        import devmap_shims
        from devmap_shims.shims.engine import ENGINE
        devmap_shims.install()
        held = threading.Event()
        def hold():
            with ENGINE.registry.lock:
                held.set()
                time.sleep(30)
        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)
            devmap_shims.uninstall(); devmap_shims.install()
            print("CHILD", len(devmap_shims.status()["shims"]), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("PARENT", os.waitstatus_to_exitcode(status), flush=True)
        os._exit(0)
    """)
    proc = _python(script)
    assert "PARENT 0" in proc.stdout and "CHILD" in proc.stdout, proc.stdout + proc.stderr


def test_a_fork_while_another_thread_looks_up_a_watched_module_leaves_it_hooked_in_the_child(monkeypatch):
    # that thread is not in the child: the name it was looking up must not stay "in progress",
    # or the child's own import of it would not be hooked
    import threading

    from devmap_shims.shims import importhook

    finder = importhook._PostImportFinder()
    monkeypatch.setattr(importhook, "_finder", finder)
    monkeypatch.setattr(importhook, "_lock", importhook._lock)  # the reinit replaces it: put back after
    monkeypatch.setitem(importhook._hooks, "colorsys", [])
    finder._in_progress["colorsys"] = threading.get_ident() + 1  # another thread, at the fork
    finder._in_progress["mine"] = threading.get_ident()  # the forking thread's own lookup goes on
    importhook.reinit_after_fork()
    assert set(finder._in_progress) == {"mine"}
    spec = finder.find_spec("colorsys")
    assert spec is not None and isinstance(spec.loader, importhook._ChainedLoader)


def test_a_layer_captured_by_a_foreign_wrapper_is_switched_off_and_a_new_install_adds_one(tmp_path, fresh_engine):
    (tmp_path / "plainlib.py").write_text("def compute(x):\n    return x * 2\n")
    import plainlib

    class Tracer:  # a foreign wrapper that keeps our layer where nobody can see it
        def __init__(self, inner):
            self._inner = inner

        def __call__(self, *args):
            return self._inner(*args)

    fresh_engine.register(*_fix("plainlib"))
    fresh_engine.install(only=["add-one"])
    plainlib.compute = Tracer(plainlib.compute)
    assert plainlib.compute(3) == 7
    fresh_engine.uninstall()
    assert plainlib.compute(3) == 6, "the captured layer must stop repairing"
    assert any("switched off" in w for w in fresh_engine.registry.warnings)
    fresh_engine.install(only=["add-one"])
    assert plainlib.compute(3) == 7, "one repair, not two"
