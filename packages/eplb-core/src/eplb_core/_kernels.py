"""Compiled planner (private): every loop of a plan, all layers in one call.

Numba ``@njit(cache=True, nogil=True)`` functions over plain loops. :func:`solve_layers` (strict and
global plans) and :func:`pack_layers` (soft-locality packing) take the whole ``[L, ...]`` problem and
loop over the layers inside, so a plan costs one compiled call and no Python work per layer or per
refinement round. The first call in a fresh environment compiles them (seconds, see the docs); the
machine code is cached next to the module (``__pycache__``) and later processes load it.

Sums of bins and rows use NumPy's summation order (:func:`_pairwise_sum`), so the figures the Python
side computes from a plan agree to the last bit with the ones the planner acted on.
"""

from __future__ import annotations

import numba
import numpy as np

_INF = np.inf
# relative peak gap beyond which a losing candidate plan stops being refined
PRUNE_MARGIN = 0.01
# a row stops once a block of rounds lowers its load above the mean by less than this fraction
MIN_BLOCK_GAIN = 1e-6
# exchanges that improve a pair by less than this fraction of the mean bin load are ignored
REL_TOL = 1e-12
# a row whose peak is within this fraction of its lower bound stops refining (invisible in the
# reported balancedness, which has 4 decimals)
CLOSE_ENOUGH = 2e-5
# with a migration budget and up to this many slots per GPU the exchange search scores every (x, y)
# pair; otherwise (and always without a budget) a sweep over the bins' items sorted by load
BRUTE_FORCE_SLOTS = 16
# pairs of bins with at most this many slots are re-split exhaustively (C(2S, S) / 2 splits: 126 at 5)
MAX_RESPLIT_SLOTS = 5
# with more slots (up to this many), a round-robin start is refined beside the LPT start
RR_MAX_SLOTS = 16
# re-splits of the heaviest bin with the lightest ones at the end of every re-split round: they
# lower the peak directly (6 rounds with them end better balanced than 32 without)
PEAK_TRIES = 16
# rows of more than this many bins (one node of 72 GPUs): per round only the heavier half of the
# pairs is re-split and the heaviest bin gets PEAK_TRIES_MANY tries, over 5 rounds; better balanced
# and ~10% faster than every pair with 16 tries over 6 rounds (the peak step lowers the peak, the
# pairs of middle bins mostly do not)
MANY_BINS = 16
PEAK_TRIES_MANY = 32
# above this many bins per row, each round's bin order is sorted from scratch (merge sort), not by
# insertion from the previous round's order
SORT_FROM_SCRATCH_BINS = 32
# refinement rounds between two re-selections of the rows that still matter
BLOCK = 4
# from this many items, a stable argsort tries buckets of the loads' bits first (a counting sort);
# a bucket of more than BUCKET_MAX items sends it back to the merge sort
BUCKET_SORT_MIN = 64
BUCKET_MAX = 16
# from this many replicas to hand out, the greedy replica split keeps the experts in a heap
GREEDY_HEAP_MIN = 8


def default_iters(num_bins: int, slots: int) -> int:
    """Refinement rounds at most: enough for every bin to meet several partners; 5 re-split rounds
    on more than ``MANY_BINS`` GPUs (each round ends with up to ``PEAK_TRIES_MANY`` re-splits of the
    heaviest bin)."""
    if slots <= MAX_RESPLIT_SLOTS and num_bins > MANY_BINS:
        return 5
    return int(min(32, max(12, num_bins + 8)))


_njit = numba.njit(cache=True, nogil=True)


@_njit
def _row_sum(a: np.ndarray, start: int, n: int) -> float:
    """``a[start:start + n].sum()`` with NumPy's summation order (pairwise, 8 accumulators; n <= 128)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[start + i]
        return res
    r0, r1, r2, r3 = a[start], a[start + 1], a[start + 2], a[start + 3]
    r4, r5, r6, r7 = a[start + 4], a[start + 5], a[start + 6], a[start + 7]
    i = 8
    stop = n - n % 8
    while i < stop:
        p = start + i
        r0 += a[p]
        r1 += a[p + 1]
        r2 += a[p + 2]
        r3 += a[p + 3]
        r4 += a[p + 4]
        r5 += a[p + 5]
        r6 += a[p + 6]
        r7 += a[p + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[start + i]
        i += 1
    return res


@_njit
def _pairwise_sum(a: np.ndarray, start: int, n: int) -> float:
    """``a[start:start + n].sum()`` in NumPy's pairwise order for any ``n``.

    NumPy sums blocks of up to 128 items with :func:`_row_sum` and splits longer ranges at half
    (rounded down to a multiple of 8), adding the two halves; the recursion runs on a small stack.
    """
    if n <= 128:
        return _row_sum(a, start, n)
    # pending ranges (combine marks: both halves are on the value stack) and computed values
    at = np.empty(96, dtype=np.int64)
    size = np.empty(96, dtype=np.int64)
    combine = np.empty(96, dtype=np.bool_)
    vals = np.empty(64)
    at[0], size[0], combine[0] = start, n, False
    top, nv = 1, 0
    while top > 0:
        top -= 1
        st, m = at[top], size[top]
        if combine[top]:
            nv -= 1
            vals[nv - 1] = vals[nv - 1] + vals[nv]
        elif m <= 128:
            vals[nv] = _row_sum(a, st, m)
            nv += 1
        else:
            half = m // 2
            half -= half % 8
            at[top], size[top], combine[top] = st, m, True
            at[top + 1], size[top + 1], combine[top + 1] = st + half, m - half, False
            at[top + 2], size[top + 2], combine[top + 2] = st, half, False
            top += 3
    return vals[0]


@_njit
def log2phy(phy2log: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """``[L, N, max(logcnt)]`` physical slots of each expert, ascending, ``-1`` padded (``ValueError``
    when ``phy2log`` does not fit ``logcnt``)."""
    num_layers, num_replicas = phy2log.shape
    num_experts = logcnt.shape[1]
    out = np.full((num_layers, num_experts, max(1, logcnt.max())), -1, dtype=np.int64)
    fill = np.zeros(num_experts, dtype=np.int64)
    for layer in range(num_layers):
        fill[:] = 0
        for p in range(num_replicas):
            e = phy2log[layer, p]
            if e < 0 or e >= num_experts or fill[e] >= out.shape[2]:
                raise ValueError("phy2log holds an expert id outside [0, N) or more replicas than logcnt")
            out[layer, e, fill[e]] = p
            fill[e] += 1
    return out


# ---------------------------------------------------------------------------- replica counts
@_njit
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
        positive = positive or per[e] > 0
    if not positive:
        for i in range(num_replicas - have):
            counts[i % n] += 1
        return
    extra = num_replicas - have
    if extra < GREEDY_HEAP_MIN:
        for _ in range(extra):
            best = 0
            for e in range(1, n):
                if per[e] > per[best]:
                    best = e
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


@_njit
def _ahead(va: float, a: int, vb: float, b: int, first: bool) -> bool:
    """Whether expert ``a`` (per-replica load ``va``) sits above ``b`` in a heap whose root is the
    first in the greedy order (largest load, lowest id on ties; ``first``) or the last."""
    if first:
        return va > vb or (va == vb and a < b)
    return va < vb or (va == vb and a > b)


@_njit
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


@_njit
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


@_njit
def greedy_counts(weight: np.ndarray, counts: np.ndarray, num_replicas: int) -> None:
    """:func:`_greedy_counts_row` on every row of ``weight [B, N]`` / ``counts [B, N]``, in place."""
    per = np.empty(weight.shape[1])
    for r in range(weight.shape[0]):
        _greedy_counts_row(weight[r], counts[r], num_replicas, per)


@_njit
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
        total = 0
        for e in range(n):
            need = 1.0
            if room > 0:
                need = min(max(np.ceil(w[e] / max(room, 1e-300)), 1.0), float(num_replicas))
            counts[e] = np.int64(need)
            total += counts[e]
            raised = raised or counts[e] > 1
        if total > num_replicas:
            counts[:] = 1
            raised = False
    _greedy_counts_row(w, counts, num_replicas, per)
    return raised


# ---------------------------------------------------------------------------- starts
@_njit
def _bucket_argsort_desc(x: np.ndarray, order: np.ndarray, val: np.ndarray) -> bool:
    """The order of :func:`_argsort_desc` by buckets, into ``order``/``val``; False (nothing written
    that counts) when the loads do not spread over the buckets (then the merge sort runs).

    A finite load >= 0 orders like the integer of its bits, so the items go by counting sort into up
    to ``2 n`` buckets of equal ranges of those integers (a logarithmic scale: a few hot experts do not
    crowd the others into one bucket), highest first, in index order; an insertion sort then puts
    each bucket in order (few items each: at most ``BUCKET_MAX`` or the merge sort runs).
    """
    n = x.size
    bits = x.view(np.int64)
    lo = np.int64(0x7FFFFFFFFFFFFFFF)
    hi = np.int64(0)
    for i in range(n):
        v = x[i]
        if not (v >= 0.0 and v < _INF):
            return False  # NaN, inf or negative: not for the bit keys
        k = bits[i] if v != 0.0 else np.int64(0)  # -0.0 ties with 0.0
        lo = min(lo, k)
        hi = max(hi, k)
    num_buckets = 2 * n
    shift = 0
    while ((hi - lo) >> shift) >= num_buckets:
        shift += 1
    count = np.zeros(num_buckets + 1, dtype=np.int64)
    for i in range(n):
        k = bits[i] if x[i] != 0.0 else np.int64(0)
        count[(k - lo) >> shift] += 1
    start = 0
    for b in range(num_buckets - 1, -1, -1):  # heaviest bucket first
        c = count[b]
        if c > BUCKET_MAX:
            return False
        count[b] = start
        start += c
    for i in range(n):
        k = bits[i] if x[i] != 0.0 else np.int64(0)
        b = (k - lo) >> shift
        p = count[b]
        count[b] = p + 1
        order[p] = i
        val[p] = x[i]
    for i in range(1, n):  # stable: a tie never moves past an earlier index
        xv = val[i]
        oi = order[i]
        j = i
        while j > 0 and val[j - 1] < xv:
            val[j] = val[j - 1]
            order[j] = order[j - 1]
            j -= 1
        val[j] = xv
        order[j] = oi
    return True


@_njit
def _argsort_desc(x: np.ndarray) -> np.ndarray:
    """Stable argsort of ``x`` by decreasing value (``np.argsort(-x, kind="stable")``): insertion
    sort of runs of 8, then bottom-up merges of (value, index) pairs without branches on the data
    (the comparison selects, it does not jump: random loads would mispredict half the jumps);
    several times faster than Numba's ``np.argsort`` on the few hundred items of a row."""
    n = x.size
    order = np.empty(n, dtype=np.int64)
    val = np.empty(n)
    if n >= BUCKET_SORT_MIN and _bucket_argsort_desc(x, order, val):
        return order
    run = 8
    for lo in range(0, n, run):
        hi = min(lo + run, n)
        for i in range(lo, hi):
            xv = x[i]
            j = i
            while j > lo and val[j - 1] < xv:
                val[j] = val[j - 1]
                order[j] = order[j - 1]
                j -= 1
            val[j] = xv
            order[j] = i
    if n <= run:
        return order
    tmp = np.empty(n, dtype=np.int64)
    tmp_val = np.empty(n)
    width = run
    while width < n:
        for lo in range(0, n, 2 * width):
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            a, b, k = lo, mid, lo
            while a < mid and b < hi:
                va, vb = val[a], val[b]
                take_b = vb > va  # strictly larger: ties keep the left (earlier) item
                tmp_val[k] = vb if take_b else va
                tmp[k] = order[b] if take_b else order[a]
                b += take_b
                a += 1 - take_b
                k += 1
            while a < mid:
                tmp_val[k] = val[a]
                tmp[k] = order[a]
                a += 1
                k += 1
            while b < hi:
                tmp_val[k] = val[b]
                tmp[k] = order[b]
                b += 1
                k += 1
        order, tmp = tmp, order
        val, tmp_val = tmp_val, val
        width *= 2
    return order


