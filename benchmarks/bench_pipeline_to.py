"""Time ``pipe.to()`` adds with the pipeline-to-sweep shim, on a Flux-sized 4-bit module tree.

The tree has FLUX.1's layout: 19 double-stream blocks and 38 single-stream blocks (57 blocks, 495
bitsandbytes ``Linear4bit`` layers with nested NF4 statistics, as ``bnb_4bit_use_double_quant``
makes them), in a diffusers ``ModelMixin`` inside a ``DiffusionPipeline``, on a simulated 2-GPU
machine. Its width is scaled down (the real 3072 would need 6 GB of host memory for the packed
weights), so the move is dominated by per-tensor overhead rather than by copying: the sweep's share
is therefore larger here than on real GPUs, where moving 6 GB across GPUs takes tens to hundreds of
milliseconds on its own.

Measured side by side, alternating in each round (median over rounds), each time moving the
pipeline to the other GPU:

* ``none``: the library alone (on bitsandbytes < 0.45.3 it leaves one NF4 table per layer behind,
  counted in the table);
* ``sweep``: the pipeline-to-sweep shim only: the walk, plus moving the tables left behind;
* ``sweep+quant-state``: both shims, as ``install()`` arms them on an affected stack (the
  quant-state shim moves the tables during the move, so the sweep only walks);
* the sweep walk alone, on a pipeline where nothing is out of place: what the shim costs beyond
  the copies the fixed library makes anyway.

Target: the sweep walk adds under 20 ms and under 10% of the move. Moving the tables left behind
is the repair itself (the copies bitsandbytes >= 0.45.3 makes inside ``.to()``); on the simulator
each copy costs what a weight copy costs, so those rows are reported, not judged. The shims are
forced on, so the benchmark runs on any stack: on an affected one (``/work/venvs/mid-2025``) it
shows the repair, on a fixed one (current) ``+ sweep`` is the walk alone in place.

Run: ``python benchmarks/bench_pipeline_to.py [--rounds 15] [--width 256]``. ``run()`` returns the rows.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any, Dict, List, Tuple

TARGET_MS = 20.0
TARGET_SHARE = 0.10
DOUBLE_BLOCKS = 19
SINGLE_BLOCKS = 38
SHIMS = {
    "none": (),
    "sweep": ("pipeline-to-sweep",),
    "sweep+quant-state": ("pipeline-to-sweep", "quant-state-follows-weight"),
}


# -- the Flux-sized tree ------------------------------------------------------------------------------
def _linear4bit(in_features: int, out_features: int, device: str) -> Any:
    """A Linear4bit holding random packed NF4 data and nested statistics created on ``device``
    (the shapes ``quantize_4bit(compress_statistics=True)`` gives; no kernel runs)."""
    import torch
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Linear4bit, Params4bit

    from devmap_shims.testing.nf4 import dynamic_code, nf4_code

    n = in_features * out_features
    blocks = (n + 63) // 64
    nested_blocks = (blocks + 255) // 256
    state2 = QuantState(
        absmax=torch.rand(nested_blocks, device=device),
        code=dynamic_code(device),
        blocksize=256,
        dtype=torch.float32,
    )
    state = QuantState(
        absmax=torch.randint(0, 256, (blocks,), dtype=torch.uint8, device=device),
        shape=torch.Size([out_features, in_features]),
        code=nf4_code(device),
        blocksize=64,
        quant_type="nf4",
        dtype=torch.bfloat16,
        offset=torch.tensor(0.5, device=device),
        state2=state2,
    )
    layer = Linear4bit(in_features, out_features, bias=True, quant_type="nf4", device="meta")
    data = torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8, device=device)
    layer.weight = Params4bit(
        data, requires_grad=False, quant_state=state, blocksize=64, compress_statistics=True,
        quant_type="nf4", quant_storage=torch.uint8, module=layer, bnb_quantized=True,
    )
    layer.quant_state = state
    layer.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=torch.bfloat16, device=device), requires_grad=False)
    return layer


def _double_block(h: int, device: str) -> Any:
    import torch

    lin = lambda i, o: _linear4bit(i, o, device)  # noqa: E731
    block = torch.nn.Module()
    block.norm1 = torch.nn.ModuleDict({"linear": lin(h, 6 * h)})
    block.norm1_context = torch.nn.ModuleDict({"linear": lin(h, 6 * h)})
    block.attn = torch.nn.ModuleDict(
        {name: lin(h, h) for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")}
    )
    block.attn["to_out"] = torch.nn.ModuleList([lin(h, h)])
    for name in ("ff", "ff_context"):
        setattr(block, name, torch.nn.Sequential(lin(h, 4 * h), torch.nn.GELU(), lin(4 * h, h)))
    return block


def _single_block(h: int, device: str) -> Any:
    import torch

    lin = lambda i, o: _linear4bit(i, o, device)  # noqa: E731
    block = torch.nn.Module()
    block.norm = torch.nn.ModuleDict({"linear": lin(h, 3 * h)})
    block.proj_mlp = lin(h, 4 * h)
    block.proj_out = lin(5 * h, h)
    block.attn = torch.nn.ModuleDict({name: lin(h, h) for name in ("to_q", "to_k", "to_v")})
    return block


def build_pipeline(width: int, device: str = "cuda:0") -> Tuple[Any, int]:
    """A DiffusionPipeline whose ``transformer`` is the Flux-sized 4-bit tree; ``(pipe, layers)``."""
    import torch
    from diffusers import DiffusionPipeline
    from diffusers.configuration_utils import ConfigMixin, register_to_config
    from diffusers.models.modeling_utils import ModelMixin
    from diffusers.quantizers.quantization_config import QuantizationMethod

    class FluxSizedTransformer(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, width: int = 256) -> None:
            super().__init__()

    class FluxSizedPipeline(DiffusionPipeline):
        def __init__(self, transformer: Any) -> None:
            super().__init__()
            self.register_modules(transformer=transformer)

    model = FluxSizedTransformer(width=width)
    model.transformer_blocks = torch.nn.ModuleList(_double_block(width, device) for _ in range(DOUBLE_BLOCKS))
    model.single_transformer_blocks = torch.nn.ModuleList(_single_block(width, device) for _ in range(SINGLE_BLOCKS))
    model.proj_out = _linear4bit(width, 64, device)
    # what diffusers sets on a model loaded in 4-bit, so DiffusionPipeline.to treats it as one
    model.is_loaded_in_4bit = True
    model.quantization_method = QuantizationMethod.BITS_AND_BYTES
    layers = sum(type(m).__name__ == "Linear4bit" for m in model.modules())
    return FluxSizedPipeline(transformer=model), layers


# -- measurement ------------------------------------------------------------------------------------------
def _install(ids: Tuple[str, ...]) -> None:
    import devmap_shims

    devmap_shims.uninstall()
    if ids:
        devmap_shims.install(only=list(ids), force=list(ids))


def measure(width: int, rounds: int) -> Dict[str, Any]:
    import torch

    import devmap_shims
    from devmap_shims.checks import check_devices
    from devmap_shims.hooks.diffusers.pipeline_to_sweep import sweep_pipeline
    from devmap_shims.testing import simulated_gpus

    times: Dict[str, List[float]] = {name: [] for name in SHIMS}
    sweep_only: List[float] = []
    left_behind = 0
    with simulated_gpus(2, memory="8GiB"), torch.no_grad():
        pipe, layers = build_pipeline(width)
        tensors = sum(1 for _ in pipe.transformer.parameters())
        where = 0
        for _round in range(rounds + 1):  # the first round warms up and is not counted
            for name, ids in SHIMS.items():
                _install(ids)
                where = 1 - where
                start = time.perf_counter()
                pipe.to(f"cuda:{where}")
                elapsed = time.perf_counter() - start
                if _round:
                    times[name].append(elapsed)
                elif not ids:
                    left_behind = len(check_devices(pipe))
                if ids:
                    assert check_devices(pipe) == [], f"{name} left tensors behind"
            _install(("pipeline-to-sweep",))
            start = time.perf_counter()
            moved, _components = sweep_pipeline(pipe)
            if _round:
                sweep_only.append(time.perf_counter() - start)
            assert moved == 0
        devmap_shims.uninstall()
    packed_mb = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters()) / 2**20
    return {
        "width": width,
        "layers": layers,
        "parameters": tensors,
        "packed_mb": packed_mb,
        "median_ms": {name: statistics.median(v) * 1000 for name, v in times.items()},
        "sweep_only_ms": statistics.median(sweep_only) * 1000,
        "left_behind": left_behind,
        "rounds": rounds,
    }


def per_layer_wrapper_cost(calls: int = 400, batches: int = 10) -> Dict[str, float]:
    """Median time of moving one ``Linear4bit`` between the simulated GPUs (``Module.to`` calls
    ``Params4bit.to``, which calls ``QuantState.to``) with and without the quant-state shim, in
    alternating batches: the whole-pipeline medians are too noisy on a shared machine to resolve a
    few ms."""
    import torch

    from devmap_shims.testing import simulated_gpus

    per_call: Dict[str, List[float]] = {"none": [], "quant-state": []}
    with simulated_gpus(2, memory="1GiB"), torch.no_grad():
        layer = _linear4bit(256, 256, "cuda:0")
        for _batch in range(batches + 1):
            for name, ids in (("none", ()), ("quant-state", ("quant-state-follows-weight",))):
                _install(ids)
                start = time.perf_counter()
                for i in range(calls):
                    layer.to("cuda:1" if i % 2 == 0 else "cuda:0")
                if _batch:
                    per_call[name].append((time.perf_counter() - start) / calls)
        _install(())
    plain = statistics.median(per_call["none"]) * 1e6
    shimmed = statistics.median(per_call["quant-state"]) * 1e6
    return {"plain_us": plain, "shimmed_us": shimmed, "added_us": shimmed - plain}


def rows_for(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    base = result["median_ms"]["none"]
    label = f"pipe.to() Flux-sized 4-bit tree, width {result['width']} ({result['layers']} Linear4bit)"
    walk = result["sweep_only_ms"]
    rows = [
        {"benchmark": f"{label}, library alone ({result['left_behind']} tensors left behind)",
         "value": round(base, 1), "unit": "ms", "target": "baseline", "met": True},
        {"benchmark": f"{label}, sweep walk (nothing to move)", "value": round(walk, 2), "unit": "ms",
         "baseline": f"{base:.1f} ms", "ratio": walk / base,
         "target": f"< {TARGET_MS:g} ms and < {TARGET_SHARE:.0%}",
         "met": walk < TARGET_MS and walk < TARGET_SHARE * base},
    ]
    for name in ("sweep", "sweep+quant-state"):
        added = result["median_ms"][name] - base
        rows.append({
            "benchmark": f"{label}, + {name}: added (walk + moving what was left behind)",
            "value": round(added, 2), "unit": "ms", "baseline": f"{base:.1f} ms",
            "ratio": result["median_ms"][name] / base, "target": "reported", "met": True,
        })
    return rows


def run(rounds: int = 15, widths: Tuple[int, ...] = (256,)) -> List[Dict[str, Any]]:
    import bitsandbytes  # noqa: F401 - before the simulation: it probes CUDA on import
    import diffusers

    for name in ("devmap_shims", "diffusers", "bitsandbytes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rows: List[Dict[str, Any]] = []
    print(f"bitsandbytes {bitsandbytes.__version__}, diffusers {diffusers.__version__}; shims forced on; "
          f"median of {rounds} alternating rounds, each a move to the other simulated GPU")
    print(f"{'width':>5}  {'layers':>6}  {'packed':>8}  {'library alone':>13}  {'left':>4}  {'sweep walk':>10}  "
          f"{'share':>6}  {'+ sweep':>9}  {'added':>9}  {'+ both shims':>12}  {'added':>9}")
    for width in widths:
        result = measure(width, rounds)
        layers = result["layers"]
        m = result["median_ms"]
        walk = result["sweep_only_ms"]
        print(f"{width:>5}  {result['layers']:>6}  {result['packed_mb']:>5.0f} MB  {m['none']:>10.1f} ms  "
              f"{result['left_behind']:>4}  {walk:>7.2f} ms  {walk / m['none']:>6.1%}  {m['sweep']:>6.1f} ms  "
              f"{m['sweep'] - m['none']:>6.1f} ms  {m['sweep+quant-state']:>9.1f} ms  "
              f"{m['sweep+quant-state'] - m['none']:>6.1f} ms")
        rows.extend(rows_for(result))
    wrapper = per_layer_wrapper_cost()
    print(f"one Linear4bit moved between the GPUs: {wrapper['plain_us']:.1f} us alone, {wrapper['shimmed_us']:.1f} us "
          f"with the quant-state shim (added {wrapper['added_us']:.1f} us per layer, "
          f"{wrapper['added_us'] * layers / 1000:.1f} ms for the tree's {layers} layers)")
    rows.append({"benchmark": "Linear4bit.to() between simulated GPUs, + quant-state shim: added per layer",
                 "value": round(wrapper["added_us"], 1), "unit": "us", "baseline": f"{wrapper['plain_us']:.1f} us",
                 "ratio": wrapper["shimmed_us"] / wrapper["plain_us"], "target": "reported", "met": True})
    judged = [r for r in rows if r["target"] not in ("baseline", "reported")]
    print(f"target: the sweep walk adds < {TARGET_MS:g} ms and < {TARGET_SHARE:.0%} of the move: "
          f"{'met' if all(r['met'] for r in judged) else 'NOT met'}")
    print("(+ sweep / + both shims also move the tensors the library left behind, one simulated copy each: "
          "the work bitsandbytes >= 0.45.3 does inside .to())")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--width", type=int, action="append", help="tree width (repeatable; default 256)")
    args = parser.parse_args()
    run(args.rounds, tuple(args.width or (256,)))
