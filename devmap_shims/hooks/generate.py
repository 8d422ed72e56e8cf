"""Put ``generate()``'s tensor inputs on the device of the model's input embeddings.

Bug ``generate-input-device-type-warning`` (huggingface/transformers#19468, #34706,
huggingface/accelerate#661): before transformers 5.13 nothing in ``generate`` moves the inputs to
the model. A model without accelerate hooks (one GPU: ``device_map={"": 7}``, the collapsed map of
Report 1, a single-device bitsandbytes model on accelerate >= 1.2) then fails in the embedding with
``Expected all tensors to be on the same device, but found at least two devices, cuda:7 and
cuda:0!`` when the user did ``inputs.to("cuda")``, and transformers only ever warns when the device
*types* differ. A dispatched model runs CPU inputs (its root hook moves them), but sampling then
runs on the CPU and transformers warns "You are calling .generate() with the `input_ids` being on
a device type different than your model's device".

The repair: every top-level tensor argument of ``generate`` (``input_ids``, ``attention_mask``,
``inputs_embeds``, ``pixel_values``, ... and tensors passed through ``**kwargs``; never
``past_key_values``) goes to the device of ``model.get_input_embeddings()`` (for an offloaded
embedding, its hook's execution device), non-blocking when the destination is a GPU, with one
DEBUG line. When the main input was moved, the tensors of the result go back to the caller's
device, so code that worked before sees the same devices. Anything that is not a tensor (a
``BatchEncoding``, nested lists, caches) is left alone, and a model without input embeddings is
not touched at all.

Where ``generate`` lives, and so where the shim hooks: ``GenerationMixin.generate`` in
``transformers.generation.utils``, plus every class that overrides it (Whisper, MusicGen, RAG,
BLIP-2, Qwen2.5-Omni ...). Those classes differ per release, so they are found in the installed
transformers' own files, without importing them: the ``models/*/modeling_*.py`` and
``models/*/generation_*.py`` files are scanned for ``def generate(`` in a class body. Reading ~500
files costs 50-150 ms, so the result is kept in ``$XDG_CACHE_HOME/devmap_shims`` (default
``~/.cache/devmap_shims``), keyed by the package's location and the stamps of its files; later
``install()`` calls read one small file.
"""

from __future__ import annotations

import os
import sys

from devmap_shims.hooks._lazy import LazyLogger
from devmap_shims.shims import Shim, Target

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing would cost install() its start-up budget
    from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

SHIM_ID = "generate-input-device"
BUG_IDS = ("generate-input-device-type-warning",)
_HERE = "devmap_shims.hooks.generate"

logger = LazyLogger("devmap_shims.hooks.generate")

#: Keyword arguments never moved: a cache split over GPUs must stay where each layer put it.
NEVER_MOVED = frozenset({"past_key_values"})
#: The argument whose device the caller gets the result back on (first one present wins).
MAIN_INPUTS = (
    "inputs",
    "input_ids",
    "inputs_embeds",
    "input_features",
    "input_values",
    "pixel_values",
    "decoder_input_ids",
)

# -- where generate is defined -----------------------------------------------------------------------

_CACHE_FORMAT = "devmap-shims generate overrides v1"


def transformers_root() -> Optional[str]:
    """The directory of the installed ``transformers`` package, found without importing it."""
    module = sys.modules.get("transformers")
    paths = getattr(module, "__path__", None) if module is not None else None
    if not paths:
        spec = _find_spec("transformers")
        paths = getattr(spec, "submodule_search_locations", None) if spec is not None else None
    for path in paths or ():
        if os.path.isdir(os.path.join(path, "models")):
            return str(path)
    return None


def _find_spec(name: str) -> Any:
    """``importlib.util.find_spec`` for a top-level name, without its 15 ms import: ask each finder
    on ``sys.meta_path`` (path entries, editable installs ...) the way the import system does."""
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, None)
        except Exception:
            continue
        if spec is not None:
            return spec
    return None


def _is_scanned(name: str) -> bool:
    if not name.endswith(".py"):
        return False
    if not name.startswith(("modeling_", "generation_")):
        return False
    return not name.startswith(("modeling_tf_", "modeling_flax_"))


