"""Float32 torch reference for masked decoding."""

from __future__ import annotations

import torch


def masked_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decode attention in float32.

    Args:
        q: ``[B, Hq, D]`` query, any float dtype.
        k: ``[B, Hkv, L, D]`` keys; ``Hq`` must be a multiple of ``Hkv`` (GQA).
        v: ``[B, Hkv, L, D]`` values.
        mask: optional ``[B, Hkv, L]`` bool, ``True`` = position excluded.
        sm_scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``out [B, Hq, D]`` in ``q.dtype`` and ``lse [B, Hq]`` float32 (natural log).
        A row with no visible position gives ``out = 0`` and ``lse = -inf``.
    """
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B, Hq, D] and k, v [B, Hkv, L, D], got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k heads ({hkv})")
    scale = d**-0.5 if sm_scale is None else sm_scale
    g = hq // hkv
    qf = q.float().view(b, hkv, g, d)
    scores = torch.einsum("bhgd,bhld->bhgl", qf, k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(mask.view(b, hkv, 1, length), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("bhgl,bhld->bhgd", p, v.float())
    return out.reshape(b, hq, d).to(q.dtype), lse.reshape(b, hq)
