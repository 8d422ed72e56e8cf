"""``devmap-shims plan``: run() with parsed arguments, as the CLI calls it."""

from __future__ import annotations

import json

import pytest

from devmap_shims.cli import main

# google/gemma-7b: Gemma-2-27B's 256k tied vocabulary, on every transformers since 4.38
GEMMA_7B = dict(
    model_type="gemma", architectures=["GemmaForCausalLM"], vocab_size=256000, hidden_size=3072,
    intermediate_size=24576, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
    head_dim=256, tie_word_embeddings=True, torch_dtype="bfloat16",
)


def run(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def gemma_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA_7B))
    return tmp_path


def assert_usage_error(code, out, err):
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("devmap-shims plan: error:")
    assert "Traceback" not in err


# -- usage errors need no model, but the ones past config reading need transformers ------------------


@pytest.mark.parametrize("gpus", ["8x", "eightx23GiB", "8x23 gigs", "0x23GiB", ""])
def test_malformed_topology(capsys, gemma_dir, gpus):
    assert_usage_error(*run(capsys, str(gemma_dir), "--gpus", gpus))


@pytest.mark.parametrize("caps", ["0=lots", "9=1GiB", "gpu0=1GiB", "0"])
def test_malformed_max_memory(capsys, gemma_dir, caps):
    assert_usage_error(*run(capsys, str(gemma_dir), "--gpus", "8x23GiB", "--max-memory", caps))


def test_missing_file(capsys, tmp_path):
    assert_usage_error(*run(capsys, str(tmp_path / "nope.json"), "--gpus", "8x23GiB"))


def test_folder_without_config(capsys, tmp_path):
    code, out, err = run(capsys, str(tmp_path), "--gpus", "8x23GiB")
    assert_usage_error(code, out, err)
    assert "config.json" in err


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", json.dumps({"hidden_size": 4})])
def test_unreadable_configs(capsys, tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    assert_usage_error(*run(capsys, str(path), "--gpus", "8x23GiB"))


def test_unknown_model_type(capsys, tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no-such-architecture"}))
    assert_usage_error(*run(capsys, str(path), "--gpus", "8x23GiB"))


def test_not_a_causal_lm(capsys, tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "intermediate_size": 128}))
    code, out, err = run(capsys, str(path), "--gpus", "2x16GiB")
    assert_usage_error(code, out, err)
    assert "causal" in err


def test_unsupported_prequantized_config(capsys, tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GEMMA_7B, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    assert_usage_error(*run(capsys, str(path), "--gpus", "8x23GiB"))


# -- plans ---------------------------------------------------------------------------------------------


@pytest.fixture
def stack_ready():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("bitsandbytes")


def test_json_plan_for_gemma_7b_4bit_on_8_gpus(capsys, gemma_dir, stack_ready):
    code, out, err = run(capsys, str(gemma_dir / "config.json"), "--gpus", "8x23GiB", "--quantization", "4bit",
                         "--cpu-memory", "180GiB", "--json")
    report = json.loads(out)
    for key in ("device_map", "bytes_per_device", "verdict", "shims_applied", "versions"):
        assert key in report
    assert report["versions"]["transformers"] and report["versions"]["accelerate"]
    assert code == 0 and report["verdict"] == "ok"
    assert sorted(set(report["device_map"].values())) == list(range(8))
    assert {k for k, v in report["bytes_per_device"].items() if v > 0} == {str(i) for i in range(8)}
    assert sum(report["bytes_per_device"].values()) == report["model_bytes"]
    assert report["shims_applied"] == ["device-map-balance"]
    assert report["without_shims"]["verdict"] != "ok"
    assert report["balance_ratio"] <= 1.10


def test_without_shims_shows_the_library_map(capsys, gemma_dir, stack_ready):
    code, out, _ = run(capsys, str(gemma_dir), "--gpus", "8x23GiB", "--quantization", "4bit",
                       "--cpu-memory", "180GiB", "--json", "--without-shims")
    report = json.loads(out)
    assert code == 1 and report["verdict"] != "ok"
    assert report["shims_applied"] == [] and "without_shims" not in report
    used = {k for k, v in report["bytes_per_device"].items() if v > 0}
    assert len(used) < 8


def test_human_output_has_a_row_per_gpu_and_a_verdict(capsys, gemma_dir, stack_ready):
    code, out, err = run(capsys, str(gemma_dir), "--gpus", "8x23GiB", "--quantization", "4bit", "--cpu-memory",
                         "180GiB")
    assert code == 0
    for i in range(8):
        assert f"GPU {i}" in out
    assert "verdict: ok" in out
    assert "without devmap-shims:" in out
    assert "model.embed_tokens" in out


def test_sequential_is_left_alone(capsys, gemma_dir, stack_ready):
    code, out, _ = run(capsys, str(gemma_dir), "--gpus", "8x23GiB", "--quantization", "4bit", "--cpu-memory",
                       "180GiB", "--device-map", "sequential", "--json")
    report = json.loads(out)
    assert report["shims_applied"] == []
    assert set(report["device_map"].values()) == {0}


def test_prequantized_bnb_config_is_planned_in_4bit(capsys, tmp_path, stack_ready):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GEMMA_7B, "quantization_config": {"quant_method": "bitsandbytes",
                                                                     "load_in_4bit": True}}))
    code, out, _ = run(capsys, str(path), "--gpus", "8x23GiB", "--cpu-memory", "180GiB", "--json")
    assert json.loads(out)["quantization"] == "4bit"


def test_user_caps_are_respected(capsys, gemma_dir, stack_ready):
    code, out, _ = run(capsys, str(gemma_dir), "--gpus", "8x23GiB", "--quantization", "4bit", "--cpu-memory",
                       "180GiB", "--max-memory", ",".join(f"{i}=3GiB" for i in range(8)), "--json")
    report = json.loads(out)
    assert all(v <= 0.9 * 3 * 2**30 for k, v in report["bytes_per_device"].items() if k.isdigit())
    assert report["verdict"] == "ok"


def test_registered_in_the_cli(capsys, gemma_dir, stack_ready):
    code = main(["plan", str(gemma_dir), "--gpus", "8x", "--json"])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_a_model_that_cannot_fit_is_not_called_ok(capsys, gemma_dir, stack_ready):
    """Gemma-7B in bf16 (17 GB) on two 1 GiB GPUs and 1 GiB of CPU: most of it goes to disk."""
    code, out, _ = run(capsys, str(gemma_dir), "--gpus", "2x1GiB", "--cpu-memory", "1GiB", "--json",
                       "--without-shims")
    report = json.loads(out)
    assert code == 1 and report["verdict"] == "does not fit", report["verdict"]
    assert any("cannot stay on the GPUs in any placement" in problem for problem in report["problems"])
