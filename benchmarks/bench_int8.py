"""Wall time the int8-state-follows-weight shim adds to each ``Linear8bitLt`` forward.

An 8-bit ``Linear8bitLt`` (256 x 256, quantized on the CPU, which bitsandbytes >= 0.46 can do) runs
one fp16 row through ``forward`` with and without the shim, interleaved in batches, reported as
medians per call. On the healthy path the shim reads one ``CB`` and compares two devices (about 2
us); the engine's call-time guard around it costs a few more. Target: under 10 % of this small
layer's forward, whose own Python path (bitsandbytes' MatMul8bitLt) is the same on a GPU.

Run: ``python benchmarks/bench_int8.py`` (about half a minute on 2 cores);
``--device cuda:0`` quantizes the layer on that GPU and runs it there (bitsandbytes' CUDA kernels).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import with_and_without_shim  # noqa: E402

TARGET_RATIO = 1.10


def _layer(device: str = "cpu") -> Any:
    import bitsandbytes as bnb
    import torch

    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = bnb.nn.Linear8bitLt(256, 256, has_fp16_weights=False)
    weight = bnb.nn.Int8Params(layer.weight.data, requires_grad=False, has_fp16_weights=False)
    layer.weight = weight._quantize(device)
    layer.bias.data = layer.bias.data.to(device)  # bitsandbytes' CUDA kernel reads it as a GPU pointer
    return layer


def run(calls: int = 6000, batches: int = 20, device: str = "cpu") -> List[Dict[str, Any]]:
    import logging

    import bitsandbytes
    import torch

    from devmap_shims.hooks.bitsandbytes import int8_state_follows_weight as hook
    from devmap_shims.versions import version_in

    logging.getLogger("devmap_shims").setLevel(logging.WARNING)
    if device == "cpu" and not version_in(bitsandbytes.__version__, ">=0.46.0"):
        return [{"benchmark": "Linear8bitLt forward (skipped: bitsandbytes < 0.46 has no CPU kernels)",
                 "value": None, "unit": "us", "target": f"< {TARGET_RATIO:g}x", "met": True}]
    layer = _layer(device)
    x = torch.randn(1, 256).half().to(device)

    def call() -> Any:
        with torch.no_grad():
            return layer(x)

    r = with_and_without_shim(hook.SHIM.id, call, calls, batches)
    print(f"bitsandbytes {bitsandbytes.__version__} on {device}: {r['calls_each']} calls each, "
          f"unhooked {r['plain_us']:.2f} us, "
          f"hooked {r['hooked_us']:.2f} us, added {r['added_us']:.2f} us (noise {r['noise_us']:.2f} us)")
    return [{
        "benchmark": f"Linear8bitLt forward (256x256, {'CPU' if device == 'cpu' else device}), "
                     "int8-state-follows-weight",
        "value": round(r["added_us"], 2), "unit": "us", "baseline": f"{r['plain_us']:.1f} us",
        "ratio": r["hooked_us"] / r["plain_us"], "target": f"< {TARGET_RATIO:g}x",
        "met": r["hooked_us"] / r["plain_us"] < TARGET_RATIO,
        "calls_each": r["calls_each"], "noise_us": round(r["noise_us"], 2),
    }]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=6000)
    parser.add_argument("--device", default="cpu", help="where the layer runs: cpu (default), or cuda:0")
    options = parser.parse_args()
    run(options.calls, device=options.device)
