"""Refinement rounds of one row of GPUs: pairwise exchanges of single replicas, and exhaustive
re-splits of the replicas of two GPUs (with up to ``MAX_RESPLIT_SLOTS`` slots per GPU)."""

from __future__ import annotations

import numpy as np

from eplb_core._numba.starts import _argsort_desc_into, _sort_workspace
from eplb_core._numba.utils import (
    _INF,
    BRUTE_FORCE_SLOTS,
    INTERPRETED,
    MANY_BINS,
    PEAK_TRIES,
    PEAK_TRIES_MANY,
    RANK_SORT_BINS,
    SORT_FROM_SCRATCH_BINS,
    _row_sum,
    njit,
    njit_inline,
)


@njit_inline
def _pair_bins(
    bin_load: np.ndarray, order: np.ndarray, it: int, heavy: np.ndarray, light: np.ndarray, sw: tuple
) -> None:
    """This round's pairs of one row: the k-th heaviest bin with the ``(k + it) mod P``-th lightest.

    ``order`` holds the bins by decreasing load, ties by index (what a stable sort gives); it is
    re-sorted in place by ranks on rows of up to ``RANK_SORT_BINS`` bins, by insertion from the
    previous round's order (which few moves disturb) on rows of up to ``SORT_FROM_SCRATCH_BINS``,
    and from scratch by a merge sort on more (the same order).
    """
    num_bins = bin_load.size
    by_rank = num_bins <= RANK_SORT_BINS and not INTERPRETED
    if num_bins > SORT_FROM_SCRATCH_BINS:
        # many bins change per round here: a merge sort beats the quadratic insertion (same order)
        order[:] = _argsort_desc_into(bin_load, sw)
    elif by_rank:
        # few bins: each bin's rank from all pairs compared without branches (the same order)
        for b in range(num_bins):
            v = bin_load[b]
            rank = 0
            for c in range(num_bins):
                u = bin_load[c]
                rank += (u > v) | ((u == v) & (c < b))
            order[rank] = b
    for i in range(1, num_bins if num_bins <= SORT_FROM_SCRATCH_BINS and not by_rank else 0):
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
    m = it % half  # (k + it) mod half, one division per round
    for k in range(half):
        heavy[k] = order[k]
        light[k] = order[num_bins - 1 - m]
        m = m + 1 if m + 1 < half else 0


@njit_inline
def _tree_update(tk: np.ndarray, ti: np.ndarray, b: int, value: float) -> int:
    """Set bin ``b``'s load in the tree of :func:`_heaviest_tree` and replay its path; returns the
    heaviest bin."""
    size = tk.size // 2
    p = size + b
    kv, iv = value, b
    tk[p] = kv
    while p > 1:
        sk, si = tk[p ^ 1], ti[p ^ 1]
        sib = (sk > kv) | ((sk == kv) & (si < iv))
        kv = sk if sib else kv
        iv = si if sib else iv
        p >>= 1
        tk[p] = kv
        ti[p] = iv
    return ti[1]


@njit_inline
def _heaviest_tree(bin_load: np.ndarray, tk: np.ndarray, ti: np.ndarray) -> int:
    """The heaviest bin (lowest index on ties, as a scan for a strictly larger load finds), from a
    tournament tree over the bins built in ``tk``/``ti`` (leaves ``size + b``, padded with ``-inf``;
    every node holds the load and index that win its subtree): :func:`_tree_update` keeps it."""
    size = tk.size // 2
    for b in range(size):
        tk[size + b] = bin_load[b] if b < bin_load.size else -_INF
        ti[size + b] = b
    for p in range(size - 1, 0, -1):
        right = tk[2 * p + 1] > tk[2 * p]  # ties: the left subtree's lower index
        tk[p] = tk[2 * p + 1] if right else tk[2 * p]
        ti[p] = ti[2 * p + 1] if right else ti[2 * p]
    return ti[1]


