"""launcher-sharding-guard: one warning (strict: an error) when every rank of a launch shards a model.

The detection is unit-tested on environment variables and device maps; the whole path runs under
``torchrun --nproc_per_node=2`` on the CPU (gloo), each rank on its own simulated 2-GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from devmap_shims.hooks.accelerate import launcher_sharding_guard as hook
from devmap_shims.shims import ShimContext, ShimError
from devmap_shims.shims.guard import bind_context
from devmap_shims.shims.registry import Registry


class _Model:
    def __init__(self, device_map):
        if device_map is not None:
            self.hf_device_map = device_map


@pytest.fixture
def launch(monkeypatch):
    """This process looks like rank 1 of a 2-process torchrun launch."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")


@pytest.fixture
def registry():
    """A registry of its own, to read the warnings the shim's context reports."""
    return Registry()


@pytest.fixture
def context(registry):
    """The shim's context as an install gives it: fresh state, reporting to ``registry``."""
    return ShimContext(hook.SHIM, registry)


@pytest.mark.parametrize(
    "device_map",
    [
        {"model": 0, "lm_head": 1},
        {"model": "cuda:0", "lm_head": "cuda:1"},
        {"a": 0, "b": "cpu", "c": 1, "d": "disk"},
    ],
)
def test_sharded_model_under_a_launch_names_cause_and_fixes(launch, device_map):
    message = hook.sharding_message(_Model(device_map), "Qwen2ForCausalLM.from_pretrained")
    assert message is not None
    assert "process 1 of 2" in message and "cuda:0, cuda:1" in message
    assert "device_map={'': 1}" in message  # this process's LOCAL_RANK
    assert hook.BUG_ID in message and "huggingface/accelerate#3434" in message
    assert "single process" in message and "DEVMAP_SHIMS_STRICT=1" in message


@pytest.mark.parametrize(
    "device_map",
    [None, {"": 1}, {"model": 0, "lm_head": 0}, {"model": 0, "lm_head": "cpu"}, {"": "cpu"}, {}],
)
def test_one_gpu_per_process_is_fine(launch, device_map):
    assert hook.sharding_message(_Model(device_map), "x") is None


@pytest.mark.parametrize("world", [None, "1", "not-a-number"])
def test_a_single_process_is_fine(monkeypatch, world):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert hook.sharding_message(_Model({"model": 0, "lm_head": 1}), "x") is None


def test_ranks_with_gpu_sets_of_their_own_are_fine(launch, monkeypatch):
    sharded = _Model({"model": 0, "lm_head": 1})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # not the launcher's (pytest's parent has another)
    assert hook.has_own_gpus()
    assert hook.sharding_message(sharded, "x") is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert not hook.has_own_gpus() and hook.sharding_message(sharded, "x") is not None


