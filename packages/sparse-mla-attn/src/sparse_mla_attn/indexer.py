"""DeepSeek-V3.2 lightning indexer: logits, top-k selection and the KL loss that trains it.

For query token ``t``, indexer head ``j`` and key token ``n``::

    I[t, n] = Σ_j  w[t, j] * ReLU(q_idx[t, j] · k_idx[n])

``indexer_topk`` picks each query's ``topk`` largest logits (the sparse attention's ``indices``), and
``indexer_kl_loss`` pulls ``softmax(I[t, selected])`` towards the attention that the main model actually
paid to those rows (``attn_sum``, summed over heads, L1-normalised and detached).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from sparse_mla_attn._runtime import (
    ENABLE_FP_FUSION,
    causal_hi,
    causal_max_k,
    cdiv,
    define_op,
    dot,
    interpreting,
    mask_and,
    next_power_of_2,
    record_launch,
)
from sparse_mla_attn._validate import causal_keep, check_causal_args, check_indexer_inputs, check_tensor
from sparse_mla_attn.reference import reduce_loss

# ----------------------------------------------------------------------------------------------------------
# Triton forward of the logits
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _logits_kernel(
    q_ptr, k_ptr, w_ptr, out_ptr,
    s_q, s_kv,
    stride_qs, stride_qh, stride_ks, stride_ws, stride_wh, stride_os,
    q_start_index, k_stride,
    H: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    mmask = offs_m < s_q
    nmask = offs_n < s_kv
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    max_k = causal_max_k(q_start_index + offs_m, k_stride)
    # Under the causal rule a tile whose first key is past the last row's limit is all -inf: skip its math.
    last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, s_q) - 1
    tile_live = (not CAUSAL) or (pid_n * BLOCK_N <= causal_max_k(q_start_index + last_row, k_stride))
    if tile_live:
        k = tl.load(
            k_ptr + offs_n[:, None].to(tl.int64) * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0
        )
        kt = tl.trans(k)
        q_row = q_ptr + offs_m[:, None].to(tl.int64) * stride_qs + offs_d[None, :]
        for h in range(H):
            qh = tl.load(q_row + h * stride_qh, mask=mmask[:, None], other=0.0)
            wh = tl.load(w_ptr + offs_m * stride_ws + h * stride_wh, mask=mmask, other=0.0).to(tl.float32)
            acc += tl.maximum(dot(qh, kt), 0.0) * wh[:, None]
    if CAUSAL:
        acc = tl.where(offs_n[None, :] <= max_k[:, None], acc, float("-inf"))
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * stride_os + offs_n[None, :],
        acc,
        mask=mmask[:, None] & nmask[None, :],
    )


def launch_logits(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    causal: bool,
    q_start_index: int,
    k_stride: int,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    s_q, h_idx, d_idx = q_idx.shape
    s_kv = k_idx.shape[0]
    q_idx = q_idx if q_idx.stride(-1) == 1 else q_idx.contiguous()
    k_idx = k_idx if k_idx.stride(-1) == 1 else k_idx.contiguous()
    out = torch.empty(s_q, s_kv, dtype=torch.float32, device=q_idx.device)
    if interpreting():
        cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    else:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
    if config:
        cfg.update(config)
    grid = (cdiv(s_kv, cfg["BLOCK_N"]), cdiv(s_q, cfg["BLOCK_M"]))
    kernel = _logits_kernel[grid](
        q_idx, k_idx, weights, out, s_q, s_kv,
        q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        q_start_index, k_stride, H=h_idx, D=d_idx, CAUSAL=causal,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    record_launch("indexer.logits", kernel)
    return out


@triton.jit
def _rows_grad(g_ptr, stride_gs, t0, s_q, offs_n, nmask, tok_of_row, max_k_row,
                       TOK: tl.constexpr, CAUSAL: tl.constexpr):  # fmt: skip
    """``[rows, N]`` fp32 upstream gradient for the rows (token-major, TOK tokens) of a tile.

    Each token's gradient row is loaded once as a ``[N]`` vector and broadcast over its heads; entries that
    are masked (past ``s_kv``, outside the causal limit, or of a padded token) are 0 even if the gradient
    there is NaN or inf.
    """
    g = tl.zeros([tok_of_row.shape[0], offs_n.shape[0]], dtype=tl.float32)
    for i in tl.static_range(TOK):
        t = t0 + i
        gi = tl.load(g_ptr + t.to(tl.int64) * stride_gs + offs_n, mask=mask_and(nmask, t < s_q), other=0.0)
        g = tl.where((tok_of_row == i)[:, None], gi[None, :], g)
    keep = nmask[None, :] & ((t0 + tok_of_row) < s_q)[:, None]
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= max_k_row[:, None])
    return tl.where(keep, g, 0.0)


@triton.jit
def _dqw_step(g_ptr, k_ptr, stride_gs, stride_ks, s_q, s_kv, n0, t0, q, w, tok_of_row, max_k_row, dq, dw,
                      TOK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """One block of BLOCK_N keys of the dq/dw sweep: returns the updated ``(dq, dw)`` accumulators."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    nmask = offs_n < s_kv
    k = tl.load(
        k_ptr + offs_n[:, None].to(tl.int64) * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0
    )
    z = dot(q, tl.trans(k))
    g = _rows_grad(g_ptr, stride_gs, t0, s_q, offs_n, nmask, tok_of_row, max_k_row, TOK, CAUSAL)
    dw += tl.sum(g * tl.maximum(z, 0.0), axis=1)
    gz = tl.where(z > 0.0, g * w[:, None], 0.0)
    return dot(gz.to(k.dtype), k, dq), dw


