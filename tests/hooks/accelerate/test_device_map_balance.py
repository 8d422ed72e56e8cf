"""The device-map-balance wrappers, called directly with the real library functions, and through
the engine (``devmap_shims.install``) on a meta-device Gemma-2-27B skeleton."""

from __future__ import annotations

import logging
from collections import OrderedDict

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("bitsandbytes")

import accelerate.utils.modeling as am  # noqa: E402
import transformers  # noqa: E402

import devmap_shims  # noqa: E402
from devmap_shims.cli import device_map_step as stack  # noqa: E402
from devmap_shims.hooks.accelerate import device_map_balance as hook  # noqa: E402

GiB = 2**30
V5 = int(transformers.__version__.split(".")[0]) >= 5
LOGGER = hook.__name__

GEMMA_27B = dict(
    vocab_size=256000, hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
    num_attention_heads=32, num_key_value_heads=16, head_dim=128, tie_word_embeddings=True,
)
MISTRAL_7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
)

# untied: the layout is built without tied groups, which accelerate reports as an empty list
LLAMA_3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
)

GEMMA_7B = dict(
    vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=16, head_dim=256, tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def gemma():
    """Gemma-2-27B, or Gemma-7B (same 256k tied vocabulary) where transformers predates Gemma-2."""
    if hasattr(transformers, "Gemma2Config"):
        config = transformers.Gemma2Config(**GEMMA_27B)
    else:
        config = transformers.GemmaConfig(**GEMMA_7B)
    return stack.build_meta_model(config, "bfloat16", "4bit")


@pytest.fixture(scope="module")
def mistral_bf16():
    return stack.build_meta_model(transformers.MistralConfig(**MISTRAL_7B), "bfloat16", "none")


def gpus(n, gib=23, cpu=180):
    mm = {i: gib * GiB for i in range(n)}
    mm["cpu"] = cpu * GiB
    return mm


def repairs(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


# -- wrappers called with the real originals ------------------------------------------------------


def test_collapsed_map_is_repaired_with_one_info_line(gemma, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    plain = stack.device_map_step(gemma, "auto", gpus(8), shim=False)
    assert len(repairs(caplog)) == 0
    fixed = stack.device_map_step(gemma, "auto", gpus(8), shim=True)
    assert set(plain.values()) != set(range(8))
    assert set(fixed.values()) == set(range(8))
    lines = repairs(caplog)
    assert len(lines) == 1
    assert hook.BUG_ID in lines[0].getMessage()
    assert isinstance(fixed, OrderedDict), "the map keeps the type the library returns"


def test_sequential_map_is_returned_unchanged(gemma, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    plain = stack.device_map_step(gemma, "sequential", gpus(8), shim=False)
    shimmed = stack.device_map_step(gemma, "sequential", gpus(8), shim=True)
    assert shimmed == plain and not repairs(caplog)


def test_healthy_balanced_map_is_returned_unchanged(mistral_bf16, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    plain = stack.device_map_step(mistral_bf16, "auto", gpus(4, 24), shim=False)
    shimmed = stack.device_map_step(mistral_bf16, "auto", gpus(4, 24), shim=True)
    assert len(set(plain.values())) == 4
    assert shimmed == plain and not repairs(caplog)


def test_result_object_is_passed_through_untouched_when_nothing_is_wrong(gemma, direct):
    repair_get_device_map = direct(hook.SHIM, hook.repair_get_device_map)
    sentinel = OrderedDict([("", 0)])
    calls = []

    def fake_original(model, device_map, max_memory, hf_quantizer):
        calls.append(device_map)
        return sentinel if isinstance(device_map, str) else device_map

    explicit = {"model": 0, "lm_head": 0}
    assert repair_get_device_map(fake_original, None, (gemma.model, explicit, None, None), {}) is explicit
    out = repair_get_device_map(fake_original, None, (gemma.model, "sequential", None, None), {})
    assert out is sentinel and calls == [explicit, "sequential"]


def test_explicit_dict_map_is_returned_unchanged_by_the_library_path(gemma, direct):
    explicit = {"": 3}
    if V5:
        from transformers.integrations import accelerate as tia

        original = stack.original(tia._get_device_map)
        out = direct(hook.SHIM, hook.repair_get_device_map)(original, None, (gemma.model, explicit, None, None), {})
        assert out == explicit
    else:
        # transformers 4.x never calls accelerate's placer for a dict map; a direct
        # infer_auto_device_map call without balancing is not touched either
        original = stack.original(am.infer_auto_device_map)
        kwargs = dict(max_memory={i: 2 * GiB for i in range(8)},
                      no_split_module_classes=list(gemma.model._no_split_modules))
        repair = direct(hook.SHIM, hook.repair_infer_auto_device_map)
        with stack.quiet_missing_devices(), stack.gpu_context([23 * GiB] * 8):
            plain = original(gemma.model, **kwargs)
            through = repair(original, None, (gemma.model,), dict(kwargs))
        assert through == plain


def accelerate_pair_inputs(meta):
    """What transformers 4.x passes to accelerate's pair for a bnb 4-bit model."""
    import torch
    from accelerate.utils import CustomDtype

    model = meta.model
    special = {
        n: torch.bfloat16 for n, _ in model.named_parameters()
        if "Linear4bit" not in type(model.get_submodule(n.rpartition(".")[0])).__name__ or n.endswith("bias")
    }
    model.tie_weights()
    return model, dict(no_split_module_classes=list(model._no_split_modules), dtype=CustomDtype.INT4,
                       special_dtypes=special)


def run_pair(model, user, kwargs, factor=0.9, shim=True, second_infer=False, adjust=None):
    from devmap_shims.shims import ShimContext
    from devmap_shims.shims.guard import bind_context

    gbm = stack.original(am.get_balanced_memory)
    iadm = stack.original(am.infer_auto_device_map)
    if shim:
        context = ShimContext(hook.SHIM)
        remember = bind_context(hook.remember_balanced_memory, context)
        repair = bind_context(hook.repair_infer_auto_device_map, context)
        call_gbm = lambda *a, **k: remember(gbm, None, a, k)  # noqa: E731
        call_iadm = lambda *a, **k: repair(iadm, None, a, k)  # noqa: E731
    else:
        call_gbm, call_iadm = gbm, iadm
    with stack.quiet_missing_devices(), stack.gpu_context([23 * GiB] * 8):
        balanced = call_gbm(model, max_memory=None if user is None else dict(user), **kwargs)
        balanced = {k: v * factor for k, v in balanced.items()}
        if adjust is not None:
            adjust(balanced)
        first = call_iadm(model, max_memory=balanced, **kwargs)
        if second_infer:
            return first, call_iadm(model, max_memory=balanced, **kwargs)
    return first


def test_accelerate_pair_is_repaired_and_the_record_is_used_once(gemma):
    model, kwargs = accelerate_pair_inputs(gemma)
    first, second = run_pair(model, gpus(8, cpu=0), kwargs, second_infer=True)
    assert set(first.values()) == set(range(8))
    assert second == run_pair(model, gpus(8, cpu=0), kwargs, shim=False), (
        "a later infer_auto_device_map call without a new get_balanced_memory is the library's own"
    )


def test_accelerate_pair_respects_user_caps_after_the_quantizer_adjustment(gemma):
    model, kwargs = accelerate_pair_inputs(gemma)
    user = {i: 3 * GiB for i in range(8)}
    fixed = run_pair(model, user, kwargs)
    sizes = am.compute_module_sizes(model, dtype=kwargs["dtype"], special_dtypes=kwargs["special_dtypes"])
    per = {}
    for name, dev in fixed.items():
        per[dev] = per.get(dev, 0) + sizes[name]
    assert set(per) == set(range(8))
    assert all(v <= 0.9 * 3 * GiB for v in per.values()), per


def test_accelerate_pair_left_alone_when_budgets_are_raised_in_between(gemma):
    model, kwargs = accelerate_pair_inputs(gemma)
    raised = run_pair(model, gpus(8, cpu=0), kwargs, factor=1.5)
    plain = run_pair(model, gpus(8, cpu=0), kwargs, factor=1.5, shim=False)
    assert raised == plain


def test_accelerate_pair_left_alone_when_the_caller_lowers_one_gpu_in_between(gemma):
    """Balanced caps taken, GPU 0 lowered, then the map: a change that is not the quantizer's
    uniform scaling is the caller's, and the map must keep to the cap it was given."""
    model, kwargs = accelerate_pair_inputs(gemma)

    def lower_gpu0(caps):
        caps[0] = GiB

    lowered = run_pair(model, gpus(8, cpu=0), kwargs, adjust=lower_gpu0)
    assert lowered == run_pair(model, gpus(8, cpu=0), kwargs, adjust=lower_gpu0, shim=False)
    sizes = am.compute_module_sizes(model, dtype=kwargs["dtype"], special_dtypes=kwargs["special_dtypes"])
    assert sum(sizes[name] for name, dev in lowered.items() if dev == 0) <= GiB


def test_balanced_low_0_keeps_gpu0_empty(gemma):
    fixed = stack.device_map_step(gemma, "balanced_low_0", gpus(8), shim=True)
    assert 0 not in fixed.values() and set(fixed.values()) == set(range(1, 8))


# -- through the engine ----------------------------------------------------------------------------


@pytest.fixture
def installed():
    devmap_shims.uninstall()
    assert devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    yield
    devmap_shims.uninstall()


def _library_step(meta, strategy, max_memory):
    """The from_pretrained step through the module attributes (wrapped or not), not stack.original."""
    if V5:
        from transformers.integrations import accelerate as tia

        with stack.quiet_missing_devices(), stack.no_environment_check(meta.quantizer), stack.gpu_context():
            return tia._get_device_map(meta.model, strategy, dict(max_memory), meta.quantizer)
    model, q, dt = meta.model, meta.quantizer, meta.dtype
    special = q.get_special_dtypes_update(model, dt) if q is not None else {}
    target = q.adjust_target_dtype(dt) if q is not None else dt
    no_split = model._get_no_split_modules(strategy)
    with stack.quiet_missing_devices(), stack.gpu_context([23 * GiB] * 8):
        mm = transformers.modeling_utils.get_balanced_memory(
            model, dtype=target, low_zero=False, max_memory=dict(max_memory),
            no_split_module_classes=no_split, special_dtypes=special,
        )
        mm = q.adjust_max_memory(mm) if q is not None else mm
        model.tie_weights()
        return transformers.modeling_utils.infer_auto_device_map(
            model, dtype=target, max_memory=mm, no_split_module_classes=no_split, special_dtypes=special,
        )


def test_installed_shim_repairs_the_map_at_the_call_sites_from_pretrained_uses(gemma, installed, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    fixed = _library_step(gemma, "auto", gpus(8))
    assert set(fixed.values()) == set(range(8))
    assert len(repairs(caplog)) == 1
    devmap_shims.uninstall()
    plain = _library_step(gemma, "auto", gpus(8))
    assert set(plain.values()) != set(range(8))
    assert len(repairs(caplog)) == 1


@pytest.mark.parametrize("case", ["collapsed", "collapsed-untied", "healthy"])
def test_installed_shim_judges_the_map_with_the_sizes_the_library_computed(case, gemma, mistral_bf16, monkeypatch):
    """The shim reads the module sizes (and, on accelerate's path, the tied groups) the library
    computed for the map instead of computing them again: a from_pretrained step calls the
    library's helpers as often with the shim as without. A healthy map is kept from those sizes
    alone; the model's layout is walked only for a map that needs repairing."""
    import functools
    from collections import Counter

    import devmap_shims.planning as planning

    if case == "collapsed":
        meta, mm = gemma, gpus(8)
    elif case == "collapsed-untied":
        meta, mm = stack.build_meta_model(transformers.LlamaConfig(**LLAMA_3_8B), "bfloat16", "4bit"), gpus(8)
    else:
        meta, mm = mistral_bf16, gpus(4, 24)
    calls = Counter()
    modules = [(am, "compute_module_sizes"), (am, "find_tied_parameters")]
    if V5:
        from transformers.integrations import accelerate as tia

        modules.append((tia, "compute_module_sizes"))
    for module, name in modules:
        real = stack.original(getattr(module, name))

        def counted(*args, _real=real, _key=f"{module.__name__}.{name}", **kwargs):
            if not kwargs.get("buffers_only"):
                calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, functools.wraps(real)(counted))
    walks = Counter()
    real_walk = planning.layout_from_module
    monkeypatch.setattr(planning, "layout_from_module",
                        lambda *a, **k: walks.update(["layout"]) or real_walk(*a, **k))

    devmap_shims.uninstall()
    plain = _library_step(meta, "auto", mm)
    without = Counter(calls)
    calls.clear()
    assert devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    try:
        shimmed = _library_step(meta, "auto", mm)
    finally:
        devmap_shims.uninstall()
    assert sum(without.values()) >= 1 and calls == without
    if case != "healthy":
        assert set(shimmed.values()) == set(range(8)) != set(plain.values())
        assert walks["layout"] == 1
    else:
        assert shimmed == plain and len(set(plain.values())) == 4
        assert walks["layout"] == 0


def test_status_reports_the_shim_active(installed):
    import accelerate.utils.modeling  # noqa: F401

    status = devmap_shims.status()
    (entry,) = [s for s in status["shims"] if s["id"] == hook.SHIM.id]
    states = {t["target"]: t["state"] for t in entry["targets"]}
    assert states["accelerate.utils.modeling:infer_auto_device_map"] == "active"
    assert states["accelerate.utils.modeling:get_balanced_memory"] == "active"
    # what the library computed for the map is read where it is computed once per map
    reader = ("_init_infer_auto_device_map" if hasattr(accelerate.utils.modeling, "_init_infer_auto_device_map")
              else "compute_module_sizes")
    assert states[f"accelerate.utils.modeling:{reader}"] == "active"
    if V5:
        import transformers.integrations.accelerate  # noqa: F401

        status = devmap_shims.status()
        (entry,) = [s for s in status["shims"] if s["id"] == hook.SHIM.id]
        states = {t["target"]: t["state"] for t in entry["targets"]}
        assert states["transformers.integrations.accelerate:_get_device_map"] == "active"


@pytest.mark.simulated_gpus(n=1, memory="1GiB")
def test_one_gpu_keeps_the_headroom_the_library_leaves_there(installed):
    """With no max_memory and a single GPU, get_balanced_memory keeps 10 % of it free for
    activations; the library's map, which offloads what does not fit in the other 90 %, stays."""
    import torch
    from accelerate import init_empty_weights

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4096, 6000, bias=False) for _ in range(10))

    with init_empty_weights():
        model = Stack()

    def library_map():
        budgets = am.get_balanced_memory(model, no_split_module_classes=["Linear"])
        return dict(am.infer_auto_device_map(model, max_memory=budgets, no_split_module_classes=["Linear"]))

    with_shim = library_map()
    devmap_shims.uninstall()
    assert with_shim == library_map()
    assert "cpu" in with_shim.values(), with_shim  # the 90 % the library allows is too small for all ten