@njit
def _row_buffers(num_bins: int, num_rows: int) -> tuple:
    """Work arrays of the refinement: pair ids, and per row its bin loads, bin order, and the versions
    that the rounds compare to skip a pair that declined before (a bin's version changes whenever its
    contents do; ``seen[h, l]`` holds the versions of the heavy and the light bin side by side, one
    memory access). The per-row arrays live from block to
    block of a row: a pair that declined in an earlier block of its row is skipped too while
    neither bin changed. Last, the work arrays of the bin order's merge sort and the tree of the
    heaviest bin (:func:`_heaviest_tree`), for rows of many bins."""
    half = num_bins // 2
    heavy = np.empty(half, dtype=np.int64)
    light = np.empty(half, dtype=np.int64)
    bin_load = np.empty((num_rows, num_bins))
    order = np.empty((num_rows, num_bins), dtype=np.int64)
    ver = np.zeros((num_rows, num_bins), dtype=np.int64)
    seen = np.full((num_rows, num_bins, num_bins, 2), -1, dtype=np.int64)
    size = 1
    while size < num_bins:
        size *= 2
    tk = np.empty(2 * size)
    ti = np.empty(2 * size, dtype=np.int64)
    return heavy, light, bin_load, order, ver, seen, _sort_workspace(num_bins), tk, ti


@njit
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


@njit_inline
def _row_state(rb: tuple, sb: tuple, r: int) -> tuple[tuple, tuple]:
    """Row ``r``'s views of the work arrays ``rb``/``sb`` of :func:`_workspace`: what
    :func:`_resplit_rounds` and :func:`_swap_rounds` take."""
    rb_r = (rb[0], rb[1], rb[2][r], rb[3][r], rb[4][r], rb[5][r], rb[6], rb[7], rb[8])
    sb_r = (sb[0], sb[1], sb[2], sb[3], sb[4], sb[5][r], sb[6])
    return rb_r, sb_r


@njit
def _sort_slots(fl: np.ndarray, num_bins: int, slots: int, srt: np.ndarray) -> None:
    """Each bin's slots by increasing load, ties by slot, into ``srt [G, S]``."""
    for g in range(num_bins):
        base = g * slots
        descending = True
        for y in range(1, slots):
            descending = descending and fl[base + y] <= fl[base + y - 1]
        if descending:
            # a packing's start fills each bin by decreasing load (the worst case of an insertion
            # sort): the order is the reverse, each run of equal loads kept in slot order
            t = 0
            end = slots
            while end > 0:
                start = end - 1
                while start > 0 and fl[base + start - 1] == fl[base + end - 1]:
                    start -= 1
                for y in range(start, end):
                    srt[g, t] = y
                    t += 1
                end = start
            continue
        for y in range(slots):
            v = fl[base + y]
            j = y
            while j > 0 and fl[base + srt[g, j - 1]] > v:
                srt[g, j] = srt[g, j - 1]
                j -= 1
            srt[g, j] = y


@njit_inline
def _gaining_exchanges(fl: np.ndarray, ha: int, lb0: int, slots: int, gap: float) -> int:
    """How many one-for-one exchanges between the bins whose slots start at ``ha`` and ``lb0`` move a
    load ``0 < d < gap`` (only those can gain: the gain is ``min(d, gap - d)``); counted branch-free."""
    if INTERPRETED:
        return _gaining_exchanges_np(fl, ha, lb0, slots, gap)
    hits = 0
    for a in range(slots):
        xa = fl[ha + a]
        for b in range(slots):
            d = xa - fl[lb0 + b]
            hits += (d > 0.0) & (d < gap)
    return hits


def _gaining_exchanges_np(fl: np.ndarray, ha: int, lb0: int, slots: int, gap: float) -> int:
    """:func:`_gaining_exchanges` in array operations (the same differences, the same count)."""
    d = fl[ha : ha + slots, None] - fl[lb0 : lb0 + slots]
    return int(np.count_nonzero((d > 0.0) & (d < gap)))


# the pairs (a, b), a < b, of the slots of a GPU (up to 32 slots), for the interpreted forms
_PAIRS = {n: np.triu_indices(n, 1) for n in range(33)}