def test_one_process_per_machine_shares_no_gpu(launch, monkeypatch):
    """torchrun --nnodes=2 --nproc_per_node=1: one sharded copy per machine is the layout the
    warning itself recommends."""
    sharded = _Model({"model": 0, "lm_head": 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert hook.sharding_message(sharded, "x") is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert hook.sharding_message(sharded, "x") is not None


@pytest.mark.parametrize("device_map, max_memory, refused", [
    ("auto", {0: "20GiB", 1: "20GiB"}, True),
    ("auto", {"0": "20GiB", "1": "20GiB", "cpu": "100GiB"}, True),
    ("auto", {1: "20GiB", "cpu": "100GiB"}, False),  # this rank's own GPU, chosen by budget
    ("balanced", {0: 0, 1: "20GiB"}, False),
    ("sequential", None, False),  # a model that fits GPU 0 stays there: judged after the load
])
def test_strict_mode_before_loading_counts_the_gpus_the_budgets_allow(
    launch, context, registry, monkeypatch, device_map, max_memory, refused
):
    registry.strict = True
    monkeypatch.setattr(hook, "_visible_gpus", lambda: ["cuda:0", "cuda:1"])
    after_load = bind_context(hook.check_after_from_pretrained, context)
    one_gpu = _Model({"": 1})
    load = (lambda *a, **k: one_gpu, None, ("path",), {"device_map": device_map, "max_memory": max_memory})
    if refused:
        with pytest.raises(ShimError, match="process 1 of 2"):
            after_load(*load)
    else:
        assert after_load(*load) is one_gpu and registry.warnings == []


def test_an_explicit_device_map_dict_is_the_users_choice(launch, context, registry):
    after_load = bind_context(hook.check_after_from_pretrained, context)
    sharded = _Model({"model": 0, "lm_head": 1})
    after_load(lambda *a, **k: sharded, None, ("path",), {"device_map": {"model": 0, "lm_head": 1}})
    assert registry.warnings == []


def test_strict_mode_refuses_before_loading(launch, context, registry, monkeypatch):
    registry.strict = True
    monkeypatch.setattr(hook, "_visible_gpus", lambda: ["cuda:0", "cuda:1"])
    after_load = bind_context(hook.check_after_from_pretrained, context)
    loads = []
    with pytest.raises(ShimError, match="process 1 of 2"):
        after_load(lambda *a, **k: loads.append(1), None, ("path",), {"device_map": "auto"})
    assert loads == [], "strict mode raises before the model is loaded"


def test_warns_once_per_install(launch, context, registry):
    sharded = _Model({"model": 0, "lm_head": 1})
    hook.check(context, sharded, "first")
    hook.check(context, sharded, "second")
    assert len(registry.warnings) == 1 and "first" in registry.warnings[0]
    hook.check(ShimContext(hook.SHIM, registry), sharded, "after a new install")
    assert len(registry.warnings) == 2, "a new install starts with fresh state"


def test_strict_mode_raises(launch, context, registry):
    registry.strict = True
    with pytest.raises(ShimError, match="process 1 of 2"):
        hook.check(context, _Model({"model": 0, "lm_head": 1}), "from_pretrained")


def test_wrappers_see_loading_info_tuples_and_warn_once(launch, context, registry):
    after_load = bind_context(hook.check_after_from_pretrained, context)
    before_generate = bind_context(hook.check_before_generate, context)
    one_gpu = _Model({"": 1})
    result = (one_gpu, {"missing_keys": []})  # from_pretrained(..., output_loading_info=True)
    assert after_load(lambda *a, **k: result, None, ("path",), {}) is result
    marker = object()
    assert before_generate(lambda *a, **k: marker, one_gpu, (), {}) is marker
    assert registry.warnings == []
    sharded = _Model({"model": 0, "lm_head": 1})
    assert after_load(lambda *a, **k: (sharded, {}), None, ("path",), {})[0] is sharded
    assert len(registry.warnings) == 1


# -- the real thing: torchrun, two ranks, each sharding a model over its two simulated GPUs -------------

WORKER = textwrap.dedent(
    """
    import datetime, json, os, sys
    import torch
    import torch.distributed as dist
    import devmap_shims
    from devmap_shims.testing import simulated_gpus
    from devmap_shims.testing.models import PAD_ID, sample_input_ids
    from transformers import AutoModelForCausalLM

    def guard_warnings():
        return [w for w in devmap_shims.status()["warnings"] if "launcher-sharding-guard" in w]

    import torch._dynamo  # noqa: F401  (torch 2.4 cannot import it inside the simulation: simulated Event)

    def phase(name):
        print(f"rank {os.environ['RANK']}: {name}", file=sys.stderr, flush=True)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    phase("process group up")
    report = {"rank": rank, "installed": devmap_shims.is_installed()}
    with simulated_gpus(2, memory="2GiB"), torch.no_grad():
        one = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map={"": local})
        report["one_copy"] = [sorted({str(p.device) for p in one.parameters()}), guard_warnings()]
        phase("one copy loaded")
        sharded = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="auto")
        report["sharded"] = [sorted({str(p.device) for p in sharded.parameters()}), guard_warnings()]
        phase("sharded copy loaded")
        devmap_shims.uninstall()  # a new install forgets the warning: see the one given when generate starts
        devmap_shims.install()
        ids = sample_input_ids().to("cuda:0")
        out = sharded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                               pad_token_id=PAD_ID)
        sharded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                         pad_token_id=PAD_ID)
        report["generate"] = [list(out.shape), guard_warnings()]
        phase("generated")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if rank == 0:
        print("REPORT " + json.dumps(gathered), flush=True)
    dist.barrier()
    # torch 2.4's gloo teardown (destroy_process_group, or interpreter exit) can hang: leave without it
    os._exit(0)
    """
)


def _torchrun(tmp_path, checkpoint, **env_extra):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVMAP_SHIMS")}
    env.update(DEVMAP_SHIMS="1", DEVMAP_SHIMS_FORCE=hook.SHIM.id, OMP_NUM_THREADS="1", **env_extra)
    try:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
             str(checkpoint)],
            capture_output=True, text=True, env=env, timeout=480, cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as exc:  # say where the ranks were
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        progress = [line for line in err.splitlines() if line.startswith("rank ")]
        pytest.fail(f"torchrun did not finish in {exc.timeout}s; last progress: {progress[-4:]}\n{err[-2000:]}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    if torch.version.cuda is None:  # pragma: no cover
        pytest.skip("the GPU simulator needs a CUDA build of torch")
    from devmap_shims.testing.models import save_tiny_causal_lm

    return save_tiny_causal_lm("qwen2", tmp_path_factory.mktemp("launch") / "qwen2", tie_word_embeddings=False)


@pytest.mark.slow
def test_torchrun_ranks_that_shard_get_one_warning_at_load_and_at_generate(tmp_path, checkpoint):
    proc = _torchrun(tmp_path, checkpoint)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(out for out in proc.stdout.splitlines() if out.startswith("REPORT "))
    reports = json.loads(line[len("REPORT "):])
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["installed"]
        devices, warned = r["one_copy"]
        assert devices == [f"cuda:{r['rank']}"] and warned == []  # device_map={"": local_rank} is the fix
        devices, warned = r["sharded"]
        assert devices == ["cuda:0", "cuda:1"]
        assert len(warned) == 1 and f"process {r['rank']} of 2" in warned[0] and "from_pretrained" in warned[0]
        shape, warned = r["generate"]
        assert shape[-1] == 8 + 3
        assert len(warned) == 2 and ".generate" in warned[1]  # once more after reset, not per call


@pytest.mark.slow
def test_torchrun_strict_mode_raises_instead(tmp_path, checkpoint):
    proc = _torchrun(tmp_path, checkpoint, DEVMAP_SHIMS_STRICT="1")
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "ShimError" in output and "launcher-sharding-guard" in output and "device_map={'': " in output
    assert "REPORT " not in proc.stdout
