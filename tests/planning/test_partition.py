"""Contiguous min-max partition: checked against brute force over every contiguous split."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devmap_shims.planning import partition


def brute_force_optimum(sizes, caps):
    """Smallest achievable max bin load over every contiguous split (None if none fits)."""
    n, u = len(caps), len(sizes)
    best = None
    # cut points: a non-decreasing sequence of n-1 positions in 0..u
    for cuts in itertools.combinations_with_replacement(range(u + 1), n - 1):
        bounds = (0,) + cuts + (u,)
        loads = [sum(sizes[bounds[i]:bounds[i + 1]]) for i in range(n)]
        if all(load <= cap for load, cap in zip(loads, caps)):
            worst = max(loads)
            best = worst if best is None else min(best, worst)
    return best


def check_assignment(sizes, caps, assignment):
    assert len(assignment) == len(sizes)
    assert assignment == sorted(assignment), "bins must be filled in order (contiguous runs)"
    loads = [0] * len(caps)
    for size, b in zip(sizes, assignment):
        loads[b] += size
    assert all(load <= cap for load, cap in zip(loads, caps))
    return loads


items = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=9)
bins = st.lists(st.integers(min_value=0, max_value=120), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(items, bins)
def test_min_max_cap_is_the_exact_optimum(sizes, caps):
    expected = brute_force_optimum(sizes, caps)
    got = partition.min_max_cap(sizes, caps)
    if expected is None:
        assert got is None
    else:
        # the cap may exceed the optimum only by slack that no bin uses
        assignment = partition.spread(sizes, [min(got, c) for c in caps])
        assert assignment is not None
        loads = check_assignment(sizes, caps, assignment)
        assert max(loads) == expected


@settings(max_examples=300, deadline=None)
@given(items, bins)
def test_balanced_assignment_is_optimal_and_contiguous(sizes, caps):
    expected = brute_force_optimum(sizes, caps)
    assignment = partition.balanced_assignment(sizes, caps)
    if expected is None:
        assert assignment is None
        return
    loads = check_assignment(sizes, caps, assignment)
    assert max(loads) == expected


@settings(max_examples=200, deadline=None)
@given(items, bins)
def test_greedy_prefix_is_the_longest_placeable_prefix(sizes, caps):
    k = partition.greedy_prefix(sizes, caps)
    assert brute_force_optimum(sizes[:k], caps) is not None
    if k < len(sizes):
        assert brute_force_optimum(sizes[: k + 1], caps) is None


def brute_force_longest_prefix_with_reserve(sizes, caps):
    """Every k: does sizes[:k] fit with the first bin keeping max(sizes[k:]) free?"""
    best = 0
    for k in range(len(sizes) + 1):
        reserve = max(sizes[k:], default=0)
        if brute_force_optimum(sizes[:k], [max(0, caps[0] - reserve)] + caps[1:]) is not None:
            best = k
    return best


@settings(max_examples=300, deadline=None)
@given(items, bins)
def test_longest_prefix_with_reserve_is_the_longest_there_is(sizes, caps):
    """A longer prefix leaves a smaller block to reserve room for, so it can fit where a shorter
    one does not: the answer is the longest over every k, not a first fixed point."""
    k, reserve = partition.longest_prefix_with_reserve(sizes, caps)
    assert k == brute_force_longest_prefix_with_reserve(sizes, caps)
    assert reserve == max(sizes[k:], default=0)


def test_longest_prefix_with_reserve_finds_the_prefix_behind_the_largest_block():
    """With room kept for the largest block (8), only the first two blocks fit (21 offloaded);
    placing all but the last block needs only its 6 kept free, and offloads 6."""
    sizes = [7, 8, 4, 1, 8, 1, 1, 6]
    assert partition.longest_prefix_with_reserve(sizes, [14, 13, 11]) == (7, 6)


def test_spread_does_not_leave_a_gpu_idle_when_the_first_block_is_big():
    # a large embedding followed by small layers on 4 GPUs: greedy first-fit at the optimal cap
    # would stack layers on the first GPUs; spread must give every GPU work
    sizes = [50] + [3] * 16
    assignment = partition.balanced_assignment(sizes, [1000] * 4)
    loads = check_assignment(sizes, [1000] * 4, assignment)
    assert max(loads) == 50
    assert all(load > 0 for load in loads)


def test_spread_uses_every_bin_when_items_allow():
    sizes = [10] * 10
    assignment = partition.balanced_assignment(sizes, [100] * 8)
    loads = check_assignment(sizes, [100] * 8, assignment)
    assert max(loads) == 20
    assert all(load > 0 for load in loads)


def test_a_small_module_does_not_take_a_gpu_of_its_own_when_gpus_outnumber_modules():
    # embedding, three layers, final norm, rotary embedding, lm_head on 8 GPUs: once no more
    # modules are left than GPUs, an even share cannot be reached module by module, and a norm
    # alone on a GPU only adds a hop; it goes with the lm_head, the busiest GPU unchanged
    sizes = [50, 100, 100, 100, 1, 1, 50]
    assignment = partition.balanced_assignment(sizes, [1000] * 8)
    loads = check_assignment(sizes, [1000] * 8, assignment)
    assert max(loads) == 100
    assert assignment == [0, 1, 2, 3, 4, 4, 4]
    # a GPU between two used ones is never left empty: the idle GPUs are the last ones
    assert [load > 0 for load in loads] == [True] * 5 + [False] * 3


def test_bins_with_zero_capacity_are_skipped():
    assignment = partition.balanced_assignment([5, 5, 5], [0, 10, 10])
    assert assignment is not None and 0 not in assignment


@pytest.mark.parametrize("sizes,caps", [([5, 5], [4, 4]), ([1, 2, 3], [])])
def test_infeasible_returns_none(sizes, caps):
    assert partition.min_max_cap(sizes, caps) is None
    assert partition.balanced_assignment(sizes, caps) is None
