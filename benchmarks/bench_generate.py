"""Wall time the generate-input-device hook adds to each ``generate()`` call.

Two measurements on a tiny Qwen2 with CPU inputs (the common case: nothing to move), each side by
side with the unhooked call, interleaved in batches, reported as the median per call:

* the hook path alone: the engine's real layer (wrapt proxy, call-time guard, the repair that finds
  the input embeddings' device and checks every argument) around a stub ``generate`` that returns
  at once, against the bare stub; >= 1000 calls each. Target: at most 5 microseconds added.
* a whole ``generate(max_new_tokens=1)`` with the shim installed against the same call without it;
  >= 1000 calls each. The difference is within the noise of a ~ms call; it is reported, not judged.

The shim is forced on (``install(force=...)``) so that the hook path is measured on any stack, also
where the matrix keeps it off.

Run: ``python benchmarks/bench_generate.py [--calls 2000]`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List

TARGET_US = 5.0


def _per_call_us(call: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def _interleaved(plain: Callable[[], Any], hooked: Callable[[], Any], calls: int, batches: int,
                 setup_hooked: Callable[[], None] = lambda: None,
                 setup_plain: Callable[[], None] = lambda: None) -> Dict[str, float]:
    per_batch = max(1, calls // batches)
    plain_us: List[float] = []
    hooked_us: List[float] = []
    for batch in range(batches):
        # alternate which side runs first, so warm-up and drift do not favour one side
        sides = [(setup_plain, plain, plain_us), (setup_hooked, hooked, hooked_us)]
        for setup, call, times in sides if batch % 2 == 0 else sides[::-1]:
            setup()
            times.append(_per_call_us(call, per_batch))
    p, h = statistics.median(plain_us), statistics.median(hooked_us)
    # spread of the unhooked batches (median absolute deviation): differences below it are noise
    noise = statistics.median(abs(x - p) for x in plain_us)
    return {"calls_each": per_batch * batches, "plain_us": p, "hooked_us": h, "added_us": h - p, "noise_us": noise}


def _model() -> Any:
    import torch

    from devmap_shims.testing.models import tiny_causal_lm

    torch.set_num_threads(1)
    return tiny_causal_lm("qwen2")


def hook_path(calls: int, batches: int) -> Dict[str, Any]:
    """The engine's generate layer around a stub original, against the stub itself."""
    import torch
    from transformers.generation.utils import GenerationMixin

    import devmap_shims
    from devmap_shims.hooks.transformers import generate_input_device as hook
    from devmap_shims.testing.models import sample_input_ids

    model = _model()
    devmap_shims.uninstall()
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    try:
        layer = vars(GenerationMixin)["generate"]
        guarded = layer._self_wrapper  # the engine's call-time guard around align_generate_inputs

        def stub(self: Any, inputs: Any = None, **kwargs: Any) -> Any:
            return inputs

        base = type(model)
        plain_cls = type("PlainStub", (base,), {"generate": stub})
        hooked_cls = type("HookedStub", (base,), {"generate": type(layer)(stub, guarded)})
        ids = sample_input_ids()
        mask = torch.ones_like(ids)
        kwargs = {"attention_mask": mask, "max_new_tokens": 1, "do_sample": False, "pad_token_id": 0}
        plain_model, hooked_model = model, _model()
        plain_model.__class__, hooked_model.__class__ = plain_cls, hooked_cls
        assert hooked_model.generate(ids, **kwargs) is ids  # nothing to move: the same object comes back
        result = _interleaved(lambda: plain_model.generate(ids, **kwargs),
                              lambda: hooked_model.generate(ids, **kwargs), calls, batches)
    finally:
        devmap_shims.uninstall()
    return result


def whole_generate(calls: int, batches: int) -> Dict[str, Any]:
    """``generate(max_new_tokens=1)`` with and without the shim installed."""
    import torch

    from devmap_shims.hooks.transformers import generate_input_device as hook
    from devmap_shims.testing.models import sample_input_ids

    model = _model()
    ids = sample_input_ids()
    mask = torch.ones_like(ids)

    def call() -> Any:
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)

    return with_and_without_shim(hook.SHIM.id, call, calls, batches)


def with_and_without_shim(shim_id: str, call: Callable[[], Any], calls: int, batches: int) -> Dict[str, float]:
    """``call()`` with the shim ``shim_id`` forced on and with no shims, interleaved in batches; the
    two give the same output first."""
    import torch

    import devmap_shims

    def on() -> None:
        devmap_shims.install(only=[shim_id], force=[shim_id])

    def off() -> None:
        devmap_shims.uninstall()

    on()
    hooked_out = call()
    off()
    plain_out = call()
    assert torch.equal(hooked_out, plain_out) and hooked_out.device == plain_out.device
    try:
        return _interleaved(call, call, calls, batches, setup_hooked=on, setup_plain=off)
    finally:
        off()


def _applies() -> bool:
    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.versions import installed_versions

    matrix = load_matrix()
    return matrix.get("generate-input-device-type-warning").applies(installed_versions(matrix.distributions()))


def run(calls: int = 2000, batches: int = 20) -> List[Dict[str, Any]]:
    import logging

    import transformers

    logging.getLogger("devmap_shims").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    stub = hook_path(calls, batches)
    whole = whole_generate(max(1000, calls // 2), batches)
    rows = [
        {
            "benchmark": "generate hook path (stub original, CPU inputs)",
            "value": round(stub["added_us"], 2),
            "unit": "us",
            "baseline": f"{stub['plain_us']:.2f} us",
            "ratio": stub["hooked_us"] / stub["plain_us"],
            "target": f"<= {TARGET_US:g} us",
            "met": stub["added_us"] <= TARGET_US,
            "calls_each": stub["calls_each"],
            "noise_us": round(stub["noise_us"], 2),
        },
        {
            "benchmark": "generate(max_new_tokens=1), tiny qwen2, CPU",
            "value": round(whole["added_us"], 1),
            "unit": "us",
            "baseline": f"{whole['plain_us'] / 1000:.2f} ms",
            "ratio": whole["hooked_us"] / whole["plain_us"],
            "target": "reported",
            "met": True,
            "calls_each": whole["calls_each"],
            "noise_us": round(whole["noise_us"], 1),
        },
    ]
    print(f"transformers {transformers.__version__}; shim forced on (the matrix row applies here: {_applies()})")
    print(f"{'measurement':36}  {'calls each':>10}  {'unhooked/call':>14}  {'hooked/call':>12}  {'added':>11}  "
          f"{'noise (MAD)':>11}")
    for name, r in (("hook path, stub generate", stub), ("whole generate(max_new_tokens=1)", whole)):
        print(f"{name:36}  {r['calls_each']:>10}  {r['plain_us']:>11.2f} us  {r['hooked_us']:>9.2f} us  "
              f"{r['added_us']:>8.2f} us  {r['noise_us']:>8.2f} us")
    print(f"target: the hook path adds <= {TARGET_US:g} us per call: {'met' if rows[0]['met'] else 'NOT met'}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    run(args.calls, args.batches)
