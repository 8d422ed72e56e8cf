"""The pipeline-to-sweep walk (``sweep_module``) and ``align_known_state`` on real bitsandbytes
``Linear4bit`` layers on simulated GPUs: every quant-state tensor that is off its weight's device
is moved there, and only those.

The layers are built with bitsandbytes' own ``Params4bit.from_prequantized`` on ``cuda:1``; a test
then puts chosen tensors of the state on ``cuda:0``, the way a load on the current device or a
``QuantState.to`` that skips ``code`` leaves them.
"""

from __future__ import annotations

import copy
import itertools
import threading

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")  # imported before any simulation starts (it probes CUDA)

from devmap_shims.devices.quant_state import (  # noqa: E402
    align_and_note,
    align_known_state,
    noted,
    start_recording,
    state_tensors,
    stop_recording,
)
from devmap_shims.hooks.diffusers import pipeline_to_sweep as hook  # noqa: E402
from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.testing.nf4 import linear4bit  # noqa: E402
from devmap_shims.versions import version_in  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

NESTED = ("absmax", "code", "offset", "state2.absmax", "state2.code")
PLAIN = ("absmax", "code")


def make_layer(nested=True, seed=0):
    torch.manual_seed(seed)
    return linear4bit(torch.nn.Linear(64, 32), "cuda:1", compress_statistics=nested)


def tensors(state):
    return {name: tensor for _owner, _attr, name, tensor in state_tensors(state)}


def stray(state, names, device="cuda:0"):
    """Put the named tensors of ``state`` (``"state2.code"`` ...) on ``device``."""
    for name in names:
        owner, _, attr = name.rpartition(".")
        target = getattr(state, owner) if owner else state
        setattr(target, attr, getattr(target, attr).to(device))


def devices(state):
    return {name: str(t.device) for name, t in tensors(state).items()}


def values(state):
    return {name: t.cpu().clone() for name, t in tensors(state).items()}


def test_every_subset_of_stray_tensors_is_moved_and_nothing_else():
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        for nested, names in ((True, NESTED), (False, PLAIN)):
            for count in range(len(names) + 1):
                for strays in itertools.combinations(names, count):
                    layer = make_layer(nested)
                    state = layer.weight.quant_state
                    assert set(tensors(state)) == set(names)
                    before = values(state)
                    stray(state, strays)
                    kept = {name: t for name, t in tensors(state).items() if name not in strays}
                    assert hook.sweep_module(layer) == len(strays), strays
                    assert set(devices(state).values()) == {"cuda:1"}, strays
                    after = tensors(state)
                    assert all(after[name] is t for name, t in kept.items()), strays  # in place: untouched
                    assert all(torch.equal(after[name].cpu(), before[name]) for name in names), strays
                    assert hook.sweep_module(layer) == 0


def test_align_known_state_compares_with_the_given_device():
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        state = make_layer().weight.quant_state
        assert align_known_state(state, torch.device("cuda", 1)) == 0
        assert align_known_state(state, torch.device("cuda", 0)) == len(NESTED)
        assert set(devices(state).values()) == {"cuda:0"}


def test_a_module_quant_state_of_its_own_follows_the_weight():
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        assert layer.quant_state is layer.weight.quant_state  # as bitsandbytes links them
        stray(layer.weight.quant_state, ["code"])
        assert hook.sweep_module(layer) == 1  # the shared state counts once
        layer.quant_state = copy.deepcopy(layer.weight.quant_state)
        stray(layer.quant_state, NESTED)
        assert hook.sweep_module(layer) == len(NESTED)
        assert set(devices(layer.quant_state).values()) == {"cuda:1"}
        assert set(devices(layer.weight.quant_state).values()) == {"cuda:1"}


def test_a_module_quant_state_follows_a_weight_that_has_none():
    """A weight that lost its state (FSDP, ``layer.weight = Parameter(...)``) gets the module's from
    bitsandbytes at the next forward, so the module's state must be where that weight is;
    check_devices reports it until the sweep moves it."""
    from devmap_shims.checks import check_devices

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        state = layer.quant_state
        layer.weight = torch.nn.Parameter(layer.weight.data, requires_grad=False)  # no quant_state
        stray(state, NESTED)
        assert {record["kind"] for record in check_devices(layer)} == {"quant_state"}
        assert hook.sweep_module(layer) == len(NESTED)
        assert set(devices(state).values()) == {"cuda:1"}
        assert check_devices(layer) == []
        assert hook.sweep_module(layer) == 0
        if version_in(bnb.__version__, ">=0.46.0"):  # CPU kernels: a 4-bit forward runs on the simulator
            layer(torch.randn(2, 64, device="cuda:1"))  # takes the module's state, all on cuda:1
            assert layer.weight.quant_state is state


