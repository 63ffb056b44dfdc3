"""Public planning entry points: :func:`rebalance_experts` (DeepSeek/vLLM/SGLang-compatible) and
:func:`plan` (the richer API with migration-aware and soft-locality modes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from eplb_core import _kernels, _solve
from eplb_core.placement import Placement

__all__ = ["check_topology", "check_weight", "plan", "rebalance_experts"]


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_topology(
    num_logical: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    """Raise ``ValueError`` naming the argument when the topology is inconsistent."""
    for name, value in (
        ("num_replicas", num_replicas),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_gpus", num_gpus),
    ):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_replicas < num_logical:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be >= the number of logical experts ({num_logical}): "
            "every expert needs at least one replica"
        )
    if num_replicas % num_gpus != 0:
        raise ValueError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})")
    if num_logical % num_groups != 0:
        raise ValueError(
            f"num_groups ({num_groups}) must divide the number of logical experts ({num_logical})"
        )
    if num_gpus % num_nodes != 0:
        raise ValueError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")


def check_weight(weight: Any, name: str = "weight") -> torch.Tensor:
    """Validate a load matrix ``[L, N]`` and return it as float64 (on its own device).

    Raises ``ValueError`` naming ``name`` for: non-numeric data, wrong rank, empty input, NaN/inf or
    negative values.
    """
    if isinstance(weight, torch.Tensor):
        t = weight.detach()
    else:
        try:
            t = torch.as_tensor(np.asarray(weight))
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"{name} must be a numeric array [num_layers, num_logical_experts]: {exc}"
            ) from exc
    if t.dtype == torch.bool or t.is_complex() or not (t.is_floating_point() or t.dtype in _INT_DTYPES):
        raise ValueError(f"{name} must hold real numbers, got dtype {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [num_layers, num_logical_experts], got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); need at least one layer and one expert")
    t = t.to(torch.float64)
    # NumPy checks a host matrix several times faster than torch's per-op dispatch does
    a = t.numpy() if t.device.type == "cpu" else None
    if not (bool(np.isfinite(a).all()) if a is not None else bool(torch.isfinite(t).all())):
        raise ValueError(f"{name} contains NaN or infinite loads")
    if bool((a < 0).any()) if a is not None else bool((t < 0).any()):
        raise ValueError(f"{name} contains negative loads")
    return t


_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _prepare(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All-zero layers are planned as uniform loads (nothing to balance; every expert one share)."""
    zero = weight.sum(1) == 0
    if bool(zero.any()):
        weight = torch.where(zero.unsqueeze(1), torch.ones_like(weight), weight)
    return weight, zero


def _mode_of(num_groups: int, num_nodes: int, soft: bool) -> str:
    if num_groups % num_nodes != 0:
        return "global"
    return "soft" if soft and num_nodes > 1 else "strict"


