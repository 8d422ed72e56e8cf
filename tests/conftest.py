"""The ``gpu`` marker (pyproject.toml): a test marked with it runs only where a real CUDA GPU is."""

from __future__ import annotations

import pytest

_REAL_CUDA = []  # [bool] once asked: torch is imported only when a gpu-marked test is about to run


def real_cuda() -> bool:
    if not _REAL_CUDA:
        try:
            import torch

            _REAL_CUDA.append(torch.cuda.is_available() and torch.cuda.device_count() > 0)
        except Exception:  # noqa: BLE001 - no torch, or a broken driver: no GPU to test on
            _REAL_CUDA.append(False)
    return _REAL_CUDA[0]


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not real_cuda():
        pytest.skip("needs a real CUDA GPU")
