"""The model-config corpus of benchmarks/bench_device_map_corpus.py: its JSON fixtures parse into the
installed transformers' configs with the published values, and the skeletons they describe have
the parameter counts the models' cards give (built on the meta device with a few layers and
extrapolated, so no test builds a 671B skeleton)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    path = ROOT / "benchmarks" / "bench_device_map_corpus.py"
    spec = importlib.util.spec_from_file_location("bench_device_map_corpus", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()
FIXTURES = bench.load_fixtures()


def test_corpus_holds_the_issue_models_and_topologies():
    assert {f["name"] for f in FIXTURES} == {
        "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "mixtral-8x22b", "qwen3-235b-a22b", "deepseek-v3",
        "gemma-2-27b",
    }
    for fixture in FIXTURES:
        owner, _, repo = fixture["source"].partition("/")
        assert owner and repo and "/" not in repo, fixture["source"]
    assert len(FIXTURES) * len(bench.QUANTIZATIONS) * len(bench.TOPOLOGIES) == 70
    assert len(bench.TOPOLOGIES) >= 5


def test_a_fixture_without_a_shape_field_is_refused(tmp_path: Path):
    good = json.loads((bench.CORPUS_DIR / "llama-3.1-8b.json").read_text())
    del good["config"]["hidden_size"]
    (tmp_path / "llama-3.1-8b.json").write_text(json.dumps(good))
    with pytest.raises(ValueError, match=r"llama-3.1-8b.json: missing config.hidden_size"):
        bench.load_fixtures(directory=tmp_path)


def test_unknown_model_names_are_listed():
    with pytest.raises(SystemExit, match="unknown model.*nope.*the corpus has .*deepseek-v3"):
        bench.load_fixtures(["nope"])


def test_rounds_alternate_which_side_runs_first():
    calls = []
    lib_t, shim_t, lib, shim = bench.interleaved(
        lambda: calls.append("lib") or "L", lambda: calls.append("shim") or "S", 4)
    assert calls == ["lib", "shim", "shim", "lib", "lib", "shim", "shim", "lib"]
    assert (len(lib_t), len(shim_t), lib, shim) == (4, 4, "L", "S")
    assert bench.percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == 9.0


def _config(fixture, **overrides):
    try:
        return bench.config_for(fixture, **overrides)
    except bench.ArchitectureMissing as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f["name"] for f in FIXTURES])
def test_fixture_parses_into_the_published_config(fixture):
    config = _config(fixture)
    for key, value in fixture["config"].items():
        if key == "model_type":
            assert config.model_type == value
        else:
            assert getattr(config, key) == value, key


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f["name"] for f in FIXTURES])
def test_fixture_describes_the_published_parameter_count(fixture):
    pytest.importorskip("accelerate")
    from devmap_shims.cli import device_map_step as stack

    layers = fixture["config"]["num_hidden_layers"]
    first = fixture["config"].get("first_k_dense_replace", 0) + 1  # from here on every layer is alike
    counts = [stack.build_meta_model(_config(fixture, num_hidden_layers=n)).parameters
              for n in (first, first + 1)]
    total = counts[0] + (layers - first) * (counts[1] - counts[0])
    published = fixture["parameters_billion"] * 1e9
    assert abs(total - published) / published < 0.01, (
        f"{total / 1e9:.2f}B built, {fixture['parameters_billion']}B published")


def test_the_benchmark_checks_keep_room_on_gpu_0_for_an_offloaded_block():
    """DeepSeek-V3 in 4-bit on 8x23 GiB, four layers: where the installed transformers keeps an MoE
    layer's experts unquantized (fused 3-D parameters), the layer is larger than any GPU's budget,
    so it is offloaded whatever the split, and accelerate keeps room for it on GPU 0, which then
    holds nothing. The benchmark's rule checks (``device_map_checks.check_map``) must not call that
    map a skipped GPU or an avoidable offload: no contiguous split does better."""
    pytest.importorskip("accelerate")
    pytest.importorskip("bitsandbytes")
    from device_map_checks import budgets_for, check_map, library_sizes

    from devmap_shims.cli import device_map_step as stack

    fixture = bench.load_fixtures(["deepseek-v3"])[0]
    meta = stack.build_meta_model(_config(fixture, num_hidden_layers=4), bench.DTYPE, "4bit")
    max_memory = bench.max_memory(8, 23)
    budgets = budgets_for(meta, max_memory)
    sizes = library_sizes(meta, bench.STRATEGY)
    largest_layer = max(sizes[f"model.layers.{i}"] for i in range(4))
    if largest_layer <= budgets[0]:
        pytest.skip("this transformers quantizes every expert: each layer fits on one GPU, nothing is offloaded")
    shimmed = stack.device_map_step(meta, bench.STRATEGY, max_memory, shim=True)
    report = check_map(meta, shimmed, budgets, bench.STRATEGY, sizes)
    assert report.offloaded >= largest_layer
    assert 0 not in report.gpus_used and report.gpus_used
    assert report.violations == []