def rebalance_experts(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop-in replacement of DeepSeek's / vLLM's ``rebalance_experts``.

    Args:
        weight: ``[L, N]`` load statistics of every logical expert (torch tensor on any device, or an
            array-like; any real dtype).
        num_replicas: physical experts ``R`` per layer, a multiple of ``num_gpus`` and ``>= N``.
        num_groups: expert groups (DeepSeek-V3: 8); must divide ``N``.
        num_nodes: server nodes; with ``num_groups % num_nodes == 0`` the plan is strictly hierarchical
            (every replica of a group's experts on the node that hosts the group), otherwise global.
        num_gpus: GPUs in total, a multiple of ``num_nodes``.

    Returns:
        ``(phy2log [L, R], log2phy [L, N, max_replicas], logcnt [L, N])``, int64 on ``weight``'s device.
        Physical slot ``p`` lives on GPU ``p // (R / num_gpus)``; ``log2phy`` is padded with ``-1``.
        Deterministic; no GPU holds two replicas of an expert when that can be avoided; no layer ends
        worse than the greedy LPT plan. The plan is computed on the host by the compiled planner (one
        thread); a CUDA ``weight`` is checked on its device, copied to the host, and the three tensors
        are copied back to it.
    """
    w = check_weight(weight)
    num_logical = w.shape[1]
    check_topology(num_logical, num_replicas, num_groups, num_nodes, num_gpus)
    w, _ = _prepare(w)
    mode = _mode_of(num_groups, num_nodes, False)
    eff_groups, eff_nodes = (num_groups, num_nodes) if mode != "global" else (1, 1)
    phy2log, logcnt = _solve.solve_hierarchical(w, num_replicas, eff_groups, eff_nodes, num_gpus)
    # only the three tensors: the quality figures of plan() (bounds, loads) are not computed here
    log2phy = torch.from_numpy(_kernels.log2phy(phy2log.cpu().numpy(), logcnt.cpu().numpy()))
    return phy2log, log2phy.to(phy2log.device), logcnt


def plan(
    weight: Any,
    *,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    previous: Placement | torch.Tensor | None = None,
    max_changed_slots: int | None = None,
    soft_locality: float | None = None,
    iters: int | None = None,
) -> Placement:
    """Plan replica counts and placement for every layer; return a :class:`Placement`.

    Args:
        weight: ``[L, N]`` loads (see :func:`rebalance_experts`). All-zero layers are planned as uniform
            and flagged in ``Placement.zero_layers``.
        num_replicas, num_groups, num_nodes, num_gpus: topology, as in :func:`rebalance_experts`.
        previous: the plan in service (a :class:`Placement` or its ``phy2log [L, R]``). Turns on the
            migration-aware mode: start from it and change at most ``max_changed_slots`` slots per layer.
        max_changed_slots: cap on changed slots per layer in migration mode (default ``R // 4``).
        soft_locality: penalty ``W >= 0`` of the soft-locality mode (hierarchical topologies only): each
            expert keeps one replica on its group's home node, redundant replicas may go to another node
            when its load times ``1 + W`` is still the lowest. ``None``: strict hierarchy.
        iters: refinement rounds (default: chosen from the GPU count).

    Returns:
        A :class:`Placement` on ``weight``'s device.
    """
    w = check_weight(weight)
    num_layers, num_logical = w.shape
    check_topology(num_logical, num_replicas, num_groups, num_nodes, num_gpus)
    if soft_locality is not None and (not isinstance(soft_locality, (int, float)) or not soft_locality >= 0):
        raise ValueError(f"soft_locality must be a float >= 0 or None, got {soft_locality!r}")
    if iters is not None and (not _is_int(iters) or iters < 0):
        raise ValueError(f"iters must be an int >= 0, got {iters!r}")
    w, zero = _prepare(w)
    mode = _mode_of(num_groups, num_nodes, soft_locality is not None)
    eff_groups, eff_nodes = (num_groups, num_nodes) if mode != "global" else (1, 1)
    home = None
    prev_phy = None
    if previous is not None:
        prev_phy = _check_previous(previous, num_layers, num_replicas, num_logical, w.device)
        if max_changed_slots is None:
            max_changed_slots = num_replicas // 4
        if not _is_int(max_changed_slots) or max_changed_slots < 0:
            raise ValueError(f"max_changed_slots must be an int >= 0, got {max_changed_slots!r}")
        phy2log, home = _solve_migration(
            w, prev_phy, num_replicas, num_groups, num_nodes, num_gpus, mode, int(max_changed_slots), iters
        )
    elif max_changed_slots is not None:
        raise ValueError("max_changed_slots needs previous (the plan in service)")
    elif mode == "soft":
        assert soft_locality is not None
        phy2log, home = _solve_soft(
            w, num_replicas, num_groups, num_nodes, num_gpus, float(soft_locality), iters
        )
    else:
        phy2log, _ = _solve.solve_hierarchical(w, num_replicas, eff_groups, eff_nodes, num_gpus, iters=iters)
        if mode == "strict" and num_nodes > 1:
            home = _home_nodes(phy2log, num_groups, num_nodes, num_logical)
    return Placement.from_tensors(
        phy2log,
        w,
        num_groups=num_groups,
        num_nodes=num_nodes,
        num_gpus=num_gpus,
        mode=mode,
        home_node=home,
        zero_layers=zero,
        previous=prev_phy,
        meta={"soft_locality": soft_locality, "max_changed_slots": max_changed_slots},
    )


def _home_nodes(phy2log: torch.Tensor, num_groups: int, num_nodes: int, num_logical: int) -> torch.Tensor:
    """Node of each group in a strict plan: ``[L, num_groups]``."""
    num_layers, num_replicas = phy2log.shape
    node = torch.arange(num_replicas, device=phy2log.device) // (num_replicas // num_nodes)
    home = torch.zeros(num_layers, num_groups, dtype=torch.int64, device=phy2log.device)
    home.scatter_(1, phy2log // (num_logical // num_groups), node.expand(num_layers, -1).contiguous())
    return home


def _check_previous(
    previous: Placement | torch.Tensor,
    num_layers: int,
    num_replicas: int,
    num_logical: int,
    device: torch.device,
) -> torch.Tensor:
    prev = previous.phy2log if isinstance(previous, Placement) else torch.as_tensor(previous)
    if prev.shape != (num_layers, num_replicas):
        raise ValueError(
            f"previous must be a plan of shape {(num_layers, num_replicas)}, got {tuple(prev.shape)}"
        )
    prev = prev.to(device, torch.int64)
    if int(prev.min()) < 0 or int(prev.max()) >= num_logical:
        raise ValueError("previous holds expert ids outside [0, num_logical)")
    counts = torch.zeros(num_layers, num_logical, dtype=torch.int64, device=device)
    counts.scatter_add_(1, prev, torch.ones_like(prev))
    if bool((counts < 1).any()):
        raise ValueError("previous leaves some logical expert without a replica")
    return prev


# ---------------------------------------------------------------------------- soft locality
def _solve_soft(
    w: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    penalty: float,
    iters: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft locality, on the host.

    Groups get home nodes by the best equal split (as in the strict mode); every expert keeps its
    first replica at home and the ``R - N`` redundant replicas are allocated to experts and nodes one
    at a time (:func:`eplb_core._kernels.soft_allocate`); redundant replicas are then traded between
    nodes to even the node loads (:func:`eplb_core._kernels.soft_node_swaps`), and each node is packed
    like a strict node (:func:`eplb_core._kernels.pack_layers`).
    """
    num_layers, num_logical = w.shape
    device = w.device
    group_size = num_logical // num_groups
    w_np = w.detach().to("cpu", torch.float64).numpy()
    group_load = w_np.reshape(num_layers, num_groups, group_size).sum(-1)
    node_of_group = _solve.assign_groups_to_nodes(group_load, num_nodes)
    home = np.ascontiguousarray(np.repeat(node_of_group, group_size, axis=1))  # [L, N]
    gpus_per_node = num_gpus // num_nodes
    expert, node, counts = _kernels.soft_allocate(w_np, home, num_replicas, num_nodes, num_gpus, penalty)
    # the one-at-a-time choices leave node loads uneven: trade redundant replicas between nodes
    _kernels.soft_node_swaps(
        w_np, counts, expert, node, home, num_nodes, gpus_per_node, penalty, 4 * (num_replicas - num_logical)
    )
    order = np.argsort(node * num_replicas + np.arange(num_replicas), axis=1)
    item_expert = np.take_along_axis(expert, order, 1).reshape(num_layers * num_nodes, -1)
    item_load = np.take_along_axis(w_np / counts, item_expert.reshape(num_layers, -1), 1)
    packed = _solve.pack_rows(
        item_load.reshape(item_expert.shape), item_expert, gpus_per_node, iters, num_logical, num_nodes
    )
    phy2log = torch.from_numpy(packed.reshape(num_layers, num_replicas)).to(device)
    return phy2log, torch.from_numpy(node_of_group).to(device)


# ---------------------------------------------------------------------------- migration
def _solve_migration(
    w: torch.Tensor,
    prev: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    mode: str,
    budget: int,
    iters: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Migration-aware: keep ``prev``'s slots, re-split replicas and swap within a change budget.

    Replicas never change node (strict and soft plans keep their locality and cross-node share);
    inside each node (or the whole layer in global mode): (1) up to half the budget moves single slots
    from over-replicated experts to the expert whose per-replica load is highest, (2) the swap
    refinement runs with the rest of the budget. Both only ever lower the peak of a row.
    """
    num_layers, num_logical = w.shape
    device = w.device
    rows_per_layer = num_nodes if mode in ("strict", "soft") else 1
    home = None
    if mode == "strict":
        from eplb_core.placement import Placement as _P

        try:
            _P.from_tensors(
                prev, w, num_groups=num_groups, num_nodes=num_nodes, num_gpus=num_gpus, mode="strict"
            ).validate()
        except ValueError as exc:
            raise ValueError(
                f"previous is not a valid strict-hierarchy plan for this topology: {exc}"
            ) from exc
        home = _home_nodes(prev, num_groups, num_nodes, num_logical)
    elif mode == "soft":
        group_load = w.detach().to("cpu", torch.float64).view(num_layers, num_groups, -1).sum(-1)
        home = torch.from_numpy(_solve.assign_groups_to_nodes(group_load.numpy(), num_nodes)).to(device)
    num_bins = num_gpus // rows_per_layer
    slots = num_replicas // num_gpus
    # exchange rounds (the budgeted swaps of this mode have no re-split or peak step)
    rounds = _kernels.default_iters(num_bins, _kernels.MAX_RESPLIT_SLOTS + 1) if iters is None else iters
    phy2log = _kernels.migrate_layers(
        w.detach().to("cpu", torch.float64).numpy(),
        prev.cpu().numpy(),
        rows_per_layer,
        num_gpus,
        budget,
        rounds,
        mode != "soft",
        _solve.split_tables(slots),
    )
    return torch.from_numpy(phy2log).to(device), home
