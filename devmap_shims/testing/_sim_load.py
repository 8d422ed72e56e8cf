"""``torch.load`` during a simulation: checkpoints bound for ``cuda:N`` load onto simulated GPU N."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ._sim_devices import parse_device
from ._sim_storages import tag_storage

#: torch.load as torch defines it
real_load = torch.load


def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``torch.load`` during a simulation: storages bound for ``cuda:N`` stay on the CPU and are
    recorded as living on simulated GPU N (the real loader would call the CUDA driver).
    torch's own warnings (torch 2.4's FutureWarning for a call without ``weights_only``) name the
    caller's line, as without the simulation, not this wrapper's."""
    with _warnings_at_caller():
        return _load_restoring(f, map_location, *args, **kwargs)


@contextlib.contextmanager
def _warnings_at_caller(stacklevel: int = 4) -> Iterator[None]:
    """Warnings that name this module's line (given with ``stacklevel=2`` by a function this
    module wraps) are given again naming the line ``stacklevel`` frames up from here, through
    the program's filters (``-W error`` raises there); other warnings are given again unchanged.
    The recording is process-wide (``warnings.catch_warnings``), like every simulation patch."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if w.filename == __file__:
            warnings.warn(w.message, w.category, stacklevel=stacklevel)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _load_restoring(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
    if callable(map_location) and not isinstance(map_location, (str, torch.device)):
        return real_load(f, map_location, *args, **kwargs)

    def restore(storage: Any, location: str) -> Any:
        loc: Any = location
        if isinstance(map_location, dict):
            loc = map_location.get(location, location)
        elif map_location is not None:
            loc = map_location
        target = parse_device(loc)
        if isinstance(target, int):
            tag_storage(storage, target)
            return storage
        return torch.serialization.default_restore_location(storage, str(target))

    return real_load(f, restore, *args, **kwargs)