def test_parameters_on_meta_are_skipped_with_their_module_state():
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        state = layer.weight.quant_state
        stray(state, NESTED)
        data = torch.empty(layer.weight.shape, dtype=torch.uint8, device="meta")
        meta = torch.nn.Parameter(data, requires_grad=False)
        meta.quant_state = state
        layer.weight = meta
        layer.quant_state = copy.deepcopy(state)
        before = devices(state)
        assert hook.sweep_module(layer) == 0
        assert devices(state) == before == devices(layer.quant_state) == {name: "cuda:0" for name in NESTED}


def test_any_parameter_carrying_a_quant_state_is_aligned_to_its_own_device():
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        extra = make_layer(seed=1).weight.quant_state
        other = torch.nn.Parameter(torch.zeros(4, device="cuda:0"), requires_grad=False)
        other.quant_state = extra
        layer.register_parameter("other", other)
        assert hook.sweep_module(layer) == len(NESTED)
        assert set(devices(extra).values()) == {"cuda:0"}
        assert set(devices(layer.weight.quant_state).values()) == {"cuda:1"}


def test_shared_modules_and_cycles_end_and_empty_slots_are_passed_over(checks):
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        stray(layer.weight.quant_state, ["code"])
        root = torch.nn.Module()
        root.first = torch.nn.Sequential(layer, torch.nn.ReLU())
        root.shared = root.first  # a container met twice is entered once
        root.register_module("loop", root)  # a cycle
        root.again = layer  # a leaf met twice is checked twice, and moves nothing the second time
        root.register_module("absent", None)
        root.register_parameter("unset", None)
        root.plain = torch.nn.Linear(4, 4, device="cuda:0")
        assert hook.sweep_module(root) == 1
        assert str(root.plain.weight.device) == "cuda:0"
        assert checks == [layer.weight.quant_state] * 2


def test_a_quant_state_of_another_layout_is_left_alone():
    """bitsandbytes < 0.41 kept the state as a list: the sweep does not fail on it or change it."""
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        absmax = torch.ones(4, device="cuda:0")
        listed = [absmax, torch.Size([32, 64]), torch.float32, 64, None, "nf4"]
        layer.weight.quant_state = listed
        layer.quant_state = listed
        assert hook.sweep_module(layer) == 0
        assert listed[0] is absmax and str(absmax.device) == "cuda:0"


