"""devmap_shims.check_devices: every tensor off its module's device, on simulated GPUs."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
try:  # before any simulation starts: bitsandbytes probes CUDA when first imported
    import bitsandbytes as _bitsandbytes
except ImportError:  # pragma: no cover - stacks without bitsandbytes skip those tests
    _bitsandbytes = None

import devmap_shims  # noqa: E402
from devmap_shims.checks import check_devices, format_records  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

SIM = pytest.mark.simulated_gpus(n=2, memory="1GiB")


def model(device="cpu"):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    return net.to(device)


def names(records):
    return sorted(r["name"] for r in records)


def test_everything_in_place_gives_nothing():
    assert check_devices(model()) == []
    assert devmap_shims.check_devices(model()) == []


@SIM
def test_stray_parameter_and_buffer_are_reported_against_the_models_device():
    net = model("cuda:1")
    net[1].running_mean.data = net[1].running_mean.data.to("cuda:0")
    net[2].bias.data = net[2].bias.data.to("cuda:0")
    records = check_devices(net)
    assert names(records) == ["1.running_mean", "2.bias"]
    by_name = {r["name"]: r for r in records}
    assert by_name["1.running_mean"]["kind"] == "buffer" and by_name["2.bias"]["kind"] == "parameter"
    assert {r["device"] for r in records} == {"cuda:0"} and {r["expected"] for r in records} == {"cuda:1"}
    assert by_name["2.bias"]["shape"] == (4,) and by_name["2.bias"]["dtype"] == "float32"
    assert devmap_shims.check_devices(net) == records


@SIM
def test_meta_tensors_are_not_strays():
    net = model("cuda:1")
    net[2].weight = torch.nn.Parameter(torch.empty(4, 8, device="meta"))
    assert check_devices(net) == []


@SIM
def test_the_device_holding_most_elements_is_the_models_device():
    net = model("cuda:0")  # elements: Linear 72, BatchNorm 33 (params and buffers), Linear 36
    net[2].to("cuda:1")
    assert names(check_devices(net)) == ["2.bias", "2.weight"]
    net[0].to("cuda:1")  # now 108 of 141 on cuda:1
    assert names(check_devices(net)) == ["1.bias", "1.num_batches_tracked", "1.running_mean", "1.running_var", "1.weight"]


@SIM
def test_pipelines_dicts_and_lists_prefix_component_names():
    text, unet = model("cuda:1"), model("cuda:1")
    unet[0].bias.data = unet[0].bias.data.to("cuda:0")
    pipe = types.SimpleNamespace(components={"text_encoder": text, "unet": unet, "tokenizer": "not a module", "scheduler": None})
    assert names(check_devices(pipe)) == ["unet.0.bias"]
    assert names(check_devices({"a": text, "b": unet})) == ["b.0.bias"]
    assert names(check_devices(pipe.components)) == ["unet.0.bias"]  # its tokenizer and None skipped as there
    assert names(check_devices([text, unet])) == ["1.0.bias"]
    holder = {"a": text, "b": unet}
    holder["self"] = holder  # a dict that holds itself is looked at once, not until RecursionError
    assert names(check_devices(holder)) == ["b.0.bias"]


def test_unsupported_objects_are_refused_with_a_message():
    with pytest.raises(TypeError, match="check_devices"):
        check_devices(42)
    trainer = types.SimpleNamespace(net=model(), steps=3)  # holds a model it cannot see into
    for holder in (trainer, {"run": trainer}, [model(), trainer]):
        with pytest.raises(TypeError, match="got SimpleNamespace"):
            check_devices(holder)


@SIM
def test_split_device_maps_are_trusted_one_device_maps_are_not():
    net = model("cuda:0")
    net[2].to("cuda:1")
    net.hf_device_map = {"0": 0, "1": 0, "2": 1}  # a split map: 2 belongs on cuda:1
    assert check_devices(net) == []
    net.hf_device_map = {0: 0, 1: 0, 2: 1}  # a hand-made map keyed by numbers says the same
    assert check_devices(net) == []
    net.hf_device_map = {"": "cuda:0"}  # the load device, stale after .to(): the majority decides
    net.to("cuda:1")
    assert check_devices(net) == []


@SIM
def test_a_split_map_of_a_model_moved_whole_without_its_hooks_is_stale():
    # accelerate's guard only warns: a dispatched model whose hooks were removed and that was then
    # moved whole runs on one device, and its hf_device_map no longer says where anything belongs
    hooks = pytest.importorskip("accelerate.hooks")
    net = model("cuda:0")
    net[2].to("cuda:1")
    net.hf_device_map = {"0": 0, "1": 0, "2": 1}
    hooks.add_hook_to_module(net[2], hooks.AlignDevicesHook(execution_device=1))
    hooks.remove_hook_from_module(net, recurse=True)
    net.to("cuda:0")
    assert check_devices(net) == []
    # moved whole but for one buffer: that buffer is the stray, not what the stale map sends elsewhere
    net[1].running_mean.data = net[1].running_mean.data.to("cuda:1")
    assert [(r["name"], r["expected"]) for r in check_devices(net)] == [("1.running_mean", "cuda:0")]
    net.to("cuda:1")
    net[1].running_mean.data = net[1].running_mean.data.to("cuda:0")
    assert [(r["name"], r["expected"]) for r in check_devices(net)] == [("1.running_mean", "cuda:1")]


@SIM
def test_a_map_key_that_names_a_parameter_decides_for_it():
    # accelerate splits a module that holds parameters of its own into one key per parameter
    hooks = pytest.importorskip("accelerate.hooks")
    net = model("cuda:0")
    net[0].bias.data = net[0].bias.data.to("cuda:1")
    net.hf_device_map = {"0.weight": 0, "0.bias": 1, "1": 0, "2": 0}
    hooks.add_hook_to_module(net, hooks.AlignDevicesHook(execution_device=0))
    assert check_devices(net) == []
    hooks.remove_hook_from_module(net, recurse=True)
    net.hf_device_map = {"0": 0, "1": 0, "2": 1}
    net[2].to("cuda:1")
    assert names(check_devices(net)) == ["0.bias"]  # its module's key says cuda:0


@SIM
def test_a_tied_parameter_is_reported_once_and_a_lazy_one_not_at_all():
    net = model("cuda:0")
    net[2].weight = torch.nn.Parameter(torch.zeros(8, 8, device="cuda:1"))
    net.append(torch.nn.Linear(8, 8, device="cuda:0"))
    net[3].weight = net[2].weight  # tied: one tensor, held by two modules
    assert names(check_devices(net)) == ["2.weight"]
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 4))
    assert check_devices(lazy) == []


class _Reports(torch.Tensor):
    """A tensor with no data that reports ``device`` (an accelerator this machine does not have)."""

    @staticmethod
    def __new__(cls, device):
        return torch.Tensor._make_wrapper_subclass(cls, (4, 4), device=torch.device(device), dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


@pytest.mark.parametrize("kind", ["xpu", "mps"])
def test_a_hook_device_without_an_index_is_the_one_its_tensors_report(kind):
    # accelerate keeps execution_device="xpu" / "mps"; the tensors there report xpu:0 / mps:0
    hooks = pytest.importorskip("accelerate.hooks")
    layer = torch.nn.Module()
    layer._parameters["weight"] = _Reports(f"{kind}:0")
    layer._hf_hook = hooks.AlignDevicesHook(execution_device=kind)  # as add_hook_to_module leaves it
    assert check_devices(layer) == []


# -- accelerate hooks ----------------------------------------------------------------------------------
@SIM
def test_hook_execution_devices_decide_for_dispatched_modules():
    hooks = pytest.importorskip("accelerate.hooks")
    net = model("cuda:0")
    net[2].to("cuda:1")
    hooks.add_hook_to_module(net[2], hooks.AlignDevicesHook(execution_device=1))
    assert check_devices(net) == []
    net[2].bias.data = net[2].bias.data.to("cuda:0")
    assert [(r["name"], r["expected"]) for r in check_devices(net)] == [("2.bias", "cuda:1")]


@SIM
def test_offloaded_modules_are_not_checked():
    hooks = pytest.importorskip("accelerate.hooks")
    net = model("cuda:0")
    net[2].to("cpu")
    hooks.add_hook_to_module(net[2], hooks.AlignDevicesHook(execution_device=0, offload=True))
    assert check_devices(net) == []


@SIM
def test_model_cpu_offload_is_checked_as_one_device():
    hooks = pytest.importorskip("accelerate.hooks")
    net = model("cpu")
    hooks.add_hook_to_module(net, hooks.CpuOffload(execution_device="cuda:0"))
    assert check_devices(net) == []


# -- quantization state ----------------------------------------------------------------------------------
@pytest.fixture
def bnb():
    if _bitsandbytes is None:
        pytest.skip("bitsandbytes is not installed")
    return _bitsandbytes


@pytest.fixture
def layer(bnb, simulated_gpus):
    from devmap_shims.testing.nf4 import linear4bit

    torch.manual_seed(0)
    return torch.nn.Sequential(linear4bit(torch.nn.Linear(128, 64), "cuda:1", compress_statistics=True))


def test_quant_state_tensors_are_checked_against_their_weight(layer):
    state = layer[0].weight.quant_state
    assert check_devices(layer) == []
    state.code = state.code.to("cuda:0")
    state.state2.absmax = state.state2.absmax.to("cuda:0")
    records = check_devices(layer)
    assert names(records) == ["0.weight.quant_state.code", "0.weight.quant_state.state2.absmax"]
    assert {r["kind"] for r in records} == {"quant_state"} and {r["expected"] for r in records} == {"cuda:1"}
    assert "0.weight.quant_state.code (quant_state, [16] float32): on cuda:0, expected cuda:1" in format_records(records)


def test_a_separate_module_quant_state_is_checked_too(layer):
    import copy

    linear = layer[0]
    linear.quant_state = copy.copy(linear.weight.quant_state)
    linear.quant_state.code = linear.quant_state.code.to("cuda:0")
    assert [(r["name"], r["kind"]) for r in check_devices(layer)] == [("0.quant_state.code", "quant_state")]


def test_quant_state_of_a_meta_weight_is_skipped(layer):
    moved = layer[0].weight.to("meta")
    moved.quant_state.code = torch.zeros(16, device="cuda:0")
    layer[0]._parameters["weight"] = moved
    assert check_devices(layer) == []


def test_tensors_attached_to_a_parameter_are_checked(bnb, simulated_gpus):
    param = bnb.nn.Int8Params(torch.randn(4, 4), requires_grad=False, has_fp16_weights=True).to(torch.float16)
    net = torch.nn.Linear(4, 4, bias=False)
    net.weight = param
    net.to("cuda:1")
    net.weight.SCB = torch.ones(4, device="cuda:0")
    records = check_devices(net)
    assert [(r["name"], r["kind"], r["device"], r["expected"]) for r in records] == [
        ("weight.SCB", "attached", "cuda:0", "cuda:1")
    ]
    assert check_devices(net.weight) == [dict(records[0], name="SCB")]


def test_format_records_says_when_all_is_well():
    assert format_records([]) == "every tensor is on its module's device"


def test_an_int8_layers_state_is_checked_against_its_weight(bnb, simulated_gpus):
    """bnb-int8-stats-stay-on-old-device: after its first forward an 8-bit layer runs on
    ``state.CB``/``state.SCB``, which a parent's ``.to()`` leaves behind; the next forward fails."""
    from bitsandbytes.nn import Linear8bitLt

    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.versions import installed_versions, version_in

    if not version_in(bnb.__version__, ">=0.46.0"):
        pytest.skip("bitsandbytes before 0.46 quantizes to 8-bit with its CUDA library only")
    matrix = load_matrix()
    applies = matrix.get("bnb-int8-stats-stay-on-old-device").applies(installed_versions(matrix.distributions()))
    torch.manual_seed(0)
    net = torch.nn.Sequential(Linear8bitLt(8, 4, has_fp16_weights=False).half())
    with torch.no_grad():
        net.to("cuda:0")
        net(torch.randn(2, 8).half().to("cuda:0"))
        assert net[0].state.CB is not None and check_devices(net) == []
        net.to("cuda:1")
    found = [(r["name"], r["kind"], r["device"], r["expected"], r["shape"]) for r in check_devices(net)]
    if applies:
        assert found == [("0.state.CB", "int8_state", "cuda:0", "cuda:1", (4, 8)),
                         ("0.state.SCB", "int8_state", "cuda:0", "cuda:1", (4,))]
    else:
        assert found == []
    net[0].state = types.SimpleNamespace(CB=torch.ones(1, device="cuda:0"))  # not bitsandbytes' state
    assert check_devices(net) == []


@SIM
def test_a_transformers_pipeline_is_checked_through_its_model_and_assistant():
    transformers = pytest.importorskip("transformers")
    from devmap_shims.testing.models._flux_tokenizers import tiny_clip_tokenizer
    from devmap_shims.testing.models.causal_lm import tiny_causal_lm

    main, assistant = tiny_causal_lm("llama").to("cuda:1"), tiny_causal_lm("llama", num_layers=1).to("cuda:1")
    pipe = transformers.pipeline("text-generation", model=main, tokenizer=tiny_clip_tokenizer(), device="cuda:1")
    assert isinstance(pipe, transformers.Pipeline) and check_devices(pipe) == []
    main.model.norm.weight.data = main.model.norm.weight.data.to("cuda:0")
    assert names(check_devices(pipe)) == ["model.model.norm.weight"]
    pipe.assistant_model = assistant  # what pipeline(..., assistant_model=...) sets where it exists
    assistant.lm_head.weight.data = assistant.lm_head.weight.data.to("cuda:0")
    assert names(check_devices(pipe)) == ["assistant_model.lm_head.weight", "model.model.norm.weight"]
    assert names(check_devices({"chat": pipe})) == ["chat.assistant_model.lm_head.weight", "chat.model.model.norm.weight"]