def _model_files(root: str) -> Iterable[Tuple[str, str]]:
    """``(module name, path)`` of every file that may define a model's ``generate``."""
    models = os.path.join(root, "models")
    for package, folder in _model_packages(models, "transformers.models"):
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if _is_scanned(entry.name):
                yield f"{package}.{entry.name[:-3]}", entry.path


def _model_packages(models: str, prefix: str) -> Iterable[Tuple[str, str]]:
    try:
        entries = list(os.scandir(models))
    except OSError:
        return
    for entry in entries:
        if not entry.is_dir() or entry.name.startswith(("_", ".")):
            continue
        if entry.name == "deprecated":  # transformers 4.x keeps retired models one level down
            for sub in _model_packages(entry.path, f"{prefix}.deprecated"):
                yield sub
            continue
        yield f"{prefix}.{entry.name}", entry.path


def classes_defining_generate(source: bytes) -> List[str]:
    """Names of the top-level classes whose body defines ``generate`` (a plain text scan)."""
    found: List[str] = []
    if b"def generate(" not in source:
        return found
    current: Optional[str] = None
    for line in source.split(b"\n"):
        if not line or line[:1] in (b" ", b"\t", b"#", b"@", b")", b"]", b"}"):
            if current is not None and line.startswith(b"    def generate(") and current not in found:
                found.append(current)
            continue
        if line.startswith(b"class "):
            name = line[6:].split(b"(", 1)[0].split(b":", 1)[0].strip()
            current = name.decode("ascii", "replace") or None
        else:  # any other top-level statement ends the class body
            current = None
    return found


def scan_generate_overrides(root: str) -> List[Tuple[str, str]]:
    """``(module, class)`` for every class in ``root``'s model files that defines ``generate``."""
    found: List[Tuple[str, str]] = []
    for module, path in _model_files(root):
        try:
            with open(path, "rb") as handle:
                source = handle.read()
        except OSError:
            continue
        found.extend((module, cls) for cls in classes_defining_generate(source))
    found.sort()
    return found


def _stamp(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_size}:{st.st_mtime_ns}"


def _cache_key(root: str) -> str:
    # An upgrade rewrites generation/utils.py and __init__.py (new size or time) and usually adds
    # model folders (new time on models/).
    real = os.path.realpath(root)
    parts = [real] + [_stamp(os.path.join(real, *p)) for p in (("__init__.py",), ("generation", "utils.py"), ("models",))]
    return "|".join(parts)


def _fnv1a(text: str) -> str:
    value = 0xCBF29CE484222325
    for byte in text.encode("utf-8", "surrogateescape"):
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{value:016x}"


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "devmap_shims")


def _read_cache(path: str, key: str) -> Optional[List[Tuple[str, str]]]:
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().split("\n")
    except (OSError, UnicodeDecodeError):
        return None
    if len(lines) < 2 or lines[0] != _CACHE_FORMAT or lines[1] != key:
        return None
    found = []
    for line in lines[2:]:
        module, sep, cls = line.partition(":")
        if sep and module and cls:
            found.append((module, cls))
    return found


def _write_cache(path: str, key: str, found: List[Tuple[str, str]]) -> None:
    text = "\n".join([_CACHE_FORMAT, key] + [f"{m}:{c}" for m, c in found]) + "\n"
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)  # atomic: torchrun workers may race to write the same file
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def generate_overrides(root: Optional[str] = None) -> List[Tuple[str, str]]:
    """The classes of the installed transformers that override ``generate``, cached per install."""
    root = root if root is not None else transformers_root()
    if root is None:
        return []
    key = _cache_key(root)
    path = os.path.join(cache_dir(), f"generate-overrides-{_fnv1a(key)}.txt")
    found = _read_cache(path, key)
    if found is None:
        found = scan_generate_overrides(root)
        _write_cache(path, key, found)
    return found


def override_targets() -> Tuple[Target, ...]:
    """One target per overriding class; never raises (install() must not fail over a scan)."""
    try:
        pairs = generate_overrides()
    except Exception as exc:  # pragma: no cover - defensive: unreadable site-packages and the like
        logger.debug("devmap_shims: could not list the classes overriding generate (%s)", exc)
        return ()
    return tuple(Target(module, f"{cls}.generate") for module, cls in pairs)


