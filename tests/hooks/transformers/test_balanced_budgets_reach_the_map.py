"""The balanced-budgets-reach-the-map wrappers, called by hand around accelerate's real
``get_balanced_memory`` / ``infer_auto_device_map`` in the order transformers 4.27's
``from_pretrained`` calls them, and forced on around a fixed ``from_pretrained`` (the 4.27 releases
themselves are the rows' scenarios, in the point sessions)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from devmap_shims.hooks.transformers import balanced_budgets_reach_the_map as hook  # noqa: E402

if torch.version.cuda is None:  # pragma: no cover - the simulator needs a CUDA build of torch
    pytest.skip("the GPU simulator needs a CUDA build of torch", allow_module_level=True)

SIM = pytest.mark.simulated_gpus(n=2, memory="1GiB")
NO_SPLIT = ["Block"]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)


def model():
    return torch.nn.Sequential(*(Block() for _ in range(4)))


def _wrappers(direct):
    return direct(hook.SHIM, hook.keep_callers_max_memory, hook.balance_callers_max_memory, hook.place_with_budgets)


def _load_like_4_27(direct, *, user_max_memory, pass_user_to_balance, placed=None):
    """What from_pretrained does on 4.27.0/1 (``pass_user_to_balance``: the user's max_memory goes
    to get_balanced_memory and the placer) and 4.27.2 (it goes to neither; the placer gets the
    budgets)."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    keep, balance, place = _wrappers(direct)
    m = model()

    def from_pretrained(**kwargs):
        extra = {"max_memory": user_max_memory} if pass_user_to_balance else {}
        budgets = balance(get_balanced_memory, None, (m,), dict(no_split_module_classes=NO_SPLIT, **extra))
        to_placer = user_max_memory if pass_user_to_balance else budgets
        return place(infer_auto_device_map, None, (placed if placed is not None else m,),
                     dict(no_split_module_classes=NO_SPLIT, max_memory=to_placer))

    return keep(from_pretrained, None, (), {"max_memory": user_max_memory})


@SIM
def test_4_27_1_order_the_placer_gets_the_budgets_it_was_denied(direct):
    device_map = _load_like_4_27(direct, user_max_memory=None, pass_user_to_balance=True)
    assert set(device_map.values()) == {0, 1}, device_map


@SIM
def test_4_27_1_order_without_the_wrappers_fills_gpu_0(direct):
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    m = model()
    get_balanced_memory(m, no_split_module_classes=NO_SPLIT, max_memory=None)  # result dropped, as in 4.27.1
    assert set(infer_auto_device_map(m, no_split_module_classes=NO_SPLIT, max_memory=None).values()) == {0}


@SIM
def test_4_27_2_order_the_callers_cap_bounds_the_budgets(direct):
    cap = {0: 40_000, 1: 10**9}  # a block is 16,640 bytes: two fit under the cap
    device_map = _load_like_4_27(direct, user_max_memory=cap, pass_user_to_balance=False)
    on_0 = [name for name, device in device_map.items() if device == 0]
    assert len(on_0) <= 2 and set(device_map.values()) <= {0, 1}, device_map


@SIM
def test_budgets_of_one_model_never_reach_another_models_map(direct):
    device_map = _load_like_4_27(direct, user_max_memory=None, pass_user_to_balance=True, placed=model())
    assert set(device_map.values()) == {0}, device_map  # another model: the user's (None) budget stands


def _gpus(budgets):
    return {device: size for device, size in budgets.items() if device != "cpu"}


@SIM
def test_outside_from_pretrained_every_call_is_passed_through(direct):
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    _, balance, place = _wrappers(direct)
    m = model()
    budgets = balance(get_balanced_memory, None, (m,), dict(no_split_module_classes=NO_SPLIT))
    # the "cpu" budget is the host's available memory at each call, which other processes change
    assert _gpus(budgets) == _gpus(get_balanced_memory(m, no_split_module_classes=NO_SPLIT)) != {}
    device_map = place(infer_auto_device_map, None, (m,), dict(no_split_module_classes=NO_SPLIT, max_memory=None))
    assert set(device_map.values()) == {0}, device_map


@SIM
def test_a_nested_load_keeps_its_own_budgets(direct):
    from accelerate.utils import infer_auto_device_map

    keep, _, place = _wrappers(direct)
    outer = model()

    def outer_load(**kwargs):
        inner = _load_like_4_27(direct, user_max_memory=None, pass_user_to_balance=True)
        # the inner load's budgets were used up by its own placer; the outer placer sees none
        return inner, place(infer_auto_device_map, None, (outer,), dict(no_split_module_classes=NO_SPLIT, max_memory=None))

    inner_map, outer_map = keep(outer_load, None, (), {})
    assert set(inner_map.values()) == {0, 1} and set(outer_map.values()) == {0}, (inner_map, outer_map)


def test_from_pretrained_of_a_fixed_release_gives_the_same_map_with_the_shim_forced(no_shim):
    """Forced on outside its range: the library already hands the budgets over, nothing changes."""
    import devmap_shims
    from devmap_shims.compat_matrix import load_matrix
    from devmap_shims.versions import installed_versions

    matrix = load_matrix()
    if any(matrix.get(row).applies(installed_versions(matrix.distributions())) for row in hook.SHIM.fixes):
        pytest.skip("a release with the bug: the rows' scenarios replay it")

    def maps():
        return (hook.balanced_uses_both_gpus(), hook.balanced_keeps_the_callers_cap())

    without = maps()
    devmap_shims.install(only=[hook.SHIM.id], force=[hook.SHIM.id])
    try:
        assert all(s["state"] != "failed" for s in devmap_shims.status()["shims"][0]["targets"])
        assert maps() == without
    finally:
        devmap_shims.uninstall()
