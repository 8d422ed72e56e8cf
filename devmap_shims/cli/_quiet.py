"""The target libraries kept quiet while a command replays scenarios: no progress bar, no warning,
nothing a scenario prints in the report."""

from __future__ import annotations

import io
import sys
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import Iterator


@contextmanager
def libraries_silent(silent: bool = True, up_to: int = 40) -> Iterator[None]:
    """While inside, nothing is logged at ``up_to`` or below (ERROR: only CRITICAL passes) and no
    warning is shown, ours included: the libraries a command imports then say nothing
    (bitsandbytes on a machine without its native library logs an error with a traceback at
    import; transformers resets its own logger's level as it is first imported, so levels set
    beforehand would not hold). What was set before comes back after."""
    if not silent:
        yield
        return
    import logging
    import warnings

    previous = logging.root.manager.disable
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(max(previous, up_to))  # a stricter level the host set stays
            yield
    finally:
        logging.disable(previous)


def quiet_libraries() -> None:
    """No progress bar and no library warning in the report: set before the libraries are imported
    (tqdm reads ``TQDM_DISABLE`` when it is imported), and again on the loggers."""
    import logging
    import os
    import warnings

    for name, value in (
        ("TQDM_DISABLE", "1"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("DIFFUSERS_VERBOSITY", "error"),
        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
        ("BITSANDBYTES_NOWELCOME", "1"),
        ("HF_HUB_OFFLINE", "1"),
    ):
        os.environ[name] = value
    for name in ("transformers", "diffusers", "accelerate", "bitsandbytes", "huggingface_hub", "torch", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    try:  # tiny models: one thread is faster than contending for two cores
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


def _silence_loaded_libraries() -> None:
    """Progress bars of libraries imported already (tqdm read its environment before ours)."""
    modules = sys.modules
    for name, call in (
        ("transformers.utils.logging", "disable_progress_bar"),
        ("diffusers.utils.logging", "disable_progress_bar"),
        ("huggingface_hub.utils", "disable_progress_bars"),
    ):
        module = modules.get(name)
        if module is not None and callable(getattr(module, call, None)):
            try:
                getattr(module, call)()
            except Exception:  # a library's switch must not stop the demo
                pass


@contextmanager
def captured() -> Iterator[io.StringIO]:
    """What a scenario writes to stdout and stderr (a stray bar, a print) stays out of the report."""
    buffer = io.StringIO()
    with redirect_stdout(buffer), redirect_stderr(buffer):
        try:
            yield buffer
        finally:
            _silence_loaded_libraries()
