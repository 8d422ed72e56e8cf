"""The quant-state-follows-weight shim with the real bitsandbytes classes of the installed stack.

4-bit parameters are built with ``Params4bit.from_prequantized`` from the pure-torch NF4 quantizer
(bitsandbytes < 0.46 cannot quantize without CUDA) and moved between simulated GPUs. Where the
matrix says a bug applies, the tests first show it reproducing without the shim, so a wrong row is
caught; everywhere the shim is tested forced on, since its repairs must also be harmless on fixed
releases.
"""

from __future__ import annotations

import copy
import logging
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")  # imported before any simulation starts (it probes CUDA)

from bitsandbytes.functional import QuantState  # noqa: E402
from bitsandbytes.nn import Int8Params, Params4bit  # noqa: E402

import devmap_shims  # noqa: E402
from devmap_shims.checks import check_devices  # noqa: E402
from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.devices import quant_state as quant_state_module  # noqa: E402
from devmap_shims.devices.quant_state import noted, start_recording, state_tensors, stop_recording  # noqa: E402
from devmap_shims.hooks.bitsandbytes import quant_state_follows_weight as hook  # noqa: E402
from devmap_shims.testing.nf4 import linear4bit, params4bit  # noqa: E402
from devmap_shims.versions import installed_versions  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

MATRIX = load_matrix()
VERSIONS = installed_versions(MATRIX.distributions())
CODE_BUG_HERE = MATRIX.get(hook.CODE_BUG).applies(VERSIONS)
FLAG_BUG_HERE = MATRIX.get(hook.FLAG_BUG).applies(VERSIONS)
SIM = pytest.mark.simulated_gpus(n=2, memory="1GiB")


def weight(rows=64, cols=128, seed=0, dtype=torch.float32):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def state_devices(param):
    return {name: str(t.device) for _o, _a, name, t in state_tensors(param.quant_state)}


def state_values(state):
    return {name: t.detach().cpu().clone() for _o, _a, name, t in state_tensors(state)}


def assert_same_state(state, reference):
    values = state_values(state)
    assert values.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(values[name], tensor), name


def shim_status():
    return next(s for s in devmap_shims.status()["shims"] if s["id"] == hook.SHIM.id)


# -- what the user sees ---------------------------------------------------------------------------------
def test_doctor_says_whether_the_shim_is_on():
    out = subprocess.run(
        [sys.executable, "-m", "devmap_shims", "doctor", "--json"], capture_output=True, text=True, check=True
    )
    import json

    report = json.loads(out.stdout[out.stdout.index("{"):])
    shims = {s["id"]: s for s in report["shims"]}
    entry = shims[hook.SHIM.id]
    assert entry["applies"] == (CODE_BUG_HERE or FLAG_BUG_HERE)
    if not entry["applies"]:
        assert entry["state"] == "skipped" and "not affected" in entry["applicability"]


# -- bnb-quantstate-code-not-moved -----------------------------------------------------------------
@SIM
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_without_the_shim_code_stays_where_the_matrix_says(no_shim, nested):
    param = params4bit(weight(), "cuda:0", compress_statistics=nested)
    moved = param.to("cuda:1")
    devices = state_devices(moved)
    assert str(moved.device) == "cuda:1" and devices["absmax"] == "cuda:1"
    if CODE_BUG_HERE:
        assert devices["code"] == "cuda:0", "bnb-quantstate-code-not-moved applies here but code moved"
        assert {k: v for k, v in devices.items() if k != "code"} == {k: "cuda:1" for k in devices if k != "code"}
    else:
        assert set(devices.values()) == {"cuda:1"}


@SIM
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_with_the_shim_every_quant_state_tensor_follows(shim, nested):
    param = params4bit(weight(), "cuda:0", compress_statistics=nested)
    reference = state_values(param.quant_state)
    moved = param.to("cuda:1")
    expected = {"code", "absmax"} | ({"offset", "state2.absmax", "state2.code"} if nested else set())
    assert expected <= set(state_devices(moved))
    assert set(state_devices(moved).values()) == {"cuda:1"}
    assert_same_state(moved.quant_state, reference)
    assert shim_status()["state"] == "active"