@triton.jit
def _dk_step(g_ptr, q_ptr, w_ptr, stride_gs, stride_qs, stride_qh, stride_ws, stride_wh, s_q, q_start_index,
                     k_stride, t0, k, offs_n, nmask, tok_of_row, head_in_block, dk,
                     H: tl.constexpr, D: tl.constexpr, TOK: tl.constexpr, BLOCK_H: tl.constexpr,
                     CAUSAL: tl.constexpr):  # fmt: skip
    """TOK tokens (all heads) of the dk sweep: returns the updated ``dk`` accumulator."""
    offs_d = tl.arange(0, D)
    t_row = t0 + tok_of_row
    max_k_row = causal_max_k(q_start_index + t_row, k_stride)
    g = _rows_grad(g_ptr, stride_gs, t0, s_q, offs_n, nmask, tok_of_row, max_k_row, TOK, CAUSAL)
    for hb in tl.static_range(0, H, BLOCK_H):
        head = hb + head_in_block
        rmask = (t_row < s_q) & (head < H)
        q = tl.load(
            q_ptr + t_row[:, None].to(tl.int64) * stride_qs + head[:, None] * stride_qh + offs_d[None, :],
            mask=rmask[:, None],
            other=0.0,
        )
        w = tl.load(w_ptr + t_row.to(tl.int64) * stride_ws + head * stride_wh, mask=rmask, other=0.0)
        z = dot(q, tl.trans(k))  # [rows, N], the same orientation as the dq kernel
        gz = tl.where(z > 0.0, g * w.to(tl.float32)[:, None], 0.0)
        dk = dot(tl.trans(gz.to(q.dtype)), q, dk)
    return dk