@_njit
def _lpt_row(
    item_load: np.ndarray,
    item_key: np.ndarray,
    use_key: bool | np.bool_,
    num_bins: int,
    bins: np.ndarray,
    key: np.ndarray,
    fill: np.ndarray,
    tag: np.ndarray,
) -> np.ndarray:
    """LPT with ``M / num_bins`` items per bin: ``bins[i]`` of every item; returns the load order.

    Items by decreasing load (stable), each onto the lightest bin with a free slot (lowest index on
    ties). With ``use_key``, an item whose lightest bin already holds its key (expert) takes the
    lightest free bin that does not, if any. Replicas of one expert have equal loads and are adjacent
    in the input (expert-major), so they stay adjacent in the sorted order: "holds its expert" is
    "the last item put there belongs to the current run of equal keys".
    """
    num_items = item_load.size
    cap = num_items // num_bins
    order = _argsort_desc(item_load)
    key[:] = 0.0
    fill[:] = 0
    tag[:] = -1
    run_start = 0
    # many bins: a tournament tree over the bins (leaves ``P + b``, padded to a power of two with
    # infinite loads) whose every node holds the (load, index) pair that wins its subtree, the
    # lightest, lowest index on ties; the root is the lightest open bin (a full bin's load is
    # infinite), and only the path of the bin that took the item is replayed, without branches
    use_tree = num_bins > 16
    size = 1
    while use_tree and size < num_bins:
        size *= 2
    tk = np.full(2 * size, _INF)
    ti = np.empty(2 * size, dtype=np.int64)
    for b in range(size if use_tree else 0):
        tk[size + b] = 0.0 if b < num_bins else _INF
        ti[size + b] = b
    for p in range(size - 1, 0, -1):
        right = tk[2 * p + 1] < tk[2 * p]  # ties: the left subtree's lower index
        tk[p] = tk[2 * p + 1] if right else tk[2 * p]
        ti[p] = ti[2 * p + 1] if right else ti[2 * p]
    for step in range(num_items):
        i = order[step]
        if use_tree:
            b = ti[1]
        else:
            b = 0
            kb = key[0]
            for j in range(1, num_bins):
                if key[j] < kb:
                    kb = key[j]
                    b = j
        if use_key:
            if step == 0 or item_key[i] != item_key[order[step - 1]]:
                run_start = step
            if tag[b] == run_start:
                alt = -1
                ka = _INF
                for j in range(num_bins):
                    if tag[j] != run_start and key[j] < ka:
                        ka = key[j]
                        alt = j
                if alt >= 0:
                    b = alt
            tag[b] = run_start
        bins[i] = b
        key[b] += item_load[i]
        fill[b] += 1
        if fill[b] == cap:
            key[b] = _INF
        if use_tree:
            kv, iv = key[b], b  # infinite once full
            p = size + b
            tk[p] = kv
            while p > 1:
                sk, si = tk[p ^ 1], ti[p ^ 1]
                sib = sk < kv or (sk == kv and si < iv)
                kv = sk if sib else kv
                iv = si if sib else iv
                p >>= 1
                tk[p], ti[p] = kv, iv
    return order


@_njit
def lpt_bins(item_load: np.ndarray, item_key: np.ndarray, use_key: bool, num_bins: int) -> np.ndarray:
    """:func:`_lpt_row` on every row of ``item_load [B, M]``: bin ``[B, M]`` of every item."""
    num_rows, num_items = item_load.shape
    out = np.empty((num_rows, num_items), dtype=np.int64)
    key = np.empty(num_bins)
    fill = np.empty(num_bins, dtype=np.int64)
    tag = np.empty(num_bins, dtype=np.int64)
    for r in range(num_rows):
        _lpt_row(item_load[r], item_key[r], use_key, num_bins, out[r], key, fill, tag)
    return out


@_njit
def _layout_row(
    bins: np.ndarray,
    item_load: np.ndarray,
    item_expert: np.ndarray,
    item_count: np.ndarray,
    num_bins: int,
    out_load: np.ndarray,
    out_expert: np.ndarray,
    out_fixed: np.ndarray,
    fill: np.ndarray,
) -> bool:
    """Items into ``[G, S]`` by bin (item order inside a bin); an item is fixed when its expert has
    more replicas than there are bins. Returns whether any item is fixed."""
    fill[:] = 0
    any_fixed = False
    for i in range(bins.size):
        b = bins[i]
        s = fill[b]
        fill[b] += 1
        out_load[b, s] = item_load[i]
        out_expert[b, s] = item_expert[i]
        out_fixed[b, s] = item_count[i] > num_bins
        any_fixed = any_fixed or out_fixed[b, s]
    return any_fixed


# ---------------------------------------------------------------------------- refinement rounds
@_njit
def _pair_bins(
    bin_load: np.ndarray, order: np.ndarray, it: int, heavy: np.ndarray, light: np.ndarray
) -> None:
    """This round's pairs of one row: the k-th heaviest bin with the ``(k + it) mod P``-th lightest.

    ``order`` holds the bins by decreasing load, ties by index (what a stable sort gives); it is
    re-sorted in place by insertion from the previous round's order, which few moves disturb, or
    from scratch by a merge sort on rows of more than ``SORT_FROM_SCRATCH_BINS`` bins (the same order).
    """
    num_bins = bin_load.size
    if num_bins > SORT_FROM_SCRATCH_BINS:
        # many bins change per round here: a merge sort beats the quadratic insertion (same order)
        order[:] = _argsort_desc(bin_load)
    for i in range(1, num_bins if num_bins <= SORT_FROM_SCRATCH_BINS else 0):
        b = order[i]
        v = bin_load[b]
        j = i
        while j > 0:
            prev = order[j - 1]
            pv = bin_load[prev]
            if pv < v or (pv == v and prev > b):
                order[j] = prev
                j -= 1
            else:
                break
        order[j] = b
    half = num_bins // 2
    for k in range(half):
        heavy[k] = order[k]
        light[k] = order[num_bins - 1 - (k + it) % half]