@SIM
def test_quant_state_to_alone_moves_code(shim):
    param = params4bit(weight(), "cuda:0", compress_statistics=True)
    param.quant_state.to("cuda:1")
    assert set(state_devices(param).values()) == {"cuda:1"}
    param.quant_state.to(torch.device("cuda", 0))
    assert set(state_devices(param).values()) == {"cuda:0"}


@SIM
def test_module_to_leaves_strays_without_and_none_with_the_shim(no_shim):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            linear4bit(torch.nn.Linear(128, 64), "cuda:0", compress_statistics=True),
            torch.nn.ReLU(),
            linear4bit(torch.nn.Linear(64, 32), "cuda:0"),
        )

    plain = model().to("cuda:1")
    strays = check_devices(plain)
    if CODE_BUG_HERE:
        assert sorted(s["name"] for s in strays) == ["0.weight.quant_state.code", "2.weight.quant_state.code"]
        assert {s["device"] for s in strays} == {"cuda:0"} and {s["shape"] for s in strays} == {(16,)}
    else:
        assert strays == []
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    repaired = model().to("cuda:1")
    assert check_devices(repaired) == []
    assert repaired[0].quant_state is repaired[0].weight.quant_state


# -- bnb-params4bit-to-drops-bnb_quantized -----------------------------------------------------------
@SIM
def test_without_the_shim_a_second_move_requantizes_where_the_matrix_says(no_shim):
    param = params4bit(weight(), "cuda:0")
    param = param.to("cuda:1")
    if FLAG_BUG_HERE:
        assert param.bnb_quantized is False
        with pytest.raises((ValueError, RuntimeError), match="uint8|16/32-bit"):
            param.to("cuda:0")
    else:
        assert param.bnb_quantized is True
        assert param.to("cuda:0").dtype == torch.uint8


@SIM
def test_with_the_shim_moves_keep_bnb_quantized_and_the_bits(shim):
    param = params4bit(weight(), "cuda:0", compress_statistics=True)
    packed = param.data.cpu().clone()
    reference = state_values(param.quant_state)
    for device in ("cuda:1", "cuda:0", "cpu", "cuda:1", torch.device("cuda", 0)):
        param = param.to(device)
        assert param.bnb_quantized is True
        assert param.dtype == torch.uint8 and torch.equal(param.data.cpu(), packed)
        assert set(state_devices(param).values()) == {str(param.device)}
        assert_same_state(param.quant_state, reference)
    assert str(param.device) == "cuda:0"


@SIM
def test_a_parameter_from_an_unrepaired_move_is_not_quantized_again(no_shim):
    param = params4bit(weight(), "cuda:0").to("cuda:1")  # bnb_quantized may be False here
    packed = param.data.cpu().clone()
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    again = param.to("cuda:0")
    assert again.bnb_quantized is True and torch.equal(again.data.cpu(), packed)


@SIM
def test_module_round_trips_and_dtype_moves_keep_state_consistent_and_weights_identical(shim):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        linear4bit(torch.nn.Linear(128, 64), "cuda:0", compress_statistics=True),
        torch.nn.LayerNorm(64).to("cuda:0"),
    )
    layer = model[0]
    packed = layer.weight.data.cpu().clone()
    reference = state_values(layer.weight.quant_state)
    moves = ["cuda:1", "cuda:0", "cpu", "cuda:1", torch.float16, "cuda:0"]
    for move in moves:
        model.to(move)
        assert check_devices(model) == [], move
        assert layer.weight.dtype == torch.uint8 and torch.equal(layer.weight.data.cpu(), packed), move
        assert layer.weight.bnb_quantized is True
        assert_same_state(layer.weight.quant_state, reference)
    assert model[1].weight.dtype == torch.float16  # the dtype move reached the unquantized module


# -- noting the states it aligned, for a sweep after the move ------------------------------------------
@SIM
def test_a_move_while_a_record_is_open_notes_the_state_for_the_weight_it_went_with(shim):
    import gc
    import weakref

    param = params4bit(weight(), "cuda:0", compress_statistics=True)
    other = params4bit(weight(seed=1), "cuda:0")
    record = start_recording()
    try:
        moved = param.to("cuda:1")
        assert set(state_devices(moved).values()) == {"cuda:1"}
        assert list(record) == [id(moved.quant_state)]
        assert noted(record, moved.quant_state, moved) and not noted(record, other.quant_state, other)
        assert not noted(record, param.quant_state, param)  # the state went to cuda:1; param is still on cuda:0
        param.data = moved.data  # what Module._apply does with the result
        assert noted(record, param.quant_state, param)
        returned = weakref.ref(moved)
        del moved
        gc.collect()
        assert returned() is None  # the record holds no weight: the parameter the move returned is gone
        assert noted(record, param.quant_state, param)  # and the note still holds for the one in place
    finally:
        stop_recording(record)
    again = param.to("cuda:0")  # the record is closed: nothing more is noted
    assert len(record) == 1 and not noted(record, again.quant_state, again)


