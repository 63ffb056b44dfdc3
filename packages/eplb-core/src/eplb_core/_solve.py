"""Strict/global planner on a float64 weight matrix (private; inputs already validated)."""

from __future__ import annotations

import torch

from eplb_core import _core, _fast, _greedy


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


def solve_hierarchical(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    iters: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan with every replica on its group's node (``num_nodes=1`` and one group: global plan).

    Runs :func:`eplb_core._fast.solve` (NumPy, on the host) and returns the plan on ``weight``'s device.
    No layer ends worse than the greedy DeepSeek-style plan with duplicate avoidance.

    Returns:
        ``(phy2log [L, R], logcnt [L, N])`` int64.
    """
    w = weight.detach().to("cpu", torch.float64).numpy()
    phy2log, logcnt = _fast.solve(w, num_replicas, num_groups, num_nodes, num_gpus, iters=iters)
    return torch.from_numpy(phy2log).to(weight.device), torch.from_numpy(logcnt).to(weight.device)
