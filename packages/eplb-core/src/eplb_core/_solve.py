"""The planner on NumPy arrays (private; inputs already validated by :mod:`eplb_core.planner`).

Every function here takes and returns NumPy arrays: the group-to-node split is chosen with NumPy (one
matrix product over the enumerated splits), everything else, for all layers, is one call of a compiled
entry point of :mod:`eplb_core._numba`. Torch appears only in the public modules.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np

from eplb_core._numba import runner
from eplb_core._numba.counts import greedy_counts
from eplb_core._numba.migrate import migrate_layers
from eplb_core._numba.soft import soft_allocate, soft_node_swaps
from eplb_core._numba.solve import pack_layers, solve_layers
from eplb_core._numba.starts import lpt_bins
from eplb_core._numba.utils import GREEDY_MARGIN, MAX_RESPLIT_SLOTS, default_iters
from eplb_core.reference import greedy_bins, greedy_layout

__all__ = [
    "assign_groups_to_nodes",
    "best_node_peaks",
    "equal_partitions",
    "greedy_fallback",
    "home_nodes",
    "pack_rows",
    "peaks",
    "solve",
    "solve_migration",
    "solve_soft",
    "split_tables",
]


@lru_cache(maxsize=8)
def split_tables(slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tables of the splits of ``2 S`` items (``S`` of the heavy bin, then ``S`` of the light bin).

    Returns ``(idx_heavy [C, S], idx_light [C, S], member [2S, C] bool, member [2S, C8] float32)``
    over the ``C`` splits whose heavy side keeps item 0 (the first is the identity split): the item
    positions on each side, and whether an item goes to the heavy bin (the float32 copy has zero
    columns up to a multiple of 8, so the compiled scoring runs in whole vectors). Above
    ``MAX_RESPLIT_SLOTS`` slots (no re-split) the tables of one slot stand in.
    """
    if slots > MAX_RESPLIT_SLOTS:
        slots = 1
    num = 2 * slots
    splits = [c for c in itertools.combinations(range(num), slots) if c[0] == 0]
    member = np.zeros((num, len(splits)), dtype=bool)
    for j, c in enumerate(splits):
        member[list(c), j] = True
    idx_heavy = np.array(splits, dtype=np.int64)
    idx_light = np.array([[i for i in range(num) if i not in c] for c in splits], dtype=np.int64)
    padded = np.zeros((num, -(-len(splits) // 8) * 8), dtype=np.float32)
    padded[:, : len(splits)] = member
    return idx_heavy, idx_light, member, padded


@lru_cache(maxsize=32)
def equal_partitions(num_items: int, num_bins: int) -> np.ndarray | None:
    """All ways to split ``num_items`` labelled items into ``num_bins`` unlabelled equal blocks.

    Returns ``[C, num_items]`` int64 bin ids (canonical: blocks numbered by their smallest item), or
    None when there are more than 4096 (105 for DeepSeek-V3's 8 groups on 4 nodes).
    """
    per_bin = num_items // num_bins
    count = math.factorial(num_items) // (math.factorial(per_bin) ** num_bins * math.factorial(num_bins))
    if count > 4096:
        return None
    out: list[list[int]] = []

    def rec(assign: list[int], remaining: list[int], next_bin: int) -> None:
        if not remaining:
            out.append(assign.copy())
            return
        first, rest = remaining[0], remaining[1:]
        for others in itertools.combinations(rest, per_bin - 1):
            for i in (first, *others):
                assign[i] = next_bin
            rec(assign, [r for r in rest if r not in others], next_bin + 1)

    rec([0] * num_items, list(range(num_items)), 0)
    return np.array(out, dtype=np.int64)


@lru_cache(maxsize=16)
def _partition_tables(num_groups: int, num_nodes: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(partitions [C, g], one-hot [g, C * nodes])`` of :func:`equal_partitions`, or None."""
    parts = equal_partitions(num_groups, num_nodes)
    if parts is None:
        return None
    onehot = (parts[:, :, None] == np.arange(num_nodes)).astype(np.float64)  # [C, g, n]
    return parts, np.ascontiguousarray(onehot.transpose(1, 0, 2).reshape(num_groups, -1))


def best_node_peaks(group_load: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(partition index [L], heaviest node [L])`` of the best equal split of every layer's groups,
    by enumeration; None when there are too many splits to list."""
    tables = _partition_tables(group_load.shape[1], num_nodes)
    if tables is None:
        return None
    node_sums = (group_load @ tables[1]).reshape(group_load.shape[0], -1, num_nodes)
    # the heaviest node, one node at a time: NumPy's max over a short last axis is much slower
    peaks = node_sums[:, :, 0].copy()
    for node in range(1, num_nodes):
        np.maximum(peaks, node_sums[:, :, node], out=peaks)
    best = peaks.argmin(1)
    return best, peaks[np.arange(len(best)), best]


def assign_groups_to_nodes(group_load: np.ndarray, num_nodes: int) -> np.ndarray:
    """Node of every group ``[L, g]`` int64 minimising the heaviest node (equal group counts).

    Exact by enumeration when the splits can be listed; otherwise the groups are packed onto the
    nodes like replicas onto GPUs (:func:`pack_rows`: LPT and round-robin starts, refinement).
    """
    num_layers, num_groups = group_load.shape
    if num_nodes == 1:
        return np.zeros((num_layers, num_groups), dtype=np.int64)
    found = best_node_peaks(group_load, num_nodes)
    if found is not None:
        tables = _partition_tables(num_groups, num_nodes)
        assert tables is not None
        return tables[0][found[0]]
    ids = np.tile(np.arange(num_groups, dtype=np.int64), (num_layers, 1))
    packed = pack_rows(group_load, ids, num_nodes, None, num_groups)  # [L, nodes, g / nodes]
    node_of_group = np.empty((num_layers, num_groups), dtype=np.int64)
    rows = np.arange(num_layers)[:, None, None]
    node_of_group[rows, packed] = np.arange(num_nodes)[None, :, None]
    return node_of_group


def solve(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    iters: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Strict (``num_nodes > 1``) or global (one node, one group) plan: :func:`solve_layers`.

    Args:
        weight: ``[L, N]`` float64, rows not all zero.

    Returns:
        ``(phy2log [L, R], logcnt [L, N])`` int64, GPU-major slots (a GPU's by decreasing load, ties by id), and
        ``greedy_peak [L]`` float64, the heaviest GPU of DeepSeek's greedy plan on the layers where
        it can be better balanced than the plan, infinite elsewhere (see :func:`greedy_fallback`).
    """
    weight = np.ascontiguousarray(weight, dtype=np.float64)
    num_layers, num_experts = weight.shape
    group_load = weight.reshape(num_layers, num_groups, num_experts // num_groups).sum(-1)
    ours_nodes = np.ascontiguousarray(assign_groups_to_nodes(group_load, num_nodes), dtype=np.int64)
    num_bins = num_gpus // num_nodes
    rounds = default_iters(num_bins, num_replicas // num_gpus) if iters is None else iters
    return runner.call(
        solve_layers,
        weight,
        group_load,
        ours_nodes,
        num_replicas,
        num_nodes,
        num_gpus,
        rounds,
        split_tables(num_replicas // num_gpus),
    )


def pack_rows(
    item_load: np.ndarray,
    item_expert: np.ndarray,
    num_bins: int,
    iters: int | None,
    num_experts: int,
    rows_per_group: int = 1,
) -> np.ndarray:
    """Pack each row's items onto ``num_bins`` GPUs (:func:`pack_layers`).

    Args:
        item_load, item_expert: ``[B, M]`` float64 / int64.

    Returns:
        ``[B, num_bins, M / num_bins]`` expert ids, a GPU's by decreasing load (ties by id).
    """
    rounds = default_iters(num_bins, item_load.shape[1] // num_bins) if iters is None else iters
    return runner.call(
        pack_layers,
        np.ascontiguousarray(item_load, dtype=np.float64),
        np.ascontiguousarray(item_expert, dtype=np.int64),
        num_bins,
        rounds,
        rows_per_group,
        num_experts,
        split_tables(item_load.shape[1] // num_bins),
    )


def home_nodes(phy2log: np.ndarray, num_groups: int, num_nodes: int, num_logical: int) -> np.ndarray:
    """Node of each group ``[L, num_groups]`` int64 in a strict plan ``phy2log [L, R]``."""
    num_layers, num_replicas = phy2log.shape
    node = np.arange(num_replicas) // (num_replicas // num_nodes)
    home = np.zeros((num_layers, num_groups), dtype=np.int64)
    np.put_along_axis(home, phy2log // (num_logical // num_groups), np.broadcast_to(node, phy2log.shape), 1)
    return home


def solve_soft(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    penalty: float,
    iters: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Soft-locality plan: ``(phy2log [L, R], node of each group [L, num_groups])`` int64.

    Groups get home nodes by the best equal split (as in the strict mode); every expert keeps its
    first replica at home and the ``R - N`` redundant replicas are allocated to experts and nodes one
    at a time (:func:`~eplb_core._numba.soft.soft_allocate`); redundant replicas are then traded
    between nodes to even the node loads (:func:`~eplb_core._numba.soft.soft_node_swaps`), and each
    node is packed like a strict node (:func:`pack_rows`).
    """
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    group_load = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    node_of_group = assign_groups_to_nodes(group_load, num_nodes)
    home = np.ascontiguousarray(np.repeat(node_of_group, group_size, axis=1))  # [L, N]
    gpus_per_node = num_gpus // num_nodes
    expert, node, counts = runner.call(
        soft_allocate, weight, home, num_replicas, num_nodes, num_gpus, penalty
    )
    # the one-at-a-time choices leave node loads uneven: trade redundant replicas between nodes
    runner.call(
        soft_node_swaps,
        weight,
        counts,
        expert,
        node,
        home,
        num_nodes,
        gpus_per_node,
        penalty,
        4 * (num_replicas - num_logical),
    )
    order = np.argsort(node * num_replicas + np.arange(num_replicas), axis=1)
    item_expert = np.take_along_axis(expert, order, 1).reshape(num_layers * num_nodes, -1)
    item_load = np.take_along_axis(weight / counts, item_expert.reshape(num_layers, -1), 1)
    packed = pack_rows(
        item_load.reshape(item_expert.shape), item_expert, gpus_per_node, iters, num_logical, num_nodes
    )
    return packed.reshape(num_layers, num_replicas), node_of_group


def solve_migration(
    weight: np.ndarray,
    previous: np.ndarray,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    mode: str,
    budget: int,
    iters: int | None,
) -> np.ndarray:
    """Migration-aware plan ``phy2log [L, R]`` int64: keep ``previous``'s slots, re-split replicas and
    swap within a budget of ``budget`` changed slots per layer.

    Replicas never change node (strict and soft plans keep their locality and cross-node share);
    inside each node (or the whole layer in global mode): (1) up to half the budget moves single slots
    from over-replicated experts to the expert whose per-replica load is highest, (2) the swap
    refinement runs with the rest of the budget. Both only ever lower the peak of a row.
    """
    num_replicas = previous.shape[1]
    rows_per_layer = num_nodes if mode in ("strict", "soft") else 1
    num_bins = num_gpus // rows_per_layer
    # exchange rounds (the budgeted swaps of this mode have no re-split or peak step)
    rounds = default_iters(num_bins, MAX_RESPLIT_SLOTS + 1) if iters is None else iters
    return runner.call(
        migrate_layers,
        weight,
        previous,
        rows_per_layer,
        num_gpus,
        budget,
        rounds,
        mode != "soft",
        split_tables(num_replicas // num_gpus),
    )


def peaks(weight: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[L]`` heaviest GPU load of ``phy2log [L, R]`` (replicas of an expert share its load)."""
    num_layers, num_logical = weight.shape
    flat = phy2log + np.arange(num_layers)[:, None] * num_logical
    counts = np.bincount(flat.ravel(), minlength=weight.size).reshape(weight.shape)
    per_slot = np.take_along_axis(weight / np.maximum(counts, 1), phy2log, 1)
    return per_slot.reshape(num_layers, num_gpus, -1).sum(-1).max(1)


def _compiled_pack(load: np.ndarray, num_bins: int, expert: np.ndarray | None) -> np.ndarray:
    """:func:`eplb_core.reference.lpt_pack`, compiled (item by item the same bins)."""
    load = np.ascontiguousarray(load, dtype=np.float64)
    key = np.zeros(load.shape, dtype=np.int64) if expert is None else np.ascontiguousarray(expert)
    return runner.call(lpt_bins, load, key, expert is not None, num_bins)


def _compiled_split(weight: np.ndarray, num_replicas: int) -> np.ndarray:
    """:func:`eplb_core.reference.greedy_replica_counts`, compiled (the same counts)."""
    counts = np.ones(weight.shape, dtype=np.int64)
    runner.call(greedy_counts, np.ascontiguousarray(weight), counts, num_replicas)
    return counts


def greedy_fallback(
    weight: np.ndarray,
    phy2log: np.ndarray,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    greedy_peak: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(phy2log [L, R], taken [L] bool)``: every layer of ``phy2log`` whose heaviest GPU is
    heavier than that of the greedy reference plan (DeepSeek's packing, which may put two replicas of
    an expert on one GPU: :func:`eplb_core.reference.greedy_rebalance`) is replaced by that greedy
    plan and flagged in ``taken``.

    ``greedy_peak [L]``: the heaviest GPU of that greedy plan where it may be better (from
    :func:`solve`), infinite elsewhere; None computes it (with the compiled LPT and replica split).
    The layers within a margin of it are then compared exactly with the reference's own plan.
    """
    num_layers, num_replicas = phy2log.shape
    if greedy_peak is None:
        _, _, _, rep_load, gpu = greedy_bins(
            weight,
            num_replicas,
            num_groups,
            num_nodes,
            num_gpus,
            avoid_duplicates=False,
            pack=_compiled_pack,
            split=_compiled_split,
        )
        gpus_per_row = num_gpus // (gpu.shape[0] // num_layers)
        flat = gpu + np.arange(gpu.shape[0])[:, None] * gpus_per_row
        gpu_loads = np.bincount(flat.ravel(), weights=rep_load.ravel(), minlength=num_layers * num_gpus)
        greedy_peak = gpu_loads.reshape(num_layers, -1).max(1)
    taken = np.zeros(num_layers, dtype=np.bool_)
    # only layers where the greedy plan's peak is known finite can be candidates (most have none)
    finite = np.flatnonzero(np.isfinite(greedy_peak))
    if finite.size == 0:
        return phy2log, taken
    plan_peak = peaks(weight[finite], phy2log[finite], num_gpus)
    close = greedy_peak[finite] < plan_peak * (1 + GREEDY_MARGIN)
    rows, plan_peak = finite[close], plan_peak[close]
    if rows.size == 0:
        return phy2log, taken
    bins = greedy_bins(weight[rows], num_replicas, num_groups, num_nodes, num_gpus, avoid_duplicates=False)
    greedy, _ = greedy_layout(bins, num_replicas)
    # strictly better only: a margin far below any real gain absorbs the order of the float sums
    better = peaks(weight[rows], greedy, num_gpus) < plan_peak * (1 - 1e-13)
    if not better.any():
        return phy2log, taken
    taken[rows[better]] = True
    out = phy2log.copy()
    out[rows[better]] = greedy[better]
    return out, taken