def test_tensor_subclass_dispatch_is_back_on_after_the_sweep():
    calls = []

    class Counting(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        stray(layer.weight.quant_state, ["code"])
        assert hook.sweep_module(layer) == 1
    counted = torch.zeros(2).as_subclass(Counting)
    calls.clear()
    torch.add(counted, 1)
    assert torch.add in calls


# -- states noted during the move ----------------------------------------------------------------------
def noted_record(*params):
    """A record noting each parameter's state under the parameter's storage, as a move with the
    quant-state shim notes them."""
    record = start_recording()
    try:
        for param in params:
            align_and_note(param.quant_state, param)
    finally:
        stop_recording(record)
    return record


def test_a_state_noted_for_its_parameter_is_not_read_again(checks):
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer, other = make_layer(), make_layer(seed=1)
        record = noted_record(layer.weight)
        root = torch.nn.Sequential(layer, other)
        assert hook.sweep_module(root, record) == 0
        assert checks == [other.weight.quant_state]  # only the layer the move did not note
        del checks[:]
        assert hook.sweep_module(root) == 0
        assert checks == [layer.weight.quant_state, other.weight.quant_state]  # no record: every state


def test_a_noted_state_is_checked_when_its_parameter_moved_since(checks):
    """A parameter moved again after the note by a path that left its state behind (here
    ``param.data = ...``, as ``Tensor.cpu()`` does on bitsandbytes < 0.46) is swept in full."""
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        record = noted_record(layer.weight)
        layer.weight.data = layer.weight.data.to("cuda:0")
        assert not noted(record, layer.weight.quant_state, layer.weight)
        assert hook.sweep_module(layer, record) == len(NESTED)
        assert set(devices(layer.weight.quant_state).values()) == {"cuda:0"}


def test_a_noted_state_is_checked_when_its_parameter_got_another_storage_on_the_same_device(checks):
    """The note names the weight's storage, not only its device: a parameter whose data was
    replaced after the note is checked in full even where the new data is on the same GPU (the
    replacement may have come with tensors the move never saw)."""
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        record = noted_record(layer.weight)
        state = layer.weight.quant_state
        layer.weight.data = layer.weight.data.clone()  # still on cuda:1
        stray(state, ["state2.code"])
        assert not noted(record, state, layer.weight)
        assert hook.sweep_module(layer, record) == 1
        assert checks == [state] and set(devices(state).values()) == {"cuda:1"}


def test_a_parameter_given_another_state_after_the_note_is_checked(checks):
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        record = noted_record(layer.weight)
        other = copy.deepcopy(layer.weight.quant_state)
        stray(other, ["absmax"])
        layer.weight.quant_state = other  # the same storage, a state the move never saw
        assert not noted(record, other, layer.weight)
        assert hook.sweep_module(layer, record) == 1
        assert checks[0] is other and set(devices(other).values()) == {"cuda:1"}


def test_a_note_holds_no_weight():
    """A record keeps no parameter alive: hundreds of them held through a move would be traversed
    by every garbage collection while it runs."""
    import gc
    import weakref

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
    # the simulation is over (plain CPU tensors): nothing but the record could refer to the weight
    record = noted_record(layer.weight)
    state = layer.weight.quant_state
    gone = weakref.ref(layer.weight)
    layer.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    gc.collect()
    assert gone() is None
    assert list(record) == [id(state)]


def test_a_noted_state_lives_as_long_as_the_record():
    """Notes are keyed by the state's id: while the record is open, no other object may take it."""
    import gc
    import weakref

    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
    record = noted_record(layer.weight)
    state = weakref.ref(layer.weight.quant_state)
    del layer
    gc.collect()
    assert state() is not None and list(record) == [id(state())]
    del record
    gc.collect()
    assert state() is None


def test_a_state_noted_again_is_noted_only_under_its_latest_storage(checks):
    """The same state noted with a second weight (a parameter moved twice in one move): a
    parameter still holding the first weight's storage is checked."""
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        state = layer.weight.quant_state
        first = layer.weight
        record = start_recording()
        try:
            align_and_note(state, first)
            second = torch.nn.Parameter(first.data.clone(), requires_grad=False)
            second.quant_state = state
            align_and_note(state, second)
        finally:
            stop_recording(record)
        assert list(record) == [id(state)]
        assert noted(record, state, second) and not noted(record, state, first)
        stray(state, ["code"])
        assert hook.sweep_module(layer, record) == 1  # layer.weight is still the first
        assert checks == [state] and set(devices(state).values()) == {"cuda:1"}


def test_a_weight_without_a_storage_is_not_noted():
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
    state = layer.weight.quant_state
    sparse = torch.zeros(4, 4).to_sparse()  # torch has no storage to name for it
    record = start_recording()
    try:
        align_and_note(state, sparse)
    finally:
        stop_recording(record)
    assert record == {} and not noted(record, state, sparse)


def test_a_noted_state_found_on_a_parameter_of_another_device_is_checked(checks):
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        record = noted_record(layer.weight)
        state = layer.weight.quant_state
        replacement = torch.nn.Parameter(layer.weight.data.to("cuda:0"), requires_grad=False)
        replacement.quant_state = state
        layer.weight = replacement
        assert hook.sweep_module(layer, record) == len(NESTED)
        assert checks == [state] and set(devices(state).values()) == {"cuda:0"}
        del checks[:]
        assert hook.sweep_module(layer, noted_record(replacement)) == 0 and checks == []  # noted for cuda:0 now


def test_a_module_quant_state_of_its_own_is_checked_beside_a_noted_weight(checks):
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        layer.quant_state = copy.deepcopy(layer.weight.quant_state)
        stray(layer.quant_state, ["code"])
        record = noted_record(layer.weight)
        assert hook.sweep_module(layer, record) == 1
        assert checks == [layer.quant_state] and set(devices(layer.quant_state).values()) == {"cuda:1"}


def test_a_recording_is_one_per_thread_and_closed_only_by_its_owner():
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = make_layer()
        record = start_recording()
        try:
            assert record == {} and start_recording() is None  # an inner move records into the outer one
            stop_recording({})  # not the open record: it stays open
            elsewhere = {}

            def other_thread():
                own = start_recording()  # this thread's record is not seen there
                align_and_note(layer.weight.quant_state, layer.weight)
                stop_recording(own)
                elsewhere.update(own)

            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
            assert record == {} and len(elsewhere) == 1
            align_and_note(layer.weight.quant_state, layer.weight)
            assert noted(record, layer.weight.quant_state, layer.weight)
        finally:
            stop_recording(record)
        align_and_note(layer.weight.quant_state, layer.weight)
        assert len(record) == 1  # closed: nothing more is noted
        again = start_recording()
        assert again == {} and again is not record
        stop_recording(again)
