"""generate-input-device: inputs go to the input embeddings' device, results come back, nothing else moves.

Real transformers models on simulated GPUs, through the engine (``install``; forced where the
matrix row does not apply, so that the shim's behaviour is checked on every stack), plus direct
calls of the wrapper for the argument shapes users pass.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

import devmap_shims  # noqa: E402
from devmap_shims.hooks.transformers import _generate_overrides as overrides  # noqa: E402
from devmap_shims.hooks.transformers import generate_input_device as hook  # noqa: E402
from devmap_shims.shims.engine import ENGINE  # noqa: E402
from devmap_shims.shims import wrapping  # noqa: E402
from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.testing.models import PAD_ID, greedy_generate, sample_input_ids, save_tiny_causal_lm  # noqa: E402

TRANSFORMERS = tuple(int(p) for p in transformers.__version__.split(".")[:2])
GPU_MEMORY = "2GiB"  # transformers 5's allocator warm-up assumes at least 1.2 GiB per GPU
WARNING_TEXT = "being on a device type different than your model's device"
NEW = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_causal_lm("qwen2", tmp_path_factory.mktemp("gen") / "qwen2", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    return greedy_generate(model, sample_input_ids(), max_new_tokens=NEW)


def _split_map() -> dict:
    """Embeddings and the first layer on cuda:0, the rest on cuda:1 (every module of this release)."""
    from transformers.models.qwen2 import modeling_qwen2

    names = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    if "rotary_emb" in inspect.getsource(modeling_qwen2.Qwen2Model.__init__):
        names.insert(1, "model.rotary_emb")
    half = len(names) // 2
    return {name: (0 if i < half else 1) for i, name in enumerate(names)}


def _generate(model, ids, **extra):
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
            min_new_tokens=NEW, pad_token_id=PAD_ID, **extra,
        )
    messages = [str(w.message) for w in caught if WARNING_TEXT in str(w.message)]
    return out, messages


def _tokens(out, ids):
    return out[:, ids.shape[1]:].cpu()


# -- where generate is hooked ------------------------------------------------------------------------


def test_override_scan_matches_the_classes_of_the_installed_transformers():
    """The text scan finds exactly the classes that define generate (checked by importing them)."""
    root = overrides.transformers_root()
    assert root is not None and os.path.samefile(root, os.path.dirname(transformers.__file__))
    found = set(overrides.scan_generate_overrides(root))
    files = dict(overrides._model_files(root))
    truth = set()
    for module_name, path in files.items():
        with open(path, "rb") as handle:
            if b"def generate(" not in handle.read():
                continue
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module_name and "generate" in vars(obj):
                truth.add((module_name, name))
    assert found == truth
    assert found, "every transformers release has models that override generate (Whisper, RAG ...)"


def test_class_scan_handles_decorators_nested_defs_and_other_top_level_code():
    source = b'''
@auto_docstring
class A(Base):
    x = 1

    def generate(self, inputs=None):
        def generate(inner):
            pass

class B(
    A,
):
    def forward(self):
        pass

def generate(x):
    pass

class C:
    """Doc."""

    @torch.no_grad()
    def generate(self):
        pass
CONSTANT = 1
    def generate(self):
'''
    assert overrides.classes_defining_generate(source) == ["A", "C"]


def test_override_list_is_cached_per_install_and_rescanned_when_files_change(tmp_path, monkeypatch):
    root = tmp_path / "transformers"
    (root / "generation").mkdir(parents=True)
    (root / "generation" / "utils.py").write_text("class GenerationMixin:\n    def generate(self): pass\n")
    (root / "__init__.py").write_text("")
    model_dir = root / "models" / "toy"
    model_dir.mkdir(parents=True)
    (model_dir / "modeling_toy.py").write_text("class ToyForX:\n    def generate(self):\n        pass\n")
    (model_dir / "modeling_tf_toy.py").write_text("class TFToy:\n    def generate(self):\n        pass\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = overrides.generate_overrides(str(root))
    assert first == [("transformers.models.toy.modeling_toy", "ToyForX")]
    assert len(list((tmp_path / "cache" / "devmap_shims").iterdir())) == 1

    def no_scan(_root):
        raise AssertionError("a cache hit must not rescan")

    monkeypatch.setattr(overrides, "scan_generate_overrides", no_scan)
    assert overrides.generate_overrides(str(root)) == first
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # An upgrade rewrites generation/utils.py: the key changes and the files are read again.
    (model_dir / "generation_toy.py").write_text("class ToyGenerationMixin:\n    def generate(self):\n        pass\n")
    (root / "generation" / "utils.py").write_text("class GenerationMixin:\n    def generate(self, x=None): pass\n")
    assert overrides.generate_overrides(str(root)) == [
        ("transformers.models.toy.generation_toy", "ToyGenerationMixin"),
        ("transformers.models.toy.modeling_toy", "ToyForX"),
    ]


def test_unwritable_cache_still_gives_the_list(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert overrides.generate_overrides() == overrides.scan_generate_overrides(overrides.transformers_root())


def test_the_shim_declares_the_mixin_and_adds_every_override_once_it_arms(shim):
    assert [t.key for t in hook.SHIM.targets] == ["transformers.generation.utils:GenerationMixin.generate"]
    targets = {t.target.key for t in ENGINE.registry.shims[hook.SHIM.id].targets}
    assert targets == {"transformers.generation.utils:GenerationMixin.generate"} | {
        f"{module}:{cls}.generate" for module, cls in overrides.generate_overrides()
    }


def test_the_override_scan_runs_only_where_the_shim_arms(no_shim, monkeypatch):
    scans = []
    monkeypatch.setattr(overrides, "generate_overrides", lambda: scans.append(1) or [])
    devmap_shims.install(only=[hook.SHIM.id], exclude=[hook.SHIM.id])
    import transformers.generation.utils  # noqa: F401

    assert scans == []
    devmap_shims.uninstall()
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    assert scans == [1]


def test_installed_shim_wraps_the_mixin_and_an_override_when_its_module_loads(shim):
    from transformers.generation.utils import GenerationMixin

    assert wrapping.is_ours(vars(GenerationMixin)["generate"])
    module_name, cls = next((m, c) for m, c in overrides.generate_overrides() if m.endswith("generation_whisper"))
    module = importlib.import_module(module_name)
    assert wrapping.is_ours(vars(getattr(module, cls))["generate"])
    states = {t["target"]: t["state"] for s in devmap_shims.status()["shims"] for t in s["targets"]}
    assert states["transformers.generation.utils:GenerationMixin.generate"] == "active"
    assert states[f"{module_name}:{cls}.generate"] == "active"


# -- behaviour on simulated GPUs ---------------------------------------------------------------------


@pytest.mark.parametrize("inputs_on", ["cuda:0", "cpu"])
def test_inputs_on_another_device_than_an_unhooked_model_generate_the_cpu_tokens(
    checkpoint, reference, shim, inputs_on, caplog
):
    ids = sample_input_ids()
    with simulated_gpus(2, memory=GPU_MEMORY):
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map={"": 1})
        given = ids.to(inputs_on)
        with caplog.at_level(logging.DEBUG, logger="devmap_shims"):
            out, warned = _generate(model, given)
        assert torch.equal(_tokens(out, ids), reference)
        assert out.device == given.device  # the caller gets the result where its inputs were
        assert warned == []
    moves = [r.getMessage() for r in caplog.records if "moved" in r.getMessage()]
    assert len(moves) == 1 and "to cuda:1" in moves[0] and "attention_mask" in moves[0]


def test_without_the_shim_the_same_call_fails_before_transformers_5_13(checkpoint, no_shim):
    ids = sample_input_ids()
    with simulated_gpus(2, memory=GPU_MEMORY):
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map={"": 1})
        if TRANSFORMERS < (5, 13):
            with pytest.raises(RuntimeError, match="same device"):
                _generate(model, ids.to("cuda:0"))
        else:  # huggingface/transformers#46590 moves the forward's inputs itself
            out, _ = _generate(model, ids.to("cuda:0"))
            assert out.device == torch.device("cuda:0")


def test_cpu_inputs_to_a_split_model_no_longer_warn_and_keep_tokens_and_devices(checkpoint, reference, no_shim):
    """The device-type warning disappears once the shim aligned the inputs; nothing else changes."""
    ids = sample_input_ids()
    device_map = _split_map()
    with simulated_gpus(2, memory=GPU_MEMORY):
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map)
        plain, plain_warned = _generate(model, ids)
        devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
        try:
            shimmed, shimmed_warned = _generate(model, ids)
            beams, _ = _generate(model, ids, num_beams=2)
        finally:
            devmap_shims.uninstall()
        plain_beams, _ = _generate(model, ids, num_beams=2)
    if TRANSFORMERS < (5, 20):
        assert plain_warned, "transformers < 5.20 warns about CPU inputs for a model on a GPU"
    assert shimmed_warned == []
    assert torch.equal(_tokens(shimmed, ids), reference) and torch.equal(_tokens(plain, ids), reference)
    assert shimmed.device == plain.device == torch.device("cpu")
    assert torch.equal(beams, plain_beams) and beams.device == plain_beams.device


def test_aligned_inputs_reach_generate_as_the_same_objects(checkpoint, shim):
    ids = sample_input_ids()
    seen = {}
    with simulated_gpus(2, memory=GPU_MEMORY):
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map={"": 1})
        given = ids.to("cuda:1")
        mask = torch.ones_like(given)
        result = object()

        def original(*args, **kwargs):
            seen["args"], seen["kwargs"] = args, kwargs
            return result

        assert hook.align_generate_inputs(original, model, (given,), {"attention_mask": mask}) is result
    assert seen["args"][0] is given and seen["kwargs"]["attention_mask"] is mask


def test_dict_output_comes_back_on_the_caller_device_except_the_cache(checkpoint, shim):
    ids = sample_input_ids()
    with simulated_gpus(2, memory=GPU_MEMORY):
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map={"": 1})
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=PAD_ID,
                return_dict_in_generate=True, output_scores=True,
            )
        assert out.sequences.device == torch.device("cpu")
        assert all(score.device == torch.device("cpu") for score in out.scores)
        # the cache stays on the model's GPU (transformers >= 5.24 names the field ``cache``)
        cache = out.get("cache", out.get("past_key_values"))
        assert _first_cached_keys(cache).device == torch.device("cuda:1")


def _first_cached_keys(cache):
    """The first layer's cached keys: cache layers (transformers >= 4.56), ``key_cache`` lists
    (4.36-4.55) or legacy tuples."""
    layers = getattr(cache, "layers", None)
    if layers:
        return layers[0].keys
    key_cache = getattr(cache, "key_cache", None)
    if key_cache:
        return key_cache[0]
    assert isinstance(cache, tuple), f"no cache in the output: {cache!r}"
    return cache[0][0]


# -- bad input passes through untouched ------------------------------------------------------------------


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "result"


@pytest.fixture
def model_on_cuda1(checkpoint):
    with simulated_gpus(2, memory=GPU_MEMORY):
        yield transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map={"": 1})


def _same(call, args, kwargs):
    got_args, got_kwargs = call
    assert len(got_args) == len(args) and all(a is b for a, b in zip(got_args, args))
    assert got_kwargs.keys() == kwargs.keys() and all(got_kwargs[k] is kwargs[k] for k in kwargs)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: ((), {}), id="no-arguments"),
        pytest.param(lambda: ((), {"max_new_tokens": 4, "do_sample": False}), id="no-tensors"),
        pytest.param(lambda: (([[5, 6, 7]],), {"attention_mask": [[1, 1, 1]]}), id="nested-lists"),
        pytest.param(
            lambda: ((transformers.BatchEncoding({"input_ids": torch.tensor([[5, 6]], device="cuda:0")}),), {}),
            id="batch-encoding",
        ),
        pytest.param(
            lambda: ((), {"past_key_values": torch.zeros(1, device="cuda:0"), "max_new_tokens": 2}),
            id="cache-tensor",
        ),
        pytest.param(  # transformers >= 5.24 names the argument ``cache``
            lambda: ((), {"cache": torch.zeros(1, device="cuda:0"), "max_new_tokens": 2}),
            id="cache-tensor-by-its-new-name",
        ),
    ],
)
def test_arguments_that_are_not_misplaced_tensors_pass_through(model_on_cuda1, make):
    args, kwargs = make()
    original = _Recorder()
    assert hook.align_generate_inputs(original, model_on_cuda1, args, kwargs) == "result"
    _same(original.calls[0], args, kwargs)


class _NoEmbeddings(torch.nn.Module):
    def get_input_embeddings(self):
        raise NotImplementedError


class _NoneEmbeddings(torch.nn.Module):
    def get_input_embeddings(self):
        return None


@pytest.mark.parametrize("instance", [_NoEmbeddings(), _NoneEmbeddings(), torch.nn.Linear(2, 2), None])
def test_models_without_input_embeddings_are_not_touched(instance):
    with simulated_gpus(2, memory=GPU_MEMORY):
        args = (torch.tensor([[5, 6]], device="cuda:0"),)
        kwargs = {"attention_mask": torch.ones(1, 2, device="cuda:1")}
        original = _Recorder()
        hook.align_generate_inputs(original, instance, args, kwargs)
    _same(original.calls[0], args, kwargs)


def test_offloaded_embedding_uses_its_hook_execution_device():
    class Hook:
        execution_device = 1

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(4, 2, device="meta")
            self.emb._hf_hook = Hook()

        def get_input_embeddings(self):
            return self.emb

    with simulated_gpus(2, memory=GPU_MEMORY):
        assert hook.input_embedding_device(Model()) == torch.device("cuda:1")


def test_original_errors_propagate_unchanged(model_on_cuda1, shim):
    def broken(*args, **kwargs):
        raise ValueError("the library's own error")

    with pytest.raises(ValueError, match="the library's own error"):
        hook.align_generate_inputs(broken, model_on_cuda1, (torch.tensor([[3]]),), {})


class _CountingModel(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.body = torch.nn.Module()
        self.body.embed = torch.nn.Embedding(4, 2, device=device)
        self.asked = 0

    def get_input_embeddings(self):
        self.asked += 1
        return self.body.embed

    def set_input_embeddings(self, value):
        self.body.embed = value


def test_remembered_embeddings_are_asked_for_once_and_dropped_when_replaced():
    import weakref

    known = weakref.WeakKeyDictionary()
    with simulated_gpus(2, memory=GPU_MEMORY):
        model = _CountingModel("cuda:0")
        assert hook.input_embedding_device(model, known) == torch.device("cuda:0")
        assert hook.input_embedding_device(model, known) == torch.device("cuda:0")
        assert model.asked == 1, "the second call reads the remembered module"
        model.set_input_embeddings(torch.nn.Embedding(4, 2, device="cuda:1"))  # as resize_token_embeddings does
        assert hook.input_embedding_device(model, known) == torch.device("cuda:1")
        assert model.asked == 2
        model.body.embed.to("cuda:0")  # a move keeps the module: its new device is read from the weight
        assert hook.input_embedding_device(model, known) == torch.device("cuda:0")
    del model
    import gc

    gc.collect()
    assert len(known) == 0, "a model that is gone leaves no entry"


def test_a_model_whose_embedding_it_holds_itself_is_freed_after_generate(shim):
    """T5 keeps its input embeddings as ``model.shared``: remembering them must not keep the model
    (and its GPU memory) alive once the program drops it."""
    import gc
    import weakref

    config = transformers.T5Config(vocab_size=32, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config).eval()
    assert model.get_input_embeddings() is model.shared
    with torch.no_grad():
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
