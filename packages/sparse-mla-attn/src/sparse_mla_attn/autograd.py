"""Autograd for sparse MLA: :class:`SparseMLAAttention` and the functional :func:`sparse_mla`."""

from __future__ import annotations

from typing import Any

import torch

from sparse_mla_attn.backward import sparse_mla_bwd
from sparse_mla_attn.config import Config
from sparse_mla_attn.forward import sparse_mla_fwd

__all__ = ["SparseMLAAttention", "sparse_mla"]


class SparseMLAAttention(torch.autograd.Function):
    """``out, lse = SparseMLAAttention.apply(q, kv, indices, sm_scale, d_v, q_start_index, k_stride, causal,
    deterministic, attn_sum_out, config)``, every argument positional (``Function.apply`` takes no keywords;
    :func:`sparse_mla` is the keyword form). Shapes and dtypes as :func:`sparse_mla`'s; ``attn_sum_out`` and
    ``config`` may be ``None``.

    Forward through the Triton ``sparse_mla_fwd``, backward through :func:`sparse_mla_bwd`. Gradients flow
    to ``q`` and ``kv``; ``lse`` is returned for the indexer target and is not differentiable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        sm_scale: float,
        d_v: int,
        q_start_index: int,
        k_stride: int,
        causal: bool,
        deterministic: bool,
        attn_sum_out: torch.Tensor | None = None,
        config: Config | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``sparse_mla_fwd`` and save what the backward needs; returns ``(out, lse)``."""
        out, _max_logits, lse = sparse_mla_fwd(
            q, kv, indices, sm_scale, d_v, q_start_index=q_start_index, k_stride=k_stride, causal=causal,
            config=config,
        )  # fmt: skip
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.args = (sm_scale, d_v, q_start_index, k_stride, causal, deterministic)
        ctx.attn_sum_out = attn_sum_out
        ctx.config = config
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        """Gradients for ``q`` and ``kv`` through :func:`sparse_mla_bwd`; ``None`` for the other inputs."""
        q, kv, indices, out, lse = ctx.saved_tensors
        sm_scale, d_v, q_start_index, k_stride, causal, deterministic = ctx.args
        attn_sum_out = ctx.attn_sum_out
        grads = sparse_mla_bwd(
            q,
            kv,
            out,
            dout.contiguous(),
            indices,
            lse,
            sm_scale,
            d_v,
            q_start_index=q_start_index,
            k_stride=k_stride,
            causal=causal,
            deterministic=deterministic,
            return_attn_sum=attn_sum_out is not None,
            config=ctx.config,
        )
        if attn_sum_out is not None:  # the indexer target, a by-product of the backward
            attn_sum_out.copy_(grads[2])
        return grads[0], grads[1], None, None, None, None, None, None, None, None, None


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    *,
    q_start_index: int = 0,
    k_stride: int = 1,
    causal: bool = False,
    deterministic: bool = False,
    return_lse: bool = False,
    attn_sum_out: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable sparse MLA attention: each query attends to its top-k KV rows.

    Args:
        q: ``[s_q, h_q, d_qk]`` bf16 (or fp16), ``d_qk`` = 576 or 512.
        kv: ``[s_kv, 1, d_qk]`` q's dtype; the first ``d_v`` channels are the values.
        indices: ``[s_q, 1, topk]`` int32 global row indices; ``< 0`` or ``>= s_kv`` is invalid.
        sm_scale: softmax scale applied to ``q · k``.
        d_v: value head dim.
        q_start_index: position of query 0 (causal limit).
        k_stride: KV compression stride (causal limit).
        causal: mask slots above ``(q_pos + 1 - k_stride) / k_stride``.
        deterministic: use the bit-reproducible ``dkv`` reduction in the backward.
        return_lse: also return ``lse [s_q, h_q]`` fp32 (natural log, not differentiable).
        attn_sum_out: optional ``[s_q, topk]`` fp32 tensor that the backward fills with the attention
            probability summed over heads at each slot (the lightning indexer's KL target, as
            ``attn_dist(..., causal=causal)``), computed from the ``P`` the backward recomputes anyway. It is
            written when ``out.backward()`` runs, so the indexer loss that uses it is back-propagated after.
        config: tuning options (:class:`~sparse_mla_attn.Config`) for the forward and the backward.

    Returns:
        ``out [s_q, h_q, d_v]`` (and ``lse`` if asked). ``out.backward()`` fills ``q.grad`` and ``kv.grad``.
    """
    if attn_sum_out is not None:
        want = (q.shape[0], indices.shape[-1])
        if attn_sum_out.shape != want or attn_sum_out.dtype != torch.float32:
            raise ValueError(
                f"attn_sum_out must be float32 {list(want)}, got {attn_sum_out.dtype} {list(attn_sum_out.shape)}"
            )
    out, lse = SparseMLAAttention.apply(
        q, kv, indices, sm_scale, d_v, q_start_index, k_stride, causal, deterministic, attn_sum_out, config
    )
    return (out, lse) if return_lse else out
