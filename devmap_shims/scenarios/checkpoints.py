"""Tiny checkpoints the scenarios share, written once per process to folders removed at exit."""

from __future__ import annotations

from typing import Any, Callable, Dict

_ONCE: Dict[Any, Any] = {}


def scratch_dir(prefix: str) -> str:
    """A fresh temporary folder ``devmap-shims-<prefix>-*`` for checkpoints a scenario writes,
    removed when the process that made it exits (not when a forked child of it does), so that
    ``demo`` and test runs leave nothing behind in the temporary directory."""
    import atexit
    import os
    import tempfile

    folder = tempfile.mkdtemp(prefix=f"devmap-shims-{prefix}-")
    atexit.register(_remove_scratch, folder, os.getpid())
    return folder


def _remove_scratch(folder: str, owner: int) -> None:
    import os
    import shutil

    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


def once(key: Any, make: Callable[[], Any], still_valid: Callable[[Any], bool] = lambda value: True) -> Any:
    """``make()``, computed once per process for ``key`` (again when ``still_valid`` says no)."""
    if key not in _ONCE or not still_valid(_ONCE[key]):
        _ONCE[key] = make()
    return _ONCE[key]


def tiny_checkpoint(arch: str, prefix: str, **overrides: Any) -> str:
    """A tiny ``arch`` checkpoint (safetensors) written to a fresh temporary folder once per
    process and set of ``overrides`` (``save_tiny_causal_lm`` arguments)."""
    import os

    def make() -> str:
        from devmap_shims.testing.models import save_tiny_causal_lm

        return str(save_tiny_causal_lm(arch, os.path.join(scratch_dir(prefix), arch), **overrides))

    key = ("checkpoint", arch, tuple(sorted(overrides.items(), key=lambda item: item[0])))
    return once(key, make, os.path.isdir)


def cpu_greedy_tokens(path: str, new_tokens: int, **load_kwargs: Any) -> Any:
    """Greedy tokens of the checkpoint at ``path`` on the CPU, for the sample prompt (once per process)."""

    def make() -> Any:
        from transformers import AutoModelForCausalLM

        from devmap_shims.testing.models import greedy_generate, sample_input_ids

        model = AutoModelForCausalLM.from_pretrained(path, **load_kwargs)
        return greedy_generate(model, sample_input_ids(), max_new_tokens=new_tokens)

    key = ("tokens", path, new_tokens, tuple(sorted(load_kwargs.items(), key=lambda item: item[0])))
    return once(key, make)


def same_tokens(tokens: Any, reference: Any, where: str) -> str:
    """``where``'s summary when ``tokens`` equal the CPU ``reference``; BugObserved otherwise."""
    import torch

    from devmap_shims.scenarios import BugObserved

    if not torch.equal(tokens.cpu(), reference.cpu()):
        raise BugObserved(f"{where}: generated {tokens.cpu().tolist()} instead of the CPU tokens {reference.tolist()}")
    return f"{where}: {reference.shape[-1]} tokens equal to the CPU reference"
