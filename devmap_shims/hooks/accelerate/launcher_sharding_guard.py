"""Shim ``launcher-sharding-guard``: warn (strict mode: raise) when every process of a
multi-process launch shards its own copy of the model over the same GPUs.

It does not fix a hang: it detects the configuration the row suspects, right after
``PreTrainedModel.from_pretrained`` returns and when ``generate`` starts (transformers'
``GenerationMixin._prepare_generation_config``, which every ``generate`` calls first; ``generate``
itself is the generate-input-device shim's), and warns once per install with the cause and the two
fixes: run one process, or load one full copy per process with ``device_map={"": local_rank}``.
In strict mode a ``from_pretrained(device_map="auto" | "balanced" ...)`` that would shard over
several GPUs under a launch raises before loading, not after.

Not flagged: a model loaded with an explicit ``device_map`` dict (the user placed it on purpose),
ranks that were given GPU sets of their own (this process's ``CUDA_VISIBLE_DEVICES`` differs from
the launcher's, its parent process's, read from ``/proc`` on Linux), and a launch with one process
per machine (``LOCAL_WORLD_SIZE=1``). Before a load, strict mode counts only the GPUs the call's
``max_memory`` gives a budget, and waits for the load with ``sequential``.

Rows (generated from known_bugs.toml by scripts/regenerate.py):
    device-map-auto-generate-hang-grpo
        affected: accelerate >=1.4.0
        fixed in: unfixed (last checked 2026-11-01)
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

from devmap_shims.shims import Shim, Target, with_context

BUG_ID = "device-map-auto-generate-hang-grpo"


class _Warned:
    """The shim's state: set once the warning was given (then a check costs one attribute read)."""

    given = False


def _launch() -> Optional[Tuple[int, int, Optional[int]]]:
    """``(rank, world size, local rank)`` of a multi-process launch, or None for a single process."""
    raw = os.environ.get("WORLD_SIZE")
    world = None
    if raw:
        try:
            world = int(raw)
        except ValueError:
            world = None
    if world is None:
        dist = _initialized_distributed()
        if dist is None:
            return None
        world = dist.get_world_size()
        rank = dist.get_rank()
    else:
        rank = _int_env("RANK", 0)
    if world <= 1:
        return None
    if _int_env("LOCAL_WORLD_SIZE", 2) <= 1:  # one process on this machine (torchrun --nnodes=N
        return None  # --nproc_per_node=1): no other rank shares its GPUs
    local = _int_env("LOCAL_RANK", None)
    return int(rank), int(world), local


def _int_env(name: str, default: Any) -> Any:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def _initialized_distributed() -> Any:
    import sys

    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    try:
        return dist if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def has_own_gpus() -> bool:
    """Whether this rank was given GPUs of its own: its ``CUDA_VISIBLE_DEVICES`` is set and is not
    the launcher's (torchrun passes its environment to every rank, so a shared setting is equal)."""
    mine = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mine is None:
        return False
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as handle:
            parent = handle.read(1 << 20).split(b"\0")
    except OSError:
        return False  # cannot tell: assume the ranks share
    for item in parent:
        if item.startswith(b"CUDA_VISIBLE_DEVICES="):
            return item.split(b"=", 1)[1].decode(errors="replace") != mine
    return True  # the launcher sees every GPU, this rank only some


def gpus_of(model: Any) -> List[str]:
    """The GPUs ``model``'s ``hf_device_map`` spreads it over, as ``cuda:N`` (sorted)."""
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict):
        return []
    gpus = set()
    for device in device_map.values():
        name = _gpu_name(device)
        if name is not None:
            gpus.add(name)
    return sorted(gpus, key=lambda n: (len(n), n))


def _gpu_name(device: Any) -> Optional[str]:
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return f"cuda:{device}"
    text = str(device)
    if text.startswith(("cuda", "xpu", "npu", "mlu", "musa")):
        return text if ":" in text else f"{text}:0"
    return None


