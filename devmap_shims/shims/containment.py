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
(segmentation fault). An idle stand-in serves the next load over the same host stream again, so
they do not pile up.
"""

from __future__ import annotations

import sys
import threading

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

#: Characters of the captured output quoted in the report (the rest is counted, not kept).
QUOTED_OUTPUT = 200


class _Captured:
    """A stand-in for sys.stdout/stderr: counts what is written, keeps the beginning."""

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

    def __init__(self, host: Any, captured: _Captured, thread: Optional[int]) -> None:
        self._host = host
        self._captured = captured
        self._thread = thread  # None once the loader has ended

    def _loader(self) -> bool:
        import threading

        return self._thread is not None and threading.get_ident() == self._thread

    def write(self, text: str) -> int:
        if self._loader():
            return self._captured.write(text)
        return self._host.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._captured if self._loader() else self._host, name)


#: Every stand-in made, kept for good (see the module's docstring), and the lock over it and over
#: what stands on ``sys.stdout`` / ``sys.stderr`` while loaders start and end.
_MADE: List[_Routed] = []
_LOCK = threading.Lock()


def _stand_in(host: Any, captured: _Captured, thread: Optional[int]) -> _Routed:
    """An idle stand-in over ``host`` routed to ``thread`` again, or a new one (under ``_LOCK``)."""
    for router in _MADE:
        if router._host is host and router._thread is None:
            router._captured = captured
            router._thread = thread
            return router
    router = _Routed(host, captured, thread)
    _MADE.append(router)
    return router


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
    console) stays None."""
    outcome: Dict[str, Any] = {}
    captured = _Captured()
    names = ("stdout", "stderr")
    hosts = [getattr(sys, name) for name in names]
    routed: List[Any] = []

    def restore() -> None:  # under _LOCK, once, by whichever of the caller and the loader is last
        for name, router, host in zip(names, routed, hosts):
            if router is not None and getattr(sys, name) is router:
                setattr(sys, name, _unrouted(host))
        del routed[:]

    routing = threading.Event()

    def run() -> None:
        try:
            routing.wait()  # the plugin's first print is already the loader's
            outcome["value"] = call()
        except BaseException as exc:  # SystemExit, KeyboardInterrupt: the plugin's, never the host's
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            with _LOCK:
                for router in routed:
                    if router is not None:
                        router._thread = None  # from now on it passes everything to the host
                outcome["done"] = True
                if outcome.get("late"):
                    restore()

    worker = threading.Thread(target=run, name="devmap-shims plugin loader", daemon=True)
    try:
        worker.start()
        with _LOCK:
            routed[:] = [None if host is None else _stand_in(host, captured, worker.ident) for host in hosts]
            for name, router in zip(names, routed):
                if router is not None:
                    setattr(sys, name, router)
        routing.set()
        worker.join(budget)
    finally:
        routing.set()
        with _LOCK:
            outcome["late"] = not outcome.get("done")
            if not outcome["late"]:
                restore()
    if outcome["late"]:
        outcome["error"] = f"still running after {budget:.3g} s; start-up went on without it"
    output = None
    if captured.size:
        quoted = " ".join(captured.start.split())
        output = f"printed {captured.size} characters, not shown to the host ({quoted!r}...)"
    return outcome.get("value"), outcome.get("error"), output
