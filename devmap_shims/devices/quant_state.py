"""The tensors of a bitsandbytes 4-bit quantization state (``QuantState``), and moving them.

A ``QuantState`` holds ``absmax``, ``code`` (the 16-entry NF4/FP4 table), ``offset`` and, for
nested statistics, a second state ``state2`` with its own ``absmax`` and ``code``. The walk finds
them through the state's attributes, so a tensor a later release adds is included too; a state
that holds exactly the attributes ``QuantState.__init__`` sets (every release from 0.41.2 to
0.50) is read by name.

A move that sweeps afterwards (``pipe.to()``) can record the states aligned while it runs
(:func:`start_recording`): code that has just put every tensor of a state on its parameter's
device notes it with that parameter's storage (:func:`align_and_note`), and the sweep that
follows skips a state whose parameter still holds that storage (:func:`noted`), instead of reading
the state's tensors a second time.
"""

from __future__ import annotations

import threading

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Dict, Iterator, List, Optional, Tuple

from devmap_shims.devices.tensors import device_type, storage_id, tensor_type

# Nested quant states (``state2``) are one level deep in every bitsandbytes release; the limit
# only guards against a cycle in a future layout.
_MAX_DEPTH = 3

#: The tensors of a QuantState in the releases the quant-state rows apply to (0.41.2-0.46.0):
#: the outer state's, then the nested ``state2``'s.
KNOWN_LAYOUT = (("absmax", "code", "offset"), ("absmax", "code"))
_OUTER, _INNER = KNOWN_LAYOUT
#: The attributes ``QuantState.__init__`` sets, in its order (0.41.2 to 0.50): of these only
#: ``absmax``, ``code`` and ``offset`` hold tensors, and ``state2`` a nested state or None.
_INIT_ATTRIBUTES = ("absmax", "shape", "code", "dtype", "blocksize", "quant_type", "offset", "state2", "nested")


def _looks_like_quant_state(value: Any) -> bool:
    return type(value).__name__ == "QuantState"


def quant_state_of(param: Any) -> Any:
    """The ``quant_state`` a bitsandbytes parameter carries, or None (read from its ``__dict__``,
    so a plain tensor costs one lookup)."""
    namespace = getattr(param, "__dict__", None)
    return namespace.get("quant_state") if namespace else None


def state_tensors(state: Any, prefix: str = "", _depth: int = 0) -> Iterator[Tuple[Any, str, str, Any]]:
    """``(owner, attribute, dotted name, tensor)`` for every tensor held by ``state``, nested
    states included (``"state2.absmax"``)."""
    if _depth >= _MAX_DEPTH:
        return
    namespace = getattr(state, "__dict__", None)
    if not namespace:
        return
    tensor = tensor_type()
    for attr, value in list(namespace.items()):
        if isinstance(value, tensor):
            yield state, attr, prefix + attr, value
        elif value is not None and _looks_like_quant_state(value):
            yield from state_tensors(value, f"{prefix}{attr}.", _depth + 1)


def align_state(state: Any, device: Any, _depth: int = 0) -> int:
    """Move every tensor of ``state`` (nested states included) that is not on ``device`` there;
    returns how many moved. Compares before moving: a ``.to()`` that moves nothing still costs a
    dispatch, and this runs for every 4-bit weight of a model at every move. A state with exactly
    :data:`_INIT_ATTRIBUTES` has its tensors read by name (1.2 us where walking every attribute
    takes 2.6, on torch's own getters); any other is walked attribute by attribute."""
    tensor, torch_device = tensor_type(), device_type()
    if not isinstance(device, torch_device):
        device = torch_device(device)
    namespace = getattr(state, "__dict__", None)
    if not namespace or _depth >= _MAX_DEPTH:
        return 0
    if tuple(namespace) == _INIT_ATTRIBUTES:  # exactly what QuantState.__init__ sets: its tensors are known
        moved = _align_entries(state, namespace, _OUTER, device)
        nested = namespace["state2"]
        if nested is not None:
            moved += align_state(nested, device, _depth + 1)
        return moved
    strays = None
    moved = 0
    for attr, value in namespace.items():
        if isinstance(value, tensor):
            if value.device != device:
                strays = [attr] if strays is None else strays + [attr]
        elif value is not None and (type(value) is type(state) or _looks_like_quant_state(value)):
            moved += align_state(value, device, _depth + 1)
    if strays:
        for attr in strays:
            setattr(state, attr, namespace[attr].to(device))
        moved += len(strays)
    return moved


