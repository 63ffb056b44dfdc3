"""Quality measures of a placement."""

from __future__ import annotations

import torch


def balancedness(gpu_loads: torch.Tensor) -> torch.Tensor:
    """Mean GPU load over max GPU load, per layer.

    Args:
        gpu_loads: ``[L, num_gpus]`` non-negative loads.

    Returns:
        ``[L]`` float64 in ``(0, 1]``; a layer with no load at all counts as perfectly balanced (1.0).
    """
    if gpu_loads.dim() != 2:
        raise ValueError(f"gpu_loads must be [num_layers, num_gpus], got shape {tuple(gpu_loads.shape)}")
    loads = gpu_loads.double()
    peak = loads.amax(dim=1)
    return torch.where(peak > 0, loads.mean(dim=1) / peak.clamp_min(1e-300), torch.ones_like(peak))
