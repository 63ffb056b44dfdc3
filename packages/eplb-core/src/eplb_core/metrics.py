"""Quality measures of a placement."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def balancedness(gpu_loads: Any) -> torch.Tensor:
    """Mean GPU load over max GPU load, per layer.

    Args:
        gpu_loads: ``[L, num_gpus]`` non-negative finite loads (tensor on any device, or array-like).

    Returns:
        ``[L]`` float64 in ``(0, 1]`` on ``gpu_loads``' device; a layer with no load at all counts as
        perfectly balanced (1.0).

    Raises:
        ValueError: for a shape other than ``[L, num_gpus]``, an empty input, NaN, infinite (for example
            overflowed sums) or negative loads.
    """
    loads = (
        gpu_loads.detach() if isinstance(gpu_loads, torch.Tensor) else torch.as_tensor(np.asarray(gpu_loads))
    )
    if loads.dim() != 2 or loads.numel() == 0:
        raise ValueError(
            f"gpu_loads must be a non-empty [num_layers, num_gpus], got shape {tuple(loads.shape)}"
        )
    if loads.dtype == torch.bool or loads.is_complex():
        raise ValueError(f"gpu_loads must hold real numbers, got dtype {loads.dtype}")
    loads = loads.double()
    if not bool(torch.isfinite(loads).all()):
        raise ValueError("gpu_loads contains NaN or infinite loads (an overflowed sum?)")
    if bool((loads < 0).any()):
        raise ValueError("gpu_loads contains negative loads")
    peak = loads.amax(dim=1).clamp_min(1e-300)
    mean = loads.mean(dim=1)
    # finite loads whose sum overflows: the mean of the loads scaled by the peak (at most 1 each)
    mean = torch.where(torch.isfinite(mean), mean / peak, (loads / peak.unsqueeze(1)).mean(dim=1))
    return torch.where(loads.amax(dim=1) > 0, mean, torch.ones_like(peak))