def align_known_state(state: Any, device: Any) -> int:
    """:func:`align_state` for :data:`KNOWN_LAYOUT`: ``device`` is a ``torch.device``; returns how
    many tensors moved.

    This runs for every 4-bit layer of a model at every sweep, so the layout is spelled out: each
    tensor is read from the state's ``__dict__`` (where every ``QuantState`` keeps them) and its
    ``.device`` read once, with no ``getattr`` or per-call tuple. A state without a ``__dict__`` is
    read with ``getattr``.
    """
    namespace = getattr(state, "__dict__", None)
    if namespace is None:
        return _align_known_by_getattr(state, device)
    moved = _align_entries(state, namespace, _OUTER, device)
    nested = namespace.get("state2")
    if nested is None:
        return moved
    namespace = getattr(nested, "__dict__", None)
    if namespace is None:
        return moved + _align_known_by_getattr(nested, device, KNOWN_LAYOUT[1])
    return moved + _align_entries(nested, namespace, _INNER, device)


def _align_entries(owner: Any, namespace: Dict[str, Any], names: Tuple[str, ...], device: Any) -> int:
    moved = 0
    for attr in names:
        value = namespace.get(attr)
        if value is not None and value.device != device:
            setattr(owner, attr, value.to(device))
            moved += 1
    return moved


def _align_known_by_getattr(state: Any, device: Any, names: Any = None) -> int:
    """:func:`align_known_state` through ``getattr`` (``names`` given: that one owner's only)."""
    if names is None:
        outer, inner = KNOWN_LAYOUT
        owners = ((state, outer), (getattr(state, "state2", None), inner))
    else:
        owners = ((state, names),)
    moved = 0
    for owner, attrs in owners:
        if owner is None:
            continue
        for attr in attrs:
            value = getattr(owner, attr, None)
            if value is not None and value.device != device:
                setattr(owner, attr, value.to(device))
                moved += 1
    return moved


# -- the states aligned during a move -----------------------------------------------------------------
class Record(dict):
    """The states aligned during one move: ``id(state) -> address of the storage of the weight it
    went with``, each state noted when every one of its tensors was put on that weight's device,
    and only for the latest weight it went with (noting it again replaces the address). A state
    that ``QuantState.to`` moves again is no longer noted (:func:`forget`). ``states`` keeps the
    noted states alive while the record is open, so that no other object takes a noted id.

    One dictionary keyed by the state, rather than one keyed by the storage plus one to find a
    state's entry again: every note and every drop is one hash operation, and noting a state
    again replaces its earlier note by itself.

    The record holds no weight and no storage, only addresses and the states, which the model
    holds anyway. Holding the weights would keep hundreds of parameters alive through the move
    for every garbage collection during it to traverse (2-6 ms more per move of a 495-layer model
    on the simulated GPUs, more than the sweep itself). A noted storage can only die while the
    record is open if its parameter is given other data by code other than ``Params4bit.to``
    (which notes the state again); for another storage to pass for it, that parameter would need
    new data a second time, at the dead storage's address, with the same state."""

    __slots__ = ("states",)

    def __init__(self) -> None:
        super().__init__()
        self.states: List[Any] = []


class _Recording(threading.local):
    """Per thread: the record of the move in progress, or None; and the slot of the
    ``Params4bit.to`` in progress (see :func:`start_weight_move`), or None."""

    entries = None  # type: Optional[Record]
    weight_move = None  # type: Optional[List[Any]]


_RECORDING = _Recording()

#: ``torch._C._storage_id``, looked up by the first note (a record holds entries only after one)
_storage_of: Any = None


