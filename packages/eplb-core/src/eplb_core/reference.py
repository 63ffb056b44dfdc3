"""The greedy DeepSeek-style balancer: the reference eplb-core's planner is checked and benchmarked
against.

It follows the public description of DeepSeek's EPLB: pack expert groups onto nodes by LPT with equal
group counts per node, give each node's experts its share of replicas by repeatedly splitting the
expert with the largest per-replica load, then pack the replicas onto the node's GPUs by LPT with equal
slot counts (heaviest replica first, onto the lightest GPU that still has a free slot, lowest index on
ties). ``num_groups % num_nodes != 0`` plans globally (one node).

Layers are batched with NumPy and the loops run over items: simple to read, slow to run. Every fresh
plan of :func:`eplb_core.plan` / :func:`eplb_core.rebalance_experts` is at least as balanced, per
layer, as :func:`greedy_rebalance` (with or without ``avoid_duplicates``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from eplb_core._validate import check_topology, check_weight

__all__ = ["greedy_bins", "greedy_layout", "greedy_rebalance", "greedy_replica_counts", "lpt_pack"]


def lpt_pack(weight: np.ndarray, num_bins: int, expert: np.ndarray | None = None) -> np.ndarray:
    """LPT packing of every row with equal slot counts.

    Args:
        weight: ``[B, M]`` float64 item loads, ``M`` a multiple of ``num_bins``.
        num_bins: bins per row; each takes ``M / num_bins`` items.
        expert: optional ``[B, M]`` int64 expert id of every item: an item avoids bins that already
            hold its expert while another bin with a free slot does not.

    Returns:
        ``[B, M]`` int64 bin of every item. Items go heaviest first (stable on ties) onto the
        lightest bin with a free slot (lowest index on ties).
    """
    rows, items = weight.shape
    cap = items // num_bins
    order = np.argsort(-weight, axis=1, kind="stable")
    bins = np.empty((rows, items), dtype=np.int64)
    key = np.zeros((rows, num_bins))
    fill = np.zeros((rows, num_bins), dtype=np.int64)
    r = np.arange(rows)
    holds = None
    if expert is not None:
        holds = np.zeros((rows, num_bins, int(expert.max()) + 1), dtype=bool)
    for step in range(items):
        item = order[:, step]
        w = weight[r, item]
        if holds is not None:
            assert expert is not None
            e = expert[r, item]
            clash = holds[r, :, e]  # [B, num_bins]
            free = key < np.inf
            masked = np.where(clash & (free & ~clash).any(1, keepdims=True), np.inf, key)
            b = masked.argmin(1)
            holds[r, b, e] = True
        else:
            b = key.argmin(1)
        bins[r, item] = b
        key[r, b] += w
        fill[r, b] += 1
        key[r, b] = np.where(fill[r, b] == cap, np.inf, key[r, b])
    return bins


def greedy_replica_counts(weight: np.ndarray, num_replicas: int) -> np.ndarray:
    """Greedy replica split ``[B, N]`` int64: starting from one replica each, ``num_replicas - N``
    times one more replica for the expert with the largest ``weight / count`` (lowest id on ties).

    Args:
        weight: ``[B, N]`` float64 expert loads.
        num_replicas: replicas per row, ``>= N``.
    """
    rows, num_experts = weight.shape
    counts = np.ones((rows, num_experts), dtype=np.int64)
    r = np.arange(rows)
    for _ in range(num_replicas - num_experts):
        counts[r, (weight / counts).argmax(1)] += 1
    return counts


def greedy_rebalance(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    avoid_duplicates: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style greedy plan of every layer.

    Args:
        weight: ``[L, N]`` non-negative finite loads (tensor on any device, or array-like; any real
            dtype).
        num_replicas, num_groups, num_nodes, num_gpus: the topology, as in
            :func:`eplb_core.rebalance_experts`; ``num_groups % num_nodes != 0`` plans globally.
        avoid_duplicates: pack a replica onto a GPU that already holds its expert only when every
            GPU with a free slot does (DeepSeek's packing does not avoid it).

    Returns:
        ``(phy2log [L, R], logcnt [L, N])``, int64 CPU tensors; physical slot ``p`` lives on GPU
        ``p // (R / num_gpus)``.

    Raises:
        ValueError: naming the argument, for the inputs :func:`eplb_core.rebalance_experts` rejects.
    """
    w_t = check_weight(weight)
    check_topology(w_t.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    w = w_t.cpu().numpy()
    bins = greedy_bins(w, num_replicas, num_groups, num_nodes, num_gpus, avoid_duplicates=avoid_duplicates)
    phy2log, logcnt = greedy_layout(bins, num_replicas)
    return torch.from_numpy(phy2log), torch.from_numpy(logcnt)


Pack = Callable[[np.ndarray, int, "np.ndarray | None"], np.ndarray]
Split = Callable[[np.ndarray, int], np.ndarray]


def greedy_bins(
    w: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    avoid_duplicates: bool,
    pack: Pack = lpt_pack,
    split: Split = greedy_replica_counts,
) -> tuple[np.ndarray, ...]:
    """The steps of :func:`greedy_rebalance` on a checked host array ``w [L, N]`` float64, up to the
    packing: ``(expert_order [L, N], counts [L * n, N / n], local [L * n, R / n], rep_load, gpu)``
    per node row (``n`` nodes; ``num_groups % num_nodes != 0`` counts as one node): the experts of
    every node in order, their replica counts, the expert of every replica (expert-major), its load
    and its GPU inside the node. ``pack`` and ``split`` replace :func:`lpt_pack` /
    :func:`greedy_replica_counts` by implementations with the same result (the planner passes its
    compiled ones)."""
    num_layers, num_experts = w.shape
    if num_groups % num_nodes != 0:
        num_groups, num_nodes = 1, 1
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    replicas_per_node = num_replicas // num_nodes
    r = np.arange(num_layers)[:, None]
    group_load = w.reshape(num_layers, num_groups, group_size).sum(-1)
    group_node = pack(group_load, num_nodes, None)  # [L, g]
    # node-major expert order: groups of node 0 (ascending group id), then node 1, ...
    group_order = np.argsort(group_node * num_groups + np.arange(num_groups), axis=1, kind="stable")
    expert_order = (group_order[:, :, None] * group_size + np.arange(group_size)).reshape(num_layers, -1)
    w_node = np.ascontiguousarray(w[r, expert_order].reshape(num_layers * num_nodes, experts_per_node))
    counts = split(w_node, replicas_per_node)
    # expert-major replicas of every node row (each row holds replicas_per_node of them)
    flat = np.repeat(np.tile(np.arange(experts_per_node), len(counts)), counts.reshape(-1))
    local = flat.reshape(len(counts), replicas_per_node)
    rep_load = np.take_along_axis(w_node / counts, local, 1)
    gpu = pack(rep_load, num_gpus // num_nodes, local if avoid_duplicates else None)
    return expert_order, counts, local, rep_load, gpu


def greedy_layout(bins: tuple[np.ndarray, ...], num_replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """``(phy2log [L, R], logcnt [L, N])`` int64 of the packing ``bins`` of :func:`greedy_bins`."""
    expert_order, counts, local, rep_load, gpu = bins
    num_layers, num_experts = expert_order.shape
    replicas_per_node = local.shape[1]
    rr = np.arange(local.shape[0])[:, None]
    # slot order inside a GPU: by placement order (sorted by load, as LPT fills it)
    key = gpu * replicas_per_node + np.argsort(np.argsort(-rep_load, axis=1, kind="stable"), axis=1)
    pos = np.argsort(key, axis=1, kind="stable")
    phy_local = local[rr, pos]
    node_experts = expert_order.reshape(local.shape[0], -1)
    phy2log = node_experts[rr, phy_local].reshape(num_layers, num_replicas)
    logcnt = np.zeros((num_layers, num_experts), dtype=np.int64)
    np.put_along_axis(logcnt, expert_order, counts.reshape(num_layers, -1), axis=1)
    return phy2log, logcnt
