"""The transformers model classes that override ``generate``, found in the installed sources.

``GenerationMixin.generate`` is overridden by some models (Whisper, MusicGen, RAG, BLIP-2,
Qwen2.5-Omni ...), and which ones differs per release, so they are found in the installed
transformers' own files without importing them: the ``models/*/modeling_*.py`` and
``models/*/generation_*.py`` files are scanned for ``def generate(`` in a class body. Reading
~500 files costs 50-150 ms, so the result is kept in ``$XDG_CACHE_HOME/devmap_shims`` (default
``~/.cache/devmap_shims``; see :mod:`devmap_shims.cache`), keyed by the package's location and the
stamps of its files, holding only lines the scan could have produced. The scan runs only when the
generate shim arms (its bug applies and transformers is being imported).
"""

from __future__ import annotations

import os
import re
import sys

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Iterable, List, Optional, Tuple

from devmap_shims import cache
from devmap_shims.shims import Target

_CACHE_FORMAT = "devmap-shims generate overrides v2"


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


#: What the scan can produce: a module of transformers.models and a class name.
_MODULE = r"transformers\.models(?:\.[A-Za-z_][A-Za-z0-9_]*)+"
_LINE = re.compile(rf"^{_MODULE}:[A-Za-z_][A-Za-z0-9_]*$")


def _accept(line: str) -> bool:
    return _LINE.match(line) is not None


def generate_overrides(root: Optional[str] = None) -> List[Tuple[str, str]]:
    """The classes of the installed transformers that override ``generate``, cached per install."""
    root = root if root is not None else transformers_root()
    if root is None:
        return []
    key = _cache_key(root)
    name, header = f"generate-overrides-{cache.fnv1a(key)}.txt", f"{_CACHE_FORMAT}\n{key}"
    lines = cache.read(name, header, _accept)
    if lines is not None:
        return [tuple(line.split(":")) for line in lines]  # type: ignore[misc]
    found = scan_generate_overrides(root)
    cache.write(name, header, [f"{m}:{c}" for m, c in found if _accept(f"{m}:{c}")])
    return found


def override_targets() -> Tuple[Target, ...]:
    """One ``generate`` target per overriding class of the installed transformers."""
    return tuple(Target(module, f"{cls}.generate") for module, cls in generate_overrides())
