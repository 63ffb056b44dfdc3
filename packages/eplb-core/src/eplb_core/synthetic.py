"""Synthetic expert-load matrices that look like DeepSeek-V3 serving statistics.

The generator is this project's own and is what the bundled demo matrix, the tests and the benchmark use.
Shape of real loads it imitates (public descriptions of DeepSeek-V3 / SGLang expert-distribution dumps):

* most experts carry between a third and twice the mean load (log-normal spread, sigma 0.45);
* a handful of "hot" experts per layer (2 to 6) carry 5 to 13 times the mean;
* whole expert groups drift together (a per-group factor, sigma 0.25), which is what makes the strict
  group-to-node hierarchy hard to balance;
* counts are integers (tokens x top-k routed to each expert), drawn from a Poisson law around the rates;
* over time (``num_windows``) every rate follows a slow log-random walk plus per-window noise, so a plan
  made on one window is scored on a different, later one.
"""

from __future__ import annotations

import torch

__all__ = ["synthetic_loads"]


def synthetic_loads(
    num_layers: int = 58,
    num_experts: int = 256,
    *,
    num_groups: int = 8,
    num_windows: int | None = None,
    tokens_per_layer: int = 8 * 65536,
    drift: float = 0.08,
    group_sigma: float = 0.25,
    seed: int = 0,
) -> torch.Tensor:
    """Skewed, integer-valued expert loads.

    Args:
        num_layers: MoE layers ``L``.
        num_experts: logical experts ``N`` per layer (a multiple of ``num_groups``).
        num_groups: expert groups sharing a common drift factor.
        num_windows: if given, return a history ``[T, L, N]`` of ``T`` successive windows.
        tokens_per_layer: routed tokens x top-k per window; the expected row sum.
        drift: per-window standard deviation of the log-random walk of every rate.
        group_sigma: standard deviation of the per-group log factor (larger: groups differ more, the
            strict-hierarchy cap drops; 0.5 gives a cap near 0.85 at 4 nodes / 32 GPUs).
        seed: seed of a private ``torch.Generator`` (the global RNG is not touched).

    Returns:
        ``[L, N]`` (or ``[T, L, N]``) float64 tensor of non-negative integer counts.
    """
    if num_experts % num_groups != 0:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_groups ({num_groups})")
    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_experts)
    log_rate = 0.45 * torch.randn(shape, generator=gen, dtype=torch.float64)
    group_factor = group_sigma * torch.randn(num_layers, num_groups, 1, generator=gen, dtype=torch.float64)
    log_rate = (log_rate.view(num_layers, num_groups, -1) + group_factor).view(shape)
    num_hot = torch.randint(2, 7, (num_layers,), generator=gen)
    hot_mult = 5.0 + 8.0 * torch.rand(num_layers, 6, generator=gen, dtype=torch.float64)
    hot_idx = torch.rand(shape, generator=gen).argsort(dim=1)[:, :6]
    base = log_rate.exp()
    base = base / base.mean(dim=1, keepdim=True)
    for layer in range(num_layers):
        k = int(num_hot[layer])
        base[layer, hot_idx[layer, :k]] = hot_mult[layer, :k]
    log_base = base.log()

    def sample(log_r: torch.Tensor) -> torch.Tensor:
        rate = log_r.exp()
        rate = rate / rate.sum(dim=1, keepdim=True) * tokens_per_layer
        return torch.poisson(rate, generator=gen)

    if num_windows is None:
        return sample(log_base)
    windows = []
    walk = torch.zeros(shape, dtype=torch.float64)
    for _ in range(num_windows):
        walk = walk + drift * torch.randn(shape, generator=gen, dtype=torch.float64)
        noise = 0.5 * drift * torch.randn(shape, generator=gen, dtype=torch.float64)
        windows.append(sample(log_base + walk + noise))
    return torch.stack(windows)