@SIM
def test_a_noted_state_moved_again_by_quant_state_to_is_no_longer_noted(shim):
    param = params4bit(weight(), "cuda:0", compress_statistics=True)
    record = start_recording()
    try:
        moved = param.to("cuda:1")
        assert noted(record, moved.quant_state, moved)
        moved.quant_state.to("cuda:0")  # the weight stays on cuda:1: a sweep must see the state now
        assert not noted(record, moved.quant_state, moved) and len(record) == 0
        again = moved.to("cuda:0")  # moved with its weight: noted again, for the weight's storage
        assert noted(record, again.quant_state, again) and len(record) == 1
    finally:
        stop_recording(record)


# -- align_state --------------------------------------------------------------------------------------
@SIM
def test_align_state_reads_the_init_attributes_by_name_and_walks_any_other_layout():
    from devmap_shims.devices.quant_state import align_state

    param = params4bit(weight(), "cuda:1", compress_statistics=True)
    state = param.quant_state
    assert tuple(vars(state)) == quant_state_module._INIT_ATTRIBUTES  # what this bitsandbytes sets
    state.code = state.code.to("cuda:0")
    state.state2.absmax = state.state2.absmax.to("cuda:0")
    assert align_state(state, "cuda:1") == 2 and set(state_devices(param).values()) == {"cuda:1"}
    # a tensor a later release might add: the state no longer has exactly those attributes
    state.scales = torch.ones(4, device="cuda:0")
    state.state2.scales = torch.ones(4, device="cuda:0")
    assert align_state(state, "cuda:1") == 2
    assert str(state.scales.device) == str(state.state2.scales.device) == "cuda:1"


# -- one check per move: QuantState.to inside Params4bit.to -------------------------------------------
def _count_checks(monkeypatch):
    """Every state ``align_state`` is asked to check, from the shim and from ``align_and_note``."""
    checked = []
    real = quant_state_module.align_state

    def counting(state, device, *rest):
        checked.append(state)
        return real(state, device, *rest)

    monkeypatch.setattr(hook, "align_state", counting)
    monkeypatch.setattr(quant_state_module, "align_state", counting)
    return checked


@SIM
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_a_params4bit_move_checks_its_state_once(shim, monkeypatch, nested):
    checked = _count_checks(monkeypatch)
    param = params4bit(weight(), "cuda:0", compress_statistics=nested)
    record = start_recording()
    try:
        moved = param.to("cuda:1")
    finally:
        stop_recording(record)
    assert set(state_devices(moved).values()) == {"cuda:1"}
    # bitsandbytes moves the state with QuantState.to, whose repair checks it; the state the
    # parameter comes back with is that one, on that device, so it is noted without a second check
    assert sum(state is moved.quant_state for state in checked) == 1
    assert noted(record, moved.quant_state, moved)
    assert quant_state_module._RECORDING.weight_move is None  # the slot is closed


@SIM
def test_a_state_aligned_for_another_device_or_another_state_is_checked_again(no_shim):
    param = params4bit(weight(), "cuda:0", compress_statistics=True)
    other = params4bit(weight(seed=1), "cuda:0", compress_statistics=True)
    original_qs_to = vars(QuantState)["to"]

    def aligns_then_returns(aligned, device, returned):
        def original(*args, **kwargs):  # QuantState.to with its repair inside the move, then a parameter
            hook.repair_quant_state_to(original_qs_to.__get__(aligned), aligned, (device,), {})
            return returned
        return original

    # aligned for cuda:1, but the parameter returned is on cuda:0: the state goes back to cuda:0
    moved = hook.repair_params4bit_to(aligns_then_returns(param.quant_state, "cuda:1", param), param, ("cuda:1",), {})
    assert moved is param and set(state_devices(moved).values()) == {"cuda:0"}
    # aligned for the device the parameter returned is on, but another state than the one it
    # carries, whose code is on cuda:1: that one is checked and its code comes back
    other.quant_state.code = other.quant_state.code.to("cuda:1")
    moved = hook.repair_params4bit_to(aligns_then_returns(param.quant_state, "cuda:0", other), other, ("cuda:0",), {})
    assert moved is other and set(state_devices(other).values()) == {"cuda:0"}


