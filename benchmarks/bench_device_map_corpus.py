"""Device-map step over a corpus of published model configs, library alone vs library + shim.

The corpus is ``benchmarks/corpus/*.json``: one file per model, holding the fields of the model's
published ``config.json`` that decide parameter shapes (``config``), the Hub repository they come
from (``source``) and the parameter count its model card gives (``parameters_billion``). Each model
is built on the meta device with ``AutoModelForCausalLM.from_config`` (bitsandbytes modules swapped
in for 4-bit / 8-bit, as ``from_pretrained`` does) and runs the device-map step ``from_pretrained``
runs, ``device_map="auto"``, on every topology (2x80, 4x24, 8x23, 8x80, 16x80 GiB).

Per case: the step's time with the library alone and through the device-map-balance shim (medians
over interleaved rounds, the side that runs first alternating), their ratio (median of the per-round
ratios) and its 90th percentile, the balance ratio (busiest GPU / max(total / GPUs, largest
unsplittable block)) of both maps, that of the exact optimum (the best contiguous split, a dynamic
programme in tests/planning/device_map_checks.py), whether the shim changed the map and whether its
map is at the optimum. The summary checks the targets: median ratio <= 1.10x, 90th percentile of
all rounds <= 1.25x, every repaired map at the optimum.

Scale rows: a DeepSeek-V3-shaped model (61 layers, all of them mixture-of-experts) with unfused
experts (one module with gate / up / down ``nn.Linear`` per expert, as transformers 4.x builds
them; transformers 5 fuses each layer's experts into one module of 3-D parameters, so there the
fused module is replaced by transformers' own ``DeepseekV3MLP`` per expert), 8 to 256 experts per
layer, 4-bit on 8x80 GiB, its blocks whole decoder layers (the model's ``_no_split_modules``) and
then every Linear (nothing unsplittable above a leaf module): against the module count, the
shim's own work (its decision, layout walk and repair, timed inside the shimmed steps) and the
side-by-side difference of the whole step, with the spread of the library's own step between
rounds. Target: the shim's own work under 0.3 s at 256 experts.

    python benchmarks/bench_device_map_corpus.py [--rounds 9] [--models llama-3.1-8b,deepseek-v3]
        [--quantizations none,4bit] [--topologies 8x23,8x80] [--quick] [--json]
        [--scale-sizes 8,32,128,256 | --no-scale | --scale-only] [--scale-rounds 3]

Progress goes to stderr, the table (or with ``--json`` one JSON document) to stdout. ``run()``
returns rows for benchmarks/run_all.py (``python benchmarks/run_all.py device_map_corpus``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CORPUS_DIR = HERE / "corpus"
GiB = 2**30

TOPOLOGIES: Tuple[Tuple[int, float], ...] = ((2, 80), (4, 24), (8, 23), (8, 80), (16, 80))
QUANTIZATIONS = ("none", "4bit")
#: host memory for offloaded layers: large enough that nothing goes to disk (a 671B bf16 model on 2x80 GiB)
CPU_GIB = 1536
STRATEGY = "auto"
DTYPE = "bfloat16"

TARGET_MEDIAN = 1.10
TARGET_P90 = 1.25
TARGET_SCALE_ADDED_S = 0.3

SCALE_SIZES = (8, 32, 128, 256)
SCALE_LAYERS = 61
SCALE_QUANTIZATION = "4bit"
SCALE_TOPOLOGY = (8, 80)
SCALE_VARIANTS = ("decoder layers", "Linears")

REQUIRED_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "tie_word_embeddings")


class ArchitectureMissing(LookupError):
    """The installed transformers has no such architecture."""


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the corpus ------------------------------------------------------------------------------------


def load_fixtures(
    names: Optional[Iterable[str]] = None, directory: Path = CORPUS_DIR
) -> List[Dict[str, Any]]:
    """The corpus files, in name order; ``names`` picks some (an unknown name is an error that lists
    the known ones)."""
    fixtures = []
    for path in sorted(directory.glob("*.json")):
        fixture = json.loads(path.read_text())
        missing = [f for f in ("name", "source", "parameters_billion", "config") if f not in fixture]
        missing += [f"config.{f}" for f in REQUIRED_FIELDS if f not in fixture.get("config", {})]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        if fixture["name"] != path.stem:
            raise ValueError(f"{path}: name {fixture['name']!r} differs from the file name")
        fixtures.append(fixture)
    if names is None:
        return fixtures
    wanted = list(names)
    known = {f["name"]: f for f in fixtures}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; the corpus has {', '.join(known)}")
    return [known[n] for n in wanted]


def config_for(fixture: Dict[str, Any], **overrides: Any) -> Any:
    """The transformers config of a corpus model (fresh each call; ``overrides`` change fields)."""
    import transformers
    from transformers import AutoConfig

    fields = dict(fixture["config"])
    fields.update(overrides)
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        if "Unrecognized model identifier" in str(exc):
            missing = f"transformers {transformers.__version__} has no {model_type}"
            raise ArchitectureMissing(missing) from None
        raise


def max_memory(gpus: int, gib: float) -> Dict[Any, int]:
    mm: Dict[Any, int] = {i: int(gib * GiB) for i in range(gpus)}
    mm["cpu"] = CPU_GIB * GiB
    return mm


def topology_label(gpus: int, gib: float) -> str:
    return f"{gpus}x{gib:g}GiB"


def parse_topology(text: str) -> Tuple[int, float]:
    gpus, _, gib = text.strip().lower().removesuffix("gib").partition("x")
    try:
        return int(gpus), float(gib)
    except ValueError:
        raise ValueError(f"topology {text!r}: write GPUSxGIB, e.g. 8x80") from None


# -- timing ----------------------------------------------------------------------------------------


def interleaved(
    library: Callable[[], Any], shim: Callable[[], Any], rounds: int
) -> Tuple[List[float], List[float], Any, Any]:
    """Per-round times of both sides (even rounds run the library first, odd rounds the shim) and
    what each side returned in its last round."""
    lib_times: List[float] = []
    shim_times: List[float] = []
    results: Dict[str, Any] = {}
    for r in range(rounds):
        order = (("library", library, lib_times), ("shim", shim, shim_times))
        for side, fn, times in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            results[side] = fn()
            times.append(time.perf_counter() - start)
    return lib_times, shim_times, results.get("library"), results.get("shim")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# -- corpus rows -----------------------------------------------------------------------------------


def _checks():
    sys.path.insert(0, str(ROOT / "tests" / "planning"))
    import device_map_checks

    return device_map_checks


def corpus_rows(
    fixtures: Sequence[Dict[str, Any]], quantizations: Sequence[str], topologies: Sequence[Tuple[int, float]],
    rounds: int,
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """One row per model x quantization x topology; also the lines saying what was skipped."""
    from devmap_shims.cli import device_map_step as stack

    checks = _checks()
    rows: List[Dict[str, Any]] = []
    skipped: List[str] = []
    total = len(fixtures) * len(quantizations) * len(topologies)
    done = 0
    for fixture in fixtures:
        for quant in quantizations:
            try:
                start = time.perf_counter()
                meta = stack.build_meta_model(config_for(fixture), DTYPE, quant)
                built = time.perf_counter() - start
            except ArchitectureMissing as exc:
                skipped.append(f"{fixture['name']}: {exc}")
                _say(f"skipping {fixture['name']} {quant}: {exc}")
                done += len(topologies)
                continue
            _say(f"built {fixture['name']} {quant} on meta: {meta.parameters / 1e9:.2f}B parameters, "
                 f"{built:.2f} s")
            sizes = checks.library_sizes(meta, STRATEGY)
            for gpus, gib in topologies:
                done += 1
                mm = max_memory(gpus, gib)
                # first calls warm both paths and give the maps that are judged
                plain_map = stack.device_map_step(meta, STRATEGY, mm, shim=False)
                shim_map = stack.device_map_step(meta, STRATEGY, mm, shim=True)
                lib_t, shim_t, _, _ = interleaved(
                    lambda: stack.device_map_step(meta, STRATEGY, mm, shim=False),
                    lambda: stack.device_map_step(meta, STRATEGY, mm, shim=True), rounds)
                budgets = checks.budgets_for(meta, mm)
                plain = checks.check_map(meta, plain_map, budgets, STRATEGY, sizes)
                shimmed = checks.check_map(meta, shim_map, budgets, STRATEGY, sizes)
                ratios = [s / p for s, p in zip(shim_t, lib_t)]
                repaired = dict(shim_map) != dict(plain_map)
                at_optimum = None if shimmed.optimum is None else shimmed.max_gpu_load <= shimmed.optimum
                row = {
                    "case": f"{fixture['name']} {quant} {topology_label(gpus, gib)}",
                    "model": fixture["name"], "quantization": quant, "gpus": gpus, "gpu_gib": gib,
                    "library_s": statistics.median(lib_t), "shim_s": statistics.median(shim_t),
                    "ratio": statistics.median(ratios), "ratio_p90": percentile(ratios, 90),
                    "round_ratios": ratios, "library_times": lib_t, "shim_times": shim_t,
                    "library_balance": plain.ratio, "shim_balance": shimmed.ratio,
                    "optimum_balance": shimmed.optimum_ratio,
                    "library_offloaded_gib": plain.offloaded / GiB, "offloaded_gib": shimmed.offloaded / GiB,
                    "repaired": repaired, "at_optimum": at_optimum,
                    "library_rules_broken": plain.violations, "shim_rules_broken": shimmed.violations,
                }
                rows.append(row)
                _say(f"[{done}/{total}] {row['case']}: "
                     f"{row['library_s'] * 1e3:.1f} -> {row['shim_s'] * 1e3:.1f} ms "
                     f"({row['ratio']:.2f}x), balance {plain.ratio:.3f} -> {shimmed.ratio:.3f}"
                     + (" repaired" if repaired else ""))
    return rows, skipped


def summarize(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    if not rows:
        return {"cases": 0}
    every_round = [r for row in rows for r in row["round_ratios"]]
    repaired = [row for row in rows if row["repaired"]]
    judged = [row for row in repaired if row["at_optimum"] is not None]
    median = statistics.median(row["ratio"] for row in rows)
    p90 = percentile(every_round, 90)
    return {
        "cases": len(rows),
        "models": len({row["model"] for row in rows}),
        "quantizations": len({row["quantization"] for row in rows}),
        "topologies": len({(row["gpus"], row["gpu_gib"]) for row in rows}),
        "rounds": len(every_round),
        "median_ratio": median,
        "p90_round_ratio": p90,
        "worst_case": max(rows, key=lambda row: row["ratio"])["case"],
        "worst_ratio": max(row["ratio"] for row in rows),
        "repaired": len(repaired),
        "repaired_at_optimum": sum(1 for row in judged if row["at_optimum"]),
        "repaired_judged": len(judged),
        "rules_broken_with_shim": sum(len(row["shim_rules_broken"]) for row in rows),
        "target_median_met": median <= TARGET_MEDIAN,
        "target_p90_met": p90 <= TARGET_P90,
        "target_optimum_met": all(row["at_optimum"] for row in judged),
    }


# -- scale rows ------------------------------------------------------------------------------------


def build_unfused_moe(experts: int, quantization: str = SCALE_QUANTIZATION) -> Tuple[Any, str]:
    """DeepSeek-V3-shaped skeleton, ``SCALE_LAYERS`` layers of ``experts`` experts each, one module
    per expert; returns the meta model and a line saying how the experts were built."""
    import transformers
    from torch import nn

    from devmap_shims.cli import device_map_step as stack

    fixture = load_fixtures(["deepseek-v3"])[0]
    config = config_for(
        fixture, n_routed_experts=experts, num_hidden_layers=SCALE_LAYERS, first_k_dense_replace=0)
    meta = stack.build_meta_model(config, DTYPE, "none")
    layers = meta.model.model.layers
    how = f"transformers {transformers.__version__} builds one module per expert"
    if not isinstance(layers[0].mlp.experts, nn.ModuleList):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

        fused = type(layers[0].mlp.experts).__name__
        with stack._meta_init():
            for layer in layers:
                layer.mlp.experts = nn.ModuleList(
                    DeepseekV3MLP(config, intermediate_size=config.moe_intermediate_size)
                    for _ in range(experts))
        how = (f"transformers {transformers.__version__} fuses experts ({fused}, 3-D parameters): "
               "replaced by one DeepseekV3MLP (gate/up/down nn.Linear) per expert, "
               "as transformers 4.x builds them")
    if quantization != "none":
        quantizer = stack._bnb_quantizer(config, meta.model, stack.torch_dtype(DTYPE), quantization)
        meta = stack.MetaModel(meta.model, quantizer, meta.dtype, quantization, meta.parameters)
    return meta, how


@contextlib.contextmanager
def timed_shim_work() -> Iterator[List[float]]:
    """Times of the device-map shim's own work in the shimmed steps of the block: deciding, and
    where the map needs it, walking the layout and repairing (``maybe_repair``, everything the
    shim does beyond reading what the library computed). At 79,246 modules the library's own step
    varies by seconds between rounds, so the side-by-side difference alone cannot resolve 0.3 s."""
    from devmap_shims.hooks.accelerate import device_map_balance as hook

    times: List[float] = []
    real = hook.maybe_repair

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    hook.maybe_repair = timed
    try:
        yield times
    finally:
        hook.maybe_repair = real


def scale_rows(
    sizes: Sequence[int], rounds: int, variants: Sequence[str] = SCALE_VARIANTS
) -> Tuple[List[Dict[str, Any]], str]:
    from devmap_shims.cli import device_map_step as stack

    rows: List[Dict[str, Any]] = []
    how = ""
    gpus, gib = SCALE_TOPOLOGY
    try:  # imports out of the first build's time
        import bitsandbytes  # noqa: F401
        import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401
    except ImportError:
        pass
    mm = max_memory(gpus, gib)
    for experts in sizes:
        start = time.perf_counter()
        try:
            meta, how = build_unfused_moe(experts)
        except ArchitectureMissing as exc:
            _say(f"skipping the scale rows: {exc}")
            return rows, str(exc)
        built = time.perf_counter() - start
        modules = sum(1 for _ in meta.model.modules())
        linears = sum(1 for m in meta.model.modules() if type(m).__name__.startswith("Linear"))
        _say(f"built {SCALE_LAYERS}x{experts}-expert MoE: {modules:,} modules, {built:.1f} s")
        own = list(meta.model._no_split_modules or [])
        for variant in variants:
            meta.model._no_split_modules = own if variant == "decoder layers" else []
            # no warm-up round here: the corpus (or the build) has imported everything, and a
            # 256-expert step takes seconds
            with timed_shim_work() as own_t:
                lib_t, shim_t, plain_map, shim_map = interleaved(
                    lambda meta=meta: stack.device_map_step(meta, STRATEGY, mm, shim=False),
                    lambda meta=meta: stack.device_map_step(meta, STRATEGY, mm, shim=True), rounds)
            lib, shim = statistics.median(lib_t), statistics.median(shim_t)
            row = {
                "experts": experts, "layers": SCALE_LAYERS, "modules": modules, "linear_modules": linears,
                "blocks": variant, "quantization": SCALE_QUANTIZATION,
                "topology": topology_label(gpus, gib),
                "build_s": built, "library_s": lib, "shim_s": shim, "added_s": shim - lib,
                "own_s": statistics.median(own_t) if own_t else 0.0, "own_times": own_t,
                "library_spread_s": max(lib_t) - min(lib_t),
                "ratio": statistics.median(s / p for s, p in zip(shim_t, lib_t)),
                "map_entries": len(shim_map), "repaired": dict(shim_map) != dict(plain_map),
                "library_times": lib_t, "shim_times": shim_t,
            }
            rows.append(row)
            _say(f"  {variant}: {lib:.3f} -> {shim:.3f} s ({shim - lib:+.3f} s); the shim's own work "
                 f"{row['own_s']:.3f} s")
        meta.model._no_split_modules = own
        del meta
    return rows, how


# -- output ----------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _table(header: Sequence[str], cells: Sequence[Sequence[str]], right: Sequence[bool]) -> List[str]:
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    out = []
    for row in [header, *cells]:
        out.append("  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)).rstrip())
    return out


def _balance(ratio: float, offloaded_gib: float) -> str:
    """The balance ratio, or how much the map offloads (then the bound, total / GPUs, is no yardstick)."""
    return f"off {offloaded_gib:.0f}G" if offloaded_gib else f"{ratio:.3f}"


def corpus_table(rows: Sequence[Dict[str, Any]]) -> List[str]:
    header = ["case", "lib ms", "shim ms", "ratio", "p90", "bal lib", "bal shim", "bal opt", "repaired",
              "at opt"]
    cells = [[
        row["case"], f"{row['library_s'] * 1e3:.1f}", f"{row['shim_s'] * 1e3:.1f}", f"{row['ratio']:.2f}",
        f"{row['ratio_p90']:.2f}", _balance(row["library_balance"], row["library_offloaded_gib"]),
        _balance(row["shim_balance"], row["offloaded_gib"]), _fmt(row["optimum_balance"]),
        _fmt(row["repaired"]), _fmt(row["at_optimum"]),
    ] for row in rows]
    lines = _table(header, cells, [False] + [True] * 9)
    for row in rows:
        for side in ("shim",):
            for rule in row[f"{side}_rules_broken"]:
                lines.append(f"  {row['case']}, {side}: {rule}")
    return lines


def summary_lines(s: Dict[str, Any], rounds: int) -> List[str]:
    if not s.get("cases"):
        return ["no corpus case ran"]
    yes = {True: "met", False: "NOT met"}
    return [
        f"{s['cases']} cases ({s['models']} models x {s['quantizations']} quantizations x "
        f"{s['topologies']} topologies), "
        f"{rounds} interleaved rounds each",
        f"median ratio {s['median_ratio']:.3f}x "
        f"(target <= {TARGET_MEDIAN:.2f}x: {yes[s['target_median_met']]}); worst case {s['worst_case']} "
        f"{s['worst_ratio']:.2f}x",
        f"90th percentile of all {s['rounds']} rounds {s['p90_round_ratio']:.3f}x "
        f"(target <= {TARGET_P90:.2f}x: {yes[s['target_p90_met']]})",
        f"repaired by the shim: {s['repaired']} of {s['cases']}; at the exact optimum: "
        f"{s['repaired_at_optimum']} of {s['repaired_judged']}"
        + (f" ({s['repaired'] - s['repaired_judged']} offload: no GPU-only optimum)"
           if s['repaired'] > s['repaired_judged'] else "")
        + f" ({yes[s['target_optimum_met']]}); rules broken with the shim: {s['rules_broken_with_shim']}",
    ]


def scale_table(rows: Sequence[Dict[str, Any]]) -> List[str]:
    header = ["experts", "modules", "Linear", "blocks", "build s", "lib s", "lib spread", "shim s", "added s",
              "ratio", "own s", "repaired"]
    cells = [[
        str(row["experts"]), f"{row['modules']:,}", f"{row['linear_modules']:,}", row["blocks"],
        f"{row['build_s']:.1f}", f"{row['library_s']:.3f}", f"{row['library_spread_s']:.3f}", f"{row['shim_s']:.3f}",
        f"{row['added_s']:+.3f}", f"{row['ratio']:.2f}", f"{row['own_s']:.3f}", _fmt(row["repaired"]),
    ] for row in rows]
    return _table(header, cells, [True, True, True, False] + [True] * 8)


def scale_summary(rows: Sequence[Dict[str, Any]]) -> List[str]:
    largest = max((row["experts"] for row in rows), default=None)
    if largest is None:
        return []
    out = []
    for row in rows:
        if row["experts"] == largest:
            met = "met" if row["own_s"] < TARGET_SCALE_ADDED_S else "NOT met"
            target = (f"target < {TARGET_SCALE_ADDED_S} s: {met}" if largest == 256
                      else "the target applies at 256 experts")
            out.append(f"{row['modules']:,} modules, blocks = {row['blocks']}: the shim's own work takes "
                       f"{row['own_s']:.3f} s ({target}); side by side the step took {row['added_s']:+.3f} s "
                       f"longer (median of {len(row['shim_times'])} rounds; the library's own step varied "
                       f"by {row['library_spread_s']:.3f} s between rounds)")
    return out


def versions() -> Dict[str, str]:
    from devmap_shims.versions import installed_versions

    return {k: v for k, v in installed_versions().items() if v}


def measure(
    fixtures: Sequence[Dict[str, Any]], quantizations: Sequence[str], topologies: Sequence[Tuple[int, float]],
    rounds: int, scale_sizes: Sequence[int], scale_rounds: int,
) -> Dict[str, Any]:
    import logging

    logging.getLogger("devmap_shims").setLevel(logging.WARNING)
    start = time.perf_counter()
    rows, skipped = corpus_rows(fixtures, quantizations, topologies, rounds) if fixtures else ([], [])
    scale, how = scale_rows(scale_sizes, scale_rounds) if scale_sizes else ([], "")
    return {
        "versions": versions(), "strategy": STRATEGY, "dtype": DTYPE,
        "rounds": rounds, "scale_rounds": scale_rounds,
        "cases": rows, "skipped": skipped, "summary": summarize(rows),
        "scale": scale, "scale_experts": how, "seconds": time.perf_counter() - start,
    }


def report(result: Dict[str, Any]) -> str:
    lines = [f"versions: {result['versions']}"]
    if result["cases"] or result["skipped"]:
        lines += ["", f"Device-map step, device_map={STRATEGY!r}, {DTYPE}: library alone vs through the "
                      f"shim, medians of {result['rounds']} interleaved rounds",
                  "ratio: median of the per-round ratios, p90 their 90th percentile; bal: busiest GPU / "
                  "max(total / GPUs, largest block)",
                  "opt: the exact optimum; off NG: the map offloads N GiB"]
        lines += corpus_table(result["cases"])
        lines += [f"skipped {s}" for s in result["skipped"]]
        lines += [""] + summary_lines(result["summary"], result["rounds"])
    if result["scale"]:
        gpus, gib = SCALE_TOPOLOGY
        lines += ["", f"Scale: DeepSeek-V3-shaped MoE, {SCALE_LAYERS} layers x N experts, unfused, "
                      f"{SCALE_QUANTIZATION} on {topology_label(gpus, gib)}, "
                      f"medians of {result['scale_rounds']} interleaved rounds", result["scale_experts"]]
        lines += scale_table(result["scale"])
        lines += scale_summary(result["scale"])
    elif result["scale_experts"]:
        lines += ["", f"scale rows skipped: {result['scale_experts']}"]
    lines.append(f"\n({result['seconds']:.0f} s)")
    return "\n".join(lines)


def run(rounds: int = 9, scale_rounds: int = 3) -> List[Dict[str, Any]]:
    """Rows for benchmarks/run_all.py: the summary's targets, then one row per scale size."""
    result = measure(load_fixtures(), QUANTIZATIONS, TOPOLOGIES, rounds, SCALE_SIZES, scale_rounds)
    print(report(result))
    return summary_rows(result)


