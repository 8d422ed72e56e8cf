"""The shims with a real ``cuda:0`` (``pytest -m gpu``): a tiny Llama saved to disk, loaded by
``from_pretrained`` with bitsandbytes quantization and ``device_map="auto"``, and a tiny Flux
pipeline with a 4-bit transformer, generating and moved between the GPU and the CPU, as a user
does on a one-GPU machine. Skipped where no GPU is present
(CI has none); the same scenarios run on the simulated GPUs in the shims' own tests.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")

import devmap_shims  # noqa: E402
from devmap_shims.compat_matrix import load_matrix  # noqa: E402
from devmap_shims.shims.engine import ENGINE  # noqa: E402
from devmap_shims.hooks.bitsandbytes.int8_state_follows_weight import BUG_ID as INT8_BUG  # noqa: E402
from devmap_shims.testing.models.causal_lm import (  # noqa: E402
    dtype_kwargs,
    greedy_generate,
    sample_input_ids,
    save_tiny_causal_lm,
)
from devmap_shims.versions import installed_versions, version_in  # noqa: E402

pytestmark = [
    pytest.mark.gpu,  # skipped without a real GPU (tests/conftest.py)
    pytest.mark.skipif(
        not version_in(bnb.__version__, ">=0.46.0"),
        reason=f"bitsandbytes {bnb.__version__} has no CPU kernels: the models cannot run on the CPU",
    ),
]

NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def without_shims_around():
    ENGINE.uninstall()
    yield
    ENGINE.uninstall()


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    return save_tiny_causal_lm("llama", tmp_path_factory.mktemp("llama"), dtype=torch.float16)


def _load(path, bits: int) -> Any:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if bits == 4:
        quant = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16,
            bnb_4bit_use_double_quant=True,
        )
    else:
        quant = BitsAndBytesConfig(load_in_8bit=True)
    return AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", quantization_config=quant, **dtype_kwargs(torch.float16)
    )


def _generate(model, device: str) -> Dict[str, Any]:
    """Greedy tokens on ``device`` (or the error), and the tensors ``check_devices`` finds astray."""
    try:
        tokens: Any = greedy_generate(model, sample_input_ids().to(device), NEW_TOKENS)
    except RuntimeError as e:  # torch.AcceleratorError (a CUDA error) is one too
        tokens = (type(e).__name__, str(e).split("\n")[0])
    return {"tokens": tokens, "strays": [s["name"] for s in devmap_shims.check_devices(model)]}


def _session(path, bits: int) -> List[Dict[str, Any]]:
    """Load on the GPU and generate; to the CPU and generate; back to the GPU and generate."""
    model = _load(path, bits)
    steps = [_generate(model, "cuda:0")]
    model.to("cpu")
    steps.append(_generate(model, "cpu"))
    model.to("cuda:0")
    steps.append(_generate(model, "cuda:0"))
    return steps


def test_a_4bit_llama_gives_the_same_tokens_with_the_shims_through_every_move(saved_llama):
    plain = _session(saved_llama, 4)
    assert isinstance(plain[0]["tokens"], torch.Tensor) and plain[0]["strays"] == []
    devmap_shims.install()
    shimmed = _session(saved_llama, 4)
    for got in shimmed:
        assert isinstance(got["tokens"], torch.Tensor), got["tokens"]
        assert got["strays"] == []
    assert torch.equal(shimmed[0]["tokens"], plain[0]["tokens"])
    if isinstance(plain[1]["tokens"], torch.Tensor):  # no bug left the CPU step failing: the same tokens
        assert torch.equal(shimmed[1]["tokens"], plain[1]["tokens"])
    assert torch.equal(shimmed[2]["tokens"], plain[0]["tokens"])  # back on the GPU: as loaded


def _plain_8bit_on_the_cpu(path) -> Dict[str, Any]:
    """In a process of its own: load 8-bit, generate on the GPU, ``model.to("cpu")``, generate on the
    CPU, then synchronize. Without the shims the CPU step can break the process's CUDA context (an
    illegal memory access, reported at a later call), so it must not run in the test process."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, DEVMAP_SHIMS="0")
    proc = subprocess.run(
        [sys.executable, __file__, str(path)], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cuda_sync() -> str:
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:  # torch.AcceleratorError on torch >= 2.8
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "ok"


def _jsonable(step: Dict[str, Any]) -> Dict[str, Any]:
    tokens = step["tokens"]
    return dict(step, tokens=tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens))