@SIM
def test_quant_state_to_outside_a_params4bit_move_keeps_nothing_on_the_thread(shim):
    import gc
    import weakref

    param = params4bit(weight(), "cuda:0", compress_statistics=True)
    state = param.quant_state
    state.to("cuda:1")
    assert set(state_devices(param).values()) == {"cuda:1"}
    assert quant_state_module._RECORDING.weight_move is None
    gone = weakref.ref(state)
    del param, state
    gc.collect()
    assert gone() is None  # a state (GPU tensors) the user dropped is not held by the layer


def test_a_params4bit_move_inside_another_restores_the_outer_slot():
    outer = quant_state_module.start_weight_move()
    try:
        quant_state_module.aligned_in_weight_move("outer state", "cuda:1")
        inner = quant_state_module.start_weight_move()
        quant_state_module.aligned_in_weight_move("inner state", "cuda:0")
        assert quant_state_module.stop_weight_move(inner) == ("inner state", "cuda:0")
    finally:
        assert quant_state_module.stop_weight_move(outer) == ("outer state", "cuda:1")
    assert quant_state_module._RECORDING.weight_move is None
    quant_state_module.aligned_in_weight_move("no move open", "cuda:1")  # nothing to fill, nothing kept
    assert quant_state_module._RECORDING.weight_move is None


# -- pass-through -----------------------------------------------------------------------------------
def _same_tensor(a, b):
    return type(a) is type(b) and a.dtype == b.dtype and a.device == b.device and torch.equal(a.cpu(), b.cpu())


def test_a_params4bit_without_quant_state_passes_through(no_shim):
    data = weight(8, 16)  # 128 values: bitsandbytes 0.48 segfaults quantizing exactly one 64-value block on CPU
    expected = [Params4bit(data.clone(), quant_type="nf4").to(move) for move in ("cpu", torch.float16, "meta")]
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    got = [Params4bit(data.clone(), quant_type="nf4").to(move) for move in ("cpu", torch.float16, "meta")]
    for a, b in zip(got, expected):  # bitsandbytes >= 0.46 quantizes on .to("cpu"); older ones do not
        assert type(a) is type(b) and a.dtype == b.dtype and a.device == b.device
        assert a.bnb_quantized == b.bnb_quantized and (a.quant_state is None) == (b.quant_state is None)
        if a.device.type != "meta":
            assert torch.equal(a.data, b.data)


def test_int8params_passes_through(shim):
    assert not hasattr(vars(Int8Params)["to"], "__wrapped__")
    int8 = Int8Params(weight(8, 8), requires_grad=False, has_fp16_weights=True)
    moved = int8.to(torch.float16)
    assert type(moved) is Int8Params and moved.dtype == torch.float16
    assert torch.equal(moved, weight(8, 8).half())


def test_a_model_without_bitsandbytes_layers_moves_exactly_as_without_the_shim(no_shim, caplog):
    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        model.to(torch.float64).to("cpu")
        return model.state_dict()

    expected = run()
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    with caplog.at_level(logging.DEBUG, logger="devmap_shims.hooks"):
        got = run()
    assert expected.keys() == got.keys()
    assert all(_same_tensor(got[k], expected[k]) for k in expected)
    assert caplog.records == []


# -- torch.compile, pickle, deepcopy ------------------------------------------------------------------
def _move_to_meta(param):
    moved = param.to("meta")
    return moved.device, moved.quant_state.code.device, moved.quant_state.absmax.device, moved.bnb_quantized


def _quant_state_to_meta(param):
    param.quant_state.to("meta")
    return param.quant_state.code.device, param.quant_state.absmax.device


def _scaled_by_state(param, x):
    moved = param.to("cpu")
    return x * moved.quant_state.code.sum() + moved.quant_state.absmax.sum()


