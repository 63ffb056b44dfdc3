"""Starting packings: stable argsort of loads, LPT packing onto GPUs with equal slot counts, and the
GPU-major layout of a packed row."""

from __future__ import annotations

import numpy as np

from eplb_core._numba.utils import _INF, BUCKET_MAX, BUCKET_SORT_MIN, INTERPRETED, njit, njit_inline


@njit
def _bucket_argsort_desc(x: np.ndarray, order: np.ndarray, val: np.ndarray, count: np.ndarray) -> bool:
    """The order of :func:`_argsort_desc` by buckets, into ``order``/``val``; False (nothing written
    that counts) when the loads do not spread over the buckets (then the merge sort runs).

    A finite load >= 0 orders like the integer of its bits, so the items go by counting sort into up
    to ``2 n`` buckets of equal ranges of those integers (a logarithmic scale: a few hot experts do not
    crowd the others into one bucket), highest first, in index order; an insertion sort then puts
    each bucket in order (few items each: at most ``BUCKET_MAX`` or the merge sort runs). ``count``
    holds at least ``2 n + 1`` entries (work space).
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
    for b in range(num_buckets + 1):
        count[b] = 0
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
def _sort_workspace(num_items: int) -> tuple:
    """Work arrays of :func:`_argsort_desc_into` for up to ``num_items`` items:
    ``(order, val, tmp, tmp_val, count)``."""
    return (
        np.empty(num_items, dtype=np.int64),
        np.empty(num_items),
        np.empty(num_items, dtype=np.int64),
        np.empty(num_items),
        np.empty(2 * num_items + 1, dtype=np.int64),
    )


@njit
def _argsort_desc_into(x: np.ndarray, sw: tuple) -> np.ndarray:
    """:func:`_argsort_desc` into the work arrays ``sw`` of :func:`_sort_workspace` (no allocation);
    returns ``sw[0][:n]``, the order."""
    order_buf, val, tmp, tmp_val, count = sw
    n = x.size
    if INTERPRETED:
        order_buf[:n] = np.argsort(-x, kind="stable")  # the one stable order
        return order_buf[:n]
    if n >= BUCKET_SORT_MIN and _bucket_argsort_desc(x, order_buf, val, count):
        return order_buf[:n]
    order = order_buf
    in_tmp = False  # whether the merged runs are in ``tmp`` (the buffers swap after every pass)
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
        in_tmp = not in_tmp
        width *= 2
    if in_tmp:
        for i in range(n):
            tmp[i] = order[i]  # ``tmp`` is the caller's order buffer now
    return order_buf[:n]


@njit
def _argsort_desc(x: np.ndarray) -> np.ndarray:
    """Stable argsort of ``x`` by decreasing value (``np.argsort(-x, kind="stable")``): insertion
    sort of runs of 8, then bottom-up merges of (value, index) pairs without branches on the data
    (the comparison selects, it does not jump: random loads would mispredict half the jumps); from
    ``BUCKET_SORT_MIN`` items a counting sort on the loads' bits first (:func:`_bucket_argsort_desc`)."""
    return _argsort_desc_into(x, _sort_workspace(x.size)).copy()


@njit
def _lpt_workspace(num_items: int, num_bins: int) -> tuple:
    """Work arrays of :func:`_lpt_into` for rows of ``num_items`` items onto ``num_bins`` bins: the
    sort's (:func:`_sort_workspace`), then the tournament tree's keys and bin ids."""
    size = 1
    while num_bins > 16 and size < num_bins:
        size *= 2
    return _sort_workspace(num_items), np.empty(2 * size), np.empty(2 * size, dtype=np.int64)


@njit_inline
def _lpt_steps(
    order: np.ndarray,
    first: int,
    item_load: np.ndarray,
    item_key: np.ndarray,
    use_key: bool | np.bool_,
    bins: np.ndarray,
    state: tuple,
    lw: tuple,
) -> int:
    """Steps ``first ..`` of the LPT of :func:`_lpt_into` (items in ``order``), from the state
    ``(key, fill, tag)`` that the steps before ``first`` left: the bin loads ``key`` (infinite when
    full), counts ``fill`` and, with ``use_key``, tags ``tag``; returns the first step at which
    ``use_key`` moved an item off its lightest bin (-1: none).

    Many bins: a tournament tree over the bins (leaves ``P + b``, padded to a power of two with
    infinite loads) whose every node holds the (load, index) pair that wins its subtree, the
    lightest, lowest index on ties; the root is the lightest open bin (a full bin's load is
    infinite), and only the path of the bin that took the item is replayed, without branches.
    """
    key, fill, tag = state
    _, tk, ti = lw
    num_items = item_load.size
    num_bins = key.size
    cap = num_items // num_bins
    # from empty bins, step s < G takes bin s while the items before it had positive loads (the
    # lightest open bin, lowest index on ties, is the first still empty; it holds no key yet)
    direct = first
    while (
        first == 0
        and direct < min(num_bins, num_items)
        and (direct == 0 or item_load[order[direct - 1]] > 0.0)
    ):
        direct += 1
    use_tree = num_bins > 16
    size = 1
    while use_tree and size < num_bins:
        size *= 2
    run_start = 0
    first_moved = -1
    for step in range(first, num_items):
        if step == direct:
            # the tree of the bins as the steps before left them
            for b in range(size if use_tree else 0):
                tk[size + b] = key[b] if b < num_bins else _INF
                ti[size + b] = b
            for p in range(size - 1, 0, -1):
                right = tk[2 * p + 1] < tk[2 * p]  # ties: the left subtree's lower index
                tk[p] = tk[2 * p + 1] if right else tk[2 * p]
                ti[p] = ti[2 * p + 1] if right else ti[2 * p]
        i = order[step]
        if step < direct:
            b = step
        elif use_tree:
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
                    if first_moved < 0:
                        first_moved = step
            tag[b] = run_start
        bins[i] = b
        key[b] += item_load[i]
        fill[b] += 1
        if fill[b] == cap:
            key[b] = _INF
        if use_tree and step >= direct:
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
    return first_moved


