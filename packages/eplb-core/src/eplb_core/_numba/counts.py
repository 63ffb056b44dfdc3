"""Replica counts: how many replicas each expert of a row gets (greedy split, slot-aware split)."""

from __future__ import annotations

import numpy as np

from eplb_core._numba.utils import (
    _INF,
    GREEDY_HEAP_MIN,
    GREEDY_SCAN_EXPERTS,
    INTERPRETED,
    _pairwise_sum,
    _row_sum,
    njit,
    njit_inline,
)


@njit
def _greedy_counts_row(w: np.ndarray, counts: np.ndarray, num_replicas: int, per: np.ndarray) -> None:
    """Sequential greedy split, in place: while ``counts`` sums to less than ``num_replicas``, one more
    replica for the expert with the largest ``w / count`` (lowest id on ties). A row of zero loads
    gets its extra replicas one per expert in id order instead (every expert ties; this keeps them
    spread over GPUs)."""
    n = w.size
    have = 0
    positive = False
    for e in range(n):
        per[e] = w[e] / counts[e]
        have += counts[e]
        positive |= per[e] > 0
    if not positive:
        for i in range(num_replicas - have):
            counts[i % n] += 1
        return
    extra = num_replicas - have
    if extra < GREEDY_HEAP_MIN or n <= GREEDY_SCAN_EXPERTS:
        # the first largest: positive finite loads order like their bits as integers (a maximum the
        # compiler vectorises); zeros tie with every zero, but the largest load here is positive
        bits = per.view(np.int64)
        for _ in range(extra):
            if INTERPRETED:
                best = int(np.argmax(per[:n]))  # the first largest (the same expert)
                counts[best] += 1
                per[best] = w[best] / counts[best]
                continue
            top = bits[0]
            for e in range(1, n):
                top = max(top, bits[e])
            best = 0
            while bits[best] != top:
                best += 1
            counts[best] += 1
            per[best] = w[best] / counts[best]
        return
    # the same choices from a binary heap ordered by (per-replica load desc, id asc): its root is
    # what the scan above finds, in O(log N) per replica instead of O(N). Only the first ``extra``
    # experts in that order at the start can get a replica (every expert before a chosen one was
    # chosen before it), so the heap holds just those: picked from a heap whose root is the last
    # of them so far
    size = min(extra, n)
    heap = np.empty(size, dtype=np.int64)
    for e in range(n):
        if e < size:
            heap[e] = e
            if e == size - 1:
                for p in range(size // 2 - 1, -1, -1):
                    _sift_down_per(heap, per, size, p, False)
        elif per[e] > per[heap[0]]:  # ties: the lower id, already in, stays
            heap[0] = e
            _sift_down_per(heap, per, size, 0, False)
    for p in range(size // 2 - 1, -1, -1):
        _sift_down_per(heap, per, size, p, True)
    n = size
    for _ in range(extra):
        best = heap[0]
        counts[best] += 1
        per[best] = w[best] / counts[best]
        _sift_down_per(heap, per, n, 0, True)


@njit_inline
def _ahead(va: float, a: int, vb: float, b: int, first: bool) -> bool:
    """Whether expert ``a`` (per-replica load ``va``) sits above ``b`` in a heap whose root is the
    first in the greedy order (largest load, lowest id on ties; ``first``) or the last."""
    if first:
        return va > vb or (va == vb and a < b)
    return va < vb or (va == vb and a > b)


@njit_inline
def _sift_down_per(heap: np.ndarray, per: np.ndarray, size: int, p: int, first: bool) -> None:
    """Sift ``heap[p]`` down a heap whose root is the first (``first``) or the last expert in the
    greedy order (see :func:`_ahead`)."""
    item = heap[p]
    v = per[item]
    while True:
        c = 2 * p + 1
        if c >= size:
            break
        a = heap[c]
        if c + 1 < size:
            b = heap[c + 1]
            if _ahead(per[b], b, per[a], a, first):
                c += 1
                a = b
        if _ahead(per[a], a, v, item, first):
            heap[p] = a
            p = c
        else:
            break
    heap[p] = item


@njit
def _is_greedy_split(w: np.ndarray, counts: np.ndarray) -> bool:
    """Whether ``counts`` is exactly what :func:`_greedy_counts_row` makes from all ones (a row with
    a positive load).

    The greedy split hands out replica ``c + 1`` of expert ``e`` in the order of ``w[e] / c``
    (decreasing, lowest ``e`` on ties; for one expert in order of ``c``): it takes the first
    ``R - N`` of these. ``counts`` took ``w[e] / c`` for ``c < counts[e]``; it is the greedy split
    exactly when the last of those it took comes before the first it did not take.
    """
    last_v, last_e = _INF, np.int64(-1)  # the last taken: smallest value, highest id on ties
    next_v, next_e = -_INF, np.int64(-1)  # the first not taken: largest value, lowest id on ties
    for e in range(w.size):
        c = counts[e]
        if c > 1:
            v = w[e] / (c - 1)
            if v <= last_v:
                last_v, last_e = v, e
        v = w[e] / c
        if v > next_v:
            next_v, next_e = v, e
    if last_e < 0:
        return False
    return last_v > next_v or (last_v == next_v and last_e <= next_e)


@njit
def greedy_counts(weight: np.ndarray, counts: np.ndarray, num_replicas: int) -> None:
    """:func:`_greedy_counts_row` on every row of ``weight [B, N]`` / ``counts [B, N]``, in place."""
    per = np.empty(weight.shape[1])
    for r in range(weight.shape[0]):
        _greedy_counts_row(weight[r], counts[r], num_replicas, per)


@njit
def _slot_aware_row(
    w: np.ndarray, num_replicas: int, num_bins: int, counts: np.ndarray, per: np.ndarray, small: np.ndarray
) -> bool:
    """Replica counts that leave room for the other items of a GPU, in ``counts``; returns whether
    any expert got more than the greedy split's one replica to start from (otherwise ``counts`` is
    exactly the greedy split of :func:`_greedy_counts_row`).

    With ``S = num_replicas / num_bins`` slots per GPU, a GPU holding a replica of load ``h`` also
    holds ``S - 1`` other replicas, so its load is at least ``h`` plus the ``S - 1`` lightest loads.
    Every expert first gets enough replicas that each fits under ``mean - filler`` (``filler``: the
    ``S - 1`` lightest expert loads) when that is affordable; the rest follow the greedy split.
    """
    n = w.size
    slots = num_replicas // num_bins
    counts[:] = 1
    raised = False
    if slots > 1 and num_replicas != n:
        mean_bin = _pairwise_sum(w, np.int64(0), n) / num_bins
        m = min(slots - 1, n)
        have = 0
        for e in range(n):  # the m smallest loads, ascending
            v = w[e]
            if have < m:
                j = have
                have += 1
            elif v < small[m - 1]:
                j = m - 1
            else:
                continue
            while j > 0 and small[j - 1] > v:
                small[j] = small[j - 1]
                j -= 1
            small[j] = v
        room = mean_bin - _row_sum(small, np.int64(0), m)
        total = n  # with no room every expert keeps its one replica (counts are all 1 already)
        if room > 0:
            # one pass without branches (the compiler vectorises it)
            cap = float(num_replicas)
            div = max(room, 1e-300)
            total = 0
            for e in range(n):
                counts[e] = np.int64(min(max(np.ceil(w[e] / div), 1.0), cap))
                total += counts[e]
                raised |= counts[e] > 1
        if total > num_replicas:
            counts[:] = 1
            raised = False
    _greedy_counts_row(w, counts, num_replicas, per)
    return raised