@pytest.mark.parametrize("fn", [_move_to_meta, _quant_state_to_meta], ids=lambda f: f.__name__)
def test_eager_equals_compiled_with_the_repair_applied(shim, fn):
    torch._dynamo.reset()
    eager = fn(params4bit(weight(), "cpu", compress_statistics=True))
    compiled = torch.compile(fn, backend="eager")(params4bit(weight(), "cpu", compress_statistics=True))
    assert compiled == eager
    assert all(getattr(d, "type", "meta") == "meta" for d in eager if isinstance(d, torch.device))


def test_eager_equals_compiled_for_tensor_math_after_a_move(shim):
    torch._dynamo.reset()
    x = torch.randn(5)
    eager = _scaled_by_state(params4bit(weight(), "cpu"), x)
    compiled = torch.compile(_scaled_by_state, backend="eager")(params4bit(weight(), "cpu"), x)
    assert torch.equal(eager, compiled)


def test_the_wrappers_are_plain_functions_not_proxies(shim):
    for owner in (Params4bit, QuantState):
        layer = vars(owner)["to"]
        assert type(layer) is type(lambda: None), f"{owner.__name__}.to is a {type(layer).__name__}"
        assert layer.__name__ == "to" and layer.__wrapped__ is not layer


def _pickled(obj):
    return pickle.loads(pickle.dumps(obj))


def _describe(param):
    """What a round trip keeps of a 4-bit parameter (torch pickles any Parameter subclass as a
    Parameter carrying the subclass's attributes; deepcopy keeps the class)."""
    state = param.__dict__.get("quant_state")
    return (type(param).__name__, param.data.clone(), param.__dict__.get("bnb_quantized"), state_values(state))


def _same_description(a, b):
    return a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2] and a[3].keys() == b[3].keys() and all(
        torch.equal(a[3][k], b[3][k]) for k in a[3]
    )


def test_pickle_and_deepcopy_of_a_parameter_and_a_model_survive(no_shim):
    def build():
        torch.manual_seed(0)
        param = params4bit(weight(), "cpu", compress_statistics=True)
        model = torch.nn.Sequential(linear4bit(torch.nn.Linear(128, 64), "cpu", compress_statistics=True))
        return param, model

    param, model = build()
    unpatched = [_describe(_pickled(param)), _describe(_pickled(model)[0].weight)]
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    param, model = build()
    patched = [_describe(_pickled(param)), _describe(_pickled(model)[0].weight)]
    assert all(_same_description(a, b) for a, b in zip(patched, unpatched))
    copied = copy.deepcopy(param)
    assert _same_description(_describe(copied), _describe(param)) and type(copied) is Params4bit
    assert set(state_devices(copied.to("meta")).values()) == {"meta"}
    clone = copy.deepcopy(model)
    assert _same_description(_describe(clone[0].weight), _describe(model[0].weight))
    moved = clone[0].weight.to("meta")
    assert set(state_devices(moved).values()) == {"meta"} and moved.bnb_quantized
    assert set(state_devices(model[0].weight).values()) == {"cpu"}  # the copy shares nothing
    assert check_devices(model) == []
    reloaded = subprocess.run(
        [sys.executable, "-c", "import pickle, sys, bitsandbytes; m = pickle.load(sys.stdin.buffer); "
         "print(type(m[0]).__name__, m[0].weight.quant_state.code.shape)"],
        input=pickle.dumps(model),
        capture_output=True,
        check=True,
    )
    assert reloaded.stdout.decode().strip().splitlines()[-1] == "Linear4bit torch.Size([16])"


# -- the wrappers themselves, without the engine --------------------------------------------
@SIM
def test_repair_functions_called_with_the_real_originals(no_shim):
    param = params4bit(weight(), "cuda:0", compress_statistics=True)
    original_qs_to = vars(QuantState)["to"]
    hook.repair_quant_state_to(original_qs_to.__get__(param.quant_state), param.quant_state, ("cuda:1",), {})
    assert set(state_devices(param).values()) == {"cuda:1"}
    original_to = vars(Params4bit)["to"]
    moved = hook.repair_params4bit_to(original_to.__get__(param), param, (), {"device": "cuda:0"})
    assert moved.bnb_quantized is True and set(state_devices(moved).values()) == {"cuda:0"}
    again = hook.repair_params4bit_to(original_to.__get__(moved), moved, ("cuda:1",), {})
    assert again.bnb_quantized is True and str(again.device) == "cuda:1"
