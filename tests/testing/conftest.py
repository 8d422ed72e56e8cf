from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny ops gain nothing from intra-op threads, and on a busy 2-core CI box OpenMP's
    spin-waiting makes them 10-30x slower: modules that ask for it run single-threaded."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
