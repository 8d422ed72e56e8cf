"""Running someone else's code contained: in a thread of its own, for a bounded time, with what it
prints kept out of the host's streams (:func:`contained`). Plugins load through it
(:mod:`devmap_shims.shims.plugins`): a plugin runs inside every process that enables the shims.

Only the loader thread's output is captured, through stand-ins for ``sys.stdout`` and
``sys.stderr`` that route by thread: the host's other threads keep printing meanwhile, a loader
that overruns its time stays captured until it ends, and a stand-in whose loader has ended passes
everything through wherever it is still held.

No stand-in is ever freed. ``print()`` holds ``sys.stdout`` as a borrowed reference between its
writes in CPython releases without the fix of python/cpython#130163: a stand-in freed while
another thread prints through it crashes that thread (RecursionError) or the whole process
(segmentation fault). Idle stand-ins serve later loads instead, over the same host stream, or
over another one when nothing but the pool holds them any more, so neither stand-ins nor the
host streams they held pile up. (A thread that is still inside a ``print()`` begun through such
a stand-in before its load ended writes the rest of that print to the stream's new host.)
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

#: Characters of the captured output quoted in the report (the rest is counted, not kept).
QUOTED_OUTPUT = 200


class _Captured:
    """A stand-in for sys.stdout/stderr: counts what is written, keeps the beginning. It has what
    code that prints looks at (``encoding``, ``errors``, ``closed``, ``isatty``) but no ``fileno``
    or ``buffer``, so nothing writes past it to the host's file descriptors."""

    encoding = "utf-8"
    errors = "strict"
    closed = False

    def __init__(self) -> None:
        self.size = 0
        self.start = ""

    def write(self, text: str) -> int:
        if len(self.start) < QUOTED_OUTPUT:
            self.start += str(text)[: QUOTED_OUTPUT - len(self.start)]
        self.size += len(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _Routed:
    """Stands in for ``sys.stdout`` / ``sys.stderr`` while a plugin loads: what the loader thread
    writes (``write``, ``writelines``; it sees the capture's attributes only, no ``buffer``) goes to
    the capture, what every other thread writes to the host's stream, which answers everything
    else (``fileno``, ``encoding``, ``buffer`` ...). Once the loader has ended it passes everything
    through, wherever it is still held (a logging handler made meanwhile, a stream put on top)."""

    def __init__(self, host: Any, captured: Optional[_Captured], thread: Optional[int]) -> None:
        self._host = host
        self._captured = captured
        self._thread = thread  # None once the loader has ended

    def _loader(self) -> bool:
        return self._thread is not None and threading.get_ident() == self._thread

    def write(self, text: str) -> int:
        if self._loader():
            return self._captured.write(text)
        return self._host.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_host", "_captured", "_thread"):
            raise AttributeError(name)  # copy's and pickle's protocol; a copy without __init__
        return getattr(self._captured if self._loader() else self._host, name)


#: Every stand-in made, by stream name, kept for good (see the module's docstring), and the lock
#: over the pool and over what stands on ``sys.stdout`` / ``sys.stderr`` while loads start and end.
_MADE: Dict[str, List[_Routed]] = {"stdout": [], "stderr": []}  # the names of the streams stood in for
_LOCK = threading.Lock()


class _Holding(threading.local):
    """Whether this thread holds ``_LOCK``. A ``__del__`` or a signal handler runs on the thread it
    interrupts: one that loads a plugin while that thread sets up or gives back stand-ins must not
    wait for the lock (for ever) nor take up stand-ins half chosen; it loads without capturing."""

    held = False


_HOLDING = _Holding()


@contextmanager
def _held() -> Iterator[None]:
    """``_LOCK``, with this thread noted as holding it from before it asks for the lock until it has
    let go: there is no moment when it holds the lock unnoted."""
    _HOLDING.held = True
    try:
        with _LOCK:
            yield
    finally:
        _HOLDING.held = False


def _references(pool: List[_Routed], index: int) -> int:
    return sys.getrefcount(pool[index])


#: What :func:`_references` counts for a stand-in that nothing but the pool holds.
_ONLY_POOLED = _references([_Routed(None, None, None)], 0)


def _stand_in(name: str, host: Any, captured: _Captured, thread: Optional[int]) -> _Routed:
    """A stand-in over ``host`` routed to ``thread`` (under ``_LOCK``): an idle one over ``host``,
    else an idle one nothing else holds (not on the streams, under no other stand-in, in no
    logging handler) pointed at ``host``, else a new one."""
    pool = _MADE[name]
    idle = [i for i in range(len(pool)) if pool[i]._thread is None]
    mine = [i for i in idle if pool[i]._host is host]
    free = mine or [i for i in idle if _references(pool, i) <= _ONLY_POOLED]
    if not free:
        pool.append(_Routed(host, captured, thread))
        return pool[-1]
    router = pool[free[0]]
    router._host, router._captured = host, captured
    router._thread = thread  # last: routing starts once the rest is in place
    return router


def _idle(router: _Routed) -> None:
    """The loader ended (under ``_LOCK``): ``router`` passes everything to its host from now on,
    and the stand-ins over it stand over its host instead, so idle ones never stack up between
    the streams and the host (each one a frame more on every print)."""
    router._thread = None
    router._captured = None  # what the loader printed is counted and quoted already
    below = _unrouted(router._host)
    for pool in _MADE.values():
        for other in pool:
            if other._host is router:
                other._host = below


def reinit_after_fork() -> None:
    """In a child forked while a plugin loaded: that loader is not there, and a lock held then
    by another thread stays held. Every stand-in passes through and the streams are the host's,
    except those of a loader that forked itself: it goes on loading in the child."""
    global _LOCK
    _LOCK = threading.Lock()
    _HOLDING.held = False
    me = threading.get_ident()
    for pool in _MADE.values():
        for router in pool:
            if router._thread != me:
                _idle(router)
    for name in _MADE:
        setattr(sys, name, _unrouted(getattr(sys, name)))


def _unrouted(stream: Any) -> Any:
    """``stream``, or the host stream behind it when it is a :class:`_Routed` whose loader ended."""
    while isinstance(stream, _Routed) and stream._thread is None:
        stream = stream._host
    return stream


def contained(call: Callable[[], Any], budget: float) -> Tuple[Any, Optional[str], Optional[str]]:
    """``call()`` run in a thread of its own within ``budget`` seconds, its prints captured:
    ``(value, error, output)``: ``error`` says what went wrong (an exception of any kind, or the
    budget), ``output`` quotes what it printed (None when nothing).

    Only the loader thread's prints are captured: the host's other threads keep writing to their
    streams meanwhile (threads the plugin starts write to them too). A loader still running after
    its budget keeps its prints captured until it ends, and the streams go back to the host's
    then, so a late plugin does not print into the host's output. A stream that is None (no
    console) stays None. A load started by a ``__del__`` or a signal handler on a thread that is
    setting stand-ins up or giving them back runs uncaptured (its prints reach the host)."""
    outcome: Dict[str, Any] = {}
    captured = _Captured()
    names = tuple(_MADE)
    hosts: List[Any] = []
    routed: List[Any] = []
    routing = threading.Event()

    def run() -> None:
        try:
            routing.wait()  # the plugin's first print is already the loader's
            outcome["value"] = call()
        except BaseException as exc:  # SystemExit, KeyboardInterrupt: the plugin's, never the host's
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            # the loader, and only it, gives the streams back: in the same hold of the lock as its
            # stand-ins go idle, before another load can take one of them up again
            if any(router is not None for router in routed):
                with _held():
                    for name, router, host in zip(names, routed, hosts):
                        if router is not None:
                            _idle(router)
                            if getattr(sys, name) is router:
                                setattr(sys, name, _unrouted(host))

    worker = threading.Thread(target=run, name="devmap-shims plugin loader", daemon=True)
    try:
        worker.start()
        if not _HOLDING.held:  # else a finalizer of this thread, run under the lock: not captured
            with _held():  # the streams as they are now, not as another load's stand-ins left them
                for name in names:
                    hosts.append(getattr(sys, name))
                    over = _unrouted(hosts[-1])  # an idle stand-in a redirect_stdout() put back
                    routed.append(None if over is None else _stand_in(name, over, captured, worker.ident))
                    if routed[-1] is not None:
                        setattr(sys, name, routed[-1])
    finally:
        routing.set()
    worker.join(budget)
    if worker.is_alive():
        outcome["error"] = f"still running after {budget:.3g} s; start-up went on without it"
    output = None
    if captured.size:
        quoted = " ".join(captured.start.split())
        output = f"printed {captured.size} characters, not shown to the host ({quoted!r}...)"
    return outcome.get("value"), outcome.get("error"), output
