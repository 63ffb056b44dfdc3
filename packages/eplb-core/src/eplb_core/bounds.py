"""Lower bounds on the best achievable max GPU load of a layer."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from eplb_core import _solve
from eplb_core._numba import runner
from eplb_core._numba.counts import greedy_counts
from eplb_core._validate import check_topology, check_weight

__all__ = ["lower_bound", "node_cap_bound"]


def lower_bound(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    mode: str = "strict",
) -> torch.Tensor:
    """Per-layer lower bound ``[L]`` float64 on the max GPU load of any valid plan.

    The largest of:

    * ``total / num_gpus`` (perfect balance);
    * the heaviest replica under the replica counts that minimise it (any plan has ``num_replicas``
      replicas, and the greedy split is optimal for the heaviest one);
    * in strict mode, the heaviest node of the best equal-size group-to-node split divided by the GPUs
      of a node (exact by enumeration when there are at most 4096 splits, e.g. 105 for DeepSeek-V3's
      8 groups on 4 nodes; otherwise a weaker valid bound). This is the "strict-hierarchy cap".

    Args:
        weight: ``[L, N]`` non-negative finite loads (tensor on any device, or array-like).
        num_replicas, num_groups, num_nodes, num_gpus: the topology, as in
            :func:`eplb_core.rebalance_experts`.
        mode: ``"strict"``, ``"global"`` or ``"soft"`` (only strict adds the node term; a topology with
            ``num_groups % num_nodes != 0`` is global).

    Returns:
        ``[L]`` float64 on ``weight``'s device.

    Raises:
        ValueError: naming the argument, for the loads and topologies :func:`eplb_core.plan` rejects
            (NaN, negative or overflowing loads, ``num_replicas < N``, counts below 1, ...) and an
            unknown ``mode``.
    """
    if mode not in ("strict", "global", "soft"):
        raise ValueError(f"mode must be 'strict', 'global' or 'soft', got {mode!r}")
    w = check_weight(weight)
    num_layers, num_experts = w.shape
    check_topology(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes != 0:
        mode = "global"
    bound = w.sum(1) / num_gpus
    # the sequential greedy split minimises the heaviest replica (compiled, on the host)
    w_host = w.detach().cpu().numpy()
    counts_np = np.ones(w_host.shape, dtype=np.int64)
    runner.call(greedy_counts, np.ascontiguousarray(w_host), counts_np, num_replicas)
    counts = torch.from_numpy(counts_np).to(w.device)
    bound = torch.maximum(bound, (w / counts.to(torch.float64)).amax(1))
    if mode == "strict" and num_nodes > 1:
        group_load = w.view(num_layers, num_groups, num_experts // num_groups).sum(-1)
        cap = node_cap_bound(group_load, num_nodes) / (num_gpus // num_nodes)
        bound = torch.maximum(bound, cap)
    return bound


def node_cap_bound(group_load: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """A lower bound ``[L]`` on the heaviest node over every equal-size group-to-node assignment.

    Exact (the best split's heaviest node) when the splits can be enumerated; otherwise the larger of
    ``total / nodes`` and the heaviest group plus the ``g / nodes - 1`` lightest ones.
    """
    if num_nodes == 1:
        return group_load.sum(1)
    found = _solve.best_node_peaks(group_load.detach().to("cpu", torch.float64).numpy(), num_nodes)
    if found is not None:
        return torch.from_numpy(found[1]).to(group_load.device)
    per_node = group_load.shape[1] // num_nodes
    asc = group_load.sort(dim=1).values
    with_heaviest = asc[:, -1] + asc[:, : per_node - 1].sum(1)
    return torch.maximum(group_load.sum(1) / num_nodes, with_heaviest)