def test_an_8bit_llama_moved_to_the_cpu_generates_only_with_the_shims_where_the_matrix_says(saved_llama):
    """bnb-int8-stats-stay-on-old-device through ``from_pretrained``: the 8-bit layers keep their
    ``state.CB``/``state.SCB`` on ``cuda:0`` after ``model.to("cpu")``, and generating on the CPU
    fails (the error, or a CUDA error at the next synchronization)."""
    if not version_in(transformers.__version__, ">=5.0.0"):
        pytest.skip(f"transformers {transformers.__version__} refuses to move an 8-bit model")
    matrix = load_matrix()
    applies = matrix.get(INT8_BUG).applies(installed_versions(matrix.distributions()))
    plain = _plain_8bit_on_the_cpu(saved_llama)
    print("without the shims, on the CPU:", plain["cpu"]["tokens"], "| then synchronize:", plain["sync"])
    assert plain["gpu"]["strays"] == [] and isinstance(plain["gpu"]["tokens"][0], list)
    if applies:
        assert any(name.endswith("state.CB") for name in plain["cpu"]["strays"]), plain["cpu"]["strays"]
        failed = plain["cpu"]["tokens"][0] in ("RuntimeError", "AcceleratorError") or plain["sync"] != "ok"
        assert failed, plain
    devmap_shims.install()
    shimmed = _session(saved_llama, 8)
    assert _cuda_sync() == "ok"
    for got in shimmed:
        assert isinstance(got["tokens"], torch.Tensor), got["tokens"]
        assert got["strays"] == []
    assert shimmed[0]["tokens"].tolist() == plain["gpu"]["tokens"]
    assert torch.equal(shimmed[2]["tokens"], shimmed[0]["tokens"])


def _flux_session(path) -> List[Dict[str, Any]]:
    """A 4-bit Flux transformer loaded on the GPU in its pipeline: images on the GPU, on the CPU
    after ``pipe.to("cpu")``, and on the GPU again, with the tensors ``check_devices`` finds astray."""
    from diffusers import BitsAndBytesConfig, FluxPipeline, FluxTransformer2DModel

    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    transformer = FluxTransformer2DModel.from_pretrained(
        path, subfolder="transformer", quantization_config=quant
    )
    pipe = FluxPipeline.from_pretrained(path, transformer=transformer).to("cuda:0")
    steps = []
    for device in ("cuda:0", "cpu", "cuda:0"):
        pipe.to(device)
        with torch.no_grad():
            images = pipe(
                "a cat", num_inference_steps=2, height=32, width=32, output_type="pt",
                generator=torch.Generator(device).manual_seed(0),
            ).images.cpu()
        steps.append({"images": images, "strays": [s["name"] for s in devmap_shims.check_devices(pipe)]})
    return steps


def test_a_4bit_flux_pipeline_gives_the_same_images_with_the_shims_through_every_move(tmp_path):
    pytest.importorskip("diffusers")
    from devmap_shims.testing.models.flux import flux_unavailable, save_tiny_flux_pipeline

    if flux_unavailable():
        pytest.skip(flux_unavailable())
    path = save_tiny_flux_pipeline(tmp_path / "flux")
    plain = _flux_session(path)
    devmap_shims.install()
    shimmed = _flux_session(path)
    for want, got in zip(plain, shimmed):
        assert got["strays"] == []
        assert torch.isfinite(got["images"]).all() and got["images"].std() > 0
        assert torch.equal(got["images"], want["images"])
    assert torch.equal(shimmed[2]["images"], shimmed[0]["images"])


if __name__ == "__main__":  # the unshimmed half of the 8-bit test, run by _plain_8bit_on_the_cpu
    import json
    import os
    import sys

    model = _load(sys.argv[1], 8)
    report = {"gpu": _jsonable(_generate(model, "cuda:0"))}
    model.to("cpu")
    report["cpu"] = _jsonable(_generate(model, "cpu"))
    report["sync"] = _cuda_sync()
    print(json.dumps(report), flush=True)
    os._exit(0)  # after an illegal memory access, tearing the CUDA context down can abort the process