@triton.jit
def _dqw_kernel(
    g_ptr, q_ptr, k_ptr, w_ptr, dq_ptr, dw_ptr,
    s_q, s_kv,
    stride_gs, stride_qs, stride_qh, stride_ks, stride_ws, stride_wh, stride_dqs, stride_dqh, stride_dws,
    q_start_index, k_stride,
    H: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_H: tl.constexpr, TOK: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One program per TOK tokens x BLOCK_H heads (rows); loops over keys: dq = (G w 1[z>0]) k, dw = G relu(z)."""
    pid_h = tl.program_id(1)
    t0 = tl.program_id(0) * TOK
    offs_r = tl.arange(0, TOK * BLOCK_H)
    tok_of_row = offs_r // BLOCK_H
    head = pid_h * BLOCK_H + offs_r % BLOCK_H
    t_row = t0 + tok_of_row
    rmask = (t_row < s_q) & (head < H)
    offs_d = tl.arange(0, D)
    q = tl.load(
        q_ptr + t_row[:, None].to(tl.int64) * stride_qs + head[:, None] * stride_qh + offs_d[None, :],
        mask=rmask[:, None],
        other=0.0,
    )
    w = tl.load(w_ptr + t_row.to(tl.int64) * stride_ws + head * stride_wh, mask=rmask, other=0.0).to(
        tl.float32
    )
    max_k_row = causal_max_k(q_start_index + t_row, k_stride)
    # Causal: keys past the last token's limit are masked for every row of the tile.
    last = tl.minimum(t0 + TOK, s_q) - 1
    n_end = causal_hi(s_kv, q_start_index + last, k_stride, CAUSAL)
    dq = tl.zeros([TOK * BLOCK_H, D], dtype=tl.float32)
    dw = tl.zeros([TOK * BLOCK_H], dtype=tl.float32)
    # The interpreter cannot range() over a run-time bound; the GPU needs a for loop to pipeline.
    if INTERPRET:
        n0 = 0
        while n0 < n_end:
            dq, dw = _dqw_step(g_ptr, k_ptr, stride_gs, stride_ks, s_q, s_kv, n0, t0, q, w,
                                       tok_of_row, max_k_row, dq, dw, TOK, CAUSAL, BLOCK_N, D)  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(0, n_end, BLOCK_N):
            dq, dw = _dqw_step(g_ptr, k_ptr, stride_gs, stride_ks, s_q, s_kv, n0, t0, q, w,
                                       tok_of_row, max_k_row, dq, dw, TOK, CAUSAL, BLOCK_N, D)  # fmt: skip
    tl.store(
        dq_ptr + t_row[:, None].to(tl.int64) * stride_dqs + head[:, None] * stride_dqh + offs_d[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=rmask[:, None],
    )
    tl.store(dw_ptr + t_row.to(tl.int64) * stride_dws + head, dw.to(dw_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _dk_kernel(
    g_ptr, q_ptr, k_ptr, w_ptr, dk_ptr,
    s_q, s_kv,
    stride_gs, stride_qs, stride_qh, stride_ks, stride_ws, stride_wh, stride_dks,
    q_start_index, k_stride,
    H: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_H: tl.constexpr, TOK: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One program per BLOCK_N keys; loops over (token, head) rows: dk = Σ_rows (G w 1[z>0])^T q. No atomics."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < s_kv
    offs_d = tl.arange(0, D)
    k = tl.load(
        k_ptr + offs_n[:, None].to(tl.int64) * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0
    )
    offs_r = tl.arange(0, TOK * BLOCK_H)
    tok_of_row = offs_r // BLOCK_H
    head_in_block = offs_r % BLOCK_H
    t_begin = 0
    # Causal: start at the first token whose limit reaches this key block (every token sees key 0).
    if CAUSAL:
        n0 = tl.program_id(0) * BLOCK_N
        t_begin = tl.where(n0 > 0, tl.maximum(n0 * k_stride + k_stride - 1 - q_start_index, 0), 0)
        t_begin = (t_begin // TOK) * TOK
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    if INTERPRET:
        t0 = t_begin
        while t0 < s_q:
            dk = _dk_step(g_ptr, q_ptr, w_ptr, stride_gs, stride_qs, stride_qh, stride_ws, stride_wh, s_q,
                                  q_start_index, k_stride, t0, k, offs_n, nmask, tok_of_row, head_in_block, dk,
                                  H, D, TOK, BLOCK_H, CAUSAL)  # fmt: skip
            t0 += TOK
    else:
        for t0 in range(t_begin, s_q, TOK):
            dk = _dk_step(g_ptr, q_ptr, w_ptr, stride_gs, stride_qs, stride_qh, stride_ws, stride_wh, s_q,
                                  q_start_index, k_stride, t0, k, offs_n, nmask, tok_of_row, head_in_block, dk,
                                  H, D, TOK, BLOCK_H, CAUSAL)  # fmt: skip
    tl.store(
        dk_ptr + offs_n[:, None].to(tl.int64) * stride_dks + offs_d[None, :],
        dk.to(dk_ptr.dtype.element_ty),
        mask=nmask[:, None],
    )


def logits_bwd_config(h_idx: int) -> dict[str, int]:
    block_h = max(16, next_power_of_2(min(h_idx, 64)))
    if interpreting():
        return {"BLOCK_H": block_h, "TOK_DQ": 2, "BLOCK_N_DQ": 16, "TOK_DK": 2, "BLOCK_N_DK": 16,
                "num_warps_dq": 4, "num_stages_dq": 1, "num_warps_dk": 4, "num_stages_dk": 1}  # fmt: skip
    # One token's 64 heads x 128 keys per dq step, and 64 keys per dk program, each with 4 warps.
    return {"BLOCK_H": block_h, "TOK_DQ": max(1, 64 // block_h), "BLOCK_N_DQ": 128,
            "TOK_DK": max(1, 64 // block_h), "BLOCK_N_DK": 64,
            "num_warps_dq": 4, "num_stages_dq": 3, "num_warps_dk": 4, "num_stages_dk": 3}  # fmt: skip


def launch_logits_bwd(
    grad: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, causal: bool = False,
    q_start_index: int = 0, k_stride: int = 1, *, config: dict[str, int] | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Triton backward of the logits: ``(dq_idx, dk_idx, dweights)`` in the inputs' dtypes (``config``
    overrides :func:`logits_bwd_config`, for tests).

    Two kernels, neither with atomics (so the result is the same bits from run to run): one program per
    block of (token, head) rows sweeps the keys for ``dq`` and ``dw``; one program per block of keys sweeps
    the rows for ``dk``. Both recompute ``z = q·k`` (4 products in all, against 3 for the minimum) and skip
    key/token ranges that the causal rule masks. ``grad`` entries at masked positions are never used (they
    may be NaN). ``out`` gives preallocated outputs.
    """
    s_q, h_idx, d_idx = q_idx.shape
    s_kv = k_idx.shape[0]
    if grad.shape != (s_q, s_kv):
        raise ValueError(f"grad must be [{s_q}, {s_kv}], got {tuple(grad.shape)}")
    grad = grad.float()
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    q_idx = q_idx if q_idx.stride(-1) == 1 else q_idx.contiguous()
    k_idx = k_idx if k_idx.stride(-1) == 1 else k_idx.contiguous()
    if out is None:
        dq = torch.empty(q_idx.shape, dtype=q_idx.dtype, device=q_idx.device)
        dk = torch.empty(k_idx.shape, dtype=k_idx.dtype, device=k_idx.device)
        dw = torch.empty(weights.shape, dtype=weights.dtype, device=weights.device)
    else:
        dq, dk, dw = out
    cfg = logits_bwd_config(h_idx)
    if config:
        cfg.update(config)
    block_h = cfg["BLOCK_H"]
    common = dict(H=h_idx, D=d_idx, CAUSAL=causal, BLOCK_H=block_h, INTERPRET=interpreting())
    kernel = _dqw_kernel[(cdiv(s_q, cfg["TOK_DQ"]), cdiv(h_idx, block_h))](
        grad, q_idx, k_idx, weights, dq, dw, s_q, s_kv,
        grad.stride(0), q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), weights.stride(0), weights.stride(1),
        dq.stride(0), dq.stride(1), dw.stride(0), q_start_index, k_stride, **common,
        TOK=cfg["TOK_DQ"], BLOCK_N=cfg["BLOCK_N_DQ"], num_warps=cfg["num_warps_dq"], num_stages=cfg["num_stages_dq"],
        enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    record_launch("indexer.dqw", kernel)
    kernel = _dk_kernel[(cdiv(s_kv, cfg["BLOCK_N_DK"]),)](
        grad, q_idx, k_idx, weights, dk, s_q, s_kv,
        grad.stride(0), q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), weights.stride(0), weights.stride(1),
        dk.stride(0), q_start_index, k_stride, **common,
        TOK=cfg["TOK_DK"], BLOCK_N=cfg["BLOCK_N_DK"], num_warps=cfg["num_warps_dk"], num_stages=cfg["num_stages_dk"],
        enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    record_launch("indexer.dk", kernel)
    return dq, dk, dw


def _logits_fake(q_idx: torch.Tensor, k_idx: torch.Tensor, *_: Any) -> torch.Tensor:
    return q_idx.new_empty(q_idx.shape[0], k_idx.shape[0], dtype=torch.float32)


def _logits_bwd_fake(
    grad: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, *_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q_idx.new_empty(q_idx.shape), k_idx.new_empty(k_idx.shape), weights.new_empty(weights.shape)


@define_op("indexer_logits_bwd", _logits_bwd_fake)
def _logits_bwd_op(
    grad: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, causal: bool,
    q_start_index: int, k_stride: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    # Masked entries are constant (-inf): the kernels ignore the gradient there (it may be NaN).
    return launch_logits_bwd(grad, q_idx, k_idx, weights, causal, q_start_index, k_stride)


def _logits_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q_idx, k_idx, weights, causal, q_start_index, k_stride = inputs
    ctx.save_for_backward(q_idx, k_idx, weights)
    ctx.mask = (causal, q_start_index, k_stride)


def _logits_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    q_idx, k_idx, weights = ctx.saved_tensors
    return (*_logits_bwd_op(grad, q_idx, k_idx, weights, *ctx.mask), None, None, None)


@define_op("indexer_logits", _logits_fake, backward=_logits_backward, setup_context=_logits_setup)
def _logits_op(
    q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, causal: bool, q_start_index: int,
    k_stride: int,
) -> torch.Tensor:  # fmt: skip
    return launch_logits(q_idx, k_idx, weights, causal, q_start_index, k_stride)


def indexer_logits(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    *,
    causal: bool = False,
    q_start_index: int = 0,
    k_stride: int = 1,
) -> torch.Tensor:
    """Lightning-indexer logits ``I[t, n] = Σ_j w[t, j] · ReLU(q_idx[t, j] · k_idx[n])``.

    Forward and backward (to ``q_idx``, ``k_idx`` and ``weights``) are Triton kernels (products in the
    input dtype, fp32 accumulation). The backward uses no atomics, so its result is the same bits from run
    to run; the gradient at causally masked entries is ignored.

    Args:
        q_idx: ``[s_q, h_idx, d_idx]`` bf16 (DeepSeek-V3.2: h_idx 64, d_idx 128; d_idx a power of two).
        k_idx: ``[s_kv, d_idx]``, same dtype (one key head shared by all indexer heads).
        weights: ``[s_q, h_idx]`` per-token head weights (any float dtype; read as fp32).
        causal: set ``I[t, n] = -inf`` for ``n > (q_pos + 1 - k_stride) / k_stride``,
            ``q_pos = q_start_index + t`` (C integer division), the same rule as the sparse attention.
        q_start_index: position of query 0.
        k_stride: KV compression stride.

    Returns:
        ``[s_q, s_kv]`` fp32 logits.
    """
    check_indexer_inputs(q_idx, k_idx, weights, q_start_index, k_stride)
    if q_idx.dtype == torch.float64:
        raise ValueError("indexer_logits runs bf16/fp16/fp32 inputs; use indexer_logits_ref for float64")
    return _logits_op(q_idx, k_idx, weights, causal, q_start_index, k_stride)


def _gather_rows(
    k_idx: torch.Tensor, idx: torch.Tensor, cdt: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[c, topk]`` indices -> (rows ``[c, topk, d]`` in ``cdt`` with invalid rows zero, valid mask)."""
    valid = (idx >= 0) & (idx < k_idx.shape[0])
    # Gathered, then converted: the same values as converting all of k_idx first, for the chunk's rows only.
    rows = k_idx[idx.clamp(0, k_idx.shape[0] - 1)].to(cdt)
    return rows * valid[..., None], valid


class _IndexerLogitsAt(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        s_q, h_idx, _ = q_idx.shape
        topk = indices.shape[-1]
        cdt = torch.float64 if q_idx.dtype == torch.float64 else torch.float32
        out = torch.empty(s_q, topk, dtype=cdt, device=q_idx.device)
        chunk = max(1, (1 << 24) // max(1, h_idx * topk))
        for s0 in range(0, s_q, chunk):
            idx = indices[s0 : s0 + chunk, 0].long()
            rows, valid = _gather_rows(k_idx, idx, cdt)
            z = torch.einsum("shd,std->sht", q_idx[s0 : s0 + chunk].to(cdt), rows)
            lg = torch.einsum("sht,sh->st", torch.relu(z), weights[s0 : s0 + chunk].to(cdt))
            out[s0 : s0 + chunk] = lg.masked_fill(~valid, float("-inf"))
        ctx.save_for_backward(q_idx, k_idx, weights, indices)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q_idx, k_idx, weights, indices = ctx.saved_tensors
        s_q, h_idx, _ = q_idx.shape
        topk = indices.shape[-1]
        cdt = torch.float64 if q_idx.dtype == torch.float64 else torch.float32
        dq = torch.empty(q_idx.shape, dtype=cdt, device=q_idx.device)
        dw = torch.empty(weights.shape, dtype=cdt, device=q_idx.device)
        dk = torch.zeros(k_idx.shape, dtype=cdt, device=q_idx.device)
        chunk = max(1, (1 << 24) // max(1, h_idx * topk))
        for s0 in range(0, s_q, chunk):
            idx = indices[s0 : s0 + chunk, 0].long()
            rows, valid = _gather_rows(k_idx, idx, cdt)
            qc = q_idx[s0 : s0 + chunk].to(cdt)
            g = torch.where(valid, grad[s0 : s0 + chunk].to(cdt), 0.0)
            z = torch.einsum("shd,std->sht", qc, rows)
            dw[s0 : s0 + chunk] = torch.einsum("st,sht->sh", g, torch.relu(z))
            gz = g[:, None, :] * weights[s0 : s0 + chunk].to(cdt)[:, :, None] * (z > 0)
            dq[s0 : s0 + chunk] = torch.einsum("sht,std->shd", gz, rows)
            drows = torch.einsum("sht,shd->std", gz, qc)
            dk.index_add_(0, idx[valid], drows[valid])
        return dq.to(q_idx.dtype), dk.to(k_idx.dtype), dw.to(weights.dtype), None


def indexer_logits_at(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
) -> torch.Tensor:
    """Indexer logits at the selected rows only: ``I[t, indices[t, 0, i]]``, with autograd.

    The input of :func:`indexer_kl_loss` without the dense ``[s_q, s_kv]`` logits: forward and backward cost
    ``topk / s_kv`` of the dense ones. Chunked float32 torch (gather + batched products), not a Triton kernel.

    Args:
        q_idx: ``[s_q, h_idx, d_idx]``; k_idx: ``[s_kv, d_idx]``; weights: ``[s_q, h_idx]`` (as in
            :func:`indexer_logits`).
        indices: ``[s_q, 1, topk]`` int32, e.g. from :func:`indexer_topk`; an index ``< 0`` or ``>= s_kv``
            is invalid.

    Returns:
        ``[s_q, topk]`` fp32 logits (fp64 for fp64 inputs), -inf at invalid slots.
    """
    check_indexer_inputs(q_idx, k_idx, weights, 0, 1)
    s_q = q_idx.shape[0]
    if indices.dim() != 3 or indices.shape[:2] != (s_q, 1) or indices.dtype != torch.int32:
        raise ValueError(
            f"indices must be int32 [{s_q}, 1, topk], got {indices.dtype} {tuple(indices.shape)}"
        )
    return _IndexerLogitsAt.apply(q_idx, k_idx, weights, indices)


def indexer_topk(
    logits: torch.Tensor,
    topk: int,
    *,
    causal: bool = False,
    q_start_index: int = 0,
    k_stride: int = 1,
) -> torch.Tensor:
    """Top-k key rows per query, as the sparse attention's ``indices``.

    Uses ``torch.topk`` (not a custom kernel). Entries that are -inf (or causally masked here) are never
    selected; a query with fewer than ``topk`` selectable keys gets -1 in its remaining slots.

    Args:
        logits: ``[s_q, s_kv]`` float indexer logits.
        topk: number of rows per query (>= 1).
        causal: also mask keys ``n > (q_pos + 1 - k_stride) / k_stride``, ``q_pos = q_start_index + t``.
        q_start_index: position of query 0.
        k_stride: KV compression stride.

    Returns:
        ``indices [s_q, 1, topk]`` int32, in descending logit order.
    """
    check_tensor(logits, "logits")
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a float [s_q, s_kv] tensor, got {tuple(logits.shape)} {logits.dtype}"
        )
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk < 2**31:
        raise ValueError(f"topk must be an int in [1, 2**31), got {topk!r}")
    check_causal_args(q_start_index, k_stride)
    s_q, s_kv = logits.shape
    with torch.no_grad():
        masked = logits.detach()
        if causal:
            masked = masked.masked_fill(
                ~causal_keep(s_q, s_kv, q_start_index, k_stride, logits.device), float("-inf")
            )
        masked = masked.masked_fill(torch.isnan(masked), float("-inf"))
        k = min(topk, s_kv)
        vals, idx = torch.topk(masked, k, dim=-1)
        idx = idx.to(torch.int32).masked_fill(vals == float("-inf"), -1)
        if k < topk:
            idx = torch.cat([idx, idx.new_full((s_q, topk - k), -1)], dim=1)
    return idx[:, None, :].contiguous()


class _IndexerKLLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, attn_sum: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        lg = logits.to(cdt)
        valid = torch.isfinite(lg)
        # (Scalar fill values where a full tensor would cost one more launch: same values.)
        target = torch.where(valid, attn_sum.to(cdt).clamp_min(0), 0.0)
        total = target.sum(-1, keepdim=True)
        has = total > 0
        p = torch.where(has, target / torch.where(has, total, 1.0), 0.0)
        lg_safe = torch.where(valid, lg, -1e30)
        logq = lg_safe - torch.logsumexp(lg_safe, -1, keepdim=True)
        pos = p > 0
        plogp = torch.where(pos, p * torch.log(torch.where(pos, p, 1.0)), 0.0)
        loss_rows = (plogp - torch.where(pos, p * logq, 0.0)).sum(-1)
        q_prob = torch.where(valid & has, torch.exp(logq), 0.0)
        ctx.save_for_backward(q_prob, p)
        ctx.in_dtype = logits.dtype
        return loss_rows

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q_prob, p = ctx.saved_tensors
        # d/dI Σ_t p_t (log p_t - log softmax(I)_t) = softmax(I) - p   (Σ p = 1; 0 on rows with no target)
        return ((q_prob - p) * grad_rows[:, None]).to(ctx.in_dtype), None


def indexer_kl_loss(
    indexer_logits_at_topk: torch.Tensor,
    attn_sum: torch.Tensor,
    *,
    reduction: str = "mean",
) -> torch.Tensor:
    """KL divergence from the attention distribution to the indexer's softmax over the selected rows.

    For each query ``t`` over its valid slots ``V_t`` (slots whose logit is finite)::

        p[t, i] = attn_sum[t, i] / Σ_{j ∈ V_t} attn_sum[t, j]          (detached target, L1-normalised)
        loss[t] = Σ_{i ∈ V_t, p > 0} p[t, i] * (log p[t, i] - log_softmax_{V_t}(I[t])[i])

    A query with no valid slot or an all-zero target contributes 0. ``reduction="mean"`` divides the
    sum of ``loss[t]`` by ``s_q`` (all queries; 0 when ``s_q = 0``), ``"sum"`` sums, ``"none"`` returns ``[s_q]``. The gradient
    with respect to ``indexer_logits_at_topk`` is ``softmax(I[t]) - p[t]`` (times the reduction's factor);
    ``attn_sum`` receives none.

    Args:
        indexer_logits_at_topk: ``[s_q, topk]`` float indexer logits at the selected rows, -inf at
            invalid slots (e.g. ``logits.gather(1, indices.clamp_min(0))`` masked where ``indices < 0``).
        attn_sum: ``[s_q, topk]`` attention probability summed over heads at the same slots (``attn_dist``).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Returns:
        Scalar fp32 loss (``[s_q]`` for ``"none"``).
    """
    check_tensor(indexer_logits_at_topk, "indexer_logits_at_topk")
    check_tensor(attn_sum, "attn_sum")
    if indexer_logits_at_topk.dim() != 2:
        raise ValueError(
            f"indexer_logits_at_topk must be [s_q, topk], got {tuple(indexer_logits_at_topk.shape)}"
        )
    if attn_sum.shape != indexer_logits_at_topk.shape:
        raise ValueError(
            f"attn_sum must have the logits' shape {tuple(indexer_logits_at_topk.shape)}, got {tuple(attn_sum.shape)}"
        )
    if not indexer_logits_at_topk.is_floating_point() or not attn_sum.is_floating_point():
        raise ValueError("indexer_logits_at_topk and attn_sum must be floating point")
    rows = _IndexerKLLoss.apply(indexer_logits_at_topk, attn_sum.detach())
    return reduce_loss(rows, reduction)