def summary_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    s = result["summary"]
    rows: List[Dict[str, Any]] = []
    if s.get("cases"):
        label = f"{s['cases']} cases, {s['models']} models x {s['topologies']} topologies"
        rows.append({"benchmark": f"device-map step with the shim / library alone, median over {label}",
                     "value": round(s["median_ratio"], 3), "unit": "x", "target": f"<= {TARGET_MEDIAN}",
                     "met": s["target_median_met"]})
        rows.append({"benchmark": f"same, 90th percentile of all {s['rounds']} rounds",
                     "value": round(s["p90_round_ratio"], 3), "unit": "x", "target": f"<= {TARGET_P90}",
                     "met": s["target_p90_met"]})
        rows.append({"benchmark": f"repaired maps at the exact optimum ({s['repaired']} repaired)",
                     "value": s["repaired_at_optimum"], "unit": f"of {s['repaired_judged']}", "target": "all",
                     "met": s["target_optimum_met"]})
    for row in result["scale"]:
        judged = row["experts"] == 256
        rows.append({"benchmark": f"unfused MoE {row['layers']}x{row['experts']} experts "
                                  f"({row['modules']:,} modules, blocks = {row['blocks']}): "
                                  "the shim's own work per step (side by side: "
                                  f"{row['added_s']:+.3f} s, library spread {row['library_spread_s']:.3f} s)",
                     "value": round(row["own_s"], 3), "unit": "s", "baseline": round(row["library_s"], 3),
                     "ratio": row["ratio"], "target": f"< {TARGET_SCALE_ADDED_S} s" if judged else "reported",
                     "met": row["own_s"] < TARGET_SCALE_ADDED_S if judged else True})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per case (default 9)")
    parser.add_argument("--models", help="comma-separated corpus names (default: all)")
    parser.add_argument("--quantizations", default=",".join(QUANTIZATIONS),
                        help="none,4bit,8bit (default none,4bit)")
    parser.add_argument("--topologies", help="comma-separated GPUSxGIB (default 2x80,4x24,8x23,8x80,16x80)")
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds, 4bit only, 8x23 and 8x80 GiB, scale sizes 8 and 32")
    parser.add_argument("--scale-sizes", help="experts per layer for the scale rows (default 8,32,128,256)")
    parser.add_argument("--scale-rounds", type=int, default=3,
                        help="interleaved rounds per scale row (default 3)")
    parser.add_argument("--no-scale", action="store_true", help="leave out the scale rows")
    parser.add_argument("--scale-only", action="store_true", help="only the scale rows")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    args = parser.parse_args(argv)

    rounds, quants = args.rounds, args.quantizations.split(",")
    topologies, sizes = list(TOPOLOGIES), list(SCALE_SIZES)
    if args.quick:
        rounds, quants, topologies, sizes = 3, ["4bit"], [(8, 23), (8, 80)], [8, 32]
    if args.topologies:
        try:
            topologies = [parse_topology(t) for t in args.topologies.split(",")]
        except ValueError as exc:
            parser.error(str(exc))
    if args.scale_sizes:
        sizes = [int(n) for n in args.scale_sizes.split(",")]
    if args.no_scale:
        sizes = []
    for q in quants:
        if q not in ("none", "4bit", "8bit"):
            parser.error(f"unknown quantization {q!r} (use none, 4bit, 8bit)")
    if rounds < 1 or args.scale_rounds < 1:
        parser.error("--rounds and --scale-rounds must be at least 1")
    fixtures = [] if args.scale_only else load_fixtures(args.models.split(",") if args.models else None)
    result = measure(fixtures, quants, topologies, rounds, sizes, args.scale_rounds)
    print(json.dumps(result, indent=1, default=str) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
