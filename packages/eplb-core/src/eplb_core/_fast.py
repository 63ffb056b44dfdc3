"""Planner of the strict and global modes (private; inputs already validated).

The batched steps (node split, node-major layout, sorting, the candidate bookkeeping) work on all
layers at once with float64 / int64 NumPy arrays (layers, or layer x node rows, along axis 0); the
sequential loops (replica-count split, LPT packing, the refinement rounds) are compiled with Numba in
:mod:`eplb_core._kernels`, one row at a time. Torch appears only at the API boundary.
"""

from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import torch

from eplb_core import _core, _kernels

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

    The sequential greedy itself (give one replica to the expert with the heaviest per-replica load,
    lowest id on ties, repeat), compiled (:func:`eplb_core._kernels.greedy_counts`); a row of zero
    loads gets its extra replicas one per expert in id order.

    Args:
        weight: ``[B, N]`` float64, non-negative.
        num_replicas: replicas per row, ``>= N``.
        base: optional ``[B, N]`` int64 minimum counts (``>= 1``, row sums ``<= num_replicas``).

    Returns:
        ``[B, N]`` int64 counts, rows summing to ``num_replicas`` (the sequential greedy's counts).
    """
    counts = np.ones(weight.shape, dtype=np.int64) if base is None else base.astype(np.int64, copy=True)
    _kernels.greedy_counts(np.ascontiguousarray(weight, dtype=np.float64), counts, num_replicas)
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
    order = np.argsort(-item_load, axis=1, kind="stable")
    w_sorted = np.take_along_axis(item_load, order, 1)
    use_expert = item_expert is not None
    e_sorted = np.take_along_axis(item_expert, order, 1) if item_expert is not None else order
    bins_sorted = _kernels.lpt_sorted(w_sorted, e_sorted, use_expert, num_bins)
    out = np.empty_like(bins_sorted)
    np.put_along_axis(out, order, bins_sorted, 1)
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
    bin's first item, scored in float32); with more slots, the single exchange that best
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
    load, expert = np.ascontiguousarray(load, dtype=np.float64).copy(), expert.astype(np.int64, copy=True)
    num_rows, num_bins, slots = load.shape
    if num_bins < 2 or iters <= 0:
        return load, expert
    has_fixed = fixed is not None
    fix = np.zeros(load.shape, dtype=bool) if fixed is None else np.array(fixed, dtype=bool, copy=True)
    alive = np.ones(num_rows, dtype=bool)
    total = load.sum((1, 2))
    tol = (_REL_TOL / num_bins) * total  # exchanges gaining less than this are ignored
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
        if slots <= _MAX_RESPLIT_SLOTS:
            idx_heavy, idx_light, member = _split_tables(slots)
            moved = _kernels.resplit_block(
                load, expert, fix, has_fixed, idx, rounds, it, idx_heavy, idx_light, member
            )
        else:
            moved = _kernels.swap_block(
                load, expert, fix, has_fixed, idx, tol, rounds, it, _BRUTE_FORCE_SLOTS
            )
        after = np.maximum(load[idx].sum(-1) - (total[idx] / num_bins)[:, None], 0).sum(1)
        alive[idx] = moved & (excess[idx] - after > _MIN_BLOCK_GAIN * total[idx])
        it += rounds
    return load, expert


@lru_cache(maxsize=8)
def _split_tables(slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tables of the splits of ``2 S`` items (``S`` of the heavy bin, then ``S`` of the light bin).

    Returns ``(idx_heavy [C, S], idx_light [C, S], member [2S, C] bool)`` over the ``C`` splits whose
    heavy side keeps item 0 (the first is the identity split): the item positions on each side, and
    whether an item goes to the heavy bin.
    """
    num = 2 * slots
    splits = [c for c in itertools.combinations(range(num), slots) if c[0] == 0]
    member = np.zeros((num, len(splits)), dtype=bool)
    for j, c in enumerate(splits):
        member[list(c), j] = True
    idx_heavy = np.array(splits, dtype=np.int64)
    idx_light = np.array([[i for i in range(num) if i not in c] for c in splits], dtype=np.int64)
    return idx_heavy, idx_light, member


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