def _resplit_hits_np(fl: np.ndarray, ha: int, lb0: int, slots: int, gap: float) -> int:
    """The exchanges :func:`_resplit_rounds` counts before re-splitting a pair, in array operations:
    single items whose loads differ by ``0 < d < gap``, and when there is none (with 4 or more
    slots) pairs of items (each pair's load summed as there)."""
    hits = _gaining_exchanges_np(fl, ha, lb0, slots, gap)
    if hits > 0 or slots < 4:
        return hits
    first, second = _PAIRS[slots]
    x = fl[ha : ha + slots]
    y = fl[lb0 : lb0 + slots]
    d = (x[first] + x[second])[:, None] - (y[first] + y[second])
    return int(np.count_nonzero((d > 0.0) & (d < gap)))


def _split_choice_np(
    items32: np.ndarray,
    fix: np.ndarray,
    any_fixed: bool,
    clash_a: np.ndarray,
    clash_b: np.ndarray,
    tables: tuple,
    total32: np.float32,
    slots: int,
) -> int:
    """The split :func:`_resplit_rounds` chooses, in array operations: the same float32 sums (each
    split's items added in item order: a running sum down the item axis) and the first best among
    the allowed splits (-1 when none is)."""
    _, _, member, member_f = tables
    num_splits = member.shape[1]
    two = 2 * slots
    sums = np.add.accumulate(member_f[:two] * items32[:two, None], axis=0)[-1, :num_splits]
    score = np.abs(np.float32(2.0) * sums - total32)
    if not any_fixed and clash_a.size == 0:
        return int(np.argmin(score))
    valid = np.ones(num_splits, dtype=np.bool_)
    if any_fixed:
        for i in np.flatnonzero(fix[:two]):
            valid &= member[i] == (i < slots)
    for a, b in zip(clash_a, clash_b, strict=True):
        valid &= member[a] != member[b]
    if not valid.any():
        return -1
    return int(np.argmin(np.where(valid, score, np.float32(np.inf))))


def _brute_exchange_np(
    fl: np.ndarray,
    fe: np.ndarray,
    ff: np.ndarray,
    has_fixed: bool | np.bool_,
    ha: int,
    lb0: int,
    slots: int,
    gap: float,
    origin: np.ndarray,
    used: int,
    budget: int,
) -> tuple[float, int, int]:
    """``(gain, x slot, y slot)`` of the exchange :func:`_swap_rounds` scores every pair for (with a
    migration budget), in array operations: the same gains, the first best in ``x``-major order
    (``-inf`` and the first slots when every pair is blocked)."""
    xs, ys = slice(ha, ha + slots), slice(lb0, lb0 + slots)
    same = fe[xs, None] == fe[ys]
    no_x = same.any(1)
    no_y = same.any(0)
    if has_fixed:
        no_x |= ff[xs]
        no_y |= ff[ys]
    delta = fl[xs, None] - fl[ys]
    gain = np.minimum(delta, gap - delta)
    blocked = no_x[:, None] | no_y[None, :]
    if budget >= 0:
        ox, oy = origin[xs], origin[ys]
        ex, ey = fe[xs], fe[ys]
        change = (
            (ey[None, :] != ox[:, None]).astype(np.int64)
            + (ex[:, None] != oy[None, :])
            - ((ex != ox).astype(np.int64)[:, None] + (ey != oy)[None, :])
        )
        blocked |= used + change > budget
    gain = np.where(blocked, -_INF, gain)
    k = int(np.argmax(gain))
    if gain.flat[k] == -_INF:
        return -_INF, ha, lb0
    return float(gain.flat[k]), ha + k // slots, lb0 + k % slots


