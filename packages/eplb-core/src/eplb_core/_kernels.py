"""Compiled inner loops of the planner (private): LPT packing and the refinement rounds.

Numba ``@njit(cache=True)`` functions over plain loops, one row (a layer, or a layer's node) at a time:
on these small shapes the cost of the NumPy version was the per-call overhead of ~25 NumPy calls per
round, not arithmetic. The first call in a fresh environment compiles them (a few seconds, see the
docs); the machine code is then cached next to the module (``__pycache__``) and later processes load it.
Bin loads are summed exactly as NumPy sums a contiguous row (:func:`_row_sum`), so that the loop and
the NumPy bookkeeping around it see the same floats.
"""

from __future__ import annotations

import numba
import numpy as np

_INF = np.inf


@numba.njit(cache=True, inline="always")
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


@numba.njit(cache=True)
def greedy_counts(weight: np.ndarray, counts: np.ndarray, num_replicas: int) -> None:
    """Sequential greedy split, in place: while a row of ``counts [B, N]`` sums to less than
    ``num_replicas``, one more replica for the expert with the largest ``weight / count`` (lowest id
    on ties). A row of zero loads gets its extra replicas one per expert in id order instead (every
    expert ties; this keeps them spread over GPUs)."""
    num_rows, num_experts = weight.shape
    per = np.empty(num_experts)
    for r in range(num_rows):
        have = 0
        positive = False
        for e in range(num_experts):
            per[e] = weight[r, e] / counts[r, e]
            have += counts[r, e]
            positive = positive or per[e] > 0
        if not positive:
            for i in range(num_replicas - have):
                counts[r, i % num_experts] += 1
            continue
        for _ in range(num_replicas - have):
            best = 0
            for e in range(1, num_experts):
                if per[e] > per[best]:
                    best = e
            counts[r, best] += 1
            per[best] = weight[r, best] / counts[r, best]


@numba.njit(cache=True)
def lpt_sorted(w_sorted: np.ndarray, e_sorted: np.ndarray, use_expert: bool, num_bins: int) -> np.ndarray:
    """LPT of items already sorted by decreasing load: bin ``[B, M]`` of every sorted item.

    Each item goes onto the lightest bin with a free slot (lowest index on ties). With ``use_expert``,
    an item whose lightest bin already holds its expert takes the lightest free bin that does not, if
    any. Replicas of one expert are adjacent in the sorted order (equal loads, expert-major input), so
    "holds its expert" is "the last item put there belongs to the current run of equal ids".
    """
    num_rows, num_items = w_sorted.shape
    cap = num_items // num_bins
    out = np.empty((num_rows, num_items), dtype=np.int64)
    key = np.empty(num_bins)
    fill = np.empty(num_bins, dtype=np.int64)
    tag = np.empty(num_bins, dtype=np.int64)
    for r in range(num_rows):
        key[:] = 0.0
        fill[:] = 0
        tag[:] = -1
        run_start = 0
        for step in range(num_items):
            b = 0
            kb = key[0]
            for j in range(1, num_bins):
                if key[j] < kb:
                    kb = key[j]
                    b = j
            if use_expert:
                if step == 0 or e_sorted[r, step] != e_sorted[r, step - 1]:
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
            out[r, step] = b
            key[b] += w_sorted[r, step]
            fill[b] += 1
            if fill[b] == cap:
                key[b] = _INF
    return out


@numba.njit(cache=True, inline="always")
def _pair_bins(
    bin_load: np.ndarray, order: np.ndarray, it: int, heavy: np.ndarray, light: np.ndarray
) -> None:
    """This round's pairs of one row: the k-th heaviest bin with the ``(k + it) mod P``-th lightest.

    ``order`` holds the bins by decreasing load, ties by index (what a stable sort gives); it is
    re-sorted in place by insertion from the previous round's order, which few moves disturb.
    """
    num_bins = bin_load.size
    for i in range(1, num_bins):
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


