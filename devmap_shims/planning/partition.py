"""Contiguous partition of an ordered sequence of sizes over ordered bins (GPUs).

Every bin receives a contiguous run of items, bins in order (so activations only ever move
forward from GPU i to GPU j > i). Two questions are answered exactly:

* :func:`min_max_cap`: the smallest ``T`` such that the items fit with every bin holding at most
  ``min(T, capacity)``. For a fixed ``T`` greedy first-fit decides feasibility optimally
  (filling a bin as far as it goes never hurts the bins after it), so a binary search on ``T``
  over integers finds the optimum in ``O(n + bins log(n) log(total))`` (prefix sums, and each
  bin's run found by bisection).
* :func:`longest_prefix_with_reserve`: when the items do not fit, the longest prefix that does
  while the first bin keeps room for the largest item left over (accelerate's reserve on its main
  GPU for streaming offloaded blocks back in).
* :func:`spread`: given that ``T``, a partition that keeps every bin at or under it while
  aiming each bin at an even share of what is left, so GPUs at the end are not left idle when
  a balanced split needs them. A backward greedy pass tells, for every bin, the earliest item
  from which the rest still fits, which keeps the forward choices feasible. Once no more items
  are left than bins, each bin takes what fits under its cap instead: a small item (a final
  norm) joins its neighbours rather than a GPU of its own, and only the last GPUs stay idle.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate
from typing import List, Optional, Sequence, Tuple


def _prefix(sizes: Sequence[int]) -> List[int]:
    return [0] + list(accumulate(sizes))


def fits(sizes: Sequence[int], caps: Sequence[int]) -> bool:
    """Do the items fit, in order and contiguously, into bins with these capacities?"""
    return greedy_prefix(sizes, caps) == len(sizes)


def greedy_prefix(sizes: Sequence[int], caps: Sequence[int]) -> int:
    """How many leading items first-fit places into the bins (the longest placeable prefix)."""
    return _greedy_end(_prefix(sizes), caps)


def _greedy_end(prefix: Sequence[int], caps: Sequence[int]) -> int:
    """:func:`greedy_prefix` from the prefix sums: each bin takes the longest run that fits,
    found by bisection, so one answer costs O(bins x log items) instead of O(items)."""
    i, u = 0, len(prefix) - 1
    for cap in caps:
        if i == u:
            break
        i = _run_end(prefix, i, cap)
    return i


def _run_end(prefix: Sequence[int], i: int, cap: int) -> int:
    """The end of the longest run of items from ``i`` whose sizes add up to at most ``cap``."""
    return max(i, bisect_right(prefix, prefix[i] + cap, i) - 1)


def longest_prefix_with_reserve(sizes: Sequence[int], caps: Sequence[int]) -> Tuple[int, int]:
    """``(k, reserve)``: the largest ``k`` such that items ``[:k]`` fit in order into the bins
    while the first bin keeps ``reserve = max(sizes[k:])`` free (0 when everything fits).

    The reserve shrinks as ``k`` grows, so a longer prefix can fit where a shorter one, leaving a
    larger block behind, does not. The ``k`` sharing one value ``r`` of ``max(sizes[k:])`` form an
    interval ``[a, b]`` on which the bins are the same, so the best ``k`` there is
    ``min(b, greedy prefix with the first bin at cap - r)`` when that is at least ``a``; the
    intervals are tried from the longest prefixes down, and the first that holds one is the answer.
    """
    u = len(sizes)
    prefix = _prefix(sizes)
    if not caps:
        return 0, max(sizes, default=0)
    if _greedy_end(prefix, caps) == u:
        return u, 0
    rest = list(caps[1:])
    b = u - 1
    while b >= 0:
        level = sizes[b]
        a = b
        while a > 0 and sizes[a - 1] <= level:  # max(sizes[k:]) == level for every k in [a, b]
            a -= 1
        k = min(b, _greedy_end(prefix, [max(0, caps[0] - level)] + rest))
        if k >= a:
            return k, level
        b = a - 1
    return 0, max(sizes, default=0)  # pragma: no cover - k = 0 always holds in the last interval


def min_max_cap(sizes: Sequence[int], caps: Sequence[int], prefix: Optional[List[int]] = None) -> Optional[int]:
    """Smallest per-bin load limit that lets all items fit (None when they never fit);
    ``prefix``: the sizes' prefix sums, when the caller has them."""
    if not sizes:
        return 0
    prefix = prefix if prefix is not None else _prefix(sizes)
    u = len(sizes)
    if not caps or _greedy_end(prefix, caps) != u:
        return None
    total = prefix[u]
    lo = max(max(sizes), -(-total // len(caps)))
    hi = max(max(caps), lo)
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy_end(prefix, [min(mid, c) for c in caps]) == u:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _earliest_starts(sizes: Sequence[int], caps: Sequence[int], prefix: Sequence[int]) -> List[int]:
    """start[b]: the smallest item index j such that items j.. fit into bins b.. (backward
    greedy, exact by the same exchange argument as the forward one). Each bin's run is found by
    bisection on the prefix sums, as in the forward pass."""
    n, u = len(caps), len(sizes)
    start = [u] * (n + 1)
    for b in range(n - 1, -1, -1):
        end = start[b + 1]
        start[b] = bisect_left(prefix, prefix[end] - caps[b], 0, end)
    return start


def spread(sizes: Sequence[int], caps: Sequence[int], prefix: Optional[List[int]] = None) -> Optional[List[int]]:
    """Bin index of every item, each bin at most ``caps[b]``, loads as even as the items allow.

    Returns None when the items do not fit. ``caps`` are typically ``min(T, capacity)`` with
    ``T`` from :func:`min_max_cap`.
    """
    u, n = len(sizes), len(caps)
    prefix = prefix if prefix is not None else _prefix(sizes)
    start = _earliest_starts(sizes, caps, prefix)
    if start[0] != 0:
        return None
    assignment: List[int] = []
    p = 0
    for b in range(n):
        bins_left = sum(1 for c in caps[b:] if c > 0) or 1
        if u - p <= bins_left:
            # no more items left than bins: an even share cannot be reached item by item, and an
            # item alone in a bin (a final norm) only adds a hop; each bin takes what fits under
            # its cap, so the bins left idle are the last ones
            end = _run_end(prefix, p, caps[b])
            assignment.extend([b] * (end - p))
            p = end
            continue
        lo_end = max(p, start[b + 1])
        target = (prefix[u] - prefix[p]) / bins_left
        best_end, best_err = lo_end, None
        e = lo_end
        while e <= u and prefix[e] - prefix[p] <= caps[b]:
            load = prefix[e] - prefix[p]
            # an empty bin is only chosen when nothing else fits: leaving a GPU idle pushes its
            # share onto the GPUs after it
            err = abs(load - target) if load > 0 or e == u else float("inf")
            if best_err is None or err < best_err:
                best_end, best_err = e, err
            elif load > target:
                break
            e += 1
        assignment.extend([b] * (best_end - p))
        p = best_end
    if p != u:  # pragma: no cover - guarded by start[0] == 0
        return None
    return assignment


def balanced_assignment(sizes: Sequence[int], capacities: Sequence[int]) -> Optional[List[int]]:
    """Min-max contiguous partition, spread evenly: bin index per item (None if it never fits)."""
    prefix = _prefix(sizes)
    cap = min_max_cap(sizes, capacities, prefix)
    if cap is None:
        return None
    return spread(sizes, [min(cap, c) for c in capacities], prefix)
