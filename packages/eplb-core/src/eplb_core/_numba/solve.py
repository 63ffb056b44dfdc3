"""Strict and global plans of every layer (:func:`solve_layers`), and the packing of given items onto
GPUs (:func:`pack_layers`, used by the soft-locality mode)."""

from __future__ import annotations

import numpy as np

from eplb_core._numba.counts import _greedy_counts_row, _is_greedy_split, _slot_aware_row
from eplb_core._numba.refine import (
    _expand_row,
    _node_max,
    _node_rows,
    _peak,
    _refine,
    _repair_row,
    _workspace,
    _write_sorted,
)
from eplb_core._numba.starts import _layout_row, _lpt_into, _lpt_workspace, _plain_lpt_peak, _slot_order
from eplb_core._numba.utils import (
    _INF,
    BRUTE_FORCE_SLOTS,
    GREEDY_MARGIN,
    MAX_RESPLIT_SLOTS,
    RR_MAX_SLOTS,
    njit,
)


@njit
def _write_layer(
    load: np.ndarray,
    expert: np.ndarray,
    fixed: np.ndarray,
    first: int,
    num_rows: int,
    slots: int,
    no_budget: np.ndarray,
    ids: np.ndarray,
    cnt: np.ndarray,
    phy_row: np.ndarray,
    cnt_row: np.ndarray,
    srt: np.ndarray,
    use_srt: bool | np.bool_,
) -> None:
    """Write the chosen start of a layer: repair rows ``first .. first + num_rows`` (no avoidable
    repeat of an expert on a GPU), write them into ``phy_row`` (a GPU's slots by decreasing load, ties
    by expert id; with ``use_srt`` taken in the slot order ``srt`` of :func:`_write_sorted`), and the
    replica counts ``cnt [nodes, per_node]`` of the experts ``ids`` into ``cnt_row``."""
    num_bins = load.shape[1]
    for r in range(first, first + num_rows):
        _repair_row(
            load[r].reshape(-1), expert[r].reshape(-1), fixed[r].reshape(-1), num_bins, slots, no_budget, -1
        )
    _write_sorted(expert, load, first, num_rows, phy_row, srt, use_srt)
    for n in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            cnt_row[ids[n, j]] = cnt[n, j]


@njit
def _seq_peak(load: np.ndarray) -> float:
    """Heaviest bin of ``load [G, S]``, each bin summed sequentially in slot order (as
    :func:`~eplb_core._numba.starts._plain_lpt_peak` sums the bins of a packing without moves)."""
    out = -_INF
    for g in range(load.shape[0]):
        acc = 0.0
        for s in range(load.shape[1]):
            acc += load[g, s]
        out = max(out, acc)
    return out