def sharding_message(model: Any, where: str, gpus: Optional[List[str]] = None) -> Optional[str]:
    """The warning for ``model`` (or for ``gpus``, before a load) in this process, or None when the
    configuration is fine."""
    launch = _launch()
    if launch is None or has_own_gpus():
        return None
    gpus = gpus_of(model) if gpus is None else gpus
    if len(gpus) < 2:
        return None
    rank, world, local = launch
    local_text = str(local) if local is not None else "local_rank"
    return (
        f"[{SHIM.id}] {where}: process {rank} of {world} (torchrun / accelerate launch / a distributed "
        f"trainer) holds a model sharded over {', '.join(gpus)}, and the other processes of this launch, "
        "running the same code, shard their own copies over the same GPUs. generate() in this "
        f"configuration can hang or return nothing ({BUG_ID}, huggingface/accelerate#3434). Fix: either "
        "run a single process (python script.py, no launcher) so that one copy is sharded over all GPUs, "
        f"or keep the launcher and load one full copy per process with device_map={{'': {local_text}}} "
        "(each process's LOCAL_RANK). Set DEVMAP_SHIMS_STRICT=1 to make this an error."
    )


def check(context: Any, model: Any, where: str, gpus: Optional[List[str]] = None) -> None:
    """Warn once (raise ``ShimError`` in strict mode) when ``model`` is sharded (or, before a load,
    would be sharded over ``gpus``) under a multi-process launch."""
    if context.state.given:
        return
    message = sharding_message(model, where, gpus)
    if message is None:
        return
    context.state.given = True
    context.refuse(message)


STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
#: the strategies that spread a model over every GPU with a budget, so that strict mode can refuse
#: before loading (``sequential`` keeps a model that fits one GPU there: judged after the load)
SPREADING = ("auto", "balanced", "balanced_low_0")


@with_context
def check_after_from_pretrained(context: Any, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Wrapper for ``PreTrainedModel.from_pretrained``: look at the map it used (strict mode: at the
    map it is about to compute, before loading)."""
    device_map = kwargs.get("device_map")
    if isinstance(device_map, dict):
        return wrapped(*args, **kwargs)  # placed by hand, on purpose
    if context.strict and not context.state.given and device_map in SPREADING:
        gpus = _budgeted_gpus(kwargs.get("max_memory"))
        if len(gpus) > 1:
            check(context, None, f"{getattr(instance, '__name__', 'model')}.from_pretrained(device_map={device_map!r})",
                  gpus)
    result = wrapped(*args, **kwargs)
    if not context.state.given:
        model = result[0] if isinstance(result, tuple) else result  # output_loading_info=True
        if isinstance(getattr(model, "hf_device_map", None), dict):
            check(context, model, f"{type(model).__name__}.from_pretrained")
    return result


def _budgeted_gpus(max_memory: Any) -> List[str]:
    """The visible GPUs a ``from_pretrained(max_memory=...)`` leaves a budget on (all without one)."""
    gpus = _visible_gpus()
    if not isinstance(max_memory, dict):
        return gpus
    named = set()
    for key, value in max_memory.items():
        name = _gpu_name(int(key) if isinstance(key, str) and key.isdigit() else key)
        if name is not None and not (isinstance(value, (int, float)) and value <= 0):
            named.add(name)
    return [gpu for gpu in gpus if gpu in named]


def _visible_gpus() -> List[str]:
    import sys

    torch = sys.modules.get("torch")
    try:
        count = torch.cuda.device_count() if torch is not None else 0
    except Exception:
        count = 0
    return [f"cuda:{i}" for i in range(count)]


@with_context
def check_before_generate(context: Any, wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Wrapper for ``GenerationMixin._prepare_generation_config`` (the start of every ``generate``)."""
    if not context.state.given and instance is not None:
        check(context, instance, f"{type(instance).__name__}.generate")
    return wrapped(*args, **kwargs)


SHIM = Shim(
    id="launcher-sharding-guard",
    fixes=(BUG_ID,),
    targets=(
        Target(
            "transformers.modeling_utils",
            "PreTrainedModel.from_pretrained",
            expect_params=("pretrained_model_name_or_path",),
            wrapper=check_after_from_pretrained,
        ),
        Target(
            "transformers.generation.utils",
            "GenerationMixin._prepare_generation_config",
            wrapper=check_before_generate,
        ),
    ),
    state=_Warned,
    summary="warn (strict: raise) when a multi-process launch shards each rank's model over the same GPUs",
    repairs=False,  # the hang itself is not repaired: doctor counts the row as warned about
)