@njit
def _lpt_into(
    item_load: np.ndarray,
    item_key: np.ndarray,
    use_key: bool | np.bool_,
    num_bins: int,
    bins: np.ndarray,
    key: np.ndarray,
    fill: np.ndarray,
    tag: np.ndarray,
    lw: tuple,
) -> tuple[np.ndarray, int]:
    """LPT with ``M / num_bins`` items per bin: ``bins[i]`` of every item, in the work arrays ``lw`` of
    :func:`_lpt_workspace`; returns the load order (a view of ``lw``) and the first step at which
    ``use_key`` moved an item off its lightest bin (-1: none, and the bins are plain LPT's; the
    steps before it are plain LPT's in any case).

    Items by decreasing load (stable), each onto the lightest bin with a free slot (lowest index on
    ties). With ``use_key``, an item whose lightest bin already holds its key (expert) takes the
    lightest free bin that does not, if any. Replicas of one expert have equal loads and are adjacent
    in the input (expert-major), so they stay adjacent in the sorted order: "holds its expert" is
    "the last item put there belongs to the current run of equal keys".
    """
    order = _argsort_desc_into(item_load, lw[0])
    key[:] = 0.0
    fill[:] = 0
    tag[:] = -1
    first_moved = _lpt_steps(order, np.int64(0), item_load, item_key, use_key, bins, (key, fill, tag), lw)
    return order, first_moved


@njit
def lpt_bins(item_load: np.ndarray, item_key: np.ndarray, use_key: bool, num_bins: int) -> np.ndarray:
    """:func:`_lpt_into` on every row of ``item_load [B, M]``: bin ``[B, M]`` of every item."""
    num_rows, num_items = item_load.shape
    out = np.empty((num_rows, num_items), dtype=np.int64)
    key = np.empty(num_bins)
    fill = np.empty(num_bins, dtype=np.int64)
    tag = np.empty(num_bins, dtype=np.int64)
    lw = _lpt_workspace(num_items, num_bins)
    for r in range(num_rows):
        _lpt_into(item_load[r], item_key[r], use_key, num_bins, out[r], key, fill, tag, lw)
    return out


@njit
def _plain_lpt_peak(
    item_load: np.ndarray,
    item_key: np.ndarray,
    order: np.ndarray,
    first_moved: int,
    num_bins: int,
    bins: np.ndarray,
    bins_plain: np.ndarray,
    key: np.ndarray,
    fill: np.ndarray,
    tag: np.ndarray,
    lw: tuple,
) -> float:
    """Heaviest bin of plain LPT (no ``item_key``), given the load ``order`` and ``bins`` of the keyed
    LPT of the same items (:func:`_lpt_into`) and the first step at which it moved an item off its
    lightest bin (-1: none, and the bins are plain LPT's): the steps before that one are plain LPT's
    too, so plain LPT continues from there."""
    src = bins
    if first_moved >= 0:
        cap = item_load.size // num_bins
        key[:] = 0.0
        fill[:] = 0
        for step in range(first_moved):
            i = order[step]
            b = bins[i]
            bins_plain[i] = b
            key[b] += item_load[i]
            fill[b] += 1
            if fill[b] == cap:
                key[b] = _INF
        _lpt_steps(order, first_moved, item_load, item_key, False, bins_plain, (key, fill, tag), lw)
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


@njit
def _slot_order(
    bins: np.ndarray,
    order: np.ndarray,
    item_load: np.ndarray,
    num_bins: int,
    srt: np.ndarray,
    fill: np.ndarray,
    item_slot: np.ndarray,
) -> None:
    """The slots of every bin of :func:`_layout_row`'s layout by increasing load, ties by slot, into
    ``srt [G, S]`` (what :func:`eplb_core._numba.rounds._sort_slots` finds), from the items' load
    ``order`` (decreasing, ties by index: :func:`_argsort_desc`) in one pass: the layout fills a
    bin's slots in item order, so a run of equal loads taken forwards is in slot order."""
    fill[:] = 0
    for i in range(bins.size):
        b = bins[i]
        item_slot[i] = fill[b]
        fill[b] += 1
    fill[:] = 0
    end = order.size
    while end > 0:
        start = end - 1
        v = item_load[order[end - 1]]
        while start > 0 and item_load[order[start - 1]] == v:
            start -= 1
        for p in range(start, end):
            i = order[p]
            b = bins[i]
            srt[b, fill[b]] = item_slot[i]
            fill[b] += 1
        end = start