@njit
def solve_layers(
    weight: np.ndarray,
    group_load: np.ndarray,
    ours_nodes: np.ndarray,
    num_replicas: int,
    num_nodes: int,
    num_gpus: int,
    iters: int,
    tables: tuple,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Strict (``num_nodes > 1``) or global (one node, one group) plan of every layer.

    Per layer:

    1. Groups go to nodes by ``ours_nodes`` (the optimal equal split), or by the greedy LPT split when
       that is optimal too; each node's experts get slot-aware replica counts
       (:func:`_slot_aware_row`), and the replicas are packed onto the node's GPUs by LPT, replicas of
       an expert on distinct GPUs (with 6-16 slots per GPU, a round-robin start too).
    2. :func:`_refine` improves every node row of every start; the start with the lowest peak is kept.
    3. Where the greedy DeepSeek-style plan (groups by LPT, greedy replica split, LPT onto GPUs,
       duplicate-avoiding: exactly :func:`eplb_core.reference.greedy_rebalance` with ``avoid_duplicates=True``) differs
       from the start of step 1, it is packed too; where it beats the refined plan, it is refined and
       kept. Where it does not differ, it *is* the start. The refinement never raises a row's peak,
       so no layer ends worse than that greedy plan.

    Args:
        weight: ``[L, N]`` float64, rows not all zero.
        group_load: ``[L, g]`` float64 group sums.
        ours_nodes: ``[L, g]`` int64 node of every group (optimal split).
        tables: split tables of :func:`_resplit_rounds` for ``S`` slots per GPU.

    Returns:
        ``(phy2log [L, R], logcnt [L, N])`` int64, GPU-major slots (a GPU's by decreasing load, ties by id), and
        ``greedy_peak [L]`` float64: the heaviest GPU of DeepSeek's greedy plan (plain LPT, repeats
        allowed) where the duplicate-avoiding packing moved a replica off its lightest GPU and that
        GPU is not heavier than the plan's (up to ``GREEDY_MARGIN``), else infinite (the plan is at
        least as balanced there).
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
    greedy_moved = np.zeros(num_layers, dtype=np.bool_)
    greedy_peak = np.zeros(num_layers)
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
    bins_plain = np.empty(reps, dtype=np.int64)
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
    lw = _lpt_workspace(reps, num_bins)
    node_lw = _lpt_workspace(num_groups, num_nodes)
    ws = _workspace(num_bins, slots, num_experts, tables[3].shape[1], num_cand * num_nodes)
    # the sweep's slot order of every row (many slots), written from the starts' load order (_refine)
    presort = slots > BRUTE_FORCE_SLOTS
    srt = ws[1][5]
    presorted = ws[3][0][3]
    item_slot = np.empty(reps, dtype=np.int64)
    node_moved = np.zeros(num_nodes, dtype=np.bool_)
    stamp = np.int64(0)
    no_budget = np.empty(0, dtype=np.int64)
    for layer in range(num_layers):
        gl = group_load[layer]
        node_use = ours_nodes[layer]
        if num_nodes > 1:
            _lpt_into(gl, node_g, np.bool_(False), num_nodes, node_g, node_key, node_fill, node_tag, node_lw)
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
            order, first_moved = _lpt_into(
                item_load, item_local, np.bool_(True), num_bins, bins, key, fill, tag, lw
            )
            any_fixed |= _layout_row(
                bins, item_load, item_expert, item_count, num_bins, load[n], expert[n], fixed[n], fill
            )
            if presort:
                _slot_order(bins, order, item_load, num_bins, srt[n], fill, item_slot)
                presorted[n] = True
            node_moved[n] = first_moved >= 0
            if same and first_moved >= 0:  # this start is the greedy plan, but for a moved replica
                greedy_moved[layer] = True
                pk = _plain_lpt_peak(
                    item_load, item_local, order, first_moved, num_bins, bins, bins_plain, key, fill, tag, lw
                )
                greedy_peak[layer] = max(greedy_peak[layer], pk)
            if num_cand == 2:
                for p in range(reps):
                    bins[order[p]] = p % num_bins
                r = num_nodes + n
                _layout_row(
                    bins, item_load, item_expert, item_count, num_bins, load[r], expert[r], fixed[r], fill
                )
                if presort:
                    _slot_order(bins, order, item_load, num_bins, srt[r], fill, item_slot)
                    presorted[r] = True
        if same and greedy_moved[layer]:
            # the nodes where nothing moved pack as plain LPT does: their start's bins, summed in
            # item order (a bin's slots are in item order), are that plan's
            for n in range(num_nodes):
                if not node_moved[n]:
                    greedy_peak[layer] = max(greedy_peak[layer], _seq_peak(load[n]))
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
        _write_layer(
            load,
            expert,
            fixed,
            pick * num_nodes,
            num_nodes,
            slots,
            no_budget,
            ids[0],
            cnt[0],
            phy2log[layer],
            logcnt[layer],
            srt,
            presort,
        )
        if same:
            continue
        any_fixed = np.bool_(False)
        for n in range(num_nodes):
            _expand_row(w_rows[1, n], cnt[1, n], ids[1, n], item_load, item_local, item_expert, item_count)
            order, first_moved = _lpt_into(
                item_load, item_local, np.bool_(True), num_bins, bins, key, fill, tag, lw
            )
            any_fixed |= _layout_row(
                bins, item_load, item_expert, item_count, num_bins, load_g[n], expert_g[n], fixed_g[n], fill
            )
            greedy_moved[layer] |= first_moved >= 0
            pk = _plain_lpt_peak(
                item_load, item_local, order, first_moved, num_bins, bins, bins_plain, key, fill, tag, lw
            )
            greedy_peak[layer] = max(greedy_peak[layer], pk)
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
            _write_layer(
                load_g,
                expert_g,
                fixed_g,
                np.int64(0),
                num_nodes,
                slots,
                no_budget,
                ids[1],
                cnt[1],
                phy2log[layer],
                logcnt[layer],
                srt,
                presort,
            )
    # DeepSeek's packing (no repeat avoidance) is the duplicate-avoiding one where that moved nothing;
    # where it moved something, it can beat the plan only if its heaviest GPU is below the plan's
    # (within the margin of the exact comparison that follows; sums in another order differ far less)
    out_peak = np.full(num_layers, _INF)
    for layer in range(num_layers):
        if not greedy_moved[layer]:
            continue
        plan_peak = -_INF
        for gpu in range(num_gpus):
            gpu_load = 0.0
            for p in range(gpu * slots, (gpu + 1) * slots):
                e = phy2log[layer, p]
                gpu_load += weight[layer, e] / logcnt[layer, e]
            plan_peak = max(plan_peak, gpu_load)
        if greedy_peak[layer] < plan_peak * (1 + GREEDY_MARGIN) * (1 + 1e-12):
            out_peak[layer] = greedy_peak[layer]
    return phy2log, logcnt, out_peak


@njit
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
        ``[B, num_bins, M / num_bins]`` expert ids, a GPU's by decreasing load (ties by id).
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
    lw = _lpt_workspace(num_items, num_bins)
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
            order, _ = _lpt_into(rl, re, np.bool_(True), num_bins, bins, key, fill, tag, lw)
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
            _write_sorted(expert, load, pick, np.int64(1), out[first + q].reshape(-1), expert, False)
    return out
