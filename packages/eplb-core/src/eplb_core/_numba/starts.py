"""Starting packings: stable argsort of loads, LPT packing onto GPUs with equal slot counts, and the
GPU-major layout of a packed row."""

from __future__ import annotations

import numpy as np

from eplb_core._numba.utils import _INF, BUCKET_MAX, BUCKET_SORT_MIN, INTERPRETED, njit


@njit
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


@njit
def _argsort_desc(x: np.ndarray) -> np.ndarray:
    """Stable argsort of ``x`` by decreasing value (``np.argsort(-x, kind="stable")``): insertion
    sort of runs of 8, then bottom-up merges of (value, index) pairs without branches on the data
    (the comparison selects, it does not jump: random loads would mispredict half the jumps)."""
    if INTERPRETED:
        return np.argsort(-x, kind="stable")  # the one stable order
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


@njit
def _lpt_row(
    item_load: np.ndarray,
    item_key: np.ndarray,
    use_key: bool | np.bool_,
    num_bins: int,
    bins: np.ndarray,
    key: np.ndarray,
    fill: np.ndarray,
    tag: np.ndarray,
) -> tuple[np.ndarray, bool]:
    """LPT with ``M / num_bins`` items per bin: ``bins[i]`` of every item; returns the load order and
    whether ``use_key`` moved an item off its lightest bin (without it, the bins are plain LPT's).

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
    diverted = False
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
                    diverted = True
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
    return order, diverted


@njit
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


@njit
def _plain_lpt_peak(
    item_load: np.ndarray,
    item_key: np.ndarray,
    moved: bool,
    num_bins: int,
    bins: np.ndarray,
    bins_plain: np.ndarray,
    key: np.ndarray,
    fill: np.ndarray,
    tag: np.ndarray,
) -> float:
    """Heaviest bin of plain LPT (no ``item_key``), given ``bins`` of the keyed LPT of the same items
    and whether it ``moved`` an item (if not, the bins are the same and are not recomputed)."""
    src = bins
    if moved:
        _lpt_row(item_load, item_key, False, num_bins, bins_plain, key, fill, tag)
        src = bins_plain
    key[:] = 0.0
    for i in range(item_load.size):
        key[src[i]] += item_load[i]
    return key.max()


@njit
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
