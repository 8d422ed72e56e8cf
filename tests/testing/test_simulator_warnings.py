"""torch's warnings from a wrapped ``torch.load`` name the caller's line, as without the simulation
(torch 2.4 warns about a call without ``weights_only``; the wrapper's frame used to take the blame)."""

from __future__ import annotations

import warnings

import pytest
import torch

from devmap_shims.testing import simulated_gpus


def load_recording(path, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.load(path, **kwargs)  # the line warnings should name
    return [(w.category, w.filename, str(w.message)[:60]) for w in caught]


@pytest.mark.parametrize("kwargs", [{}, {"map_location": "cuda:1"}, {"map_location": {"cpu": "cuda:0"}}])
def test_torch_load_warns_as_without_the_simulation(tmp_path, kwargs):
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    outside = load_recording(path, map_location="cpu" if kwargs else None)
    with simulated_gpus(2):
        inside = load_recording(path, **kwargs)
    assert inside == outside
    assert all(filename == __file__ for _, filename, _ in inside)


def test_warning_as_error_is_raised_at_the_caller(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        try:
            torch.load(path)
            expected = None
        except FutureWarning as exc:  # torch < 2.6: no weights_only given
            expected = str(exc)
        with simulated_gpus(2):
            if expected is None:
                torch.load(path)
            else:
                with pytest.raises(FutureWarning) as raised:
                    torch.load(path)
                assert str(raised.value) == expected
