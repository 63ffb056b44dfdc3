"""Refinement driver: runs the rounds of :mod:`eplb_core._numba.rounds` on every row that still
decides its layer's peak, repairs avoidable repeats of an expert on a GPU, and writes rows out."""

from __future__ import annotations

import numpy as np

from eplb_core._numba.rounds import (
    _resplit_rounds,
    _row_buffers,
    _row_state,
    _sort_slots,
    _start_row,
    _swap_rounds,
)
from eplb_core._numba.utils import (
    _INF,
    BLOCK,
    BRUTE_FORCE_SLOTS,
    CLOSE_ENOUGH,
    INTERPRETED,
    MAX_RESPLIT_SLOTS,
    MIN_BLOCK_GAIN,
    PRUNE_MARGIN,
    RANK_SORT_SLOTS,
    REL_TOL,
    REPAIR_SCAN_SLOTS,
    _pairwise_sum,
    _row_sum,
    njit,
)


@njit
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
        np.empty(slots * slots),
    )
    two = 2 * slots
    pb = (
        np.empty(two),
        np.empty(two, dtype=np.float32),
        np.empty(num_splits, dtype=np.float32),
        np.empty(num_splits, dtype=np.bool_),
        np.empty(num_splits, dtype=np.float32),
        np.empty(two, dtype=np.int64),
        np.empty(two, dtype=np.bool_),
        np.empty(two, dtype=np.int64),
        np.empty(two),
        np.empty(two, dtype=np.int64),
        np.empty(two, dtype=np.bool_),
        np.empty(two * two, dtype=np.int64),
        np.empty(two * two, dtype=np.int64),
    )
    # per row: alive, active, ready, presorted (the caller wrote the row's slot order: see
    # :func:`_refine`); total, tol, peak, excess, row_lb; per bin: loads; per candidate: peaks
    flags = np.zeros((4, num_rows), dtype=np.bool_)
    stats = np.empty((5, num_rows))
    bin_tmp = np.empty(num_bins)
    cand_peak = np.empty(num_rows)
    return rb, sb, pb, (flags, stats, bin_tmp, cand_peak)


@njit
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


