"""How one replay's outcome is classified: ran, failed, or cannot run on this stack."""

from __future__ import annotations

import pytest

from devmap_shims.scenarios import BugObserved, Scenario, ScenarioUnavailable
from devmap_shims.scenarios.replay import replay


def _outcome(func):
    return replay(Scenario("row", "title", func, needs=()), shims=False)


def _raise(exc):
    def func():
        raise exc

    return func


def test_a_model_the_installed_transformers_cannot_build_is_unavailable_not_a_failure():
    pytest.importorskip("transformers")
    from devmap_shims.testing.models.causal_lm import UnsupportedArchError

    outcome = _outcome(_raise(UnsupportedArchError("llama: transformers 4.27.1 has no LlamaForCausalLM")))
    assert outcome.ok and outcome.unavailable and "LlamaForCausalLM" in outcome.detail


@pytest.mark.parametrize("exc, unavailable", [
    (ScenarioUnavailable("needs peft"), True),
    (BugObserved("the map collapsed"), False),
    (RuntimeError("Expected all tensors to be on the same device"), False),
])
def test_only_a_missing_piece_of_the_stack_excuses_a_scenario(exc, unavailable):
    outcome = _outcome(_raise(exc))
    assert (outcome.ok, outcome.unavailable) == ((True, True) if unavailable else (False, False))
    assert str(exc) in outcome.detail
