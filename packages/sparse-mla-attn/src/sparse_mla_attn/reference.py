"""Float32 torch references for sparse MLA."""

from __future__ import annotations

import torch


def sparse_mla_fwd_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA forward in float32.

    Args:
        q: ``[s_q, h_q, d_qk]``.
        kv: ``[s_kv, 1, d_qk]``; the first ``d_v`` channels are the values.
        indices: ``[s_q, 1, topk]`` int32; an index ``< 0`` or ``>= s_kv`` is invalid and ignored.
        sm_scale: softmax scale applied to ``q · k``.
        d_v: value head dim.

    Returns:
        ``out [s_q, h_q, d_v]`` (q's dtype), ``max_logits [s_q, h_q]`` fp32, ``lse [s_q, h_q]`` fp32
        in natural log. A query with no valid index gives ``out = 0``, ``lse = -inf``.
    """
    s_kv = kv.shape[0]
    idx = indices[:, 0].long()
    valid = (idx >= 0) & (idx < s_kv)
    rows = kv[:, 0].float()[idx.clamp(0, s_kv - 1)]  # [s_q, topk, d_qk]
    scores = torch.einsum("shd,std->sht", q.float(), rows) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    max_logits = scores.amax(-1)
    lse = torch.logsumexp(scores, -1)
    p = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    out = torch.einsum("sht,std->shd", p, rows[..., :d_v])
    return out.to(q.dtype), max_logits, lse