@njit
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

    The exchange rounds of more than ``BRUTE_FORCE_SLOTS`` slots keep each bin's slots in load order
    (``ws[1][5][r]``), sorted at the row's first block unless the caller wrote them and set
    ``ws[3][0][3, r]`` (cleared on return).
    """
    _, num_bins, slots = load.shape
    rb, sb, pb, state = ws
    flags, stats, bin_tmp, cand_peak = state
    alive, active, ready, presorted = flags[0], flags[1], flags[2], flags[3]
    if num_bins < 2 or iters <= 0:
        for r in range(num_rows):
            presorted[r] = False
        return stamp
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
                if slots > BRUTE_FORCE_SLOTS and not presorted[r]:
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
    for r in range(num_rows):
        presorted[r] = False  # good for this call only
    return stamp


@njit
def _peak(load: np.ndarray, first: int, num_rows: int) -> float:
    """Heaviest bin of rows ``first .. first + num_rows - 1`` of ``load [B, G, S]``."""
    _, num_bins, slots = load.shape
    out = -_INF
    for r in range(first, first + num_rows):
        fl = load[r].reshape(-1)
        for g in range(num_bins):
            out = max(out, _row_sum(fl, g * slots, slots))
    return out


@njit
def _in_bin(fe: np.ndarray, b: int, slots: int, e: int, skip: int) -> bool:
    """Whether bin ``b`` holds expert ``e`` at a slot other than ``skip``."""
    for t in range(slots):  # noqa: SIM110 (a generator is not compiled as tightly)
        if t != skip and fe[b * slots + t] == e:
            return True
    return False


@njit
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
    if slots <= REPAIR_SCAN_SLOTS:
        for b in range(num_bins):
            for s in range(slots):
                i = b * slots + s
                for t in range(s + 1, slots):
                    j = b * slots + t
                    repeats |= (fe[i] == fe[j]) & ~(ff[i] & ff[j])
    else:
        # many slots: one pass, remembering per expert the last bin it was met in and whether a
        # replica there was not fixed (two replicas on a bin repeat unless both are fixed)
        top = 0
        for p in range(fe.size):
            top = max(top, fe[p])
        last_bin = np.full(top + 1, -1, dtype=np.int64)
        loose = np.zeros(top + 1, dtype=np.bool_)
        for p in range(fe.size):
            e = fe[p]
            b = p // slots
            if last_bin[e] == b:
                repeats = repeats or loose[e] or not ff[p]
                loose[e] = loose[e] or not ff[p]
            else:
                last_bin[e] = b
                loose[e] = not ff[p]
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
                        after = (
                            int(fe[j] != fo[i])
                            + int(fe[i] != fo[j])
                            - int(fe[i] != fo[i])
                            - int(fe[j] != fo[j])
                        )
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
                    changed += (
                        int(fe[j] != fo[i]) + int(fe[i] != fo[j]) - int(fe[i] != fo[i]) - int(fe[j] != fo[j])
                    )
                fl[i], fl[best_j] = fl[best_j], fl[i]
                fe[i], fe[best_j] = fe[best_j], fe[i]
                ff[i], ff[best_j] = ff[best_j], ff[i]


@njit
def _write_sorted_rank(
    expert: np.ndarray, load: np.ndarray, first: int, num_rows: int, out: np.ndarray
) -> None:
    """:func:`_write_sorted` by ranks: every slot goes to the count of the bin's slots that come before
    it (larger load, lower expert id on ties, lower slot on full ties, which are alike), all pairs
    compared without branches."""
    _, num_bins, slots = expert.shape
    for r in range(first, first + num_rows):
        for g in range(num_bins):
            start = (r - first) * num_bins * slots + g * slots
            for i in range(slots):
                li = load[r, g, i]
                ei = expert[r, g, i]
                rank = 0
                for j in range(slots):
                    lj = load[r, g, j]
                    ej = expert[r, g, j]
                    rank += (lj > li) | ((lj == li) & ((ej < ei) | ((ej == ei) & (j < i))))
                out[start + rank] = ei


@njit
def _write_sorted(
    expert: np.ndarray,
    load: np.ndarray,
    first: int,
    num_rows: int,
    out: np.ndarray,
    srt: np.ndarray,
    use_srt: bool | np.bool_,
) -> None:
    """Rows ``first ..`` of ``expert [B, G, S]`` into ``out [num_rows * G * S]``, each bin's slots by
    decreasing ``load``, ties by expert id (the order in which DeepSeek's packing fills a GPU).

    An insertion sort; with ``use_srt`` it takes each bin's slots in the reverse of ``srt [B, G, S]``
    (a permutation of the slots per bin: the exchange rounds' order by increasing load, see
    :func:`_refine`), which makes it one pass when that order is current. The result is the same
    for any order the slots arrive in (the sorted order is unique up to equal items)."""
    _, num_bins, slots = expert.shape
    if slots <= RANK_SORT_SLOTS and not use_srt and not INTERPRETED:
        _write_sorted_rank(expert, load, first, num_rows, out)
        return
    key = np.empty(slots)
    for r in range(first, first + num_rows):
        for g in range(num_bins):
            start = (r - first) * num_bins * slots + g * slots
            for t in range(slots):
                s = srt[r, g, slots - 1 - t] if use_srt else t
                v = expert[r, g, s]
                x = load[r, g, s]
                j = t
                while j > 0 and (key[j - 1] < x or (key[j - 1] == x and out[start + j - 1] > v)):
                    out[start + j] = out[start + j - 1]
                    key[j] = key[j - 1]
                    j -= 1
                out[start + j] = v
                key[j] = x


@njit
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


@njit
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


@njit
def _node_max(group_load: np.ndarray, node: np.ndarray, sums: np.ndarray) -> float:
    """Heaviest node of a group-to-node assignment (groups added in id order)."""
    sums[:] = 0.0
    for grp in range(node.size):
        sums[node[grp]] += group_load[grp]
    return sums.max()
