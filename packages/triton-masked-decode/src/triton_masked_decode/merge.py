"""Merging two partial attention results by their log-sum-exp (split caches, prefix + suffix)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_masked_decode._utils import ENABLE_FP_FUSION, interpreting
from triton_masked_decode.masked_decode import _empty_or_nan

__all__ = ["merge_attention_states"]


@triton.jit
def _merge_two_kernel(
    OutA,
    LseA,
    OutB,
    LseB,
    Out,
    Lse,
    n_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rows < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    la = tl.load(LseA + rows, mask=r_mask, other=float("-inf"))
    lb = tl.load(LseB + rows, mask=r_mask, other=float("-inf"))
    m = tl.maximum(la, lb)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_use)
    wb = tl.exp(lb - m_use)
    tot = wa + wb
    seen = tot > 0.0
    safe = tl.where(seen, tot, 1.0)
    off = rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    io_mask = r_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    # A side with zero weight is not read: its output may be anything (a never-written buffer).
    oa = tl.load(OutA + off, mask=io_mask & (wa > 0.0)[:, None], other=0.0).to(tl.float32)
    ob = tl.load(OutB + off, mask=io_mask & (wb > 0.0)[:, None], other=0.0).to(tl.float32)
    out = (oa * wa[:, None] + ob * wb[:, None]) / safe[:, None]
    tl.store(Out + off, out.to(Out.dtype.element_ty), mask=io_mask)
    tl.store(Lse + rows, tl.where(seen, m_use + tl.log(safe), _empty_or_nan(tot)), mask=r_mask)


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets into the result over their union.

    ``out = (exp(lse_a) * out_a + exp(lse_b) * out_b) / (exp(lse_a) + exp(lse_b))`` and
    ``lse = log(exp(lse_a) + exp(lse_b))``, computed stably in float32. A side with ``lse = -inf`` (no
    visible key) contributes nothing and its output is not read; if both are ``-inf`` the result is
    ``out = 0``, ``lse = -inf``. A NaN or ``+inf`` LSE on either side is not an attention result: the row
    gives ``out = NaN`` and ``lse = NaN`` (never a finite or empty-looking value).

    Args:
        out_a: ``[..., H, D]`` float16/bfloat16/float32 partial output.
        lse_a: ``[..., H]`` float32 natural-log LSE of ``out_a``.
        out_b: like ``out_a`` (same shape and dtype).
        lse_b: like ``lse_a``.

    Returns:
        ``(out [..., H, D] in out_a.dtype, lse [..., H] float32)``.
    """
    if out_a.shape != out_b.shape or out_a.dtype != out_b.dtype:
        raise ValueError(
            f"merge_attention_states: out_a {tuple(out_a.shape)} {out_a.dtype} and out_b "
            f"{tuple(out_b.shape)} {out_b.dtype} must match"
        )
    if out_a.dim() < 2 or lse_a.shape != out_a.shape[:-1] or lse_b.shape != out_a.shape[:-1]:
        raise ValueError(
            f"merge_attention_states: lse_a {tuple(lse_a.shape)} and lse_b {tuple(lse_b.shape)} must be "
            f"out's shape without the last dim, {tuple(out_a.shape[:-1])}"
        )
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise ValueError(f"merge_attention_states: lse must be float32, got {lse_a.dtype}, {lse_b.dtype}")
    if out_a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"merge_attention_states: out dtype must be float16/bfloat16/float32, got {out_a.dtype}"
        )
    devs = {t.device for t in (out_a, lse_a, out_b, lse_b)}
    if len(devs) != 1:
        raise ValueError(f"merge_attention_states: all tensors must be on one device, got {devs}")
    dev = out_a.device
    if dev.type != "cuda" and not interpreting():
        raise ValueError(
            f"merge_attention_states: tensors must be on CUDA (CPU needs TRITON_INTERPRET=1), got {dev}"
        )
    if torch.compiler.is_compiling():  # traced: the custom op (its fake gives shapes and dtypes)
        return torch.ops.triton_masked_decode.merge_attention_states(out_a, lse_a, out_b, lse_b)
    return _launch_merge(out_a, lse_a, out_b, lse_b)


def _launch_merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the merge kernel on validated inputs."""
    d = out_a.shape[-1]
    oa, ob = out_a.contiguous(), out_b.contiguous()
    la, lb = lse_a.contiguous(), lse_b.contiguous()
    out = torch.empty_like(oa)
    lse = torch.empty_like(la)
    n_rows = la.numel()
    if n_rows == 0:
        return out, lse
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(16, 4096 // block_d))
    _merge_two_kernel[(triton.cdiv(n_rows, block_r),)](
        oa, la, ob, lb, out, lse, n_rows, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4,
        enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    return out, lse


_merge_op = torch.library.custom_op(
    "triton_masked_decode::merge_attention_states", _launch_merge, mutates_args=()
)


@_merge_op.register_fake
def _merge_fake(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(out_a, memory_format=torch.contiguous_format), torch.empty_like(
        lse_a, memory_format=torch.contiguous_format
    )