@njit
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
    and puts no expert twice on a GPU; fixed items never move. Up to ``BRUTE_FORCE_SLOTS`` slots
    every ``(x, y)`` is scored (without a budget in one branch-free pass). With more slots a sweep
    finds the same exchange: the gain of ``x`` peaks at the ``y`` nearest ``x - gap / 2``, so the best
    ``y`` of each ``x`` is one of the two allowed light items around that target: every bin keeps its
    slots sorted by load (ties by slot; two insertion steps per exchange), and one pointer sweeps the
    light bin's allowed items while ``x`` goes up the heavy bin's order, ``O(S)`` per pair; equal
    gains go to the lowest slots, as when every pair is scored, so both searches make the same
    exchanges.

    ``rb`` holds this row's bin loads, order and versions (set up by :func:`_start_row`) and ``sb``,
    for the sweep, its slot order ``srt [G, S]`` (:func:`_sort_slots`), kept from block to block.

    Returns:
        ``(moved, stamp)``: whether something moved, and the last bin version used.
    """
    heavy, light, bin_load, order, ver, seen, sw, _, _ = rb
    held, va, no_x, no_y, ya, srt, gains = sb
    gain_bits = gains.view(np.int64)
    num_bins = bin_load.size
    half = num_bins // 2
    # up to BRUTE_FORCE_SLOTS slots every (x, y) pair is scored (the same exchanges as the sweep);
    # the kept slot order ``srt`` and the ``held`` table serve the sweep only
    brute = slots <= BRUTE_FORCE_SLOTS
    moved = False

    def change(a: int, b: int) -> int:
        # change in the number of slots that differ from ``origin`` if slots a and b swap
        before = int(fe[a] != origin[a]) + int(fe[b] != origin[b])
        return int(fe[b] != origin[a]) + int(fe[a] != origin[b]) - before

    used = 0
    if budget >= 0:
        for p in range(num_bins * slots):
            used += fe[p] != origin[p]
    if not brute:
        # ``held`` is all zeros between calls (each call clears the entries it set); bin by bin (no
        # division per slot)
        for g in range(num_bins):
            for t in range(g * slots, (g + 1) * slots):
                held[g, fe[t]] += 1
    for it in range(it0, it0 + rounds):
        _pair_bins(bin_load, order, it, heavy, light, sw)
        for k in range(half):
            h, lt = heavy[k], light[k]
            if seen[h, lt, 0] == ver[h] and seen[h, lt, 1] == ver[lt]:
                continue  # declined before and neither bin changed since
            seen[h, lt, 0] = ver[h]
            seen[h, lt, 1] = ver[lt]
            gap = bin_load[h] - bin_load[lt]
            ha, lb0 = h * slots, lt * slots
            # an exchange gains only if its loads differ by 0 < d < gap (otherwise min(d, gap - d)
            # <= 0): most declining pairs have none, and on up to BRUTE_FORCE_SLOTS slots counting
            # them (branch-free) is cheaper than the search
            if slots <= BRUTE_FORCE_SLOTS and _gaining_exchanges(fl, ha, lb0, slots, gap) == 0:
                continue
            best = -_INF
            pa, pb = ha, lb0
            if brute and INTERPRETED:
                best, pa, pb = _brute_exchange_np(
                    fl, fe, ff, has_fixed, ha, lb0, slots, gap, origin, used, budget
                )
            elif brute and budget < 0:
                # every pair's gain, clamped at 0 (a gain <= 0 never moves: ``tol`` >= 0) and 0 where
                # blocked, as the integer of its bits (order-preserving for floats >= 0): the first
                # largest in x-major order is what the scoring below picks, found without branches
                for x in range(slots):
                    no_x[x] = has_fixed and ff[ha + x]
                    no_y[x] = has_fixed and ff[lb0 + x]
                for x in range(slots):
                    ex = fe[ha + x]
                    clash = False
                    for y in range(slots):
                        same = fe[lb0 + y] == ex
                        clash |= same
                        no_y[y] |= same
                    no_x[x] |= clash
                for x in range(slots):
                    fx = fl[ha + x]
                    bx = no_x[x]
                    for y in range(slots):
                        delta = fx - fl[lb0 + y]
                        gain = min(delta, gap - delta)
                        blocked = bx | no_y[y]
                        gains[x * slots + y] = gain if gain > 0.0 and not blocked else 0.0
                top = np.int64(0)
                for q in range(slots * slots):
                    top = max(top, gain_bits[q])
                if top > 0:
                    q = 0
                    while gain_bits[q] != top:
                        q += 1
                    best = gains[q]
                    pa, pb = ha + q // slots, lb0 + q % slots
            elif brute:
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
                        # blocked pairs count as -inf: they never win (checked only for a winner)
                        if (
                            gain > best
                            and not no_y[y]
                            and (budget < 0 or used + change(ha + x, lb0 + y) <= budget)
                        ):
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
        for g in range(num_bins):
            for t in range(g * slots, (g + 1) * slots):
                held[g, fe[t]] = 0
    return moved, stamp


@njit
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
    heavy, light, bin_load, order, ver, seen, sw, tk, ti = rb
    idx_heavy, idx_light, member, member_f = tables
    items, items32, sums, valid, score, ids, fix, pos, tmp_l, tmp_e, tmp_f, clash_a, clash_b = pb
    score_bits = score.view(np.int32)
    num_bins = bin_load.size
    half = num_bins // 2
    num_pairs = (half + 1) // 2 if num_bins > MANY_BINS else half
    peak_tries = PEAK_TRIES_MANY if num_bins > MANY_BINS else PEAK_TRIES
    # many bins: the peak step finds the heaviest bin in a tree (two paths per move, not a scan)
    many = num_bins > MANY_BINS
    num_splits = idx_heavy.shape[0]
    # member_f has zero columns up to a multiple of 8 splits: the sums run in whole vectors
    num_padded = member_f.shape[1]
    two = 2 * slots
    two_f = np.float32(2.0)
    moved = False
    for it in range(it0, it0 + rounds):
        _pair_bins(bin_load, order, it, heavy, light, sw)
        k = 0  # next pair of the round
        peak_phase = False
        j = 0  # next light partner of the heaviest bin
        tries = 0
        hp = 0  # the heaviest bin (changes only when a re-split moves something)
        while True:
            if not peak_phase:
                if k == num_pairs:
                    peak_phase = True
                    if many:
                        hp = _heaviest_tree(bin_load, tk, ti)
                    else:
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
            if seen[h, lt, 0] == ver[h] and seen[h, lt, 1] == ver[lt]:
                continue  # declined before and neither bin changed since
            seen[h, lt, 0] = ver[h]
            seen[h, lt, 1] = ver[lt]
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
            if INTERPRETED:
                hits = _resplit_hits_np(fl, ha, lb0, slots, gap)
            elif slots == 4 or slots == 5:
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
            if hits == 0 and slots >= 6 and not INTERPRETED:
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
            if INTERPRETED:
                choice = _split_choice_np(
                    items32, fix, any_fixed, clash_a[:n_clash], clash_b[:n_clash], tables, total32, slots
                )
            else:
                for c in range(num_padded):
                    sums[c] = np.float32(0.0)
                for i in range(two):
                    xi = items32[i]
                    for c in range(num_padded):
                        sums[c] += member_f[i, c] * xi
                for c in range(num_splits):
                    score[c] = abs(two_f * sums[c] - total32)
                # the first best split: scores are >= 0 (or NaN), which order like their bits as
                # integers (a minimum the compiler vectorises); NaN bits exceed every other score's, and
                # a NaN first score keeps split 0, as a scan for a strictly lower score would
                choice = -1
                if not any_fixed and n_clash == 0:
                    choice = 0
                    if not np.isnan(score[0]):
                        low = score_bits[0]
                        for c in range(1, num_splits):
                            low = min(low, score_bits[c])
                        while score_bits[choice] != low:
                            choice += 1
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
                    first_valid = 0
                    while first_valid < num_splits and not valid[first_valid]:
                        first_valid += 1
                    if first_valid < num_splits:
                        choice = first_valid
                        if not np.isnan(score[first_valid]):
                            # the same minimum over the allowed splits (others count as the largest bits)
                            top = np.int32(0x7FFFFFFF)
                            low = top
                            for c in range(num_splits):
                                low = min(low, score_bits[c] if valid[c] else top)
                            while not (valid[choice] and score_bits[choice] == low):
                                choice += 1
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
                if many:
                    # only h and lt changed: replay their paths of the tree
                    _tree_update(tk, ti, h, load_h)
                    hp = _tree_update(tk, ti, lt, load_l)
                else:
                    hp = 0
                    for g in range(1, num_bins):
                        if bin_load[g] > bin_load[hp]:
                            hp = g
    return moved, stamp
