"""NumPy planner of the strict and global modes (private; inputs already validated).

Every step works on all layers at once (layers, or layer x node rows, along axis 0) with float64 /
int64 NumPy arrays: a NumPy call on these small arrays costs a fraction of a torch call on CPU, and the
sequential part (LPT packing) is a loop over the items of one row, never over layers. Torch appears only
at the API boundary and for one small matrix product per refinement round (it keeps to
``torch.get_num_threads()``, where NumPy's BLAS would start its own threads).
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np
import torch

from eplb_core import _core

# relative peak gap beyond which a losing candidate plan stops being refined
_PRUNE_MARGIN = 0.01
# a row stops once a block of rounds lowers its load above the mean by less than this fraction
_MIN_BLOCK_GAIN = 1e-6
# swaps that improve a pair by less than this fraction of the mean bin load are ignored
_REL_TOL = 1e-12
# a row whose peak is within this fraction of its lower bound stops refining (invisible in the
# reported balancedness, which has 4 decimals)
_CLOSE_ENOUGH = 2e-5
# up to this many slots per GPU the swap search tries every (x, y) pair, above it a binary search
_BRUTE_FORCE_SLOTS = 16
# pairs of bins with at most this many slots are re-split exhaustively (C(2S, S) / 2 splits: 126 at 5)
_MAX_RESPLIT_SLOTS = 5
# with more slots (up to this many), a round-robin start is refined beside the LPT start
_RR_MAX_SLOTS = 16


def split_counts(weight: np.ndarray, num_replicas: int, base: np.ndarray | None = None) -> np.ndarray:
    """Replica counts minimising the largest per-replica load, as the sequential greedy split hands them.

    The sequential greedy (give one replica to the expert with the heaviest per-replica load, lowest id
    on ties, repeat) hands the extra replicas to the largest values of ``{w_e / k : k >= base_e}`` in the
    order (value desc, expert id asc); all of them are taken at once here. Only experts among the
    ``extra`` heaviest per-replica loads can receive one, and an expert ends with at most
    ``R w_e / total + 1`` replicas, which bounds the candidate table.

    Args:
        weight: ``[B, N]`` float64, non-negative.
        num_replicas: replicas per row, ``>= N``.
        base: optional ``[B, N]`` int64 minimum counts (``>= 1``, row sums ``<= num_replicas``).

    Returns:
        ``[B, N]`` int64 counts, rows summing to ``num_replicas`` (the sequential greedy's counts).
    """
    num_rows, num_experts = weight.shape
    counts = np.ones((num_rows, num_experts), dtype=np.int64) if base is None else base.copy()
    extra_rows = num_replicas - counts.sum(1)
    extra = int(extra_rows.max())
    if extra == 0:
        return counts
    top = min(extra, num_experts)
    per = weight / counts
    heavy = np.sort(np.argsort(-per, axis=1, kind="stable")[:, :top], axis=1)  # by expert id
    w_top = np.take_along_axis(weight, heavy, 1)
    c_top = np.take_along_axis(counts, heavy, 1)
    total = np.maximum(weight.sum(1, keepdims=True), 1e-300)
    bound = float((num_replicas * w_top / total + 2 - c_top).max())
    max_extra = math.ceil(bound) if math.isfinite(bound) else extra
    max_extra = min(extra, max(max_extra, -(-extra // top), 1))
    k = np.arange(max_extra, dtype=np.float64)
    # the k-th extra replica of e is worth its per-replica load before the split, w / (c + k)
    cand = (w_top[:, :, None] / (c_top[:, :, None] + k)).reshape(num_rows, -1)
    order = np.argsort(-cand, axis=1, kind="stable")[:, :extra]  # ties: lower expert id, then lower k
    take = np.arange(extra) < extra_rows[:, None]
    chosen = np.take_along_axis(heavy, order // max_extra, 1)
    flat = (np.arange(num_rows)[:, None] * num_experts + chosen)[take]
    counts += np.bincount(flat, minlength=num_rows * num_experts).reshape(num_rows, num_experts)
    return counts


def slot_aware_counts(
    weight: np.ndarray, num_replicas: int, num_bins: int, greedy: np.ndarray | None = None
) -> np.ndarray:
    """Counts that leave room for the other ``S - 1`` items of a GPU (see ``_core.slot_aware_counts``).

    Args:
        weight: ``[B, N]`` float64.
        greedy: ``split_counts(weight, num_replicas)`` if already known (returned when no expert needs
            more than one replica to fit).

    Returns:
        ``[B, N]`` int64.
    """
    slots = num_replicas // num_bins
    if slots <= 1 or num_replicas == weight.shape[1]:
        return split_counts(weight, num_replicas) if greedy is None else greedy
    mean_bin = weight.sum(1, keepdims=True) / num_bins
    filler = np.sort(weight, axis=1)[:, : slots - 1].sum(1, keepdims=True)
    room = mean_bin - filler
    with np.errstate(divide="ignore", invalid="ignore"):
        need = np.where(room > 0, np.ceil(weight / np.maximum(room, 1e-300)), 1.0)
    need = np.clip(need, 1, num_replicas).astype(np.int64)
    base = np.where(need.sum(1, keepdims=True) <= num_replicas, need, 1)
    if greedy is not None and bool((base == 1).all()):
        return greedy
    return split_counts(weight, num_replicas, base)


def lpt_bins(item_load: np.ndarray, num_bins: int, item_expert: np.ndarray | None = None) -> np.ndarray:
    """LPT with ``M / num_bins`` items per bin: bin ``[B, M]`` int64 of every item.

    Items by decreasing load (stable), each onto the lightest bin with a free slot (lowest index on
    ties). With ``item_expert``, an item avoids the bins holding its expert while another bin with a
    free slot does not. Same bins as the greedy baseline's ``_greedy._lpt_pack``, which the tests check.

    Replicas of one expert have equal loads and are adjacent in the input (expert-major), so they stay
    adjacent in the sorted order: "holding its expert" only needs the bins of the current run. When the
    ``G - 1`` heaviest items of every row are positive, the first ``G`` items land on bins ``0..G-1`` in
    order (every bin is empty and the lowest index wins), so the loop starts at item ``G``. The loop
    runs over the items of a row, all rows at once.
    """
    num_rows, num_items = item_load.shape
    cap = num_items // num_bins
    order = np.argsort(-item_load, axis=1, kind="stable")
    w_sorted = np.take_along_axis(item_load, order, 1).T.copy()  # [M, B]: one contiguous row per step
    e_sorted = None if item_expert is None else np.take_along_axis(item_expert, order, 1).T.copy()
    key = np.zeros(num_rows * num_bins)
    fill = np.zeros(num_rows * num_bins, dtype=np.int64)
    key2 = key.reshape(num_rows, num_bins)
    row_base = np.arange(num_rows) * num_bins
    bins_sorted = np.empty((num_items, num_rows), dtype=np.int64)
    # duplicates: run_start[r] is the step where row r's current run of one expert began, and
    # tag[r, bin] the run start of the last item put on bin; the bin holds the run's expert iff equal
    tag = np.full(num_rows * num_bins, -1, dtype=np.int64)
    tag2 = tag.reshape(num_rows, num_bins)
    run_start = np.zeros(num_rows, dtype=np.int64)
    first = 0
    if num_bins == 1 or cap == 1 or bool((w_sorted[num_bins - 2] > 0).all()):
        first = num_bins
        bins_sorted[:first] = np.arange(first)[:, None]
        key2[:] = w_sorted[:first].T
        fill[:] = 1
        if cap == 1:
            key[:] = np.inf
        if e_sorted is not None:
            # run start of every item of the first round, then the one of the last item
            starts = np.zeros((first, num_rows), dtype=np.int64)
            for step in range(1, first):
                starts[step] = np.where(e_sorted[step] == e_sorted[step - 1], starts[step - 1], step)
            tag2[:] = starts.T
            run_start = starts[first - 1].copy()
    same_prev = np.zeros((num_items, num_rows), dtype=bool)
    if e_sorted is not None:
        same_prev[1:] = e_sorted[1:] == e_sorted[:-1]
    cont = np.any(same_prev, axis=1).tolist()  # steps continuing a run in some row: only ones with clashes
    inf = np.inf
    for step in range(first, num_items):
        b = key2.argmin(1)
        if e_sorted is not None:
            if cont[step]:
                run_start = np.where(same_prev[step], run_start, step)
                clash = np.flatnonzero(tag[row_base + b] == run_start)
                if clash.size:
                    # avoid the bins holding the run's expert while a free one does not
                    masked = np.where(tag2[clash] == run_start[clash, None], inf, key2[clash])
                    alt = masked.argmin(1)
                    ok = masked[np.arange(clash.size), alt] < inf
                    b[clash[ok]] = alt[ok]
            else:
                run_start[:] = step
            tag[row_base + b] = run_start
        flat = row_base + b
        bins_sorted[step] = b
        key[flat] += w_sorted[step]
        f = fill[flat] + 1
        fill[flat] = f
        full = f == cap
        if full.any():
            key[flat[full]] = inf
    out = np.empty((num_rows, num_items), dtype=np.int64)
    np.put_along_axis(out, order, bins_sorted.T, 1)
    return out


def rr_bins(item_load: np.ndarray, num_bins: int) -> np.ndarray:
    """Round robin: items by decreasing load (stable), position ``p`` onto bin ``p mod num_bins``."""
    order = np.argsort(-item_load, axis=1, kind="stable")
    out = np.empty_like(order)
    np.put_along_axis(out, order, np.broadcast_to(np.arange(order.shape[1]) % num_bins, order.shape), 1)
    return out


def layout(bins: np.ndarray, num_bins: int, *items: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-item arrays ``[B, M]`` laid out as ``[B, num_bins, M / num_bins]`` by their bin."""
    num_rows = bins.shape[0]
    order = np.argsort(bins, axis=1, kind="stable")
    return tuple(np.take_along_axis(t, order, 1).reshape(num_rows, num_bins, -1) for t in items)


def refine(
    load: np.ndarray,
    expert: np.ndarray,
    fixed: np.ndarray | None,
    *,
    iters: int,
    rows_per_group: int = 1,
    num_candidates: int = 1,
    block: int = 4,
) -> tuple[np.ndarray, np.ndarray]:
    """Pairwise refinement of packed rows; never raises a row's heaviest bin.

    Each round sorts the bins of every row by load and pairs the k-th heaviest with a light partner
    (the pairing rotates from round to round). With at most ``_MAX_RESPLIT_SLOTS`` slots per GPU, each
    pair's ``2 S`` items are re-split optimally into two bins of ``S`` (every split that keeps the heavy
    bin's first item, scored with one matrix product); with more slots, the single exchange that best
    evens the pair is made. A move is taken only when it strictly lowers the pair's larger load and
    puts no expert twice on a GPU; fixed items never change GPU.

    Rows leave after a block of ``block`` rounds once their peak is at their own lower bound
    (``max(total / G, heaviest item)``) or at the best bound of another row of their layer
    (``rows_per_group`` consecutive rows, e.g. the nodes of a layer), or once a block no longer shrinks
    their load above the mean.

    Args:
        load: ``[B, G, S]`` float64 item loads.
        expert: ``[B, G, S]`` int64 expert ids.
        fixed: optional ``[B, G, S]`` bool, items that never change GPU.
        iters: rounds at most.
        rows_per_group: rows of one layer (consecutive).
        num_candidates: the rows are that many stacked plans of the same layers (candidate-major); a
            candidate that trails the best one of its layer by more than 1% stops refining that layer.

    Returns:
        ``(load, expert)`` refined copies.
    """
    load, expert = load.copy(), expert.copy()
    fixed = None if fixed is None else fixed.copy()
    num_rows, num_bins, slots = load.shape
    if num_bins < 2 or iters <= 0:
        return load, expert
    alive = np.ones(num_rows, dtype=bool)
    total = load.sum((1, 2))
    it = 0
    while it < iters:
        bin_load = load.sum(-1)
        peak = bin_load.max(1)
        excess = np.maximum(bin_load - (total / num_bins)[:, None], 0).sum(1)
        row_lb = np.maximum(total / num_bins, load.reshape(num_rows, -1).max(1))
        floor = np.repeat(row_lb.reshape(-1, rows_per_group).max(1), rows_per_group)
        active = alive & (peak > floor * (1 + _CLOSE_ENOUGH)) & (peak > row_lb * (1 + _CLOSE_ENOUGH))
        if num_candidates > 1 and it > 0:
            layer_peak = peak.reshape(num_candidates, -1, rows_per_group).max(-1)
            keep = layer_peak <= layer_peak.min(0, keepdims=True) * (1 + _PRUNE_MARGIN)
            active &= np.repeat(keep.reshape(-1), rows_per_group)
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        rounds = min(block, iters - it)
        sub_l, sub_e = load[idx], expert[idx]
        sub_f = None if fixed is None else fixed[idx]
        if slots <= _MAX_RESPLIT_SLOTS:
            moved = _resplit_block(sub_l, sub_e, sub_f, rounds, it)
        else:
            moved = _swap_block(sub_l, sub_e, sub_f, rounds, it)
        load[idx], expert[idx] = sub_l, sub_e
        if fixed is not None and sub_f is not None:
            fixed[idx] = sub_f
        after = np.maximum(sub_l.sum(-1) - (total[idx] / num_bins)[:, None], 0).sum(1)
        alive[idx] = moved & (excess[idx] - after > _MIN_BLOCK_GAIN * total[idx])
        it += rounds
    return load, expert


@lru_cache(maxsize=8)
def _split_tables(
    slots: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tables of the splits of ``2 S`` items (``S`` of the heavy bin, then ``S`` of the light bin).

    Returns ``(member [2S, C], pair_a, pair_b, same_side [P2, C], idx_heavy [C, S], idx_light [C, S])``
    over the ``C`` splits whose heavy side keeps item 0: ``member`` is 1 for the items going to the
    heavy bin, ``same_side`` says whether item pair ``(pair_a, pair_b)`` ends on one side.
    """
    num = 2 * slots
    splits = [c for c in itertools.combinations(range(num), slots) if c[0] == 0]
    member = np.zeros((num, len(splits)))
    for j, c in enumerate(splits):
        member[list(c), j] = 1.0
    pairs = list(itertools.combinations(range(num), 2))
    pair_a = np.array([a for a, _ in pairs])
    pair_b = np.array([b for _, b in pairs])
    same_side = (member[pair_a] == member[pair_b]).astype(np.float64)
    idx_heavy = np.array(splits, dtype=np.int64)
    idx_light = np.array([[i for i in range(num) if i not in c] for c in splits], dtype=np.int64)
    return member, pair_a, pair_b, same_side, idx_heavy, idx_light


def _pairs(bin_load: np.ndarray, it: int) -> tuple[np.ndarray, np.ndarray]:
    """Global bin ids ``(heavy [B * P], light [B * P])`` of this round's ``P = G // 2`` pairs.

    The heavier half of the bins is paired with the lighter half, the k-th heaviest with the
    ``(k + it) mod P``-th lightest, so that every heavy bin meets every light one over ``P`` rounds.
    """
    num_rows, num_bins = bin_load.shape
    half = num_bins // 2
    order = np.argsort(-bin_load, axis=1, kind="stable")
    heavy = order[:, :half]
    light = order[:, num_bins - half :][:, ::-1]  # lightest first
    light = light[:, (np.arange(half) + it) % half]
    base = (np.arange(num_rows) * num_bins)[:, None]
    return (base + heavy).reshape(-1), (base + light).reshape(-1)


def _resplit_block(
    load: np.ndarray, expert: np.ndarray, fixed: np.ndarray | None, rounds: int, it0: int
) -> np.ndarray:
    """``rounds`` re-split rounds on ``load``/``expert``/``fixed`` in place; ``[B]`` rows that moved."""
    num_rows, num_bins, slots = load.shape
    member, pair_a, pair_b, same_side, idx_heavy, idx_light = _split_tables(slots)
    # an item leaving its bin: membership differs from the start (heavy items first, on side 1)
    start_side = np.concatenate([np.ones(slots), np.zeros(slots)])
    leaves = (member != start_side[:, None]).astype(np.float64)
    member_t = torch.from_numpy(member.astype(np.float32))
    moved = np.zeros(num_rows, dtype=bool)
    flat_l, flat_e = load.reshape(-1), expert.reshape(-1)
    flat_f = None if fixed is None else fixed.reshape(-1)
    bins = load.reshape(-1, slots)
    bin_load = bins.sum(1)
    slot = np.arange(slots)
    for it in range(it0, it0 + rounds):
        heavy, light = _pairs(bin_load.reshape(num_rows, num_bins), it)
        pos = np.concatenate([heavy[:, None] * slots + slot, light[:, None] * slots + slot], 1)  # [N, 2S]
        items = flat_l[pos]
        ids = flat_e[pos]
        total = bin_load[heavy] + bin_load[light]
        # heavy-bin load of every split, in float32 (the chosen split is re-summed in float64 below);
        # torch: one thread under torch.set_num_threads(1), unlike NumPy's BLAS
        sums = (torch.from_numpy(items.astype(np.float32)) @ member_t).numpy()
        score = np.abs(2.0 * sums - total.astype(np.float32)[:, None])  # |heavy - light| after each split
        if flat_f is not None:
            fix = flat_f[pos]
            # fixed items may share a GPU with their own replicas already: never count those as clashes
            ids = np.where(fix, -1 - np.arange(2 * slots), ids)
            _forbid(score, fix, leaves)
        _forbid(score, ids[:, pair_a] == ids[:, pair_b], same_side)
        choice = score.argmin(1)
        new_heavy = np.take_along_axis(items, idx_heavy[choice], 1).sum(1)
        do = np.maximum(new_heavy, total - new_heavy) < bin_load[heavy] * (1 - 1e-12)
        if not do.any():
            continue
        moved |= do.reshape(num_rows, -1).any(1)
        p = pos[do]
        c = choice[do]
        src = np.concatenate(
            [np.take_along_axis(p, idx_heavy[c], 1), np.take_along_axis(p, idx_light[c], 1)], 1
        )
        flat_l[p] = flat_l[src]
        flat_e[p] = flat_e[src]
        if flat_f is not None:
            flat_f[p] = flat_f[src]
        # exact sums of the new bins (summation order differs from new_heavy's)
        changed = np.concatenate([heavy[do], light[do]])
        bin_load[changed] = bins[changed].sum(1)
    return moved


def _forbid(score: np.ndarray, hits: np.ndarray, table: np.ndarray) -> None:
    """Set ``score [N, C]`` to inf where a row's ``hits [N, K]`` meet ``table [K, C]`` (in place)."""
    rows = np.flatnonzero(hits.any(1))
    if rows.size:
        bad = np.einsum("nk,kc->nc", hits[rows].astype(np.float64), table) > 0
        sub = score[rows]
        sub[bad] = np.inf
        score[rows] = sub


def _swap_block(
    load: np.ndarray, expert: np.ndarray, fixed: np.ndarray | None, rounds: int, it0: int
) -> np.ndarray:
    """``rounds`` single-exchange rounds in place (many slots per GPU); ``[B]`` rows that moved.

    Up to ``_BRUTE_FORCE_SLOTS`` slots every ``(x, y)`` exchange of a pair is scored (pairs along the
    last axis, so every NumPy call runs over long contiguous rows); above, for each ``x`` the ``y``
    closest to ``x - gap / 2`` is found by binary search.
    """
    num_rows, num_bins, slots = load.shape
    moved = np.zeros(num_rows, dtype=bool)
    flat_l, flat_e = load.reshape(-1), expert.reshape(-1)
    flat_f = None if fixed is None else fixed.reshape(-1)
    bins = load.reshape(-1, slots)
    bin_load = bins.sum(1)
    tol = np.repeat((_REL_TOL / num_bins) * load.sum((1, 2)), num_bins // 2)
    slot = np.arange(slots)
    if slots > _BRUTE_FORCE_SLOTS:
        # items of each expert on each bin, [bins * E] (a swap updates four entries)
        num_ids = int(flat_e.max()) + 1
        held = np.bincount(
            np.arange(flat_e.size) // slots * num_ids + flat_e, minlength=bin_load.size * num_ids
        )
    for it in range(it0, it0 + rounds):
        heavy, light = _pairs(bin_load.reshape(num_rows, num_bins), it)
        gap = bin_load[heavy] - bin_load[light]
        if slots <= _BRUTE_FORCE_SLOTS:
            pos_a = slot[:, None] + heavy * slots  # [S, N]
            pos_b = slot[:, None] + light * slots
            la, lb = flat_l[pos_a], flat_l[pos_b]
            ea, eb = flat_e[pos_a], flat_e[pos_b]
            same = ea[:, None, :] == eb[None, :, :]  # [S, S, N]
            bad_x, bad_y = same.any(1), same.any(0)
            if flat_f is not None:
                bad_x |= flat_f[pos_a]
                bad_y |= flat_f[pos_b]
            delta = la[:, None, :] - lb[None, :, :]
            gain = np.minimum(delta, gap - delta)
            np.putmask(gain, bad_x[:, None, :] | bad_y[None, :, :], -np.inf)
            gain = gain.reshape(slots * slots, -1)
            pick = gain.argmax(0)
            cols = np.arange(gain.shape[1])
            best = gain[pick, cols]
            pa_all = pos_a[pick // slots, cols]
            pb_all = pos_b[pick % slots, cols]
        else:
            pos_a = heavy[:, None] * slots + slot  # [N, S]
            pos_b = light[:, None] * slots + slot
            la, lb = flat_l[pos_a], flat_l[pos_b]
            ea, eb = flat_e[pos_a], flat_e[pos_b]
            bad_x = held[light[:, None] * num_ids + ea] > 0  # x's expert already on the light GPU
            bad_y = held[heavy[:, None] * num_ids + eb] > 0
            if flat_f is not None:
                bad_x |= flat_f[pos_a]
                bad_y |= flat_f[pos_b]
            # excluded y: far above every load, so that no exchange with them gains
            lb_eff = np.where(bad_y, 4.0 * max(la.max(), lb.max()) + 1.0, lb)
            y_sorted = np.argsort(lb_eff, axis=1, kind="stable")
            lbs = np.take_along_axis(lb_eff, y_sorted, 1)
            # the y of the light bin whose exchange with x moves closest to half the gap
            at = _row_searchsorted(lbs, la - 0.5 * gap[:, None])
            lo, hi = np.maximum(at - 1, 0), np.minimum(at, slots - 1)
            d_lo = la - np.take_along_axis(lbs, lo, 1)
            d_hi = la - np.take_along_axis(lbs, hi, 1)
            g_lo = np.minimum(d_lo, gap[:, None] - d_lo)
            g_hi = np.minimum(d_hi, gap[:, None] - d_hi)
            take_hi = g_hi > g_lo
            gain = np.where(take_hi, g_hi, g_lo)
            gain[bad_x] = -np.inf
            y = np.take_along_axis(y_sorted, np.where(take_hi, hi, lo), 1)
            best_x = gain.argmax(1)
            rows = np.arange(gain.shape[0])
            best = gain[rows, best_x]
            pa_all = pos_a[rows, best_x]
            pb_all = pos_b[rows, y[rows, best_x]]
        do = best > tol
        if not do.any():
            continue
        moved |= do.reshape(num_rows, -1).any(1)
        pa, pb = pa_all[do], pb_all[do]
        if slots > _BRUTE_FORCE_SLOTS:
            e_x, e_y = flat_e[pa], flat_e[pb]
            h_bin, l_bin = pa // slots * num_ids, pb // slots * num_ids
            held[h_bin + e_x] -= 1
            held[l_bin + e_y] -= 1
            held[l_bin + e_x] += 1
            held[h_bin + e_y] += 1
        for flat in (flat_l, flat_e) + (() if flat_f is None else (flat_f,)):
            tmp = flat[pa]
            flat[pa] = flat[pb]
            flat[pb] = tmp
        changed = np.concatenate([heavy[do], light[do]])
        bin_load[changed] = bins[changed].sum(1)
    return moved


def _row_searchsorted(sorted_rows: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Left insertion points ``[N, Q]`` of ``queries`` in each row of ``sorted_rows [N, S]`` (finite).

    One ``np.searchsorted`` over the rows laid end to end, each shifted by its index times the span of
    all values (NumPy has no batched search; torch's costs more on these small shapes).
    """
    num, width = sorted_rows.shape
    low = min(sorted_rows.min(), queries.min())
    span = max(sorted_rows.max(), queries.max()) - low + 1
    shift = np.arange(num)[:, None] * span - low
    at = np.searchsorted((sorted_rows + shift).reshape(-1), (queries + shift).reshape(-1))
    return at.reshape(num, -1) - np.arange(num)[:, None] * width


def assign_groups_to_nodes(group_load: np.ndarray, num_nodes: int) -> np.ndarray:
    """Node of every group ``[L, g]`` int64 minimising the heaviest node (equal group counts).

    Exact by enumeration when the partitions can be listed (105 for 8 groups on 4 nodes); otherwise
    the torch LPT + swap packing of ``_core.assign_groups_to_nodes``.
    """
    num_layers, num_groups = group_load.shape
    if num_nodes == 1:
        return np.zeros((num_layers, num_groups), dtype=np.int64)
    parts_t = _core._equal_partitions(num_groups, num_nodes)
    if parts_t is None:
        return _core.assign_groups_to_nodes(torch.from_numpy(group_load), num_nodes)[0].numpy()
    parts = parts_t.numpy()
    onehot = (parts[:, :, None] == np.arange(num_nodes)).astype(np.float64)  # [C, g, n]
    node_loads = group_load @ onehot.transpose(1, 0, 2).reshape(num_groups, -1)
    best = node_loads.reshape(num_layers, -1, num_nodes).max(2).argmin(1)
    return parts[best]


def _node_major(
    weight: np.ndarray, node_of_group: np.ndarray, num_nodes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Experts node-major (ascending id inside a node): ``(ids, loads)`` ``[L * nodes, N / nodes]``."""
    num_layers, num_experts = weight.shape
    group_size = num_experts // node_of_group.shape[1]
    node_of_expert = np.repeat(node_of_group, group_size, axis=1)
    order = np.argsort(node_of_expert * num_experts + np.arange(num_experts), axis=1)
    ids = order.reshape(num_layers * num_nodes, -1)
    return ids, np.take_along_axis(weight, order, 1).reshape(ids.shape)


def _expand(w_rows: np.ndarray, counts: np.ndarray, num_items: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-replica ``(load, local expert index)`` ``[B, num_items]``, expert-major."""
    num_rows, num_experts = counts.shape
    local = np.repeat(np.tile(np.arange(num_experts), num_rows), counts.reshape(-1)).reshape(num_rows, -1)
    return np.take_along_axis(w_rows / counts, local, 1), local


def _scatter_counts(ids: np.ndarray, counts: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, N]`` counts by expert id from node-major rows ``[L * nodes, N / nodes]``."""
    out = np.empty((ids.size // num_experts, num_experts), dtype=np.int64)
    np.put_along_axis(out, ids.reshape(out.shape), counts.reshape(out.shape), 1)
    return out


def solve(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    iters: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Strict (``num_nodes > 1``) or global (one node, one group) plan of every layer.

    1. Groups go to nodes by the optimal equal split, each node's experts get slot-aware replica counts,
       and the replicas are packed onto the node's GPUs by LPT, replicas of an expert on distinct GPUs.
    2. The refinement (:func:`refine`) improves every node row.
    3. On layers where the greedy DeepSeek-style plan (groups by LPT, greedy replica split, LPT onto
       GPUs, duplicate-avoiding: exactly ``_greedy.greedy_rebalance(..., avoid_duplicates=True)``)
       differs from the start of step 1, it is packed too; where it beats the refined plan, it is
       refined and kept. Where it does not differ, it *is* the start. The refinement never raises a
       row's peak, so no layer ends worse than that greedy plan.

    Args:
        weight: ``[L, N]`` float64, rows not all zero.

    Returns:
        ``(phy2log [L, R], logcnt [L, N])`` int64, GPU-major slots, sorted inside a GPU.
    """
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    reps_node = num_replicas // num_nodes
    num_bins = num_gpus // num_nodes
    group_load = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    ours_nodes = assign_groups_to_nodes(group_load, num_nodes)
    greedy_nodes = lpt_bins(group_load, num_nodes) if num_nodes > 1 else ours_nodes
    if num_nodes > 1:
        # where the greedy split is optimal too (ties), take it: the greedy plan is then our start
        rows = np.arange(num_layers)[:, None]
        node_max = [
            np.bincount((rows * num_nodes + n).reshape(-1), group_load.reshape(-1), num_layers * num_nodes)
            .reshape(num_layers, -1)
            .max(1)
            for n in (ours_nodes, greedy_nodes)
        ]
        ours_nodes = np.where((node_max[1] <= node_max[0])[:, None], greedy_nodes, ours_nodes)
    ids_o, w_o = _node_major(weight, ours_nodes, num_nodes)
    if bool((ours_nodes == greedy_nodes).all()):
        ids_g, w_g = ids_o, w_o
        counts_g = split_counts(w_g, reps_node)
        counts_o = slot_aware_counts(w_o, reps_node, num_bins, greedy=counts_g)
    else:
        ids_g, w_g = _node_major(weight, greedy_nodes, num_nodes)
        counts_o = slot_aware_counts(w_o, reps_node, num_bins)
        counts_g = split_counts(w_g, reps_node)
    # The greedy plan must be packed on the layers where its node split or counts differ from ours
    # and a lower bound on its peak (its heaviest node over the GPUs of a node, its heaviest replica)
    # is not already above our lower bound... which it never is once refined; so: on every such layer.
    same = (ours_nodes == greedy_nodes).all(1) & (counts_o == counts_g).reshape(num_layers, -1).all(1)
    check = np.flatnonzero(~same)
    g_rows = (check[:, None] * num_nodes + np.arange(num_nodes)).reshape(-1)
    ids = np.concatenate([ids_o, ids_g[g_rows]])
    counts = np.concatenate([counts_o, counts_g[g_rows]])
    item_load, local = _expand(np.concatenate([w_o, w_g[g_rows]]), counts, reps_node)
    item_expert = np.take_along_axis(ids, local, 1)
    item_count = np.take_along_axis(counts, local, 1)
    # one LPT batch: our start (exactly the greedy plan on the layers where nothing differs) and the
    # greedy plan of the other layers
    lpt = layout(lpt_bins(item_load, num_bins, local), num_bins, item_load, item_expert, item_count)
    n_ours = num_layers * num_nodes
    starts = [tuple(t[:n_ours] for t in lpt)]
    if _MAX_RESPLIT_SLOTS < num_replicas // num_gpus <= _RR_MAX_SLOTS:
        # many slots per GPU: the round robin start too (its refinement ends lower on some layers)
        sl = slice(0, n_ours)
        rr = rr_bins(item_load[sl], num_bins)
        starts.append(layout(rr, num_bins, item_load[sl], item_expert[sl], item_count[sl]))
    load = np.concatenate([x[0] for x in starts])
    expert = np.concatenate([x[1] for x in starts])
    count = np.concatenate([x[2] for x in starts])
    rounds = default_iters(num_bins) if iters is None else iters
    fixed = count > num_bins  # more replicas than GPUs: spread by LPT, then left alone
    load, expert = refine(
        load,
        expert,
        fixed if fixed.any() else None,
        iters=rounds,
        rows_per_group=num_nodes,
        num_candidates=len(starts),
    )
    peak = load.sum(-1).max(-1).reshape(len(starts), num_layers, num_nodes).max(-1)
    pick = peak.argmin(0)  # first on ties: the LPT start
    layers = np.arange(num_layers)
    phy2log = np.sort(expert, axis=-1).reshape(len(starts), num_layers, num_replicas)[pick, layers]
    logcnt = _scatter_counts(ids_o, counts_o, num_experts)
    if check.size:
        load_g, expert_g, count_g = (t[n_ours:] for t in lpt)
        peak_g = load_g.sum(-1).max(-1).reshape(-1, num_nodes).max(-1)
        win = np.flatnonzero(peak_g < peak[pick, layers][check])
        if win.size:  # the greedy plan is better on these layers: refine it and keep it
            rows_w = (win[:, None] * num_nodes + np.arange(num_nodes)).reshape(-1)
            fixed_g = count_g[rows_w] > num_bins
            _, expert_w = refine(
                load_g[rows_w],
                expert_g[rows_w],
                fixed_g if fixed_g.any() else None,
                iters=rounds,
                rows_per_group=num_nodes,
            )
            phy2log[check[win]] = np.sort(expert_w, axis=-1).reshape(-1, num_replicas)
            g_ids, g_counts = ids[n_ours:][rows_w], counts[n_ours:][rows_w]
            logcnt[check[win]] = _scatter_counts(g_ids, g_counts, num_experts)
    return phy2log, logcnt


def default_iters(num_bins: int) -> int:
    """Refinement rounds at most: enough for every bin to meet several partners."""
    return int(min(32, max(12, num_bins + 8)))
