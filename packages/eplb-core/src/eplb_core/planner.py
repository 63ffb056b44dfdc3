"""Public planning entry points: :func:`rebalance_experts` (DeepSeek/vLLM/SGLang-compatible) and
:func:`plan` (the richer API with migration-aware and soft-locality modes).

Torch appears only here, at the boundary: the load is checked (on its device), copied to the host as
one float64 NumPy array, planned by :mod:`eplb_core._solve`, and the plan goes back to the load's device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from eplb_core import _solve
from eplb_core._numba import runner
from eplb_core._numba.utils import log2phy
from eplb_core._validate import check_previous, check_topology, check_weight, is_int
from eplb_core.placement import Placement, avoidable_repeats

__all__ = ["plan", "rebalance_experts"]


def _host_weight(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(weight [L, N] float64 host array, zero_layers [L] bool)``: all-zero layers are planned as
    uniform loads (nothing to balance; every expert one share)."""
    a = np.array(w.cpu().numpy(), dtype=np.float64, order="C")
    zero = a.sum(1) == 0
    a[zero] = 1.0
    return a, zero


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
        num_groups: expert groups (DeepSeek-V3: 8); must divide ``N`` for a hierarchical plan.
        num_nodes: server nodes; with ``num_groups % num_nodes == 0`` the plan is strictly hierarchical
            (every replica of a group's experts on the node that hosts the group), otherwise global
            (groups ignored), as in DeepSeek's function.
        num_gpus: GPUs in total, a multiple of ``num_nodes``.

    Returns:
        ``(phy2log [L, R], log2phy [L, N, max_replicas], logcnt [L, N])``, int64 on ``weight``'s device.
        Physical slot ``p`` lives on GPU ``p // (R / num_gpus)``; the slots of a GPU hold its
        replicas by decreasing load (an expert's load shared by its replicas), ties by expert id, the
        order in which DeepSeek's packing fills a GPU; ``log2phy`` is padded with ``-1``.
        Deterministic; no layer is less balanced than DeepSeek's greedy plan
        (:func:`eplb_core.reference.greedy_rebalance`); no GPU holds two replicas of an expert when that
        can be avoided, except in a layer where the greedy plan, which allows it, is more balanced
        than the planner's plan without it: there the greedy plan is returned. The plan is computed on the host by the compiled planner (one
        thread); a CUDA ``weight`` is checked on its device, copied to the host, and the three tensors
        are copied back to it. The first call in a fresh environment compiles the planner.

    Raises:
        ValueError: naming the argument: ``weight`` not a non-empty 2-D matrix of real numbers, with
            NaN, infinite or negative loads, or layer sums that overflow float64; counts below 1,
            ``num_replicas < N``, ``num_replicas % num_gpus != 0``, ``num_gpus % num_nodes != 0``, or
            ``num_groups`` not dividing ``N`` in a hierarchical topology. The topology errors are
            also ``AssertionError`` s, as DeepSeek's and vLLM's function raise for them.
    """
    w = check_weight(weight)
    num_logical = w.shape[1]
    check_topology(num_logical, num_replicas, num_groups, num_nodes, num_gpus)
    w_np, _ = _host_weight(w)
    if _mode_of(num_groups, num_nodes, False) == "global":
        num_groups, num_nodes = 1, 1
    phy2log, logcnt, greedy_peak = _solve.solve(w_np, num_replicas, num_groups, num_nodes, num_gpus)
    phy2log, taken = _solve.greedy_fallback(w_np, phy2log, num_groups, num_nodes, num_gpus, greedy_peak)
    if taken.any():
        logcnt = _counts(phy2log, num_logical)
    # only the three tensors: the quality figures of plan() (bounds, loads) are not computed here
    return tuple(
        torch.from_numpy(a).to(w.device) for a in (phy2log, runner.call(log2phy, phy2log, logcnt), logcnt)
    )  # type: ignore[return-value]


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
        previous: the plan in service (a :class:`Placement` or its integer ``phy2log [L, R]``). Turns
            on the migration-aware mode: start from it and change at most ``max_changed_slots`` slots per
            layer; replicas keep their node, so from a strict plan the result is strict (``mode``
            ``"strict"``) even with ``soft_locality``.
        max_changed_slots: cap on changed slots per layer in migration mode (default ``R // 4``).
        soft_locality: penalty ``W >= 0`` of the soft-locality mode (hierarchical topologies only): each
            expert keeps one replica on its group's home node, redundant replicas may go to another node
            when its load times ``1 + W`` is still the lowest. ``None``: strict hierarchy.
        iters: refinement rounds (default: chosen from the GPU count).

    Returns:
        A :class:`Placement` on ``weight``'s device that passes :meth:`Placement.validate`;
        ``mode`` is ``"strict"``, ``"global"`` (when ``num_groups % num_nodes != 0``) or ``"soft"``.
        Without ``previous`` no layer is less balanced than DeepSeek's greedy plan
        (:func:`eplb_core.reference.greedy_rebalance`): where that plan, which may put two replicas
        of an expert on one GPU, is more balanced than the planner's, it is taken for the layer and
        the layer is flagged in ``Placement.colocated_layers``. With ``previous``, a layer keeps
        such a repeat only if the plan in service had one there (and is flagged).

    Raises:
        ValueError: naming the argument, for the inputs :func:`rebalance_experts` rejects, and for
            ``soft_locality`` negative or not finite, ``max_changed_slots`` negative or given without
            ``previous``, a ``previous`` of another shape or a float dtype, with ids outside ``[0, N)``
            or an expert without a replica, a strict ``previous`` that is not a valid strict plan, or
            when no valid plan lies within ``max_changed_slots`` of ``previous``.
    """
    w = check_weight(weight)
    num_layers, num_logical = w.shape
    check_topology(num_logical, num_replicas, num_groups, num_nodes, num_gpus)
    if soft_locality is not None and (
        not isinstance(soft_locality, (int, float)) or not 0 <= soft_locality < float("inf")
    ):
        raise ValueError(f"soft_locality must be a finite float >= 0 or None, got {soft_locality!r}")
    if iters is not None and (not is_int(iters) or iters < 0):
        raise ValueError(f"iters must be an int >= 0, got {iters!r}")
    w_np, zero = _host_weight(w)
    mode = _mode_of(num_groups, num_nodes, soft_locality is not None)
    home = None
    prev_np = None
    colocated = None
    greedy_peak = None  # the peak of DeepSeek's greedy plan where it may win (None: not known)
    if previous is not None:
        prev_np = check_previous(previous, num_layers, num_replicas, num_logical)
        if max_changed_slots is None:
            max_changed_slots = num_replicas // 4
        if not is_int(max_changed_slots) or max_changed_slots < 0:
            raise ValueError(f"max_changed_slots must be an int >= 0, got {max_changed_slots!r}")
        if mode == "soft" and _plan_error(prev_np, w_np, num_groups, num_nodes, num_gpus, "strict") is None:
            # replicas keep their node in a migration: from a strict plan in service the result is strict
            mode = "strict"
        if mode == "strict":
            error = _plan_error(prev_np, w_np, num_groups, num_nodes, num_gpus, "strict")
            if error is not None:
                raise ValueError(f"previous is not a valid strict-hierarchy plan for this topology: {error}")
            home = _solve.home_nodes(prev_np, num_groups, num_nodes, num_logical)
        elif mode == "soft":
            group_load = w_np.reshape(num_layers, num_groups, -1).sum(-1)
            home = _solve.assign_groups_to_nodes(group_load, num_nodes)
        phy2log = _solve.solve_migration(
            w_np, prev_np, num_groups, num_nodes, num_gpus, mode, int(max_changed_slots), iters
        )
        # a repeat of an expert on a GPU stays allowed where the plan in service had one (a greedy
        # layer); a layer whose migration would raise its peak to undo such a repeat, or would leave
        # an avoidable repeat the plan in service did not have, keeps the plan in service
        had = avoidable_repeats(prev_np, _counts(prev_np, num_logical), num_gpus, num_nodes, mode)
        has = avoidable_repeats(phy2log, _counts(phy2log, num_logical), num_gpus, num_nodes, mode)
        raised = _solve.peaks(w_np, phy2log, num_gpus) > _solve.peaks(w_np, prev_np, num_gpus)
        keep = (had & raised) | (has & ~had)
        phy2log[keep] = prev_np[keep]
        colocated = had & (has | keep)
    elif max_changed_slots is not None:
        raise ValueError("max_changed_slots needs previous (the plan in service)")
    elif mode == "soft":
        assert soft_locality is not None
        phy2log, home = _solve.solve_soft(
            w_np, num_replicas, num_groups, num_nodes, num_gpus, float(soft_locality), iters
        )
    else:
        eff_groups, eff_nodes = (num_groups, num_nodes) if mode != "global" else (1, 1)
        phy2log, _, greedy_peak = _solve.solve(
            w_np, num_replicas, eff_groups, eff_nodes, num_gpus, iters=iters
        )
    if prev_np is None:
        # never below DeepSeek's greedy plan: where it is more balanced (it may repeat an expert on a
        # GPU, which the planner avoids), it is the plan of the layer
        phy2log, colocated = _solve.greedy_fallback(
            w_np, phy2log, num_groups, num_nodes, num_gpus, greedy_peak
        )
        if mode == "strict" and num_nodes > 1:
            home = _solve.home_nodes(phy2log, num_groups, num_nodes, num_logical)
        elif mode == "soft" and colocated.any():
            assert home is not None
            home = home.copy()
            home[colocated] = _solve.home_nodes(phy2log[colocated], num_groups, num_nodes, num_logical)

    def to_device(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(a).to(w.device)

    try:
        placement = Placement.from_tensors(
            torch.from_numpy(phy2log).to(w.device),
            torch.from_numpy(w_np).to(w.device),
            num_groups=num_groups,
            num_nodes=num_nodes,
            num_gpus=num_gpus,
            mode=mode,
            home_node=to_device(home),
            zero_layers=to_device(zero),
            previous=to_device(prev_np),
            colocated_layers=to_device(colocated),
            meta={"soft_locality": soft_locality, "max_changed_slots": max_changed_slots},
        )
    except ValueError as exc:
        if prev_np is None:
            raise  # not reached: every fresh plan is valid by construction
        raise ValueError(
            f"no valid {mode} plan within max_changed_slots={max_changed_slots} of previous: {exc}"
        ) from exc
    return placement


def _counts(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """``[L, N]`` int64 replica count of every expert in ``phy2log [L, R]``."""
    num_layers = phy2log.shape[0]
    flat = phy2log + np.arange(num_layers)[:, None] * num_logical
    return np.bincount(flat.ravel(), minlength=num_layers * num_logical).reshape(num_layers, num_logical)


def _plan_error(
    phy2log: np.ndarray, weight: np.ndarray, num_groups: int, num_nodes: int, num_gpus: int, mode: str
) -> str | None:
    """Why ``phy2log`` is not a valid plan of ``mode`` for this topology, or None when it is."""
    try:
        Placement.from_tensors(
            torch.from_numpy(phy2log),
            torch.from_numpy(weight),
            num_groups=num_groups,
            num_nodes=num_nodes,
            num_gpus=num_gpus,
            mode=mode,
            # the hierarchy is checked here; repeats of an expert on a GPU are the migration's concern
            colocated_layers=torch.ones(phy2log.shape[0], dtype=torch.bool),
        )
    except ValueError as exc:
        return str(exc)
    return None