SHIMS = (
    Shim(
        id=SHIM_ID,
        fixes=BUG_IDS,
        targets=(Target("transformers.generation.utils", "GenerationMixin.generate"),) + override_targets(),
        wrapper=f"{_HERE}:align_generate_inputs",
        summary="move generate()'s tensor inputs to the input embeddings' device (and the result back)",
    ),
)

# -- the repair (runs only once transformers, and so torch, is imported) -------------------------------

_TENSOR: Any = None


def _tensor_type() -> Any:
    global _TENSOR
    if _TENSOR is None:
        import torch

        _TENSOR = torch.Tensor
    return _TENSOR


def _hook_execution_device(module: Any) -> Any:
    """The execution device of accelerate's hook on ``module`` (an offloaded embedding), or None."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or (hook,)
    for item in hooks:
        device = getattr(item, "execution_device", None)
        if device is not None:
            import torch

            try:
                return torch.device(device)
            except (TypeError, RuntimeError, ValueError):
                return None
    return None


def input_embedding_device(model: Any) -> Any:
    """Where ``model``'s input embeddings compute, or None when it cannot be told."""
    getter = getattr(model, "get_input_embeddings", None)
    if getter is None:
        return None
    try:
        embedding = getter()
    except Exception:  # NotImplementedError on models without input embeddings
        return None
    if embedding is None:
        return None
    tensor = _tensor_type()
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, tensor):
        parameters = getattr(embedding, "parameters", None)
        weight = next(iter(parameters()), None) if callable(parameters) else None
        if weight is None:
            return None
    device = weight.device
    if device.type == "meta":
        return _hook_execution_device(embedding)
    return device


def _misplaced(args: Tuple[Any, ...], kwargs: Dict[str, Any], target: Any) -> bool:
    tensor = _TENSOR
    for value in args:
        if isinstance(value, tensor) and value.device != target:
            return True
    for name, value in kwargs.items():
        if isinstance(value, tensor) and value.device != target and name not in NEVER_MOVED:
            return True
    return False


def _main_input(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    tensor = _TENSOR
    for value in args:
        if isinstance(value, tensor):
            return value
    for name in MAIN_INPUTS:
        value = kwargs.get(name)
        if isinstance(value, tensor):
            return value
    return None


def align_generate_inputs(
    wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """Wrapper for ``generate``: align the inputs, call, give the result back on the caller's device."""
    target = input_embedding_device(instance)
    if target is None or not _misplaced(args, kwargs, target):
        return wrapped(*args, **kwargs)
    main = _main_input(args, kwargs)
    caller_device = main.device if main is not None and main.device != target else None
    non_blocking = target.type == "cuda"
    moved: List[str] = []

    def move(name: str, value: Any) -> Any:
        if isinstance(value, _TENSOR) and value.device != target and name not in NEVER_MOVED:
            moved.append(f"{name} ({value.device})")
            return value.to(target, non_blocking=non_blocking)
        return value

    new_args = tuple(move(f"positional argument {i}", value) for i, value in enumerate(args))
    new_kwargs = {name: move(name, value) for name, value in kwargs.items()}
    logger.debug(
        "devmap_shims: %s moved %s to %s, the device of %s's input embeddings, before generate()",
        SHIM_ID, ", ".join(moved), target, type(instance).__name__,
    )
    result = wrapped(*new_args, **new_kwargs)
    if caller_device is None:
        return result
    return to_device(result, caller_device)


def to_device(result: Any, device: Any, depth: int = 0) -> Any:
    """``result``'s tensors on ``device``: a tensor, or a ModelOutput / tuple holding tensors.

    Caches are left where they are (``past_key_values`` keys, and any object that is not a tensor,
    tuple, list or mapping). Copies to the CPU are blocking, so the caller can read them at once.
    """
    if isinstance(result, _TENSOR):
        return result.to(device)
    if depth > 3:
        return result
    if isinstance(result, tuple) and not hasattr(result, "_fields"):
        return tuple(to_device(item, device, depth + 1) for item in result)
    if isinstance(result, list):
        return [to_device(item, device, depth + 1) for item in result]
    keys = getattr(result, "keys", None)
    if callable(keys) and hasattr(result, "__setitem__"):
        for key in list(keys()):
            if key in NEVER_MOVED:
                continue
            value = result[key]
            new = to_device(value, device, depth + 1)
            if new is not value:
                result[key] = new
    return result