@_njit
def _row_buffers(
    num_bins: int, num_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Work arrays of the refinement: pair ids, and per row its bin loads, bin order, and the versions
    that the rounds compare to skip a pair that declined before (a bin's version changes whenever its
    contents do). The per-row arrays live from block to block of a row: a pair that declined in an
    earlier block of its row is skipped too while neither bin changed."""
    half = num_bins // 2
    heavy = np.empty(half, dtype=np.int64)
    light = np.empty(half, dtype=np.int64)
    bin_load = np.empty((num_rows, num_bins))
    order = np.empty((num_rows, num_bins), dtype=np.int64)
    ver = np.zeros((num_rows, num_bins), dtype=np.int64)
    seen_h = np.full((num_rows, num_bins, num_bins), -1, dtype=np.int64)
    seen_l = np.full((num_rows, num_bins, num_bins), -1, dtype=np.int64)
    return heavy, light, bin_load, order, ver, seen_h, seen_l


@_njit
def _start_row(
    fl: np.ndarray, slots: int, bin_load: np.ndarray, order: np.ndarray, ver: np.ndarray, stamp: int
) -> int:
    """Bin loads of a row, the identity bin order, and fresh bin versions (none recorded as seen:
    versions only grow within a plan, so no reset of the seen tables is needed); returns the last
    version used."""
    for g in range(bin_load.size):
        bin_load[g] = _row_sum(fl, g * slots, slots)
        order[g] = g
        ver[g] = stamp + 1 + g
    return stamp + bin_load.size


@_njit
def _row_state(rb: tuple, sb: tuple, r: int) -> tuple[tuple, tuple]:
    """Row ``r``'s views of the work arrays ``rb``/``sb`` of :func:`_workspace`: what
    :func:`_resplit_rounds` and :func:`_swap_rounds` take."""
    rb_r = (rb[0], rb[1], rb[2][r], rb[3][r], rb[4][r], rb[5][r], rb[6][r])
    sb_r = (sb[0], sb[1], sb[2], sb[3], sb[4], sb[5][r])
    return rb_r, sb_r


@_njit
def _sort_slots(fl: np.ndarray, num_bins: int, slots: int, srt: np.ndarray) -> None:
    """Each bin's slots by increasing load, ties by slot, into ``srt [G, S]``."""
    for g in range(num_bins):
        base = g * slots
        for y in range(slots):
            v = fl[base + y]
            j = y
            while j > 0 and fl[base + srt[g, j - 1]] > v:
                srt[g, j] = srt[g, j - 1]
                j -= 1
            srt[g, j] = y


@_njit
def _gaining_exchanges(fl: np.ndarray, ha: int, lb0: int, slots: int, gap: float) -> int:
    """How many one-for-one exchanges between the bins whose slots start at ``ha`` and ``lb0`` move a
    load ``0 < d < gap`` (only those can gain: the gain is ``min(d, gap - d)``); counted branch-free."""
    hits = 0
    for a in range(slots):
        xa = fl[ha + a]
        for b in range(slots):
            d = xa - fl[lb0 + b]
            hits += (d > 0.0) & (d < gap)
    return hits


@_njit
def _swap_rounds(
    fl: np.ndarray,
    fe: np.ndarray,
    ff: np.ndarray,
    has_fixed: bool | np.bool_,
    tol: float,
    rounds: int,
    it0: int,
    slots: int,
    rb: tuple,
    sb: tuple,
    stamp: int,
    origin: np.ndarray,
    budget: int,
) -> tuple[bool, int]:
    """``rounds`` single-exchange rounds on one row (``fl``/``fe``/``ff``: ``[G * S]`` loads, expert
    ids, fixed flags, in place). With ``budget >= 0`` an exchange is refused when it would leave more
    than ``budget`` slots holding another expert than ``origin [G * S]`` (migration-aware mode).

    Per round, every pair of bins (see :func:`_pair_bins`) makes the one exchange of an item ``x`` of
    the heavy bin with an item ``y`` of the light bin that best evens the pair (gain
    ``min(x - y, gap - (x - y))``, first best in ``x``-major order), if it gains more than ``tol``
    and puts no expert twice on a GPU; fixed items never move. The gain of ``x`` peaks at the ``y``
    nearest ``x - gap / 2``, so the best ``y`` of each ``x`` is one of the two allowed light items
    around that target: every bin keeps its slots sorted by load (ties by slot; two insertion steps
    per exchange), and one pointer sweeps the light bin's allowed items while ``x`` goes up the heavy
    bin's order, ``O(S)`` per pair; equal gains go to the lowest slots, as when every pair is scored,
    so both searches make the same exchanges. With a migration budget and up to ``BRUTE_FORCE_SLOTS`` slots
    every ``(x, y)`` is scored instead (the budget may refuse the nearest ``y`` and allow another).

    ``rb`` holds this row's bin loads, order and versions (set up by :func:`_start_row`) and ``sb``
    its slot order ``srt [G, S]`` (:func:`_sort_slots`), kept from block to block.

    Returns:
        ``(moved, stamp)``: whether something moved, and the last bin version used.
    """
    heavy, light, bin_load, order, ver, seen_h, seen_l = rb
    held, va, no_x, no_y, ya, srt = sb
    num_bins = bin_load.size
    half = num_bins // 2
    # the sweep needs no budget check per (x, y): with a migration budget every pair is scored
    brute = budget >= 0 and slots <= BRUTE_FORCE_SLOTS
    moved = False

    def change(a: int, b: int) -> int:
        # change in the number of slots that differ from ``origin`` if slots a and b swap
        before = (fe[a] != origin[a]) + (fe[b] != origin[b])
        return (fe[b] != origin[a]) + (fe[a] != origin[b]) - before

    used = 0
    if budget >= 0:
        for p in range(num_bins * slots):
            used += fe[p] != origin[p]
    if not brute:
        # ``held`` is all zeros between calls (each call clears the entries it set)
        for p in range(num_bins * slots):
            held[p // slots, fe[p]] += 1
    for it in range(it0, it0 + rounds):
        _pair_bins(bin_load, order, it, heavy, light)
        for k in range(half):
            h, lt = heavy[k], light[k]
            if seen_h[h, lt] == ver[h] and seen_l[h, lt] == ver[lt]:
                continue  # declined before and neither bin changed since
            seen_h[h, lt] = ver[h]
            seen_l[h, lt] = ver[lt]
            gap = bin_load[h] - bin_load[lt]
            ha, lb0 = h * slots, lt * slots
            # an exchange gains only if its loads differ by 0 < d < gap (otherwise min(d, gap - d)
            # <= 0): most declining pairs have none, and on up to BRUTE_FORCE_SLOTS slots counting
            # them (branch-free) is cheaper than the search
            if slots <= BRUTE_FORCE_SLOTS and _gaining_exchanges(fl, ha, lb0, slots, gap) == 0:
                continue
            best = -_INF
            pa, pb = ha, lb0
            if brute:
                # x (y) may not move when fixed or when its expert is already on the other bin
                for x in range(slots):
                    no_x[x] = has_fixed and ff[ha + x]
                    no_y[x] = has_fixed and ff[lb0 + x]
                for x in range(slots):
                    ex = fe[ha + x]
                    for y in range(slots):
                        if fe[lb0 + y] == ex:
                            no_x[x] = True
                            no_y[y] = True
                for x in range(slots):
                    if no_x[x]:
                        continue  # every (x, y) blocked: none can beat -inf
                    fx = fl[ha + x]
                    for y in range(slots):
                        delta = fx - fl[lb0 + y]
                        gain = min(delta, gap - delta)
                        if no_y[y] or (budget >= 0 and used + change(ha + x, lb0 + y) > budget):
                            gain = -_INF
                        if gain > best:
                            best = gain
                            pa, pb = ha + x, lb0 + y
            else:
                # allowed light items by increasing load (the bin's kept order, minus items whose
                # expert is on the heavy bin or that are fixed)
                na = 0
                for t in range(slots):
                    y = srt[lt, t]
                    if not (held[h, fe[lb0 + y]] > 0 or (has_fixed and ff[lb0 + y])):
                        ya[na] = y
                        va[na] = fl[lb0 + y]
                        na += 1
                # heavy items by increasing load: their targets x - gap / 2 increase, so one pointer
                # sweeps the light items once (the first allowed item at or above the target)
                p = 0
                for t in range(slots if na > 0 else 0):
                    x = srt[h, t]
                    fx = fl[ha + x]
                    if held[lt, fe[ha + x]] > 0 or (has_fixed and ff[ha + x]):
                        continue
                    q = fx - 0.5 * gap
                    while p < na and va[p] < q:
                        p += 1
                    lo = max(p - 1, 0)
                    hi = p if p < na else lo
                    while lo > 0 and va[lo - 1] == va[lo]:
                        lo -= 1  # equal loads gain equally: the first slot, as scoring all pairs does
                    d_lo = fx - va[lo]
                    d_hi = fx - va[hi]
                    g_lo = min(d_lo, gap - d_lo)
                    g_hi = min(d_hi, gap - d_hi)
                    if g_hi > g_lo or (g_hi == g_lo and ya[hi] < ya[lo]):
                        gain, y = g_hi, ya[hi]
                    else:
                        gain, y = g_lo, ya[lo]
                    if budget >= 0 and used + change(ha + x, lb0 + y) > budget:
                        continue
                    # the first best in slot order of the heavy bin
                    if gain > best or (gain == best and ha + x < pa):
                        best = gain
                        pa, pb = ha + x, lb0 + y
            if best > tol:
                moved = True
                if budget >= 0:
                    used += change(pa, pb)
                if not brute:
                    e_x, e_y = fe[pa], fe[pb]
                    held[h, e_x] -= 1
                    held[lt, e_y] -= 1
                    held[lt, e_x] += 1
                    held[h, e_y] += 1
                fl[pa], fl[pb] = fl[pb], fl[pa]
                fe[pa], fe[pb] = fe[pb], fe[pa]
                ff[pa], ff[pb] = ff[pb], ff[pa]
                if not brute:
                    # the changed slot of each bin moves to its place in the bin's order
                    for side in range(2):
                        g = h if side == 0 else lt
                        sl = pa - ha if side == 0 else pb - lb0
                        base = g * slots
                        v = fl[base + sl]
                        i = 0
                        while srt[g, i] != sl:
                            i += 1
                        while i > 0:
                            o = srt[g, i - 1]
                            if fl[base + o] > v or (fl[base + o] == v and o > sl):
                                srt[g, i] = o
                                i -= 1
                            else:
                                break
                        while i < slots - 1:
                            o = srt[g, i + 1]
                            if fl[base + o] < v or (fl[base + o] == v and o < sl):
                                srt[g, i] = o
                                i += 1
                            else:
                                break
                        srt[g, i] = sl
                bin_load[h] = _row_sum(fl, h * slots, slots)
                bin_load[lt] = _row_sum(fl, lt * slots, slots)
                ver[h] = stamp + 1
                ver[lt] = stamp + 2
                stamp += 2
    if not brute:
        for p in range(num_bins * slots):
            held[p // slots, fe[p]] = 0
    return moved, stamp


@_njit
def _resplit_rounds(
    fl: np.ndarray,
    fe: np.ndarray,
    ff: np.ndarray,
    has_fixed: bool | np.bool_,
    rounds: int,
    it0: int,
    slots: int,
    tables: tuple,
    rb: tuple,
    pb: tuple,
    stamp: int,
) -> tuple[bool, int]:
    """``rounds`` re-split rounds on one row (``fl``/``fe``/``ff``: ``[G * S]``, ``S <= 5``, in place).

    Every pair of bins (see :func:`_pair_bins`; on rows of more than ``MANY_BINS`` bins the heavier
    half of the pairs) is re-split; then the heaviest bin is re-split with the lightest bins in turn,
    up to ``PEAK_TRIES`` evaluations (``PEAK_TRIES_MANY`` on rows of more than ``MANY_BINS`` bins;
    after each success the new heaviest bin starts again from the lightest).

    A re-split of bins ``h`` (heavy) and ``lt`` (light) pools their ``2 S`` items (heavy bin first)
    and takes the split into two bins of ``S`` that minimises ``|heavy - light|`` (first such split in
    ``idx_heavy`` order; every split keeps item 0 on the heavy side), among the splits that leave
    fixed items in place and put no expert twice on one side; the split is made only if it lowers
    the pair's larger load. The sums of all splits are scored at once in float32 (``sum_k member[k,
    c] * x[k]``, sequential in item order, a loop the compiler vectorises; adding ``0 * x`` changes
    nothing); the float64 sum of the chosen split decides the move. A pair whose two bins did not
    change since it last declined is skipped (the outcome depends only on their contents).

    The body is written out once inside the loop, with no helper taking arrays: Numba increments and
    decrements the reference count of every array handed to a helper on each call, which cost more
    than the re-split itself.

    Args:
        tables: ``(idx_heavy [C, S], idx_light [C, S], member [2S, C] bool, member_f [2S, C8] float32)``
            (``member_f``: ``member`` with zero columns up to a multiple of 8).

    Returns:
        ``(moved, stamp)``: whether something moved, and the last bin version used.
    """
    heavy, light, bin_load, order, ver, seen_h, seen_l = rb
    idx_heavy, idx_light, member, member_f = tables
    items, items32, sums, valid, _, ids, fix, pos, tmp_l, tmp_e, tmp_f, clash_a, clash_b = pb
    num_bins = bin_load.size
    half = num_bins // 2
    num_pairs = (half + 1) // 2 if num_bins > MANY_BINS else half
    peak_tries = PEAK_TRIES_MANY if num_bins > MANY_BINS else PEAK_TRIES
    num_splits = idx_heavy.shape[0]
    # member_f has zero columns up to a multiple of 8 splits: the sums run in whole vectors
    num_padded = member_f.shape[1]
    two = 2 * slots
    two_f = np.float32(2.0)
    moved = False
    for it in range(it0, it0 + rounds):
        _pair_bins(bin_load, order, it, heavy, light)
        k = 0  # next pair of the round
        peak_phase = False
        j = 0  # next light partner of the heaviest bin
        tries = 0
        hp = 0  # the heaviest bin (changes only when a re-split moves something)
        while True:
            if not peak_phase:
                if k == num_pairs:
                    peak_phase = True
                    for g in range(1, num_bins):
                        if bin_load[g] > bin_load[hp]:
                            hp = g
                    continue
                h, lt = heavy[k], light[k]
                k += 1
            else:
                if j >= half or tries >= peak_tries:
                    break
                h, lt = hp, order[num_bins - 1 - j]
                j += 1
                if lt == h:
                    continue
            if seen_h[h, lt] == ver[h] and seen_l[h, lt] == ver[lt]:
                continue  # declined before and neither bin changed since
            seen_h[h, lt] = ver[h]
            seen_l[h, lt] = ver[lt]
            if peak_phase:
                tries += 1
            # ---- re-split of (h, lt)
            # A split lowers the pair's peak only if it exchanges k <= S / 2 items of each bin (more
            # is the complement of fewer) whose loads differ by d in (0, gap), with margins far above
            # rounding (the move needs both sides under ``load_h * (1 - 1e-12)``). Most pairs have
            # no such exchange: counting them (branch-free) is exact and costs a fraction of scoring
            # every split.
            gap = bin_load[h] - bin_load[lt]
            ha, lb0 = h * slots, lt * slots
            hits = 0
            if slots == 4 or slots == 5:
                # the same counts over tuples of constant length (unrolled by the compiler)
                x0, x1, x2, x3 = fl[ha], fl[ha + 1], fl[ha + 2], fl[ha + 3]
                y0, y1, y2, y3 = fl[lb0], fl[lb0 + 1], fl[lb0 + 2], fl[lb0 + 3]
                x4 = fl[ha + 4] if slots == 5 else x3
                y4 = fl[lb0 + 4] if slots == 5 else y3
                for xa in (x0, x1, x2, x3):
                    for yb in (y0, y1, y2, y3):
                        d = xa - yb
                        hits += (d > 0.0) & (d < gap)
                if slots == 5:
                    for xa in (x0, x1, x2, x3, x4):
                        d = xa - y4
                        hits += (d > 0.0) & (d < gap)
                    for yb in (y0, y1, y2, y3):
                        d = x4 - yb
                        hits += (d > 0.0) & (d < gap)
                if hits == 0 and slots == 4:
                    xs = (x0 + x1, x0 + x2, x0 + x3, x1 + x2, x1 + x3, x2 + x3)
                    for ys in (y0 + y1, y0 + y2, y0 + y3, y1 + y2, y1 + y3, y2 + y3):
                        for xa in xs:
                            d = xa - ys
                            hits += (d > 0.0) & (d < gap)
                    if hits == 0:
                        continue
                if hits == 0 and slots == 5:
                    xs5 = (
                        x0 + x1,
                        x0 + x2,
                        x0 + x3,
                        x0 + x4,
                        x1 + x2,
                        x1 + x3,
                        x1 + x4,
                        x2 + x3,
                        x2 + x4,
                        x3 + x4,
                    )
                    for ys in (
                        y0 + y1,
                        y0 + y2,
                        y0 + y3,
                        y0 + y4,
                        y1 + y2,
                        y1 + y3,
                        y1 + y4,
                        y2 + y3,
                        y2 + y4,
                        y3 + y4,
                    ):
                        for xa in xs5:
                            d = xa - ys
                            hits += (d > 0.0) & (d < gap)
                    if hits == 0:
                        continue
            else:
                hits = _gaining_exchanges(fl, ha, lb0, slots, gap)
            if hits == 0 and slots >= 6:
                for a in range(slots):
                    for a2 in range(a + 1, slots):
                        xa = fl[ha + a] + fl[ha + a2]
                        for b in range(slots):
                            for b2 in range(b + 1, slots):
                                d = xa - (fl[lb0 + b] + fl[lb0 + b2])
                                hits += (d > 0.0) & (d < gap)
            if hits == 0:
                continue
            any_fixed = False
            for s in range(slots):
                pos[s] = ha + s
                pos[slots + s] = lb0 + s
            for i in range(two):
                items[i] = fl[pos[i]]
                items32[i] = np.float32(items[i])
                fix[i] = has_fixed and ff[pos[i]]
                # fixed items may share a GPU with their own replicas already: never a clash
                ids[i] = -1 - i if fix[i] else fe[pos[i]]
                any_fixed = any_fixed or fix[i]
            n_clash = 0
            for a in range(two):
                for b in range(a + 1, two):
                    if ids[a] == ids[b]:
                        clash_a[n_clash] = a
                        clash_b[n_clash] = b
                        n_clash += 1
            total = bin_load[h] + bin_load[lt]
            total32 = np.float32(total)
            for c in range(num_padded):
                sums[c] = np.float32(0.0)
            for i in range(two):
                xi = items32[i]
                for c in range(num_padded):
                    sums[c] += member_f[i, c] * xi
            choice = -1
            if not any_fixed and n_clash == 0:
                best = abs(two_f * sums[0] - total32)
                choice = 0
                for c in range(1, num_splits):
                    score = abs(two_f * sums[c] - total32)
                    if score < best:
                        best = score
                        choice = c
            else:
                # the first best among the splits that keep fixed items on their side and
                # separate clashing items
                for c in range(num_splits):
                    valid[c] = True
                if any_fixed:
                    for i in range(two):
                        if fix[i]:
                            side = i < slots
                            for c in range(num_splits):
                                valid[c] = valid[c] and member[i, c] == side
                for q in range(n_clash):
                    a, b = clash_a[q], clash_b[q]
                    for c in range(num_splits):
                        valid[c] = valid[c] and member[a, c] != member[b, c]
                best = np.float32(_INF)
                for c in range(num_splits):
                    if valid[c]:
                        score = abs(two_f * sums[c] - total32)
                        if choice < 0 or score < best:
                            best = score
                            choice = c
            if choice < 0:
                continue
            best_sum = 0.0
            for s in range(slots):
                best_sum += items[idx_heavy[choice, s]]
            if not max(best_sum, total - best_sum) < bin_load[h] * (1 - 1e-12):
                continue
            for s in range(slots):
                tmp_l[s] = items[idx_heavy[choice, s]]
                tmp_l[slots + s] = items[idx_light[choice, s]]
                src_h = pos[idx_heavy[choice, s]]
                src_l = pos[idx_light[choice, s]]
                tmp_e[s] = fe[src_h]
                tmp_e[slots + s] = fe[src_l]
                tmp_f[s] = ff[src_h]
                tmp_f[slots + s] = ff[src_l]
            for i in range(two):
                fl[pos[i]] = tmp_l[i]
                fe[pos[i]] = tmp_e[i]
                ff[pos[i]] = tmp_f[i]
            # new loads (sequential sums: what _row_sum does below 8 items) and versions
            load_h = 0.0
            load_l = 0.0
            for s in range(slots):
                load_h += fl[h * slots + s]
                load_l += fl[lt * slots + s]
            bin_load[h] = load_h
            bin_load[lt] = load_l
            ver[h] = stamp + 1
            ver[lt] = stamp + 2
            stamp += 2
            moved = True
            if peak_phase:
                j = 0
                hp = 0
                for g in range(1, num_bins):
                    if bin_load[g] > bin_load[hp]:
                        hp = g
    return moved, stamp


# ---------------------------------------------------------------------------- refinement driver
@_njit
def _workspace(num_bins: int, slots: int, num_ids: int, num_splits: int, num_rows: int) -> tuple:
    """Work arrays of the refinement, allocated once per plan: ``(rb, sb, pb, state)``
    (``num_splits``: the padded split count of the re-split tables)."""
    rb = _row_buffers(num_bins, num_rows)
    held = np.zeros((num_bins, num_ids), dtype=np.int64)
    sb = (
        held,
        np.empty(slots),
        np.empty(slots, dtype=np.bool_),
        np.empty(slots, dtype=np.bool_),
        np.empty(slots, dtype=np.int64),
        np.empty((num_rows, num_bins, slots), dtype=np.int64),
    )
    two = 2 * slots
    pb = (
        np.empty(two),
        np.empty(two, dtype=np.float32),
        np.empty(num_splits, dtype=np.float32),
        np.empty(num_splits, dtype=np.bool_),
        np.empty(slots, dtype=np.int64),
        np.empty(two, dtype=np.int64),
        np.empty(two, dtype=np.bool_),
        np.empty(two, dtype=np.int64),
        np.empty(two),
        np.empty(two, dtype=np.int64),
        np.empty(two, dtype=np.bool_),
        np.empty(two * two, dtype=np.int64),
        np.empty(two * two, dtype=np.int64),
    )
    # per row: alive, active, ready; total, tol, peak, excess, row_lb; per bin: loads; per candidate: peaks
    flags = np.empty((3, num_rows), dtype=np.bool_)
    stats = np.empty((5, num_rows))
    bin_tmp = np.empty(num_bins)
    cand_peak = np.empty(num_rows)
    return rb, sb, pb, (flags, stats, bin_tmp, cand_peak)


@_njit
def _row_stats(fl: np.ndarray, num_bins: int, slots: int, mean: float, bin_tmp: np.ndarray) -> tuple:
    """``(peak, excess, heaviest item)`` of a row: heaviest bin, load above the mean, largest item."""
    peak = -_INF
    for g in range(num_bins):
        bl = _row_sum(fl, g * slots, slots)
        peak = max(peak, bl)
        bin_tmp[g] = max(bl - mean, 0.0)
    top = -_INF
    for p in range(num_bins * slots):
        top = max(top, fl[p])
    return peak, _pairwise_sum(bin_tmp, np.int64(0), num_bins), top


@_njit
def _refine(
    load: np.ndarray,
    expert: np.ndarray,
    fixed: np.ndarray,
    has_fixed: bool | np.bool_,
    num_rows: int,
    rows_per_group: int,
    num_candidates: int,
    iters: int,
    tables: tuple,
    ws: tuple,
    stamp: int,
    origin: np.ndarray,
    budgets: np.ndarray,
) -> int:
    """Pairwise refinement of the first ``num_rows`` rows of ``load``/``expert``/``fixed`` ``[B, G, S]``
    (one layer: ``num_candidates`` stacked plans of ``rows_per_group`` rows each), in place; never
    raises a row's heaviest bin.

    Each round sorts the bins of a row by load and pairs the k-th heaviest with a light partner (the
    pairing rotates from round to round). With at most ``MAX_RESPLIT_SLOTS`` slots per GPU, each
    pair's ``2 S`` items are re-split optimally into two bins of ``S`` (:func:`_resplit_rounds`); with
    more slots, the single exchange that best evens the pair is made (:func:`_swap_rounds`).

    Rows leave after a block of ``BLOCK`` rounds once their peak is at their own lower bound
    (``max(total / G, heaviest item)``) or at the best bound of another row of their plan, or once a
    block no longer shrinks their load above the mean; a candidate whose peak trails the best
    candidate by more than ``PRUNE_MARGIN`` stops. Returns the last bin version used.
    """
    _, num_bins, slots = load.shape
    if num_bins < 2 or iters <= 0:
        return stamp
    rb, sb, pb, state = ws
    flags, stats, bin_tmp, cand_peak = state
    alive, active, ready = flags[0], flags[1], flags[2]
    total, tol, peak, excess, row_lb = stats[0], stats[1], stats[2], stats[3], stats[4]
    # a migration budget (``budgets[r] >= 0``, slots that may differ from ``origin [B, G, S]``) is
    # kept by the exchange rounds only
    use_budget = budgets.size > 0
    resplit = slots <= MAX_RESPLIT_SLOTS and not use_budget
    width = num_bins * slots
    load_flat = load.reshape(-1)
    expert_flat = expert.reshape(-1)
    fixed_flat = fixed.reshape(-1)
    origin_flat = origin.reshape(-1)
    for r in range(num_rows):
        alive[r] = True
        total[r] = _pairwise_sum(load[r].reshape(-1), np.int64(0), width)
        tol[r] = (REL_TOL / num_bins) * total[r]
        # a row's stats change only when it is refined: they are updated after each of its blocks
        # (its heaviest item, hence its bound, never changes: items only move between its bins)
        mean = total[r] / num_bins
        pk, ex, top = _row_stats(load[r].reshape(-1), num_bins, slots, mean, bin_tmp)
        peak[r] = pk
        excess[r] = ex
        row_lb[r] = max(mean, top)
        ready[r] = False
    it = np.int64(0)
    while it < iters:
        any_active = False
        for c in range(num_candidates):
            cand_peak[c] = -_INF
            for q in range(rows_per_group):
                cand_peak[c] = max(cand_peak[c], peak[c * rows_per_group + q])
        best_cand = cand_peak[0]
        for c in range(1, num_candidates):
            best_cand = min(best_cand, cand_peak[c])
        for c in range(num_candidates):
            floor = -_INF
            for q in range(rows_per_group):
                floor = max(floor, row_lb[c * rows_per_group + q])
            keep = num_candidates == 1 or it == 0 or cand_peak[c] <= best_cand * (1 + PRUNE_MARGIN)
            for q in range(rows_per_group):
                r = c * rows_per_group + q
                active[r] = (
                    keep
                    and alive[r]
                    and peak[r] > floor * (1 + CLOSE_ENOUGH)
                    and peak[r] > row_lb[r] * (1 + CLOSE_ENOUGH)
                )
                any_active = any_active or active[r]
        if not any_active:
            break
        rounds = min(BLOCK, iters - it)
        for r in range(num_rows):
            if not active[r]:
                continue
            # rows as slices of the flat arrays (a slice is cheaper than a reshape of each row)
            fl = load_flat[r * width : (r + 1) * width]
            fe = expert_flat[r * width : (r + 1) * width]
            ff = fixed_flat[r * width : (r + 1) * width]
            rb_r, sb_r = _row_state(rb, sb, r)
            if not ready[r]:
                # a row's bin loads, order, versions and slot order, set up at its first block
                ready[r] = True
                stamp = _start_row(fl, slots, rb_r[2], rb_r[3], rb_r[4], stamp)
                if not resplit:
                    _sort_slots(fl, num_bins, slots, sb_r[5])
            elif resplit or use_budget:
                # fresh versions: the re-split's peak step counts the pairs it tries, which a skip
                # of pairs declined in an earlier block would change; with a budget, the budget left
                # can let a pair through that declined in an earlier block
                for g in range(num_bins):
                    rb[4][r, g] = stamp + 1 + g
                stamp += num_bins
            if resplit:
                moved, stamp = _resplit_rounds(
                    fl, fe, ff, has_fixed, rounds, it, slots, tables, rb_r, pb, stamp
                )
            else:
                budget = budgets[r] if use_budget else -1
                fo = origin_flat[r * width : (r + 1) * width]
                moved, stamp = _swap_rounds(
                    fl, fe, ff, has_fixed, tol[r], rounds, it, slots, rb_r, sb_r, stamp, fo, budget
                )
            pk, after, _ = _row_stats(fl, num_bins, slots, total[r] / num_bins, bin_tmp)
            alive[r] = moved and (excess[r] - after > MIN_BLOCK_GAIN * total[r])
            peak[r] = pk
            excess[r] = after
        it += rounds
    return stamp


@_njit
def _peak(load: np.ndarray, first: int, num_rows: int) -> float:
    """Heaviest bin of rows ``first .. first + num_rows - 1`` of ``load [B, G, S]``."""
    _, num_bins, slots = load.shape
    out = -_INF
    for r in range(first, first + num_rows):
        fl = load[r].reshape(-1)
        for g in range(num_bins):
            out = max(out, _row_sum(fl, g * slots, slots))
    return out


@_njit
def _in_bin(fe: np.ndarray, b: int, slots: int, e: int, skip: int) -> bool:
    """Whether bin ``b`` holds expert ``e`` at a slot other than ``skip``."""
    for t in range(slots):  # noqa: SIM110 (a generator is not compiled as tightly)
        if t != skip and fe[b * slots + t] == e:
            return True
    return False


@_njit
def _repair_row(
    fl: np.ndarray, fe: np.ndarray, ff: np.ndarray, num_bins: int, slots: int, fo: np.ndarray, budget: int
) -> None:
    """Undo avoidable repeats of an expert on one GPU (LPT can leave them on ties, e.g. a node whose
    experts all have zero load): swap the repeated item with an item of a GPU that lacks its expert,
    the nearest load first, when that puts no other expert twice on a GPU (experts with more replicas
    than GPUs may repeat) and no bin above the row's peak; when every such swap would raise the peak,
    the one that raises it least (a repeat that can be undone is never kept: ``Placement.validate``
    rejects it). With ``budget >= 0`` (migration) only swaps that leave at most ``budget`` slots
    different from ``fo`` (the plan in service) are taken."""
    repeats = False  # most rows have none: find out without a call per item
    for b in range(num_bins):
        for s in range(slots):
            i = b * slots + s
            for t in range(s + 1, slots):
                j = b * slots + t
                repeats = repeats or (fe[i] == fe[j] and not (ff[i] and ff[j]))
    if not repeats:
        return
    changed = 0
    if budget >= 0:
        for p in range(fe.size):
            changed += fe[p] != fo[p]
    peak = -_INF
    for g in range(num_bins):
        peak = max(peak, _row_sum(fl, g * slots, slots))
    for b in range(num_bins):
        for s in range(slots):
            i = b * slots + s
            if ff[i] or not _in_bin(fe, b, slots, fe[i], s):
                continue
            load_b = _row_sum(fl, b * slots, slots)
            best_j = -1
            best_d = _INF
            over_j = -1  # the legal swap that raises the peak least, if none keeps it
            over_peak = _INF
            for b2 in range(num_bins):
                if b2 == b or _in_bin(fe, b2, slots, fe[i], -1):
                    continue
                load_b2 = _row_sum(fl, b2 * slots, slots)
                for t in range(slots):
                    j = b2 * slots + t
                    # an expert with more replicas than GPUs (fixed) may repeat; others may not
                    if not ff[j] and (_in_bin(fe, b, slots, fe[j], -1) or _in_bin(fe, b2, slots, fe[j], t)):
                        continue
                    if budget >= 0:
                        after = (fe[j] != fo[i]) + (fe[i] != fo[j]) - (fe[i] != fo[i]) - (fe[j] != fo[j])
                        if changed + after > budget:
                            continue
                    d = fl[j] - fl[i]
                    new_peak = max(load_b + d, load_b2 - d)
                    if new_peak <= peak and abs(d) < best_d:
                        best_d = abs(d)
                        best_j = j
                    elif new_peak < over_peak:
                        over_peak = new_peak
                        over_j = j
            if best_j < 0 and over_j >= 0:
                best_j = over_j
                peak = over_peak
            if best_j >= 0:
                if budget >= 0:
                    j = best_j
                    changed += (fe[j] != fo[i]) + (fe[i] != fo[j]) - (fe[i] != fo[i]) - (fe[j] != fo[j])
                fl[i], fl[best_j] = fl[best_j], fl[i]
                fe[i], fe[best_j] = fe[best_j], fe[i]
                ff[i], ff[best_j] = ff[best_j], ff[i]


@_njit
def _write_sorted(expert: np.ndarray, first: int, num_rows: int, out: np.ndarray) -> None:
    """Rows ``first ..`` of ``expert [B, G, S]`` into ``out [num_rows * G * S]``, ids ascending per bin."""
    _, num_bins, slots = expert.shape
    p = 0
    for r in range(first, first + num_rows):
        for g in range(num_bins):
            start = p
            for s in range(slots):
                v = expert[r, g, s]
                j = p
                while j > start and out[j - 1] > v:
                    out[j] = out[j - 1]
                    j -= 1
                out[j] = v
                p += 1


@_njit
def _expand_row(
    w: np.ndarray,
    counts: np.ndarray,
    ids: np.ndarray,
    item_load: np.ndarray,
    item_local: np.ndarray,
    item_expert: np.ndarray,
    item_count: np.ndarray,
) -> None:
    """Per-replica ``(load, local index, expert id, count)``, expert-major."""
    p = 0
    for j in range(w.size):
        c = counts[j]
        share = w[j] / c
        for _ in range(c):
            item_load[p] = share
            item_local[p] = j
            item_expert[p] = ids[j]
            item_count[p] = c
            p += 1


@_njit
def _node_rows(
    weight: np.ndarray, node: np.ndarray, group_size: int, ids: np.ndarray, w_rows: np.ndarray
) -> None:
    """Experts node-major, ascending id inside a node: ``ids``/``w_rows`` ``[nodes, N / nodes]``."""
    for n in range(ids.shape[0]):
        j = 0
        for grp in range(node.size):
            if node[grp] == n:
                for k in range(group_size):
                    e = grp * group_size + k
                    ids[n, j] = e
                    w_rows[n, j] = weight[e]
                    j += 1


@_njit
def _node_max(group_load: np.ndarray, node: np.ndarray, sums: np.ndarray) -> float:
    """Heaviest node of a group-to-node assignment (groups added in id order)."""
    sums[:] = 0.0
    for grp in range(node.size):
        sums[node[grp]] += group_load[grp]
    return sums.max()


# ---------------------------------------------------------------------------- planners
@_njit
def solve_layers(
    weight: np.ndarray,
    group_load: np.ndarray,
    ours_nodes: np.ndarray,
    num_replicas: int,
    num_nodes: int,
    num_gpus: int,
    iters: int,
    tables: tuple,
) -> tuple[np.ndarray, np.ndarray]:
    """Strict (``num_nodes > 1``) or global (one node, one group) plan of every layer.

    Per layer:

    1. Groups go to nodes by ``ours_nodes`` (the optimal equal split), or by the greedy LPT split when
       that is optimal too; each node's experts get slot-aware replica counts
       (:func:`_slot_aware_row`), and the replicas are packed onto the node's GPUs by LPT, replicas of
       an expert on distinct GPUs (with 6-16 slots per GPU, a round-robin start too).
    2. :func:`_refine` improves every node row of every start; the start with the lowest peak is kept.
    3. Where the greedy DeepSeek-style plan (groups by LPT, greedy replica split, LPT onto GPUs,
       duplicate-avoiding: exactly ``_greedy.greedy_rebalance(..., avoid_duplicates=True)``) differs
       from the start of step 1, it is packed too; where it beats the refined plan, it is refined and
       kept. Where it does not differ, it *is* the start. The refinement never raises a row's peak,
       so no layer ends worse than that greedy plan.

    Args:
        weight: ``[L, N]`` float64, rows not all zero.
        group_load: ``[L, g]`` float64 group sums.
        ours_nodes: ``[L, g]`` int64 node of every group (optimal split).
        tables: split tables of :func:`_resplit_rounds` for ``S`` slots per GPU.

    Returns:
        ``(phy2log [L, R], logcnt [L, N])`` int64, GPU-major slots, ascending ids inside a GPU.
    """
    num_layers, num_experts = weight.shape
    num_groups = group_load.shape[1]
    group_size = num_experts // num_groups
    per_node = num_experts // num_nodes
    reps = num_replicas // num_nodes
    num_bins = num_gpus // num_nodes
    slots = num_replicas // num_gpus
    num_cand = 2 if MAX_RESPLIT_SLOTS < slots <= RR_MAX_SLOTS else 1
    phy2log = np.empty((num_layers, num_replicas), dtype=np.int64)
    logcnt = np.empty((num_layers, num_experts), dtype=np.int64)
    # node rows of our split [0] and of the greedy split [1]
    ids = np.empty((2, num_nodes, per_node), dtype=np.int64)
    w_rows = np.empty((2, num_nodes, per_node))
    cnt = np.empty((2, num_nodes, per_node), dtype=np.int64)
    load = np.empty((num_cand * num_nodes, num_bins, slots))
    expert = np.empty((num_cand * num_nodes, num_bins, slots), dtype=np.int64)
    fixed = np.empty((num_cand * num_nodes, num_bins, slots), dtype=np.bool_)
    load_g = np.empty((num_nodes, num_bins, slots))
    expert_g = np.empty((num_nodes, num_bins, slots), dtype=np.int64)
    fixed_g = np.empty((num_nodes, num_bins, slots), dtype=np.bool_)
    item_load = np.empty(reps)
    item_local = np.empty(reps, dtype=np.int64)
    item_expert = np.empty(reps, dtype=np.int64)
    item_count = np.empty(reps, dtype=np.int64)
    bins = np.empty(reps, dtype=np.int64)
    key = np.empty(num_bins)
    fill = np.empty(num_bins, dtype=np.int64)
    tag = np.empty(num_bins, dtype=np.int64)
    per = np.empty(per_node)
    small = np.empty(max(slots, 1))
    node_g = np.zeros(num_groups, dtype=np.int64)
    node_key = np.empty(num_nodes)
    node_fill = np.empty(num_nodes, dtype=np.int64)
    node_tag = np.empty(num_nodes, dtype=np.int64)
    node_sum = np.empty(num_nodes)
    ws = _workspace(num_bins, slots, num_experts, tables[3].shape[1], num_cand * num_nodes)
    stamp = np.int64(0)
    no_budget = np.empty(0, dtype=np.int64)
    for layer in range(num_layers):
        gl = group_load[layer]
        node_use = ours_nodes[layer]
        if num_nodes > 1:
            _lpt_row(gl, node_g, np.bool_(False), num_nodes, node_g, node_key, node_fill, node_tag)
            # where the greedy split is optimal too (ties), take it: the greedy plan is then our start
            if _node_max(gl, node_g, node_sum) <= _node_max(gl, node_use, node_sum):
                node_use = node_g
        same_split = True
        for grp in range(num_groups):
            same_split = same_split and node_use[grp] == node_g[grp]
        _node_rows(weight[layer], node_use, group_size, ids[0], w_rows[0])
        if same_split:
            ids[1] = ids[0]
            w_rows[1] = w_rows[0]
        else:
            _node_rows(weight[layer], node_g, group_size, ids[1], w_rows[1])
        same = same_split
        for n in range(num_nodes):
            raised = _slot_aware_row(w_rows[0, n], reps, num_bins, cnt[0, n], per, small)
            if same_split and (not raised or _is_greedy_split(w_rows[0, n], cnt[0, n])):
                # the greedy split of the same experts
                cnt[1, n] = cnt[0, n]
                continue
            cnt[1, n] = 1
            _greedy_counts_row(w_rows[1, n], cnt[1, n], reps, per)
            for j in range(per_node):
                same = same and cnt[0, n, j] == cnt[1, n, j]
        any_fixed = np.bool_(False)
        for n in range(num_nodes):
            _expand_row(w_rows[0, n], cnt[0, n], ids[0, n], item_load, item_local, item_expert, item_count)
            order = _lpt_row(item_load, item_local, np.bool_(True), num_bins, bins, key, fill, tag)
            any_fixed |= _layout_row(
                bins, item_load, item_expert, item_count, num_bins, load[n], expert[n], fixed[n], fill
            )
            if num_cand == 2:
                for p in range(reps):
                    bins[order[p]] = p % num_bins
                r = num_nodes + n
                _layout_row(
                    bins, item_load, item_expert, item_count, num_bins, load[r], expert[r], fixed[r], fill
                )
        stamp = _refine(
            load,
            expert,
            fixed,
            any_fixed,
            num_cand * num_nodes,
            num_nodes,
            num_cand,
            iters,
            tables,
            ws,
            stamp,
            expert,
            no_budget,
        )
        best = _INF
        pick = 0
        for c in range(num_cand):
            pk = _peak(load, c * num_nodes, num_nodes)
            if pk < best:
                best = pk
                pick = c
        for r in range(pick * num_nodes, (pick + 1) * num_nodes):
            _repair_row(
                load[r].reshape(-1),
                expert[r].reshape(-1),
                fixed[r].reshape(-1),
                num_bins,
                slots,
                no_budget,
                -1,
            )
        _write_sorted(expert, pick * num_nodes, num_nodes, phy2log[layer])
        for n in range(num_nodes):
            for j in range(per_node):
                logcnt[layer, ids[0, n, j]] = cnt[0, n, j]
        if same:
            continue
        any_fixed = np.bool_(False)
        for n in range(num_nodes):
            _expand_row(w_rows[1, n], cnt[1, n], ids[1, n], item_load, item_local, item_expert, item_count)
            _lpt_row(item_load, item_local, np.bool_(True), num_bins, bins, key, fill, tag)
            any_fixed |= _layout_row(
                bins, item_load, item_expert, item_count, num_bins, load_g[n], expert_g[n], fixed_g[n], fill
            )
        if (
            _peak(load_g, np.int64(0), num_nodes) < best
        ):  # the greedy plan is better here: refine it and keep it
            stamp = _refine(
                load_g,
                expert_g,
                fixed_g,
                any_fixed,
                num_nodes,
                num_nodes,
                np.int64(1),
                iters,
                tables,
                ws,
                stamp,
                expert_g,
                no_budget,
            )
            for r in range(num_nodes):
                _repair_row(
                    load_g[r].reshape(-1),
                    expert_g[r].reshape(-1),
                    fixed_g[r].reshape(-1),
                    num_bins,
                    slots,
                    no_budget,
                    -1,
                )
            _write_sorted(expert_g, np.int64(0), num_nodes, phy2log[layer])
            for n in range(num_nodes):
                for j in range(per_node):
                    logcnt[layer, ids[1, n, j]] = cnt[1, n, j]
    return phy2log, logcnt


@_njit
def pack_layers(
    item_load: np.ndarray,
    item_expert: np.ndarray,
    num_bins: int,
    iters: int,
    rows_per_group: int,
    num_experts: int,
    tables: tuple,
) -> np.ndarray:
    """Pack each row's items onto ``num_bins`` GPUs of ``M / num_bins`` slots.

    Two starts are refined (:func:`_refine`, one layer of ``rows_per_group`` rows at a time), LPT and
    round robin (LPT keeps the replicas of an expert on distinct GPUs when it can), and each row keeps
    the one with the lower peak.

    Args:
        item_load: ``[B, M]`` float64.
        item_expert: ``[B, M]`` int64 expert ids in ``[0, num_experts)``.

    Returns:
        ``[B, num_bins, M / num_bins]`` expert ids, ascending inside a GPU.
    """
    num_rows, num_items = item_load.shape
    slots = num_items // num_bins
    num_cand = 2 if num_bins > 1 else 1
    out = np.empty((num_rows, num_bins, slots), dtype=np.int64)
    load = np.empty((num_cand * rows_per_group, num_bins, slots))
    expert = np.empty((num_cand * rows_per_group, num_bins, slots), dtype=np.int64)
    fixed = np.empty((num_cand * rows_per_group, num_bins, slots), dtype=np.bool_)
    rl = np.empty(num_items)
    re = np.empty(num_items, dtype=np.int64)
    rc = np.empty(num_items, dtype=np.int64)
    bins = np.empty(num_items, dtype=np.int64)
    key = np.empty(num_bins)
    fill = np.empty(num_bins, dtype=np.int64)
    tag = np.empty(num_bins, dtype=np.int64)
    per_expert = np.zeros(num_experts, dtype=np.int64)
    ws = _workspace(num_bins, slots, num_experts, tables[3].shape[1], num_cand * rows_per_group)
    stamp = np.int64(0)
    no_budget = np.empty(0, dtype=np.int64)
    for first in range(0, num_rows, rows_per_group):
        any_fixed = np.bool_(False)
        for q in range(rows_per_group):
            # expert-major items (the LPT start needs the replicas of an expert adjacent)
            by_expert = np.argsort(item_expert[first + q], kind="mergesort")
            for i in range(num_items):
                rl[i] = item_load[first + q, by_expert[i]]
                re[i] = item_expert[first + q, by_expert[i]]
                per_expert[re[i]] = 0
            for i in range(num_items):
                per_expert[re[i]] += 1
            for i in range(num_items):
                rc[i] = per_expert[re[i]]
            order = _lpt_row(rl, re, np.bool_(True), num_bins, bins, key, fill, tag)
            any_fixed |= _layout_row(bins, rl, re, rc, num_bins, load[q], expert[q], fixed[q], fill)
            if num_cand == 2:
                for p in range(num_items):
                    bins[order[p]] = p % num_bins
                r = rows_per_group + q
                _layout_row(bins, rl, re, rc, num_bins, load[r], expert[r], fixed[r], fill)
        stamp = _refine(
            load,
            expert,
            fixed,
            any_fixed,
            num_cand * rows_per_group,
            rows_per_group,
            num_cand,
            iters,
            tables,
            ws,
            stamp,
            expert,
            no_budget,
        )
        for q in range(rows_per_group):
            best = _INF
            pick = q
            for c in range(num_cand):
                pk = _peak(load, c * rows_per_group + q, np.int64(1))
                if pk < best:
                    best = pk
                    pick = c * rows_per_group + q
            _repair_row(
                load[pick].reshape(-1),
                expert[pick].reshape(-1),
                fixed[pick].reshape(-1),
                num_bins,
                slots,
                no_budget,
                -1,
            )
            _write_sorted(expert, pick, np.int64(1), out[first + q].reshape(-1))
    return out


@_njit
def soft_node_swaps(
    weight: np.ndarray,
    counts: np.ndarray,
    expert: np.ndarray,
    node: np.ndarray,
    home: np.ndarray,
    num_nodes: int,
    gpus_per_node: int,
    penalty: float,
    max_steps: int,
) -> None:
    """Even out the node loads of a soft-locality allocation by exchanging redundant replicas.

    Per layer, up to ``max_steps`` times: the heaviest node ``H`` trades one of its redundant replicas
    (slot ``>= N``: the first ``N`` slots are every expert's primary replica, which stays home) for a
    lighter redundant replica of another node ``L``, the exchange that lowers ``max(H, L)`` the most,
    if the drop exceeds ``penalty`` times the cross-node load it adds and no node then holds more
    replicas of an expert than it has GPUs.

    Args:
        weight: ``[L, N]`` float64 loads; counts: ``[L, N]`` int64 replica counts.
        expert, node: ``[L, R]`` int64 expert and node of every replica (``node`` updated in place).
        home: ``[L, N]`` int64 home node of every expert.
    """
    num_layers, num_replicas = expert.shape
    num_experts = weight.shape[1]
    load = np.empty(num_nodes)
    on_node = np.zeros((num_nodes, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        load[:] = 0.0
        on_node[:] = 0
        for p in range(num_replicas):
            e = expert[layer, p]
            load[node[layer, p]] += weight[layer, e] / counts[layer, e]
            on_node[node[layer, p], e] += 1
        for _ in range(max_steps):
            h = np.argmax(load)
            best = load[h]
            bi = -1
            bj = -1
            for i in range(num_experts, num_replicas):
                if node[layer, i] != h:
                    continue
                e = expert[layer, i]
                pe = weight[layer, e] / counts[layer, e]
                for j in range(num_experts, num_replicas):
                    lt = node[layer, j]
                    if lt == h:
                        continue
                    f = expert[layer, j]
                    pf = weight[layer, f] / counts[layer, f]
                    d = pe - pf
                    if d <= 0 or e == f:
                        continue
                    peak = max(load[h] - d, load[lt] + d)
                    if peak >= best:
                        continue
                    if on_node[lt, e] >= gpus_per_node or on_node[h, f] >= gpus_per_node:
                        continue
                    # cross-node load added by the exchange
                    cross = pe * ((home[layer, e] != lt) - (home[layer, e] != h))
                    cross += pf * ((home[layer, f] != h) - (home[layer, f] != lt))
                    if load[h] - peak <= penalty * max(cross, 0.0):
                        continue
                    best = peak
                    bi = i
                    bj = j
            if bi < 0:
                break
            lt = node[layer, bj]
            e = expert[layer, bi]
            f = expert[layer, bj]
            d = weight[layer, e] / counts[layer, e] - weight[layer, f] / counts[layer, f]
            load[h] -= d
            load[lt] += d
            on_node[h, e] -= 1
            on_node[lt, e] += 1
            on_node[lt, f] -= 1
            on_node[h, f] += 1
            node[layer, bi] = lt
            node[layer, bj] = h


@_njit
def soft_allocate(
    weight: np.ndarray, home: np.ndarray, num_replicas: int, num_nodes: int, num_gpus: int, penalty: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replica counts and nodes of the soft-locality mode, every layer.

    Every expert keeps its first replica on its home node. The ``R - N`` redundant replicas are handed
    out one at a time: each step either splits the expert with the heaviest replica (what GPU packing
    needs, option a) or the expert whose split takes the most load off the heaviest node (option b),
    whichever gives the lower estimate of the final peak ``max(heaviest node / GPUs per node,
    heaviest replica + the S - 1 lightest loads)``; the new replica goes to the node with a free slot
    where ``(load + replica) * (1 + W [not home])`` is lowest (option a weighs leaving home with
    ``max(W, 1)``: a split for packing stays home when it can). Experts that would need a second
    replica on a GPU of a node are skipped while others can still take one.

    Args:
        weight: ``[L, N]`` float64; home: ``[L, N]`` int64 home node of every expert.

    Returns:
        ``(expert [L, R], node [L, R], counts [L, N])`` int64: the first ``N`` replicas are the
        primaries (expert ``e`` at slot ``e``), then the redundant ones in the order they were made.
    """
    num_layers, num_experts = weight.shape
    per_node_cap = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots = num_replicas // num_gpus
    expert = np.empty((num_layers, num_replicas), dtype=np.int64)
    node = np.empty((num_layers, num_replicas), dtype=np.int64)
    counts = np.empty((num_layers, num_experts), dtype=np.int64)
    on_node = np.empty((num_experts, num_nodes), dtype=np.int64)
    free = np.empty(num_nodes, dtype=np.int64)
    node_load = np.empty(num_nodes)
    load_after = np.empty(num_nodes)
    per = np.empty(num_experts)
    feasible = np.empty(num_experts, dtype=np.bool_)
    pick_e = np.empty(2, dtype=np.int64)
    pick_n = np.empty(2, dtype=np.int64)
    score = np.empty(2)
    for layer in range(num_layers):
        w = weight[layer]
        c = counts[layer]
        c[:] = 1
        on_node[:] = 0
        free[:] = per_node_cap
        for e in range(num_experts):
            on_node[e, home[layer, e]] = 1
            free[home[layer, e]] -= 1
            expert[layer, e] = e
            node[layer, e] = home[layer, e]
        filler = np.sort(w)[: slots - 1].sum()
        for step in range(num_experts, num_replicas):
            node_load[:] = 0.0
            for e in range(num_experts):
                per[e] = w[e] / c[e]
                for n in range(num_nodes):
                    node_load[n] += on_node[e, n] * per[e]
            heavy = np.argmax(node_load)
            any_feasible = False
            for e in range(num_experts):
                feasible[e] = False
                for n in range(num_nodes):
                    if free[n] > 0 and on_node[e, n] < gpus_per_node:
                        feasible[e] = True
                any_feasible = any_feasible or feasible[e]
            if not any_feasible:  # a repeat on some GPU is unavoidable
                feasible[:] = True
            # option a: the heaviest replica; option b: the most load off the heaviest node
            e_a, e_b = -1, -1
            best_a, best_b = -_INF, -_INF
            any_heavy = False
            for e in range(num_experts):
                any_heavy = any_heavy or (feasible[e] and on_node[e, heavy] > 0)
            for e in range(num_experts):
                if not feasible[e]:
                    continue
                if per[e] > best_a:
                    best_a, e_a = per[e], e
                if on_node[e, heavy] > 0 or not any_heavy:
                    shed = on_node[e, heavy] * (per[e] - w[e] / (c[e] + 1))
                    if shed > best_b:
                        best_b, e_b = shed, e
            pick_e[0], pick_e[1] = e_a, e_b
            for which in range(2):
                e = pick_e[which]
                new_per = w[e] / (c[e] + 1)
                any_open = False
                for n in range(num_nodes):
                    load_after[n] = node_load[n] - on_node[e, n] * (per[e] - new_per)
                    crowded = on_node[e, n] >= gpus_per_node and c[e] + 1 <= num_gpus
                    any_open = any_open or (free[n] > 0 and not crowded)
                best_cost = _INF
                best_n = 0
                for n in range(num_nodes):
                    crowded = on_node[e, n] >= gpus_per_node and c[e] + 1 <= num_gpus
                    if free[n] <= 0 or (crowded and any_open):
                        continue
                    away = 1.0
                    if n != home[layer, e]:
                        away += penalty if which == 1 else max(penalty, 1.0)
                    cost = (load_after[n] + new_per) * away
                    if cost < best_cost:
                        best_cost, best_n = cost, n
                load_after[best_n] += new_per
                top = new_per
                for f in range(num_experts):
                    if f != e:
                        top = max(top, per[f])
                score[which] = max(load_after.max() / gpus_per_node, top + filler)
                pick_n[which] = best_n
            take = 1 if score[1] < score[0] else 0
            e, n = pick_e[take], pick_n[take]
            c[e] += 1
            on_node[e, n] += 1
            free[n] -= 1
            expert[layer, step] = e
            node[layer, step] = n
    return expert, node, counts


@_njit
def _row_peak(weight: np.ndarray, row: np.ndarray, counts: np.ndarray, num_bins: int, slots: int) -> float:
    """Heaviest GPU of a row of expert ids, every replica carrying ``weight / counts`` of its expert."""
    peak = -_INF
    for g in range(num_bins):
        load = 0.0
        for s in range(slots):
            e = row[g * slots + s]
            load += weight[e] / max(counts[e], 1)
        peak = max(peak, load)
    return peak


@_njit
def _transfer_row(
    weight: np.ndarray,
    row: np.ndarray,
    counts: np.ndarray,
    num_bins: int,
    slots: int,
    transfers: int,
    work: tuple,
) -> None:
    """Re-split replicas inside one row of a plan in service, one slot at a time, in place.

    Targets are the slot-aware counts of the experts present in the row (:func:`_slot_aware_row`).
    Each step moves one slot from the over-replicated expert whose replicas would stay lightest to the
    under-replicated expert with the heaviest replica, on a GPU that does not hold the receiver (a GPU
    holding the donor twice first; below ``num_bins + 1`` replicas it must be such a GPU), and is kept
    only if the row's peak does not rise; the first refused step ends the row.
    """
    target, sub_w, sub_c, per, small, ids = work
    n_present = 0
    for e in range(weight.size):
        target[e] = 0
        if counts[e] > 0:
            ids[n_present] = e
            sub_w[n_present] = weight[e]
            n_present += 1
    if n_present == 0:
        return
    _slot_aware_row(sub_w[:n_present], row.size, num_bins, sub_c[:n_present], per[:n_present], small)
    for j in range(n_present):
        target[ids[j]] = sub_c[j]
    for _ in range(transfers):
        recv, donor = -1, -1
        best_r, best_d = -_INF, _INF
        for j in range(n_present):
            e = ids[j]
            c = counts[e]
            if c < target[e] and weight[e] / c > best_r:
                best_r, recv = weight[e] / c, e
            if c > target[e] and weight[e] / max(c - 1, 1) < best_d:
                best_d, donor = weight[e] / max(c - 1, 1), e
        if recv < 0 or donor < 0:
            return
        any_doubled = False
        for g in range(num_bins):
            n_donor = 0
            for s in range(slots):
                n_donor += row[g * slots + s] == donor
            any_doubled = any_doubled or n_donor > 1
        must = counts[donor] - 1 <= num_bins and any_doubled
        slot, slot_doubled = -1, False
        for g in range(num_bins):
            has_recv = False
            n_donor = 0
            for s in range(slots):
                has_recv = has_recv or row[g * slots + s] == recv
                n_donor += row[g * slots + s] == donor
            if has_recv or (must and n_donor < 2):
                continue
            for s in range(slots):
                p = g * slots + s
                if row[p] == donor and (slot < 0 or (n_donor > 1 and not slot_doubled)):
                    slot, slot_doubled = p, n_donor > 1
        if slot < 0:
            return
        before = _row_peak(weight, row, counts, num_bins, slots)
        row[slot] = recv
        counts[donor] -= 1
        counts[recv] += 1
        if _row_peak(weight, row, counts, num_bins, slots) > before:
            row[slot] = donor
            counts[donor] += 1
            counts[recv] -= 1
            return


@_njit
def migrate_layers(
    weight: np.ndarray,
    prev: np.ndarray,
    rows_per_layer: int,
    num_gpus: int,
    budget: int,
    iters: int,
    transfers_on: bool,
    tables: tuple,
) -> np.ndarray:
    """Migration-aware plan: keep ``prev``'s slots, re-split replicas and exchange within a budget.

    Replicas never leave their row (a node in strict and soft plans, the layer in global ones). In
    each row (1) up to half the row's budget moves single slots between experts (:func:`_transfer_row`,
    with ``transfers_on``), (2) exchange rounds (:func:`_refine` with the budget) run with the rest:
    no row ends with more than ``budget // rows_per_layer`` slots that differ from ``prev``, and no
    step raises a row's peak.

    Args:
        weight: ``[L, N]`` float64; prev: ``[L, R]`` int64 plan in service (GPU-major slots).

    Returns:
        ``[L, R]`` int64, the new ``phy2log`` (slots in place: unchanged slots keep their position).
    """
    num_layers, num_replicas = prev.shape
    num_experts = weight.shape[1]
    per_row = num_replicas // rows_per_layer
    num_bins = num_gpus // rows_per_layer
    slots = num_replicas // num_gpus
    row_budget = budget // rows_per_layer
    out = prev.copy()
    counts = np.zeros((rows_per_layer, num_experts), dtype=np.int64)
    layer_counts = np.zeros(num_experts, dtype=np.int64)
    row = np.empty(per_row, dtype=np.int64)
    work = (
        np.zeros(num_experts, dtype=np.int64),
        np.empty(num_experts),
        np.empty(num_experts, dtype=np.int64),
        np.empty(num_experts),
        np.empty(max(slots, 1)),
        np.empty(num_experts, dtype=np.int64),
    )
    load = np.empty((rows_per_layer, num_bins, slots))
    expert = np.empty((rows_per_layer, num_bins, slots), dtype=np.int64)
    origin = np.empty((rows_per_layer, num_bins, slots), dtype=np.int64)
    fixed = np.zeros((rows_per_layer, num_bins, slots), dtype=np.bool_)
    budgets = np.full(rows_per_layer, row_budget, dtype=np.int64)
    ws = _workspace(num_bins, slots, num_experts, tables[3].shape[1], rows_per_layer)
    stamp = np.int64(0)
    for layer in range(num_layers):
        layer_counts[:] = 0
        for q in range(rows_per_layer):
            counts[q] = 0
            for p in range(per_row):
                row[p] = out[layer, q * per_row + p]
                counts[q, row[p]] += 1
            if transfers_on and row_budget // 2 > 0:
                _transfer_row(weight[layer], row, counts[q], num_bins, slots, row_budget // 2, work)
            fe = expert[q].reshape(-1)
            fo = origin[q].reshape(-1)
            for p in range(per_row):
                fe[p] = row[p]
                fo[p] = prev[layer, q * per_row + p]
            for e in range(num_experts):
                layer_counts[e] += counts[q, e]
        for q in range(rows_per_layer):
            fl = load[q].reshape(-1)
            fe = expert[q].reshape(-1)
            for p in range(per_row):
                fl[p] = weight[layer, fe[p]] / layer_counts[fe[p]]
        stamp = _refine(
            load,
            expert,
            fixed,
            np.bool_(False),
            rows_per_layer,
            rows_per_layer,
            np.int64(1),
            iters,
            tables,
            ws,
            stamp,
            origin,
            budgets,
        )
        for q in range(rows_per_layer):
            # transfers can leave an expert twice on a GPU after its count fell to the row's GPUs or fewer
            fe = expert[q].reshape(-1)
            ff = fixed[q].reshape(-1)
            for p in range(per_row):
                ff[p] = counts[q, fe[p]] > num_bins  # (more replicas here than GPUs: repeats allowed)
            _repair_row(load[q].reshape(-1), fe, ff, num_bins, slots, origin[q].reshape(-1), row_budget)
            for p in range(per_row):
                ff[p] = False
                out[layer, q * per_row + p] = fe[p]
    return out
