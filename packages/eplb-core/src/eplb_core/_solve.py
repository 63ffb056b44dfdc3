"""Strict/global planner on a float64 weight matrix (private; inputs already validated)."""

from __future__ import annotations

import torch

from eplb_core import _core, _greedy
from eplb_core._greedy import greedy_rebalance


def replica_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """``[L, R]`` load of every physical slot, the expert's load split evenly over its replicas."""
    return (weight / logcnt.to(weight.dtype)).gather(1, phy2log)


def gpu_loads(
    weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int
) -> torch.Tensor:
    """``[L, num_gpus]`` summed replica loads per GPU (GPU-major slots)."""
    per_slot = replica_loads(weight, phy2log, logcnt)
    return per_slot.view(per_slot.shape[0], num_gpus, -1).sum(-1)


def default_iters(num_bins: int, slots: int) -> int:
    """Refinement rounds: enough for every bin to meet several partners, bounded for speed."""
    return int(min(64, max(12, num_bins + 8)))


def node_order(node_of_expert: torch.Tensor) -> torch.Tensor:
    """Experts sorted node-major (ascending id inside a node): ``[L, N]`` global ids."""
    num_experts = node_of_expert.shape[1]
    ids = torch.arange(num_experts, device=node_of_expert.device)
    return torch.argsort(node_of_expert * num_experts + ids, dim=1)


