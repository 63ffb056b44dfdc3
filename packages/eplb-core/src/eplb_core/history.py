"""Planning from a history of load windows."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from eplb_core.placement import Placement

__all__ = ["expected_load", "plan_from_history"]


def expected_load(history: Any, *, method: str = "ema", halflife: float | None = None) -> torch.Tensor:
    """Expected next-window load ``[L, N]`` float64 from ``history [T, L, N]`` (oldest window first).

    Args:
        history: ``T >= 1`` successive load windows (per-step or per-interval counts).
        method: ``"ema"`` (default) or ``"mean"``.
        halflife: EMA half-life in windows (default ``max(1, T / 4)``).

    The default is an exponential moving average: expert popularity drifts (the plan is scored on load
    that comes after it), so recent windows say more about the next one than old ones, while averaging
    several windows removes the per-window sampling noise that a plan made from the last window alone
    would chase. ``"mean"`` weighs all windows equally (stationary load). Each window is first normalised
    to its layer totals so that busy and quiet windows count alike; the result is scaled back to the mean
    total.
    """
    if isinstance(history, torch.Tensor):
        h = history.detach()
    else:
        h = torch.as_tensor(np.asarray(history))
    if h.dim() != 3:
        raise ValueError(
            f"history must be 3-D [num_windows, num_layers, num_logical_experts], got shape {tuple(h.shape)}"
        )
    if h.numel() == 0:
        raise ValueError("history is empty")
    h = h.to(torch.float64)
    if not bool(torch.isfinite(h).all()) or bool((h < 0).any()):
        raise ValueError("history contains NaN, infinite or negative loads")
    if method not in ("ema", "mean"):
        raise ValueError(f"method must be 'ema' or 'mean', got {method!r}")
    num_windows = h.shape[0]
    totals = h.sum(-1, keepdim=True)
    share = torch.where(totals > 0, h / totals.clamp_min(1e-300), torch.zeros_like(h))
    if method == "mean":
        weights = torch.ones(num_windows, dtype=torch.float64, device=h.device)
    else:
        hl = max(1.0, num_windows / 4) if halflife is None else float(halflife)
        if not hl > 0:
            raise ValueError(f"halflife must be > 0, got {halflife!r}")
        age = torch.arange(num_windows - 1, -1, -1, dtype=torch.float64, device=h.device)
        weights = 0.5 ** (age / hl)
    active = (totals.squeeze(-1) > 0).to(torch.float64)  # [T, L]: windows that saw traffic
    wt = weights.view(-1, 1) * active
    denom = wt.sum(0).clamp_min(1e-300)
    mix = (share * wt.unsqueeze(-1)).sum(0) / denom.unsqueeze(-1)
    scale = (totals.squeeze(-1) * active).sum(0) / active.sum(0).clamp_min(1)
    return mix * scale.unsqueeze(-1)


def plan_from_history(
    history: Any, *, method: str = "ema", halflife: float | None = None, **plan_kwargs: Any
) -> Placement:
    """:func:`eplb_core.plan` on :func:`expected_load` of ``history [T, L, N]``.

    Args:
        history: load windows, oldest first.
        method, halflife: see :func:`expected_load`.
        **plan_kwargs: ``num_replicas``, ``num_groups``, ``num_nodes``, ``num_gpus`` and the optional
            modes of :func:`eplb_core.plan`.
    """
    from eplb_core.planner import plan

    return plan(expected_load(history, method=method, halflife=halflife), **plan_kwargs)
