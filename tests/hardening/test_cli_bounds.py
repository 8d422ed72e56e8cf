"""Bad input to the CLI: one clear line and exit 2, never a traceback or a hang.

Every case here is refused before torch or transformers would be imported, so it runs on every
stack, the engine's included.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from devmap_shims.cli import main

LLAMA = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
             num_hidden_layers=32, num_attention_heads=32)


def run(capsys, *argv, seconds=30):
    """``devmap-shims argv`` in a thread, failing the test instead of hanging it."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", main(list(argv))), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"devmap-shims {' '.join(argv)} still running after {seconds} s"
    out, err = capsys.readouterr()
    return result["code"], out, err


def config(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, **changes}))
    return str(path)


def assert_one_line_usage_error(code, out, err, *phrases):
    assert code == 2, (code, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


@pytest.mark.parametrize("changes, phrase", [
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0"),
    ({"num_hidden_layers": 10**6}, "1 to 4096 layers"),
    ({"num_hidden_layers": "many"}, 'num_hidden_layers = "many" is not a whole number of layers'),
    ({"num_hidden_layers": "32"}, 'num_hidden_layers = "32" is not a whole number of layers (a JSON integer'),
    ({"num_hidden_layers": 32.0}, "num_hidden_layers = 32.0 is not a whole number of layers"),
    ({"hidden_size": 10**30}, "larger than any model dimension"),
    # counts the top-level check does not see: an encoder-decoder's, a sub-config's
    ({"decoder_layers": 10**5}, "decoder_layers = 100000 (plan builds models of 1 to 4096 layers)"),
    ({"text_config": {"num_hidden_layers": 10**5}}, "text_config.num_hidden_layers = 100000"),
    ({"encoder_layers": 3000, "decoder_layers": 3000}, "6032 layers over the config and its sub-configs"),
    ({"vision_config": {"hidden_size": 10**30}}, "vision_config.hidden_size = 1000000"),
    ({"audio_config": {"num_blocks": 8000}}, "audio_config.num_blocks = 8000"),
    ({"vision_config": {"depth": 5000}}, "vision_config.depth = 5000"),
    ({"num_layers": 3000, "num_decoder_layers": 3000}, "6000 layers over the config"),  # T5's two stacks
    ({"vision_config": {"depths": [2000, 2000, 200]}}, "4232 layers over the config"),  # Swin's stages
])
def test_implausible_configs_are_refused(capsys, tmp_path, changes, phrase):
    assert_one_line_usage_error(*run(capsys, "plan", config(tmp_path, **changes), "--gpus", "2x80GiB"), phrase)


def test_deeply_nested_json_is_refused(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert_one_line_usage_error(*run(capsys, "plan", str(path), "--gpus", "2x80GiB"), "cannot be read as a model config")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_fifo_as_config_does_not_hang(capsys, tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    assert_one_line_usage_error(*run(capsys, "plan", str(fifo), "--gpus", "2x80GiB"), "not a regular file")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_dev_zero_as_config_is_refused(capsys):
    assert_one_line_usage_error(*run(capsys, "plan", "/dev/zero", "--gpus", "2x80GiB"), "not a regular file")


def test_a_huge_config_file_is_not_read(capsys, tmp_path):
    path = tmp_path / "config.json"
    with open(path, "wb") as handle:
        handle.truncate(3 << 30)
    assert_one_line_usage_error(*run(capsys, "plan", str(path), "--gpus", "2x80GiB"), "larger than 4 MiB")


@pytest.mark.parametrize("option, value, phrase", [
    ("--gpus", "8x" + "9" * 400 + "GiB", "not a memory size"),
    ("--gpus", "8x100000TiB", "over 1 PiB"),
    ("--gpus", "2x2PiB", "over 1 PiB"),  # told too large, not unreadable
    ("--cpu-memory", "5PiB", "over 1 PiB"),
    ("--cpu-memory", "1.2PB", "over 1 PiB"),
    ("--gpus", "4000x80GiB,4000x80GiB", "more than 4096 GPUs"),
    ("--gpus", "99999999999999999999x1GiB", "more than 4096 GPUs"),
    ("--cpu-memory", "1e400GiB", "not a memory size"),
    ("--cpu-memory", "9" * 30, "over 1 PiB"),
    ("--max-memory", "0=" + "9" * 30, "over 1 PiB"),
])
def test_sizes_beyond_any_machine_are_refused(capsys, tmp_path, option, value, phrase):
    argv = ["plan", config(tmp_path), "--gpus", "2x80GiB", option, value]
    if option == "--gpus":
        argv = ["plan", config(tmp_path), option, value]
    assert_one_line_usage_error(*run(capsys, *argv), phrase)


@pytest.mark.parametrize("value", ["²=10GiB", "٣=10GiB"])
def test_a_gpu_number_in_other_digits_is_refused(capsys, tmp_path, value):
    # str.isdigit() takes a superscript two or an Arabic-Indic three; int() does not
    argv = ["plan", config(tmp_path), "--gpus", "2x80GiB", "--max-memory", value]
    assert_one_line_usage_error(*run(capsys, *argv), "unknown device")


@pytest.mark.parametrize("option", [("--library", "bitsandbytes"), ("--applicable",), ("--library", "nope")])
def test_markdown_does_not_drop_a_filter_silently(capsys, option):
    code, out, err = run(capsys, "matrix", "--markdown", *option)
    assert_one_line_usage_error(code, out, err, "--markdown writes the whole matrix")


def test_an_unexpected_error_is_one_line_and_exit_1(capsys, monkeypatch):
    from devmap_shims.cli import matrix

    monkeypatch.setattr(matrix, "known", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    monkeypatch.delenv("DEVMAP_SHIMS_LOG", raising=False)
    code, out, err = run(capsys, "matrix")
    assert code == 1 and "Traceback" not in err and "RuntimeError: boom" in err and len(err.splitlines()) == 1


def test_matrix_and_explain_survive_a_malformed_plugin_row(capsys, monkeypatch):
    from devmap_shims.shims import plugins

    good = dict(id="acme:good", title="t", library="x", affected={"x": ">=1"}, fixed_in="unfixed",
                last_checked="2026-01-01", symptom="s", root_cause="r", upstream=["a/b#1"], verification=["I"],
                workaround="w", source="acme")
    bad = dict(good, id="acme:bad", affected={"x": ">>1"})
    monkeypatch.setattr(plugins, "plugin_rows", lambda *a, **k: ([good, bad], []))
    monkeypatch.setattr(plugins, "plugin_shims", lambda *a, **k: ([], []))
    code, out, err = run(capsys, "matrix")
    assert code == 0 and "acme:good" in out and "acme:bad" not in out
    assert "acme:bad" in err and "the row is ignored" in err
    code, out, err = run(capsys, "explain", "acme:good")
    assert code == 0 and "acme:good" in out


@pytest.mark.parametrize("value", ["1", "TRUE", "Yes", "on"])
def test_no_plugins_is_understood_in_any_spelling(capsys, monkeypatch, value):
    from devmap_shims.shims import plugins

    monkeypatch.setenv("DEVMAP_SHIMS_NO_PLUGINS", value)
    monkeypatch.setattr(plugins, "plugin_rows", lambda *a, **k: pytest.fail("plugins were loaded"))
    code, _, _ = run(capsys, "matrix")
    assert code == 0