@numba.njit(cache=True, inline="always")
def _row_buffers(
    num_bins: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-row work arrays of the refinement: pair ids, bin loads, bin order, and the versions that
    :func:`_declined_before` compares (a bin's version changes whenever its contents do)."""
    half = num_bins // 2
    heavy = np.empty(half, dtype=np.int64)
    light = np.empty(half, dtype=np.int64)
    bin_load = np.empty(num_bins)
    order = np.empty(num_bins, dtype=np.int64)
    ver = np.zeros(num_bins, dtype=np.int64)
    seen_h = np.full((num_bins, num_bins), -1, dtype=np.int64)
    seen_l = np.full((num_bins, num_bins), -1, dtype=np.int64)
    return heavy, light, bin_load, order, ver, seen_h, seen_l


@numba.njit(cache=True, inline="always")
def _start_row(
    fl: np.ndarray, slots: int, bin_load: np.ndarray, order: np.ndarray, ver: np.ndarray, stamp: int
) -> int:
    """Bin loads of a row, the identity bin order, and fresh bin versions (none recorded as seen:
    versions only grow within a call, so no reset of the seen tables is needed); returns the last
    version used."""
    for g in range(bin_load.size):
        bin_load[g] = _row_sum(fl, g * slots, slots)
        order[g] = g
        ver[g] = stamp + 1 + g
    return stamp + bin_load.size


@numba.njit(cache=True, inline="always")
def _declined_before(h: int, lt: int, ver: np.ndarray, seen_h: np.ndarray, seen_l: np.ndarray) -> bool:
    """Whether pair ``(h, lt)`` was evaluated without a move and neither bin changed since (then it
    declines again: the outcome depends only on the two bins' contents); records this evaluation."""
    if seen_h[h, lt] == ver[h] and seen_l[h, lt] == ver[lt]:
        return True
    seen_h[h, lt] = ver[h]
    seen_l[h, lt] = ver[lt]
    return False


@numba.njit(cache=True, inline="always")
def _after_move(
    fl: np.ndarray, slots: int, h: int, lt: int, bin_load: np.ndarray, ver: np.ndarray, stamp: int
) -> int:
    """New loads and versions of the two bins of a pair that changed; returns the last version used."""
    bin_load[h] = _row_sum(fl, h * slots, slots)
    bin_load[lt] = _row_sum(fl, lt * slots, slots)
    ver[h] = stamp + 1
    ver[lt] = stamp + 2
    return stamp + 2


@numba.njit(cache=True)
def swap_block(
    load: np.ndarray,
    expert: np.ndarray,
    fixed: np.ndarray,
    has_fixed: bool,
    rows: np.ndarray,
    tol: np.ndarray,
    rounds: int,
    it0: int,
    brute_force_slots: int,
) -> np.ndarray:
    """``rounds`` single-exchange rounds on ``rows`` of ``load``/``expert``/``fixed`` ``[B, G, S]`` in place.

    Per round, every pair of bins (see :func:`_pair_bins`) makes the one exchange of an item ``x`` of
    the heavy bin with an item ``y`` of the light bin that best evens the pair (gain
    ``min(x - y, gap - (x - y))``, first best in ``x``-major order), if it gains more than the row's
    ``tol`` and puts no expert twice on a GPU; fixed items never move. Up to ``brute_force_slots``
    slots every ``(x, y)`` is scored; above, for each ``x`` the ``y`` nearest ``x - gap / 2`` is found
    by binary search over the light bin's allowed items sorted by load.

    Returns:
        ``[len(rows)]`` bool, rows where something moved.
    """
    _, num_bins, slots = load.shape
    half = num_bins // 2
    moved = np.zeros(rows.size, dtype=np.bool_)
    heavy, light, bin_load, order, ver, seen_h, seen_l = _row_buffers(num_bins)
    num_ids = 1
    brute = slots <= brute_force_slots
    if not brute:
        for ri in range(rows.size):
            for g in range(num_bins):
                for s in range(slots):
                    if expert[rows[ri], g, s] + 1 > num_ids:
                        num_ids = expert[rows[ri], g, s] + 1
    held = np.zeros((num_bins, num_ids), dtype=np.int64)
    lb_eff = np.empty(slots)
    no_x = np.empty(slots, dtype=np.bool_)
    no_y = np.empty(slots, dtype=np.bool_)
    y_sorted = np.empty(slots, dtype=np.int64)
    stamp = 0
    for ri in range(rows.size):
        r = rows[ri]
        fl = load[r].reshape(-1)
        fe = expert[r].reshape(-1)
        ff = fixed[r].reshape(-1)
        stamp = _start_row(fl, slots, bin_load, order, ver, stamp)
        if not brute:
            held[:] = 0
            for g in range(num_bins):
                for s in range(slots):
                    held[g, fe[g * slots + s]] += 1
        for it in range(it0, it0 + rounds):
            _pair_bins(bin_load, order, it, heavy, light)
            any_move = False
            for k in range(half):
                h, lt = heavy[k], light[k]
                if _declined_before(h, lt, ver, seen_h, seen_l):
                    continue
                gap = bin_load[h] - bin_load[lt]
                ha, lb0 = h * slots, lt * slots
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
                        for y in range(slots):
                            if no_x[x] or no_y[y]:
                                gain = -_INF
                            else:
                                delta = fl[ha + x] - fl[lb0 + y]
                                gain = min(delta, gap - delta)
                            if gain > best:
                                best = gain
                                pa, pb = ha + x, lb0 + y
                else:
                    big = 0.0
                    for s in range(slots):
                        big = max(big, fl[ha + s], fl[lb0 + s])
                    big = 4.0 * big + 1.0
                    n_ok = 0
                    for y in range(slots):
                        bad_y = held[h, fe[lb0 + y]] > 0 or (has_fixed and ff[lb0 + y])
                        lb_eff[y] = big if bad_y else fl[lb0 + y]
                        # stable insertion sort of the light items by effective load
                        j = y
                        while j > 0 and lb_eff[y_sorted[j - 1]] > lb_eff[y]:
                            y_sorted[j] = y_sorted[j - 1]
                            j -= 1
                        y_sorted[j] = y
                        if not bad_y:
                            n_ok += 1
                    for x in range(slots):
                        q = fl[ha + x] - 0.5 * gap
                        lo_i, hi_i = 0, slots  # first position with lb_eff >= q
                        while lo_i < hi_i:
                            mid = (lo_i + hi_i) // 2
                            if lb_eff[y_sorted[mid]] < q:
                                lo_i = mid + 1
                            else:
                                hi_i = mid
                        lo = max(lo_i - 1, 0)
                        hi = min(lo_i, slots - 1)
                        d_lo = fl[ha + x] - lb_eff[y_sorted[lo]]
                        d_hi = fl[ha + x] - lb_eff[y_sorted[hi]]
                        g_lo = min(d_lo, gap - d_lo)
                        g_hi = min(d_hi, gap - d_hi)
                        if g_hi > g_lo:
                            gain, y = g_hi, y_sorted[hi]
                        else:
                            gain, y = g_lo, y_sorted[lo]
                        if held[lt, fe[ha + x]] > 0 or (has_fixed and ff[ha + x]):
                            gain = -_INF
                        if gain > best:
                            best = gain
                            pa, pb = ha + x, lb0 + y
                if best > tol[r]:
                    any_move = True
                    if not brute:
                        e_x, e_y = fe[pa], fe[pb]
                        held[h, e_x] -= 1
                        held[lt, e_y] -= 1
                        held[lt, e_x] += 1
                        held[h, e_y] += 1
                    fl[pa], fl[pb] = fl[pb], fl[pa]
                    fe[pa], fe[pb] = fe[pb], fe[pa]
                    ff[pa], ff[pb] = ff[pb], ff[pa]
                    stamp = _after_move(fl, slots, h, lt, bin_load, ver, stamp)
            if any_move:
                moved[ri] = True
    return moved


@numba.njit(cache=True, inline="always")
def _best_free_split(x: np.ndarray, member_f: np.ndarray, sums: np.ndarray, total32: np.float32) -> int:
    """First split minimising ``|2 s - T|`` among all splits (no constraint), ``s`` in float32.

    ``s`` of every split is the sequential float32 sum of its heavy items in index order, computed
    for all splits at once as ``sum_k member[k, c] * x[k]`` (adding ``0 * x`` changes nothing), a
    loop over the splits that the compiler vectorises.
    """
    num_splits = sums.size
    for c in range(num_splits):
        sums[c] = np.float32(0.0)
    for k in range(x.size):
        xk = x[k]
        for c in range(num_splits):
            sums[c] += member_f[k, c] * xk
    two_f = np.float32(2.0)
    for c in range(num_splits):
        sums[c] = abs(two_f * sums[c] - total32)
    best = sums[0]
    choice = 0
    for c in range(1, num_splits):
        if sums[c] < best:
            best = sums[c]
            choice = c
    return choice


@numba.njit(cache=True)
def resplit_block(
    load: np.ndarray,
    expert: np.ndarray,
    fixed: np.ndarray,
    has_fixed: bool,
    rows: np.ndarray,
    rounds: int,
    it0: int,
    idx_heavy: np.ndarray,
    idx_light: np.ndarray,
    member: np.ndarray,
) -> np.ndarray:
    """``rounds`` re-split rounds on ``rows`` of ``load``/``expert``/``fixed`` ``[B, G, S]`` in place.

    Every pair of bins (see :func:`_pair_bins`) pools its ``2 S`` items (heavy bin first) and takes
    the split into two bins of ``S`` that minimises ``|heavy - light|`` (first such split in
    ``idx_heavy`` order; every split keeps item 0 on the heavy side), among the splits that leave fixed
    items in place and put no expert twice on one side; the split is made only if it lowers the
    pair's larger load.

    Args:
        idx_heavy, idx_light: ``[C, S]`` item positions on each side of every split.
        member: ``[2S, C]`` bool, item on the heavy side.

    Returns:
        ``[len(rows)]`` bool, rows where something moved.
    """
    _, num_bins, slots = load.shape
    half = num_bins // 2
    two = 2 * slots
    moved = np.zeros(rows.size, dtype=np.bool_)
    heavy, light, bin_load, order, ver, seen_h, seen_l = _row_buffers(num_bins)
    items = np.empty(two)
    items32 = np.empty(two, dtype=np.float32)
    member_f = member.astype(np.float32)
    sums = np.empty(member.shape[1], dtype=np.float32)
    part = np.empty(slots, dtype=np.float32)
    comb = np.empty(slots, dtype=np.int64)
    ids = np.empty(two, dtype=np.int64)
    fix = np.empty(two, dtype=np.bool_)
    pos = np.empty(two, dtype=np.int64)
    tmp_l = np.empty(two)
    tmp_e = np.empty(two, dtype=np.int64)
    tmp_f = np.empty(two, dtype=np.bool_)
    clash_a = np.empty(two * two, dtype=np.int64)
    clash_b = np.empty(two * two, dtype=np.int64)
    stamp = 0
    for ri in range(rows.size):
        r = rows[ri]
        fl = load[r].reshape(-1)
        fe = expert[r].reshape(-1)
        ff = fixed[r].reshape(-1)
        stamp = _start_row(fl, slots, bin_load, order, ver, stamp)
        for it in range(it0, it0 + rounds):
            _pair_bins(bin_load, order, it, heavy, light)
            any_move = False
            for k in range(half):
                h, lt = heavy[k], light[k]
                if _declined_before(h, lt, ver, seen_h, seen_l):
                    continue
                any_fixed = False
                for s in range(slots):
                    pos[s] = h * slots + s
                    pos[slots + s] = lt * slots + s
                for i in range(two):
                    items[i] = fl[pos[i]]
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
                # splits are scored in float32 (the float64 sum of the chosen one decides the move)
                total32 = np.float32(total)
                for i in range(two):
                    items32[i] = np.float32(items[i])
                best = np.float32(_INF)
                choice = 0
                found = False
                if not any_fixed and n_clash == 0:
                    choice = _best_free_split(items32, member_f, sums, total32)
                    found = True
                    c = -1  # skip the general enumeration below
                else:
                    c = 0
                # splits in lexicographic order of their heavy side (comb[0] = 0), the partial
                # float32 sums of a shared prefix reused
                for j in range(slots):
                    comb[j] = j
                    part[j] = items32[j] if j == 0 else part[j - 1] + items32[j]
                while c >= 0:
                    ok = True
                    if any_fixed:
                        for i in range(two):
                            if fix[i] and member[i, c] != (i < slots):
                                ok = False
                                break
                    if ok:
                        for q in range(n_clash):
                            if member[clash_a[q], c] == member[clash_b[q], c]:
                                ok = False
                                break
                    if ok:
                        score = abs(np.float32(2.0) * part[slots - 1] - total32)
                        if not found or score < best:
                            best = score
                            choice = c
                            found = True
                    # next combination: the rightmost position that can still advance
                    i = slots - 1
                    while i >= 1 and comb[i] == slots + i:
                        i -= 1
                    if i < 1:
                        break
                    comb[i] += 1
                    part[i] = part[i - 1] + items32[comb[i]]
                    for j in range(i + 1, slots):
                        comb[j] = comb[j - 1] + 1
                        part[j] = part[j - 1] + items32[comb[j]]
                    c += 1
                if not found:
                    continue
                best_sum = 0.0
                for j in range(slots):
                    best_sum += items[idx_heavy[choice, j]]
                if max(best_sum, total - best_sum) < bin_load[h] * (1 - 1e-12):
                    any_move = True
                    for j in range(slots):
                        tmp_l[j] = items[idx_heavy[choice, j]]
                        tmp_l[slots + j] = items[idx_light[choice, j]]
                        src_h = pos[idx_heavy[choice, j]]
                        src_l = pos[idx_light[choice, j]]
                        tmp_e[j] = fe[src_h]
                        tmp_e[slots + j] = fe[src_l]
                        tmp_f[j] = ff[src_h]
                        tmp_f[slots + j] = ff[src_l]
                    for i in range(two):
                        fl[pos[i]] = tmp_l[i]
                        fe[pos[i]] = tmp_e[i]
                        ff[pos[i]] = tmp_f[i]
                    stamp = _after_move(fl, slots, h, lt, bin_load, ver, stamp)
            if any_move:
                moved[ri] = True
    return moved
