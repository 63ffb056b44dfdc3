"""Argument checks shared by the public functions (private): each raises ``ValueError`` naming the
argument and what was expected."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = [
    "MAX_LAYER_SUM",
    "TopologyError",
    "check_int_tensor",
    "check_placement_tensors",
    "check_previous",
    "check_topology",
    "check_weight",
    "is_int",
]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
# the largest load sum of a layer: the planner adds and compares sums of loads, with headroom
MAX_LAYER_SUM = float(np.finfo(np.float64).max) / 2**10


class TopologyError(ValueError, AssertionError):
    """An inconsistent topology: a ``ValueError`` that is also an ``AssertionError``, which is what
    DeepSeek's and vLLM's ``rebalance_experts`` raise for these conditions (they assert them), so
    code written against either catches it unchanged."""


def is_int(x: object) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_topology(
    num_logical: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    """Raise :class:`TopologyError` (a ``ValueError``) naming the argument when the topology is
    inconsistent.

    Like DeepSeek's and vLLM's ``rebalance_experts``, a topology with ``num_groups % num_nodes != 0``
    is planned globally (groups are ignored), so only hierarchical ones need ``num_groups`` to divide
    the experts.
    """
    for name, value in (
        ("num_replicas", num_replicas),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_gpus", num_gpus),
    ):
        if not is_int(value) or value < 1:
            raise TopologyError(f"{name} must be a positive int, got {value!r}")
    if num_replicas < num_logical:
        raise TopologyError(
            f"num_replicas ({num_replicas}) must be >= the number of logical experts ({num_logical}): "
            "every expert needs at least one replica"
        )
    if num_replicas % num_gpus != 0:
        raise TopologyError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})")
    if num_groups % num_nodes == 0 and num_logical % num_groups != 0:
        raise TopologyError(
            f"num_groups ({num_groups}) must divide the number of logical experts ({num_logical}) "
            f"for a hierarchical plan (num_groups % num_nodes == 0; otherwise the plan is global)"
        )
    if num_gpus % num_nodes != 0:
        raise TopologyError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")


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
    with np.errstate(over="ignore"):
        peak = float(a.sum(1).max()) if a is not None else float(t.sum(1).max())
    if not peak <= MAX_LAYER_SUM:
        raise ValueError(
            f"{name}: a layer's loads sum to {peak:.3g}, which overflows float64 arithmetic (at most "
            f"{MAX_LAYER_SUM:.3g}); scale the loads down"
        )
    return t


def check_int_tensor(x: Any, name: str, shape: str) -> torch.Tensor:
    """``x`` as an int64 tensor of rank ``len(shape)`` (``ValueError`` naming ``name`` otherwise; a
    float tensor is rejected, never truncated)."""
    t = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() != shape.count(",") + 1 or t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty {shape} tensor, got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def check_placement_tensors(
    weight: torch.Tensor, phy2log: Any, logcnt: Any, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phy2log, logcnt)`` as int64 on ``weight``'s device, checked against the load ``weight
    [L, N]``: shapes, expert ids in ``[0, N)``, counts >= 1, slots a multiple of ``num_gpus``."""
    phy = check_int_tensor(phy2log, "phy2log", "[L, R]").to(weight.device)
    cnt = check_int_tensor(logcnt, "logcnt", "[L, N]").to(weight.device)
    if phy.shape[0] != weight.shape[0] or cnt.shape != weight.shape:
        raise ValueError(
            f"phy2log [L, R] and logcnt [L, N] must match weight {tuple(weight.shape)}, got "
            f"{tuple(phy.shape)} and {tuple(cnt.shape)}"
        )
    if not is_int(num_gpus) or num_gpus < 1 or phy.shape[1] % num_gpus != 0:
        raise ValueError(
            f"num_gpus must be a positive divisor of num_replicas ({phy.shape[1]}), got {num_gpus!r}"
        )
    if int(phy.min()) < 0 or int(phy.max()) >= weight.shape[1]:
        raise ValueError(f"phy2log holds an expert id outside [0, {weight.shape[1]})")
    if bool((cnt < 1).any()):
        raise ValueError("logcnt: some logical expert has no replica (logcnt < 1)")
    return phy, cnt


def check_previous(previous: Any, num_layers: int, num_replicas: int, num_logical: int) -> np.ndarray:
    """``previous`` (a :class:`~eplb_core.Placement` or its ``phy2log [L, R]``) as a host int64 array.

    Raises ``ValueError`` for a float or bool dtype (never truncated), a wrong shape, expert ids outside
    ``[0, num_logical)``, or an expert without a replica.
    """
    from eplb_core.placement import Placement

    prev = (
        previous.phy2log
        if isinstance(previous, Placement)
        else check_int_tensor(previous, "previous", "[L, R]")
    )
    if prev.shape != (num_layers, num_replicas):
        raise ValueError(
            f"previous must be a plan of shape {(num_layers, num_replicas)}, got {tuple(prev.shape)}"
        )
    a = np.ascontiguousarray(prev.detach().cpu().numpy(), dtype=np.int64)
    if int(a.min()) < 0 or int(a.max()) >= num_logical:
        raise ValueError("previous holds expert ids outside [0, num_logical)")
    counts = np.zeros((num_layers, num_logical), dtype=np.int64)
    np.add.at(counts, (np.arange(num_layers)[:, None], a), 1)
    if bool((counts < 1).any()):
        raise ValueError("previous leaves some logical expert without a replica")
    return a