def start_recording() -> Optional[Record]:
    """Start recording, on this thread, the quant states aligned from now on; returns the record
    (hand it to :func:`stop_recording`), or None when a record is open already (it belongs to the
    outer move, which sweeps and stops it)."""
    if _RECORDING.entries is not None:
        return None
    entries = Record()
    _RECORDING.entries = entries
    return entries


def stop_recording(entries: Optional[Record]) -> None:
    """Stop the recording that :func:`start_recording` returned ``entries`` for (None: nothing)."""
    if entries is not None and _RECORDING.entries is entries:
        _RECORDING.entries = None


def align_and_note(state: Any, weight: Any) -> int:
    """:func:`align_state` onto ``weight``'s device, then :func:`note` it; returns how many
    tensors moved."""
    moved = align_state(state, weight.device)
    note(state, weight)
    return moved


def note(state: Any, weight: Any) -> None:
    """While a recording is open on this thread, note ``state``, every tensor of which is on
    ``weight``'s device, under the address of ``weight``'s storage, so the sweep after the move
    takes it as checked for a parameter that still holds that storage. A state without a
    ``__dict__`` (:func:`align_state` cannot see its tensors) or a weight without a storage is not
    noted."""
    global _storage_of
    entries = _RECORDING.entries
    if entries is not None and getattr(state, "__dict__", None):
        if _storage_of is None:
            _storage_of = storage_id()
        try:
            address = _storage_of(weight)
        except (RuntimeError, TypeError):  # no storage (a wrapper subclass), or no _storage_id
            return
        entries[id(state)] = address  # a note for an earlier weight is replaced: only the latest counts
        entries.states.append(state)


def forget(state: Any) -> None:
    """While a recording is open on this thread, drop the note of ``state``: its tensors are being
    moved (``QuantState.to``), so the device it was noted for may no longer be theirs."""
    entries = _RECORDING.entries
    if entries:
        entries.pop(id(state), None)


def noted(entries: Record, state: Any, param: Any) -> bool:
    """Whether ``entries`` notes ``state`` as aligned for the device ``param`` is on now.

    One storage lookup, where a check reads the ``.device`` of every tensor of the state: a
    storage lives on one device for its whole life, so a parameter that holds the storage a state
    was noted under is on the device the state was aligned for. A parameter given another storage
    after the note (``Tensor.cpu()`` on bitsandbytes < 0.46, ``param.data = ...``) is not taken as
    checked, even when that storage is on the same device."""
    try:
        return entries.get(id(state)) == _storage_of(param)
    except (RuntimeError, TypeError):  # no storage, or nothing noted yet (no _storage_of)
        return False


# -- the state a QuantState.to aligned inside a Params4bit.to ------------------------------------------
# bitsandbytes' ``Params4bit.to`` moves its state with ``QuantState.to`` and hands that same state to
# the parameter it returns. When the ``QuantState.to`` repair has just put every tensor of the state
# on a device and the returned parameter is on that device, checking the state again tensor by
# tensor reads each tensor's ``.device`` for nothing.
def start_weight_move() -> Optional[List[Any]]:
    """Open, on this thread, the slot of a ``Params4bit.to``: :func:`aligned_in_weight_move` fills
    it. Returns the slot it replaces (a move inside a move), for :func:`stop_weight_move`."""
    previous = _RECORDING.weight_move
    _RECORDING.weight_move = [None, None]
    return previous


def stop_weight_move(previous: Optional[List[Any]]) -> Tuple[Any, Any]:
    """Close the slot :func:`start_weight_move` opened, putting ``previous`` back; returns
    ``(state, device)`` as the last :func:`aligned_in_weight_move` left them, or ``(None, None)``."""
    slot = _RECORDING.weight_move
    _RECORDING.weight_move = previous
    if slot is None:
        return None, None
    return slot[0], slot[1]


def aligned_in_weight_move(state: Any, device: Any) -> None:
    """Tell the ``Params4bit.to`` in progress on this thread, if any, that every tensor of ``state``
    is on ``device`` now (:func:`align_state` has just put them there)."""
    slot = _RECORDING.weight_move
    if slot is not None:
        slot[0], slot[1] = state, device