def _layout(
    weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plan as ``[L * nodes, gpus_per_node, slots]`` (load, expert, replica count of the expert)."""
    num_layers, num_replicas = phy2log.shape
    shape = (num_layers * num_nodes, num_gpus // num_nodes, num_replicas // num_gpus)
    load = replica_loads(weight, phy2log, logcnt).view(shape)
    return load, phy2log.view(shape), logcnt.gather(1, phy2log).view(shape)


def pack_rows(
    item_load: torch.Tensor,
    item_expert: torch.Tensor,
    num_bins: int,
    slots: int,
    iters: int | None,
    rows_per_group: int = 1,
) -> torch.Tensor:
    """Pack each row's items onto ``num_bins`` GPUs of ``slots`` slots.

    Two starts are refined in one batch, the round robin and LPT (each avoiding two replicas of an
    expert on one GPU), and each row keeps the lower peak.

    Args:
        item_load, item_expert: ``[B, num_bins * slots]``.

    Returns:
        ``[B, num_bins, slots]`` expert ids (sorted inside a GPU).
    """
    num_rows = item_load.shape[0]
    # replicas of the item's expert in this row
    per_expert = torch.zeros(num_rows, int(item_expert.max()) + 1, dtype=torch.int64, device=item_load.device)
    per_expert.scatter_add_(1, item_expert, torch.ones_like(item_expert))
    count = per_expert.gather(1, item_expert)
    load_rr, exp_rr, cnt_rr = _core.round_robin_pack(item_load, item_expert, num_bins, slots, count)
    lpt_bin = torch.from_numpy(
        _greedy._lpt_pack(item_load.cpu().numpy(), num_bins, item_expert.cpu().numpy())
    ).to(item_load.device)
    order = torch.argsort(
        lpt_bin * item_load.shape[1] + torch.arange(item_load.shape[1], device=item_load.device), dim=1
    )
    shape = (num_rows, num_bins, slots)
    load = torch.cat([load_rr, item_load.gather(1, order).view(shape)])
    expert = torch.cat([exp_rr, item_expert.gather(1, order).view(shape)])
    cnt = torch.cat([cnt_rr, count.gather(1, order).view(shape)])
    bucket = _core.duplicate_buckets(expert, cnt)
    fixed = cnt > num_bins
    rounds = default_iters(num_bins, slots) if iters is None else iters
    load, expert = _core.refine_swaps(
        load,
        expert,
        iters=rounds,
        bucket=bucket,
        fixed=fixed if bool(fixed.any()) else None,
        rows_per_group=rows_per_group,
    )
    peak = load.sum(-1).amax(-1).view(2, num_rows)
    pick = (peak[1] < peak[0]).long()
    expert = expert.view(2, num_rows, num_bins, slots)[pick, torch.arange(num_rows, device=item_load.device)]
    return expert.sort(dim=-1).values


def refine_candidates(
    weight: torch.Tensor,
    candidates: list[tuple[torch.Tensor, torch.Tensor]],
    num_nodes: int,
    num_gpus: int,
    iters: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refine several plans of the same layers in one batch and keep, per layer, the least loaded peak.

    Args:
        candidates: ``(phy2log [L, R], logcnt [L, N])`` plans (each replica of an expert on its own GPU when
            possible, slots GPU-major).

    Returns:
        ``(phy2log, logcnt)`` of the winner of every layer; ties go to the earlier candidate.
    """
    num_layers = weight.shape[0]
    parts = [_layout(weight, p, c, num_nodes, num_gpus) for p, c in candidates]
    load = torch.cat([q[0] for q in parts])
    expert = torch.cat([q[1] for q in parts])
    count = torch.cat([q[2] for q in parts])
    num_bins, slots = load.shape[1], load.shape[2]
    bucket = _core.duplicate_buckets(expert, count)
    fixed = count > num_bins  # more replicas than GPUs: spread evenly once, then left alone
    rounds = default_iters(num_bins, slots) if iters is None else iters
    load, expert = _core.refine_swaps(
        load,
        expert,
        iters=rounds,
        bucket=bucket,
        fixed=fixed if bool(fixed.any()) else None,
        rows_per_group=num_nodes,
        num_candidates=len(candidates),
    )
    expert, _order = expert.sort(dim=-1, stable=True)
    num_cand = len(candidates)
    peak = load.sum(-1).view(num_cand, num_layers, -1).amax(-1)  # [C, L]
    best = peak.argmin(0)  # first minimum: earlier candidate on ties
    phy2log = expert.view(num_cand, num_layers, -1)
    rows = torch.arange(num_layers, device=weight.device)
    logcnt = torch.stack([c for _, c in candidates])
    return phy2log[best, rows], logcnt[best, rows]


def solve_hierarchical(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    iters: int | None = None,
    with_greedy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan with every replica on its group's node (``num_nodes=1`` and one group: global plan).

    The plan of this package (optimal group-to-node split, slot-aware counts, round-robin start) and,
    with ``with_greedy``, the greedy DeepSeek-style plan are refined together; each layer keeps the better
    one, so no layer ends worse than greedy LPT (the refinement never raises a peak).

    Returns:
        ``(phy2log [L, R], logcnt [L, N])`` int64.
    """
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    group_load = weight.view(num_layers, num_groups, group_size).sum(-1)
    node_of_group, _ = _core.assign_groups_to_nodes(group_load, num_nodes)
    node_of_expert = node_of_group.repeat_interleave(group_size, dim=1)
    order = node_order(node_of_expert)  # [L, N]
    rows = num_layers * num_nodes
    per_node = num_experts // num_nodes
    w_node = weight.gather(1, order).view(rows, per_node)
    ids_node = order.view(rows, per_node)
    reps_node = num_replicas // num_nodes
    num_bins = num_gpus // num_nodes
    slots = num_replicas // num_gpus
    counts = _core.slot_aware_counts(w_node, reps_node, num_bins)
    item_load, item_local = _core.expand_replicas(w_node, counts, reps_node)
    item_expert = ids_node.gather(1, item_local)
    _, expert = _core.round_robin_pack(item_load, item_expert, num_bins, slots)[:2]
    phy2log = expert.reshape(num_layers, num_replicas)
    logcnt = torch.empty(num_layers, num_experts, dtype=torch.int64, device=weight.device)
    logcnt.scatter_(1, order, counts.view(num_layers, num_experts))
    candidates = [(phy2log, logcnt)]
    if with_greedy:
        g_phy2log, g_logcnt = greedy_rebalance(
            weight, num_replicas, num_groups, num_nodes, num_gpus, avoid_duplicates=True
        )
        candidates.append((g_phy2log.to(weight.device), g_logcnt.to(weight.device)))
    return refine_candidates(weight, candidates, num_nodes, num_gpus, iters)
