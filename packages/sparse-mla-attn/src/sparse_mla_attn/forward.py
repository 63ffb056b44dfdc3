"""Sparse MLA forward: every query attends to its own top-k latent KV rows (Triton).

One program owns one query token and a tile of up to 64 heads. It keeps the query tile on chip, walks the
token's ``topk`` indices ``BLOCK_T`` at a time, gathers those KV rows (invalid ones are masked, never
loaded), computes ``S = q_nope·k_nope^T + q_rope·k_rope^T`` as two tensor-core products (512 + 64 channels),
runs an online softmax in base 2 and accumulates ``O += P·V`` with ``V = k_nope`` (the same 512 latent
channels, so each gathered row is read once for both products). The same kernel serves paged decode,
whose positions are first mapped to cache rows by a small kernel (:func:`paged_to_rows`).

When the grid would not fill the GPU (small-batch decode), each query's top-k list is split over several
programs (split-K); they write fp32 partial outputs with their own base-2 log-sum-exp, and a second
kernel merges them with lse weights.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import triton
import triton.language as tl

from sparse_mla_attn._runtime import (
    LaunchContext,
    LaunchReplay,
    cached,
    call_signature,
    causal_hi,
    cdiv,
    check_kernel_device,
    define_op,
    eager_stream,
    interpreting,
    keep_replay,
    l2_cache_bytes,
    launch,
    launch_context,
    next_power_of_2,
    no_launch_hooks,
    num_sms,
    online_softmax_update,
    plan_replay,
    record_launch,
    record_launches,
    softmax_output_scale,
)
from sparse_mla_attn._validate import (
    SparseDims,
    check_arg_types,
    check_causal_args,
    check_kernel_dims,
    check_optional_vectors,
    check_sm_scale,
    check_sparse_inputs,
)
from sparse_mla_attn.backends.gluon_sm90 import launch_fwd_gluon, use_gluon
from sparse_mla_attn.backends.gluon_sm90_fp8 import launch_decode_fp8_gluon
from sparse_mla_attn.config import DEFAULT, Config, config_of
from sparse_mla_attn.fp8_cache import FP8_TILE as _FP8_TILE
from sparse_mla_attn.fp8_cache import FP8_TOKEN_BYTES as _FP8_TOKEN_BYTES

LOG2E = math.log2(math.e)
#: The FP8 cache layout (``fp8_cache``) as kernel constants.
FP8_TOKEN_BYTES = tl.constexpr(_FP8_TOKEN_BYTES)
FP8_TILE = tl.constexpr(_FP8_TILE)


@triton.jit
def _block_rows(t0, n_t, hi, idx_row, BLOCK_T: tl.constexpr):
    """KV row numbers (int64, 0 where invalid) and validity of the top-k slots [t0, t0 + BLOCK_T)."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    idx = tl.load(idx_row + offs_t, mask=offs_t < n_t, other=-1)
    valid = (idx >= 0) & (idx < hi)
    return tl.where(valid, idx, 0).to(tl.int64), valid


@triton.jit
def _row_start(row, stride_kv_row, kv_block_size, stride_kv_block, KV_FP8: tl.constexpr):
    """Offset of KV row ``row`` from the cache's start: ``row * stride_kv_row``; in an FP8 cache
    (``KV_FP8``, offsets in bytes) row ``block * kv_block_size + t`` of a paged cache whose blocks are
    ``stride_kv_block`` bytes apart and tokens ``stride_kv_row`` bytes apart."""
    if KV_FP8:
        return (row // kv_block_size) * stride_kv_block + (row % kv_block_size) * stride_kv_row
    else:
        return row * stride_kv_row


@triton.jit
def _prefetch_rows(row, valid, KV, stride_kv_row, kv_block_size, stride_kv_block, D_QK: tl.constexpr,
                   KV_FP8: tl.constexpr):  # fmt: skip
    """Ask L2 for the given KV rows (``prefetch.global.L2``, one per 128-byte line).

    The gathers go through ``cp.async`` one block ahead of their use; for rows that are not in L2 yet
    (decode, long KV) this starts the DRAM reads one more block ahead. The rows come from indices loaded
    an iteration earlier, so the prefetch does not wait on an index load.
    """
    line = tl.arange(0, 16)  # 128-byte lines: 9 per 576-channel bf16 row, 8 per 512-channel row
    start = _row_start(row, stride_kv_row, kv_block_size, stride_kv_block, KV_FP8)
    if KV_FP8:
        # A 656-byte token spans up to 7 lines (16-byte aligned): its first byte and each 128 bytes on.
        ptr = KV + start[:, None] + tl.minimum(line[None, :] * 128, FP8_TOKEN_BYTES - 1)
        on = (valid[:, None] & (line[None, :] * 128 < FP8_TOKEN_BYTES + 127)).to(tl.int32)
    else:
        ptr = KV + start[:, None] + line[None, :] * 64
        on = (valid[:, None] & (line[None, :] * 128 < D_QK * 2)).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptr, on],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _scores(q_v, q_rope, k_v, k_rope, D_ROPE: tl.constexpr):
    """S = q·k^T over the 512 latent channels plus the 64 rope channels."""
    s = tl.dot(q_v, tl.trans(k_v))
    if D_ROPE > 0:
        s = tl.dot(q_rope, tl.trans(k_rope), s)
    return s


@triton.jit
def _softmax_step(q_v, q_rope, k_v, k_rope, valid, m_i, l_i, sm_scale_log2, D_ROPE: tl.constexpr):
    """Scores of one block (two unchained products) and the online-softmax update: m, alpha, l, P."""
    s = tl.dot(q_v, tl.trans(k_v)) * sm_scale_log2
    if D_ROPE > 0:
        s += tl.dot(q_rope, tl.trans(k_rope)) * sm_scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new, alpha, l_i, p = online_softmax_update(s, m_i, l_i)
    return m_new, alpha, l_i, p.to(k_v.dtype)


@triton.jit
def _load_q_tile(Q, pid_s, stride_q_s, stride_q_h, offs_h, h_mask,
                 D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """Query tile of token ``pid_s``, heads ``offs_h`` (padding heads 0): latent and rope channels."""
    q_base = Q + pid_s.to(tl.int64) * stride_q_s + offs_h[:, None] * stride_q_h
    q_v = tl.load(q_base + tl.arange(0, D_NOPE)[None, :], mask=h_mask[:, None], other=0.0)
    if D_ROPE > 0:
        q_rope = tl.load(q_base + D_NOPE + tl.arange(0, D_ROPE)[None, :], mask=h_mask[:, None], other=0.0)
    else:
        q_rope = q_v  # unused
    if DOT_F32:
        q_v = q_v.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    return q_v, q_rope


@triton.jit
def _gather_fp8_rows(row, valid, KV, stride_kv_row, kv_block_size, stride_kv_block,
                     D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """Gather and dequantize FP8 cache rows (``fp8_cache`` layout) where ``valid``: ``k_v`` (the latent
    channels, ``fp8 * scale`` per 128-channel tile) in bf16 (float32 under ``DOT_F32``) and the bf16
    ``k_rope``. With power-of-two scales the bf16 values are exact."""
    start = _row_start(row, stride_kv_row, kv_block_size, stride_kv_block, True)
    n_tiles: tl.constexpr = D_NOPE // FP8_TILE
    tile = tl.arange(0, n_tiles)
    KV_BYTES = KV.to(tl.pointer_type(tl.uint8), bitcast=True)  # the cache may be float8_e4m3fn or uint8
    k8 = tl.load(
        KV_BYTES
        + start[:, None, None]
        + (tile * FP8_TILE)[None, :, None]
        + tl.arange(0, FP8_TILE)[None, None, :],
        mask=valid[:, None, None],
        other=0,
    )
    scale_ptr = (KV + start + D_NOPE).to(tl.pointer_type(tl.float32), bitcast=True)
    scale = tl.load(scale_ptr[:, None] + tile[None, :], mask=valid[:, None], other=0.0)
    k_v = k8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
    k_v = tl.reshape(k_v, (k_v.shape[0], D_NOPE))
    rope_ptr = (KV + start + D_NOPE + 4 * n_tiles).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    k_rope = tl.load(rope_ptr[:, None] + tl.arange(0, D_ROPE)[None, :], mask=valid[:, None], other=0.0)
    if DOT_F32:
        k_rope = k_rope.to(tl.float32)
    else:
        k_v = k_v.to(tl.bfloat16)
    return k_v, k_rope


@triton.jit
def _gather_rows(
    row, valid, KV, stride_kv_row, D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, DOT_F32: tl.constexpr
):
    """Gather the KV rows ``row`` where ``valid``: latent channels ``k_v`` and rope channels ``k_rope``.

    Masked rows are never dereferenced: invalid indices cost no memory traffic and may point anywhere.
    """
    k_ptr = KV + row[:, None] * stride_kv_row
    # k_v: the 512 latent channels, keys of the first product and values of P·V.
    k_v = tl.load(k_ptr + tl.arange(0, D_NOPE)[None, :], mask=valid[:, None], other=0.0)
    if DOT_F32:
        k_v = k_v.to(tl.float32)
    k_rope = k_v  # unused unless D_ROPE > 0
    if D_ROPE > 0:
        k_rope = tl.load(k_ptr + D_NOPE + tl.arange(0, D_ROPE)[None, :], mask=valid[:, None], other=0.0)
        if DOT_F32:
            k_rope = k_rope.to(tl.float32)
    return k_v, k_rope


@triton.jit
def _store_result(
    OUT, LSE, MAX_LOGITS, pid_s, stride_o_s, stride_o_h, h_q, offs_h, h_mask, offs_d, out, lse2, m2
):
    """Store a token's final ``out`` (in OUT's dtype), ``lse`` and ``max_logits`` (base 2 -> natural log)."""
    o_ptr = OUT + pid_s.to(tl.int64) * stride_o_s + offs_h[:, None] * stride_o_h + offs_d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=h_mask[:, None])
    tl.store(LSE + pid_s.to(tl.int64) * h_q + offs_h, lse2 * 0.6931471805599453, mask=h_mask)
    tl.store(MAX_LOGITS + pid_s.to(tl.int64) * h_q + offs_h, m2 * 0.6931471805599453, mask=h_mask)


@triton.jit
def _fwd_block(
    row, valid,
    KV,
    stride_kv_row, kv_block_size, stride_kv_block,
    q_v, q_rope, m_i, l_i, acc, sm_scale_log2,
    D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, DOT_F32: tl.constexpr, S_SPLIT: tl.constexpr,
    KV_FP8: tl.constexpr,
):  # fmt: skip
    """One BLOCK_T slice of the top-k list: gather, two products, online-softmax update."""
    if KV_FP8:
        k_v, k_rope = _gather_fp8_rows(row, valid, KV, stride_kv_row, kv_block_size, stride_kv_block, D_NOPE,
                                       D_ROPE, DOT_F32)  # fmt: skip
    else:
        k_v, k_rope = _gather_rows(row, valid, KV, stride_kv_row, D_NOPE, D_ROPE, DOT_F32)
    if S_SPLIT:
        # Triton gives every warp of a dot whose result feeds another dot (here P·V) a slice of M; with
        # 64 head rows both warpgroups would then compute the whole S. Produced inside a run-time branch
        # (both arms identical; strides are positive), S no longer counts as chained: the warpgroups
        # split its columns, and P reaches the P·V product through shared memory.
        if stride_kv_row > 0:
            m_new, alpha, l_i, p = _softmax_step(
                q_v, q_rope, k_v, k_rope, valid, m_i, l_i, sm_scale_log2, D_ROPE
            )
        else:
            m_new, alpha, l_i, p = _softmax_step(
                q_v, q_rope, k_v, k_rope, valid, m_i, l_i, sm_scale_log2, D_ROPE
            )
    else:
        s = _scores(q_v, q_rope, k_v, k_rope, D_ROPE)
        s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(k_v.dtype)
    acc = acc * alpha[:, None]
    acc = tl.dot(p, k_v, acc)
    return m_new, l_i, acc


@triton.jit
def _sparse_mla_fwd_kernel(
    Q, KV, IDX, OUT, MAX_LOGITS, LSE, SINK, TOPK_LEN, FINAL_O, FINAL_MAX, FINAL_LSE, COUNTERS,
    stride_q_s, stride_q_h, stride_kv_row, stride_idx_s, stride_o_s, stride_o_h,
    n_tok, h_q, n_head_tiles, topk, split_len, s_kv, q_start_index, k_stride, sm_scale_log2,
    kv_block_size, stride_kv_block,
    D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_SINK: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, CAUSAL: tl.constexpr, SPLIT_K: tl.constexpr,
    STATIC_T: tl.constexpr, DOT_F32: tl.constexpr, S_SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    MERGE_LAST: tl.constexpr = False, N_SPLITS: tl.constexpr = 1, SPLITS_P2: tl.constexpr = 1,
    KV_FP8: tl.constexpr = False,
):  # fmt: skip
    """Forward of one (split, token, head tile). With ``SPLIT_K`` it writes the split's fp32 partial
    result to ``OUT`` / ``LSE`` / ``MAX_LOGITS`` (the partial buffers), and with ``MERGE_LAST`` as well the
    last of the token's ``N_SPLITS`` programs to finish (a ticket from ``COUNTERS``, one per token and head
    tile, zero between launches) merges them into ``FINAL_O`` / ``FINAL_MAX`` / ``FINAL_LSE``, so the
    call needs no second launch (without ``MERGE_LAST`` those four are not used). With ``KV_FP8``, ``KV``
    is an FP8 cache (``fp8_cache`` layout, byte offsets; ``kv_block_size`` / ``stride_kv_block``: its
    paging) dequantized as it is gathered."""
    pid = tl.program_id(0)
    # Programs of one token (head tiles) are neighbours in launch order: their gathers hit L2.
    pid_h = pid % n_head_tiles
    pid_sk = pid // n_head_tiles
    pid_s = pid_sk % n_tok
    # Split-K: program pid_k walks the top-k slots [pid_k * split_len, (pid_k + 1) * split_len).
    pid_k = pid_sk // n_tok
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < h_q
    offs_d = tl.arange(0, D_NOPE)
    q_v, q_rope = _load_q_tile(Q, pid_s, stride_q_s, stride_q_h, offs_h, h_mask, D_NOPE, D_ROPE, DOT_F32)

    n_t = topk
    if HAS_TOPK_LEN:
        n_t = tl.minimum(tl.load(TOPK_LEN + pid_s), topk)
    t_start = pid_k * split_len
    t_end = tl.minimum(n_t, t_start + split_len)
    # Valid indices are [0, hi): the KV length and the causal limit.
    hi = causal_hi(s_kv, q_start_index + pid_s, k_stride, CAUSAL)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_NOPE], tl.float32)
    idx_row = IDX + pid_s.to(tl.int64) * stride_idx_s
    # The rows of block t+1 are loaded one iteration ahead, so the gather of a block depends only on
    # loop-carried values and the pipeliner can issue it num_stages - 1 iterations early.
    row_n, valid_n = _block_rows(t_start, t_end, hi, idx_row, BLOCK_T)
    # PREFETCH: rows of block t+2 go to L2 during block t (their indices were loaded during block t-1).
    row_p, valid_p = row_n, valid_n
    if PREFETCH:
        _prefetch_rows(
            row_n, valid_n, KV, stride_kv_row, kv_block_size, stride_kv_block, D_NOPE + D_ROPE, KV_FP8
        )
        row_p, valid_p = _block_rows(t_start + BLOCK_T, t_end, hi, idx_row, BLOCK_T)
        _prefetch_rows(
            row_p, valid_p, KV, stride_kv_row, kv_block_size, stride_kv_block, D_NOPE + D_ROPE, KV_FP8
        )
        row_p, valid_p = _block_rows(t_start + 2 * BLOCK_T, t_end, hi, idx_row, BLOCK_T)
    if STATIC_T > 0:
        # The CPU interpreter only runs loops with compile-time bounds; blocks past t_end are fully masked.
        for i in range(0, STATIC_T, BLOCK_T):
            row, valid = row_n, valid_n
            row_n, valid_n = _block_rows(t_start + i + BLOCK_T, t_end, hi, idx_row, BLOCK_T)
            m_i, l_i, acc = _fwd_block(row, valid, KV, stride_kv_row, kv_block_size, stride_kv_block, q_v, q_rope,
                                       m_i, l_i, acc, sm_scale_log2, D_NOPE, D_ROPE, DOT_F32, S_SPLIT,
                                       KV_FP8)  # fmt: skip
    else:
        for t0 in range(t_start, t_end, BLOCK_T):
            row, valid = row_n, valid_n
            row_n, valid_n = _block_rows(t0 + BLOCK_T, t_end, hi, idx_row, BLOCK_T)
            if PREFETCH:
                _prefetch_rows(row_p, valid_p, KV, stride_kv_row, kv_block_size, stride_kv_block, D_NOPE + D_ROPE,
                               KV_FP8)  # fmt: skip
                row_p, valid_p = _block_rows(t0 + 3 * BLOCK_T, t_end, hi, idx_row, BLOCK_T)
            m_i, l_i, acc = _fwd_block(row, valid, KV, stride_kv_row, kv_block_size, stride_kv_block, q_v, q_rope,
                                       m_i, l_i, acc, sm_scale_log2, D_NOPE, D_ROPE, DOT_F32, S_SPLIT,
                                       KV_FP8)  # fmt: skip

    # (With split-K the combine kernel adds the sink.)
    m_use, has_any, scale = softmax_output_scale(m_i, l_i, SINK, offs_h, h_mask, HAS_SINK and not SPLIT_K)
    out = acc * scale[:, None]
    lse2 = tl.where(has_any, m_use + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
    if SPLIT_K:
        # Partial results in fp32: out normalised by this split's own sum, base-2 lse and max.
        part = pid_k.to(tl.int64) * n_tok + pid_s
        o_ptr = OUT + (part * h_q + offs_h[:, None]) * D_NOPE + offs_d[None, :]
        tl.store(o_ptr, out, mask=h_mask[:, None])
        tl.store(LSE + part * h_q + offs_h, lse2, mask=h_mask)
        tl.store(MAX_LOGITS + part * h_q + offs_h, m_i, mask=h_mask)
        if MERGE_LAST:
            # Every thread's stores precede the ticket's release; the acquire by the last program orders
            # its reads of the other programs' partials (read through L2: .cg).
            tl.debug_barrier()
            slot = COUNTERS + pid_s * n_head_tiles + pid_h
            ticket = tl.atomic_add(slot, 1, sem="acq_rel")
            if ticket == N_SPLITS - 1:
                tl.atomic_xchg(slot, 0)  # zero again for the next launch (and the next graph replay)
                for h0 in tl.static_range(0, BLOCK_H, MERGE_H):
                    offs_m = pid_h * BLOCK_H + h0 + tl.arange(0, MERGE_H)
                    _merge_split_partials(
                        OUT, LSE, MAX_LOGITS, SINK, FINAL_O, FINAL_MAX, FINAL_LSE, pid_s, offs_m,
                        stride_o_s, stride_o_h, n_tok, h_q, N_SPLITS, D_NOPE, MERGE_H, SPLITS_P2, HAS_SINK,
                        ".cg",
                    )  # fmt: skip
    else:
        _store_result(
            OUT, LSE, MAX_LOGITS, pid_s, stride_o_s, stride_o_h, h_q, offs_h, h_mask, offs_d, out, lse2, m_i
        )


#: Heads merged per step when the last split program merges (a [MERGE_H, 512] fp32 tile at a time).
MERGE_H = tl.constexpr(16)


@triton.jit
def _merge_split_partials(
    PART_O, PART_LSE, PART_MAX, SINK, OUT, MAX_LOGITS, LSE,
    pid_s, offs_h, stride_o_s, stride_o_h, n_tok, h_q,
    N_SPLITS: tl.constexpr, D_V: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS_P2: tl.constexpr,
    HAS_SINK: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """Merge the split-K partials of token ``pid_s``, heads ``offs_h``: lse-weighted sum of the fp32
    partial outputs, base-2 lse and max, written as the final ``out`` / ``lse`` / ``max_logits``."""
    h_mask = offs_h < h_q
    offs_k = tl.arange(0, SPLITS_P2)
    part = (offs_k.to(tl.int64)[:, None] * n_tok + pid_s) * h_q + offs_h[None, :]
    mask_kh = (offs_k[:, None] < N_SPLITS) & h_mask[None, :]
    lse_k = tl.load(PART_LSE + part, mask=mask_kh, other=float("-inf"), cache_modifier=CACHE)
    m_tot = tl.max(tl.load(PART_MAX + part, mask=mask_kh, other=float("-inf"), cache_modifier=CACHE), 0)
    lse_max = tl.max(lse_k, 0)
    has_any = lse_max > float("-inf")
    lse_ref = tl.where(has_any, lse_max, 0.0)
    total = tl.where(has_any, tl.sum(tl.exp2(lse_k - lse_ref[None, :]), 0), 1.0)
    lse_tot = tl.where(has_any, lse_ref + tl.log2(total), float("-inf"))
    offs_d = tl.arange(0, D_V)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    for k in range(0, N_SPLITS):
        row = (k * n_tok + pid_s).to(tl.int64) * h_q + offs_h
        lse_one = tl.load(PART_LSE + row, mask=h_mask, other=float("-inf"), cache_modifier=CACHE)
        w = tl.where(has_any, tl.exp2(lse_one - lse_ref), 0.0)  # unnormalised weight of this split
        o = tl.load(
            PART_O + row[:, None] * D_V + offs_d[None, :],
            mask=h_mask[:, None],
            other=0.0,
            cache_modifier=CACHE,
        )
        acc += w[:, None] * o
    denom = tl.where(has_any, tl.exp2(lse_tot - lse_ref), 1.0)
    if HAS_SINK:
        sink = tl.load(SINK + offs_h, mask=h_mask, other=0.0)
        denom = denom + tl.exp2(sink * 1.4426950408889634 - lse_ref)
    out = tl.where(has_any[:, None], acc / denom[:, None], 0.0)
    _store_result(
        OUT, LSE, MAX_LOGITS, pid_s, stride_o_s, stride_o_h, h_q, offs_h, h_mask, offs_d, out, lse_tot, m_tot
    )


@triton.jit(do_not_specialize=["tok0"])
def _split_combine_kernel(
    PART_O, PART_LSE, PART_MAX, SINK, OUT, MAX_LOGITS, LSE,
    stride_o_s, stride_o_h,
    n_tok, h_q, tok0,
    N_SPLITS: tl.constexpr, D_V: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS_P2: tl.constexpr,
    HAS_SINK: tl.constexpr,
):  # fmt: skip
    """Merge the split-K partials (``[N_SPLITS, n_tok, h_q(, D_V)]``) of one token and a tile of heads:
    lse-weighted sum of the outputs, written as token ``tok0 +`` that token of the outputs."""
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok0 = tok0.to(tl.int64)
    _merge_split_partials(
        PART_O, PART_LSE, PART_MAX, SINK, OUT + tok0 * stride_o_s, MAX_LOGITS + tok0 * h_q, LSE + tok0 * h_q,
        tl.program_id(0), offs_h, stride_o_s, stride_o_h, n_tok, h_q, N_SPLITS, D_V, BLOCK_H, SPLITS_P2,
        HAS_SINK, "",
    )  # fmt: skip


@triton.jit
def _paged_rows_kernel(
    IDX, BLOCK_TABLE, SEQLENS, ROWS,
    topk, q_per_batch,
    stride_idx_s, stride_bt_b,
    page_size, max_blocks, n_rows,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Map the sequence positions of one decode token to rows of the flattened cache (-1 if invalid)."""
    pid_s = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    t_mask = offs < topk
    batch = pid_s // q_per_batch
    hi = tl.minimum(tl.load(SEQLENS + batch), max_blocks * page_size)
    pos = tl.load(IDX + pid_s.to(tl.int64) * stride_idx_s + offs, mask=t_mask, other=-1)
    valid = (pos >= 0) & (pos < hi)
    safe = tl.where(valid, pos, 0)
    blk = tl.load(BLOCK_TABLE + batch.to(tl.int64) * stride_bt_b + safe // page_size, mask=valid, other=0)
    row = blk.to(tl.int64) * page_size + safe % page_size
    # A table entry outside the cache is treated like an invalid position: never read.
    row = tl.where(valid & (blk >= 0) & (row < n_rows), row, -1)
    tl.store(ROWS + pid_s.to(tl.int64) * topk + offs, row.to(tl.int32), mask=t_mask)


@functools.lru_cache(maxsize=64)
def fwd_config(h_q: int, topk: int) -> dict[str, Any]:
    """Tile shape and launch options for a head count (``BLOCK_H``, ``BLOCK_T``, warps, stages)."""
    if interpreting():
        return {
            "BLOCK_H": max(16, next_power_of_2(min(h_q, 64))),
            "BLOCK_T": 16,
            "num_warps": 4,
            "num_stages": 1,
        }
    if h_q > 32:
        # S_SPLIT: the two warpgroups split S's columns; PREFETCH: KV rows two blocks ahead go to L2.
        return {
            "BLOCK_H": 64,
            "BLOCK_T": 64,
            "num_warps": 8,
            "num_stages": 2,
            "S_SPLIT": True,
            "PREFETCH": True,
        }
    return {"BLOCK_H": max(16, next_power_of_2(h_q)), "BLOCK_T": 64, "num_warps": 4, "num_stages": 2}


def choose_splits(n_programs: int, topk: int, block_t: int, device: torch.device, fill: float = 1.0) -> int:
    """Split-K factor of a grid of ``n_programs`` (tokens x head tiles) on ``device``:
    :meth:`Config.splits_for` with the device's multiprocessor count (1 off CUDA and under the
    interpreter) and ``fill`` (``Config.split_fill``)."""
    n_sm = num_sms(device)
    if interpreting() or n_sm == 0:
        return 1
    return Config(split_fill=fill).splits_for(n_programs, topk, n_sm, block_t)


@dataclass
class FwdPlan:
    """How the forward runs a validated problem: its sizes, the kernel family, split-K, and every launch's
    grid, integer arguments and constexprs (all fixed by the call signature), plus the compiled-kernel
    handles (``slots``, see :func:`sparse_mla_attn._runtime.launch`)."""

    dims: SparseDims
    gluon: bool
    n_splits: int
    grid: tuple[int, ...]
    ints: tuple[int, ...]
    consts: dict[str, Any]
    combine_grid: tuple[int, ...]
    combine_consts: dict[str, Any]
    merge_last_consts: dict[str, Any]
    #: Options of the Gluon kernel (``launch_fwd_gluon``'s ``persistent_programs``).
    gluon_options: dict[str, Any] = field(default_factory=dict)
    #: ``(n_main, splits, split_len)``: the Gluon kernel runs the work items (token x head tile) from
    #: ``n_main`` on in ``splits`` pieces of ``split_len`` slots, merged by the merge kernel (``set_gluon_options``).
    tail: tuple[int, int, int] | None = None
    slots: dict[Any, Any] = field(default_factory=dict)
    #: ``(kv_block_size, stride_kv_block)`` of an FP8 cache (unused ``(1, 0)`` otherwise).
    kv_ints: tuple[int, int] = (1, 0)
    #: Recorded launches of ``sparse_mla_fwd`` per (device, stream, thread), replayed by its eager calls.
    replays: dict[Any, LaunchReplay] = field(default_factory=dict)


def plan_fwd(
    q: torch.Tensor, kv_rows: torch.Tensor, idx_stride: int, dims: SparseDims, *, has_sink: bool,
    has_topk_length: bool, q_start_index: int, k_stride: int, causal: bool, config: Config,
    tiles: dict[str, Any] | None = None, fp8_paging: tuple[int, int] | None = None,
) -> FwdPlan:  # fmt: skip
    """The :class:`FwdPlan` of a validated problem (``tiles`` overrides :func:`fwd_config`, for tests).

    ``fp8_paging``: ``kv_rows`` is an FP8 cache (``fp8_cache`` layout, ``kv_rows.stride(0)`` its token
    stride in bytes) of blocks of ``fp8_paging[0]`` tokens, ``fp8_paging[1]`` bytes apart (read by the
    Gluon FP8 decode kernel where the Gluon kernels run, else by the Triton kernel)."""
    n_tok, h_q = dims.s_q, dims.h_q
    cfg = {**fwd_config(h_q, dims.topk), **(tiles or {})}
    n_head_tiles = cdiv(h_q, cfg["BLOCK_H"])
    block_t = cfg["BLOCK_T"]
    n_splits = config.num_splits or choose_splits(
        n_tok * n_head_tiles, dims.topk, block_t, q.device, config.split_fill
    )
    split_len = cdiv(cdiv(dims.topk, n_splits), block_t) * block_t
    n_splits = cdiv(dims.topk, split_len)  # no empty split
    # The Gluon kernels split too; their partials are merged by the merge kernel, not by a last program.
    # (An FP8 cache runs its own Gluon kernel, ``gluon_sm90_fp8``.)
    eligible = h_q > 32 and (n_splits == 1 or config.split_merge != "last_program")
    gluon = use_gluon(config.backend, eligible, "sparse_mla_fwd", q, kv_rows)
    # out [n_tok, h_q, d_v] is allocated contiguous: strides h_q * d_v and d_v.
    ints = (q.stride(0), q.stride(1), kv_rows.stride(0), idx_stride, h_q * dims.d_v, dims.d_v, n_tok, h_q,
            n_head_tiles, dims.topk, split_len, dims.s_kv, q_start_index, k_stride)  # fmt: skip
    consts = dict(
        D_NOPE=512, D_ROPE=dims.d_qk - 512, BLOCK_H=cfg["BLOCK_H"], BLOCK_T=block_t, HAS_SINK=has_sink,
        HAS_TOPK_LEN=has_topk_length, CAUSAL=causal, SPLIT_K=n_splits > 1,
        STATIC_T=split_len if interpreting() else 0,
        # The interpreter's bf16 tl.dot is wrong (numpy has no bf16): it multiplies in float32 instead.
        DOT_F32=interpreting(), S_SPLIT=bool(cfg.get("S_SPLIT", False)),
        PREFETCH=bool(cfg.get("PREFETCH", False)) and not interpreting(), KV_FP8=fp8_paging is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    combine_h = 16
    combine_consts = dict(
        N_SPLITS=n_splits, D_V=dims.d_v, BLOCK_H=combine_h, SPLITS_P2=next_power_of_2(n_splits),
        HAS_SINK=has_sink, num_warps=4,
    )  # fmt: skip
    merge_last_consts = {
        **consts,
        "MERGE_LAST": True,
        "N_SPLITS": n_splits,
        "SPLITS_P2": next_power_of_2(n_splits),
    }
    return FwdPlan(
        dims, gluon, n_splits, (n_splits * n_tok * n_head_tiles,), ints, consts,
        (n_tok, cdiv(h_q, combine_h)), combine_consts, merge_last_consts,
        kv_ints=fp8_paging if fp8_paging is not None else (1, 0),
    )  # fmt: skip


def run_fwd(
    plan: FwdPlan, q: torch.Tensor, kv_rows: torch.Tensor, idx: torch.Tensor, sm_scale: float,
    attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None, *, cache_slots: bool = True,
    scratch: Sequence[torch.Tensor] | None = None, counters: torch.Tensor | None = None,
    outputs: tuple[torch.Tensor, torch.Tensor] | None = None, ctx: LaunchContext | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Run a :class:`FwdPlan` on the tensors it was made for: ``out``, ``max_logits``, ``lse``.

    ``cache_slots``: launch through the plan's cached compiled kernels (the plan was made for this call
    signature). ``scratch``: ``(max_logits, part_o, part_max, part_lse)`` to reuse (decode), else allocated.
    ``counters``: with split-K, int32 ``[>= n_tok * n_head_tiles]`` zeros (left zero): the last split
    program of each token and head tile merges the partials in the same launch; without, a second kernel
    merges them. ``outputs``: ``(out, lse)`` to write, contiguous, of ``n_tok * h_q * d_v`` and
    ``n_tok * h_q`` elements (any shape), else allocated. ``q``, ``kv_rows`` and ``idx`` may be any views of
    the memory the plan was made for (the kernels take the plan's strides). ``ctx``: the call's
    :func:`~sparse_mla_attn._runtime.launch_context`, if known.
    """
    dims = plan.dims
    n_tok, h_q = dims.s_q, dims.h_q
    dev = q.device
    if outputs is None:
        out = torch.empty(n_tok, h_q, dims.d_v, dtype=q.dtype, device=dev)
        lse = torch.empty(n_tok, h_q, dtype=torch.float32, device=dev)
    else:
        out, lse = outputs
    if scratch is None:
        scratch = fwd_scratch(plan, dev)
    max_logits = scratch[0]
    if n_tok == 0:
        return out, max_logits, lse
    slots = plan.slots if cache_slots else None
    sink = attn_sink if attn_sink is not None else lse
    split = plan.n_splits > 1
    dst = scratch[1:] if split else (out, max_logits, lse)  # partial out, max, lse of each split
    if plan.gluon:
        # Hopper: warp-specialised kernel (a producer warpgroup gathers, two consumers alternate blocks).
        d_out, d_max, d_lse = dst
        if plan.consts["KV_FP8"]:
            kernel = launch_decode_fp8_gluon(
                q, kv_rows, idx, d_out, d_max, d_lse, dims, sm_scale * LOG2E, kv_paging=plan.kv_ints,
                strides=(*plan.ints[:2], *plan.ints[3:6]), slots=slots, ctx=ctx,
                splits=(plan.n_splits, plan.ints[10]),
            )  # fmt: skip
        else:
            tail = None
            if plan.tail is not None:
                n_main, t_splits, t_len = plan.tail
                tail_tok = n_tok - n_main // cdiv(h_q, 64)
                tail_parts = (
                    torch.empty(t_splits, tail_tok, h_q, dims.d_v, dtype=torch.float32, device=dev),
                    torch.empty(t_splits, tail_tok, h_q, dtype=torch.float32, device=dev),
                    torch.empty(t_splits, tail_tok, h_q, dtype=torch.float32, device=dev),
                )
                tail = (n_main, t_splits, t_len, *tail_parts)
            kernel = launch_fwd_gluon(
                q, kv_rows, idx, d_out, d_max, d_lse, sink, topk_length, dims, sm_scale * LOG2E,
                has_sink=plan.consts["HAS_SINK"], q_start_index=plan.ints[-2], k_stride=plan.ints[-1],
                causal=plan.consts["CAUSAL"], slots=slots, strides=plan.ints[:6], ctx=ctx,
                splits=(plan.n_splits, plan.ints[10]), tail=tail, **plan.gluon_options,
            )  # fmt: skip
            if tail is not None:
                part_o, part_max, part_lse = tail[3:]
                launch(
                    _split_combine_kernel, (tail_tok, cdiv(h_q, 16)), slots, "combine_tail",
                    (part_o, part_lse, part_max, sink, out, max_logits, lse, h_q * dims.d_v, dims.d_v, tail_tok,
                     h_q, n_tok - tail_tok),
                    {**plan.combine_consts, "N_SPLITS": t_splits, "SPLITS_P2": next_power_of_2(t_splits)}, ctx,
                )  # fmt: skip
        merge = "kernel" if split or plan.tail is not None else None
        record_launch("fwd", kernel, backend="gluon", splits=plan.n_splits, merge=merge)
        if split:
            _launch_combine(plan, dst, sink, out, max_logits, lse, slots, ctx)
        return out, max_logits, lse
    merge_last = split and counters is not None
    kernel = launch(
        _sparse_mla_fwd_kernel, plan.grid, slots, "fwd_merge_last" if merge_last else "fwd",
        (q, kv_rows, idx, *dst, sink, topk_length if topk_length is not None else idx, out, max_logits, lse,
         counters if merge_last else idx, *plan.ints, sm_scale * LOG2E, *plan.kv_ints),
        plan.merge_last_consts if merge_last else plan.consts, ctx,
    )  # fmt: skip
    record_launch("fwd", kernel, splits=plan.n_splits,
                  merge=None if not split else "last_program" if merge_last else "kernel")  # fmt: skip
    if split and not merge_last:
        _launch_combine(plan, dst, sink, out, max_logits, lse, slots, ctx)
    return out, max_logits, lse


def _launch_combine(
    plan: FwdPlan, partials: Sequence[torch.Tensor], sink: torch.Tensor, out: torch.Tensor,
    max_logits: torch.Tensor, lse: torch.Tensor, slots: dict[Any, Any] | None, ctx: LaunchContext | None,
) -> None:  # fmt: skip
    """The merge kernel of split-K ``partials`` (out, max, lse of each split) into the final outputs."""
    part_o, part_max, part_lse = partials
    dims = plan.dims
    launch(
        _split_combine_kernel, plan.combine_grid, slots, "combine",
        (part_o, part_lse, part_max, sink, out, max_logits, lse, dims.h_q * dims.d_v, dims.d_v, dims.s_q,
         dims.h_q, 0),
        plan.combine_consts, ctx,
    )  # fmt: skip


def fwd_scratch(plan: FwdPlan, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``max_logits [n_tok, h_q]`` and, with split-K, the partial ``out`` / ``max`` / ``lse`` of each split."""
    n_tok, h_q, s = plan.dims.s_q, plan.dims.h_q, plan.n_splits
    max_logits = torch.empty(n_tok, h_q, dtype=torch.float32, device=device)
    if s == 1:
        return (max_logits,)
    part_o = torch.empty(s, n_tok, h_q, plan.dims.d_v, dtype=torch.float32, device=device)
    part_lse = torch.empty(s, n_tok, h_q, dtype=torch.float32, device=device)
    return max_logits, part_o, torch.empty_like(part_lse), part_lse


def launch_fwd(
    q: torch.Tensor, kv_rows: torch.Tensor, idx: torch.Tensor, dims: SparseDims, sm_scale: float, *,
    attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None, q_start_index: int = 0,
    k_stride: int = 1, causal: bool = False, config: Config = DEFAULT, tiles: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Plan and launch the forward on validated inputs, nothing cached (tests and tools).

    Args:
        q: ``[n_tok, h_q, d_qk]`` (last dim contiguous).
        kv_rows: ``[n_rows, d_qk]`` KV rows (last dim contiguous).
        idx: ``[n_tok, topk]`` int32 row numbers (last dim contiguous); ``[0, dims.s_kv)`` is valid.
        dims: sizes.
        config: backend and split-K factor (``num_splits`` 0: :func:`choose_splits`).
        tiles: overrides of :func:`fwd_config`'s Triton tile (tests).

    Returns:
        ``out [n_tok, h_q, 512]``, ``max_logits [n_tok, h_q]``, ``lse [n_tok, h_q]`` (natural log).
    """
    plan = plan_fwd(
        q, kv_rows, idx.stride(0), dims, has_sink=attn_sink is not None, has_topk_length=topk_length is not None,
        q_start_index=q_start_index, k_stride=k_stride, causal=causal, config=config, tiles=tiles,
    )  # fmt: skip
    set_gluon_options(plan, config, q.device)
    return run_fwd(plan, q, kv_rows, idx, sm_scale, attn_sink, topk_length, cache_slots=False)


@dataclass
class RowsPlan:
    """The launch of :func:`paged_to_rows` for a call signature (grid, integer arguments, constexprs)."""

    grid: tuple[int, ...]
    ints: tuple[int, ...]
    consts: dict[str, Any]
    slots: dict[Any, Any] = field(default_factory=dict)


def plan_rows(
    indices: torch.Tensor, block_table: torch.Tensor, q_per_batch: int, page_size: int, n_rows: int
) -> RowsPlan:
    """The :class:`RowsPlan` of ``paged_to_rows`` with these arguments."""
    n_tok, topk = indices.shape
    block = min(1024, next_power_of_2(topk))
    ints = (
        topk,
        q_per_batch,
        indices.stride(0),
        block_table.stride(0),
        page_size,
        block_table.shape[1],
        n_rows,
    )
    return RowsPlan((n_tok, cdiv(topk, block)), ints, {"BLOCK": block, "num_warps": 4})


def paged_to_rows(
    indices: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, q_per_batch: int,
    page_size: int, n_rows: int, *, plan: RowsPlan | None = None, rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Decode indices (positions in each sequence) to rows of the flattened paged cache, ``-1`` if invalid.

    Args:
        indices: ``[n_tok, topk]`` int32 positions; token ``t`` belongs to sequence ``t // q_per_batch``.
            A position ``< 0`` or ``>= min(cache_seqlens[b], max_blocks * page_size)`` is invalid.
        block_table: ``[b, max_blocks]`` int32 (last dim contiguous).
        cache_seqlens: ``[b]`` int32.
        page_size: tokens per cache block.
        n_rows: rows in the cache (``num_blocks * page_size``); a table entry outside the cache is invalid.
        plan: the :class:`RowsPlan` of this call signature (its compiled kernel is cached); ``None``: made
            here, nothing cached.
        rows: ``[n_tok, topk]`` int32 output to fill (else allocated).

    Returns:
        ``[n_tok, topk]`` int32 cache rows.
    """
    n_tok, topk = indices.shape
    if rows is None:
        rows = torch.empty(n_tok, topk, dtype=torch.int32, device=indices.device)
    if n_tok == 0:
        return rows
    if plan is None:
        launch_rows(plan_rows(indices, block_table, q_per_batch, page_size, n_rows), indices, block_table,
                    cache_seqlens, rows, cache_slots=False)  # fmt: skip
    else:
        launch_rows(plan, indices, block_table, cache_seqlens, rows)
    return rows


def launch_rows(
    plan: RowsPlan, indices: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
    rows: torch.Tensor, *, cache_slots: bool = True, ctx: LaunchContext | None = None,
) -> None:  # fmt: skip
    """Launch the kernel of :func:`paged_to_rows` as ``plan`` says (through its cached compiled kernel with
    ``cache_slots``; ``ctx``: the call's :func:`~sparse_mla_attn._runtime.launch_context`). ``indices`` may
    be any view of the memory the plan was made for (the kernel takes the plan's row stride), e.g.
    ``[b, s_q, topk]`` before its reshape to ``[b * s_q, topk]``."""
    launch(
        _paged_rows_kernel, plan.grid, plan.slots if cache_slots else None, "rows",
        (indices, block_table, cache_seqlens, rows, *plan.ints), plan.consts, ctx,
    )  # fmt: skip


def _fwd_fake(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int, *_: Any
) -> tuple[torch.Tensor, ...]:
    dims = check_sparse_inputs(q, kv, indices, d_v, float_ok=False)
    max_logits = q.new_empty(dims.s_q, dims.h_q, dtype=torch.float32)
    return q.new_empty(dims.s_q, dims.h_q, d_v), max_logits, torch.empty_like(max_logits)


def _plan_fwd_call(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None, q_start_index: int, k_stride: int, causal: bool, config: Config,
) -> FwdPlan:  # fmt: skip
    dims = check_sparse_inputs(q, kv, indices, d_v, float_ok=False)
    check_kernel_dims(dims, q.dtype, "sparse_mla_fwd")
    check_optional_vectors(attn_sink, topk_length, dims, q.device)
    check_causal_args(q_start_index, k_stride)
    check_kernel_device(q, "sparse_mla_fwd")
    plan = plan_fwd(
        q, kv[:, 0], indices.stride(0), dims, has_sink=attn_sink is not None,
        has_topk_length=topk_length is not None,
        q_start_index=q_start_index, k_stride=k_stride, causal=causal, config=config,
    )  # fmt: skip
    return set_gluon_options(plan, config, q.device)


def set_gluon_options(plan: FwdPlan, config: Config, device: torch.device) -> FwdPlan:
    """Give ``plan`` the Gluon forward's options of ``config`` (``fwd_persistent``: one program per
    multiprocessor of ``device``, by default where a token has more than one 64-head tile or where the KV
    rows fit in half of the device's L2 cache, see :class:`Config`; ``fwd_tail_split``: the last items in
    pieces, :func:`tail_split`) and, one program per item up to 64 heads where the KV rows do not fit in the
    L2 cache, the query tile loaded by the consumer warpgroups (``launch_fwd_gluon``'s
    ``q_in_consumers``); returns ``plan``."""
    mode = config.fwd_persistent
    dims = plan.dims
    l2_bytes = l2_cache_bytes(device)
    kv_in_l2 = 2 * dims.s_kv * dims.d_qk * 2 <= l2_bytes  # bf16 / fp16 rows
    persistent = mode == "on" or (mode == "auto" and (dims.h_q > 64 or kv_in_l2))
    n_sm = num_sms(device)
    plan.gluon_options = {"persistent_programs": n_sm if persistent else 0}
    if not persistent and dims.h_q <= 64 and dims.s_kv * dims.d_qk * 2 > l2_bytes:
        # One program per item, rows past L2: the first gathers (from HBM) overlap the query load.
        plan.gluon_options["q_in_consumers"] = True
    plan.tail = None
    mode = config.fwd_tail_split
    if mode != "off" and plan.gluon and plan.n_splits == 1 and not plan.consts.get("KV_FP8"):
        plan.tail = tail_split(dims.s_q, cdiv(dims.h_q, 64), dims.topk, n_sm, mode == "on")
    return plan


def tail_split(
    n_tok: int, n_head_tiles: int, topk: int, n_sm: int, force: bool = False
) -> tuple[int, int, int] | None:
    """How the Gluon forward splits its last work items (``FwdPlan.tail``): the ``r`` items past the last
    full wave of ``n_sm`` (whole tokens' head tiles) run in ``s`` pieces each of ``split_len`` slots (a
    multiple of 128, one pair of blocks), ``r s <= n_sm``, where ``r`` is at most half of ``n_sm``
    (``force``: wherever ``r >= 1`` and a split is possible). ``None`` where the items are not split:
    ``(n_main, s, split_len)`` else."""
    n_items = n_tok * n_head_tiles
    if n_sm <= 0:
        return None
    r = n_items % n_sm if n_items > n_sm else n_items if force else 0
    r = cdiv(r, n_head_tiles) * n_head_tiles  # whole tokens
    if r == 0 or (2 * r > n_sm and not force):
        return None
    s = min(cdiv(topk, 128), max(1, n_sm // r))
    split_len = cdiv(cdiv(topk, s), 128) * 128
    s = cdiv(topk, split_len)
    if s < 2:
        return None
    return n_items - r, s, split_len


_PLANS: dict[Any, FwdPlan] = {}


def _fwd_key(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None, d_v: int, q_start_index: int, k_stride: int, causal: bool,
    options: tuple[Any, ...],
) -> tuple[Any, ...]:  # fmt: skip
    """What a call's validation and launch plan depend on (``_runtime.call_signature`` of its tensors and
    its other arguments but the scale): the key of ``_PLANS``."""
    return (*call_signature(q, kv, indices, attn_sink, topk_length), d_v, q_start_index, k_stride, causal,
            options)  # fmt: skip


@define_op("sparse_mla_fwd", _fwd_fake)
def _fwd_op(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
    attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None, q_start_index: int, k_stride: int,
    causal: bool, backend: str, num_splits: int, fwd_persistent: str = "auto", fwd_tail_split: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    # Validation and launch plan depend only on the call signature: made once per signature.
    options = (backend, num_splits, fwd_persistent, fwd_tail_split)
    key = _fwd_key(q, kv, indices, attn_sink, topk_length, d_v, q_start_index, k_stride, causal, options)
    config = lambda: replace(
        config_of(backend, num_splits), fwd_persistent=fwd_persistent, fwd_tail_split=fwd_tail_split
    )
    plan = cached(
        _PLANS, key, lambda: _plan_fwd_call(q, kv, indices, d_v, attn_sink, topk_length, q_start_index, k_stride,
                                            causal, config()),
    )  # fmt: skip
    scale = check_sm_scale(sm_scale)
    ctx = launch_context(q.device)
    # kv and indices as they are: the kernels take the plan's strides (those of kv[:, 0], indices[:, 0]).
    if ctx is None or ctx.capturing or not no_launch_hooks():
        return run_fwd(plan, q, kv, indices, scale, attn_sink, topk_length, ctx=ctx)
    # Eager on a GPU: once this plan's launches all go through cached kernels on this stream, they are
    # recorded, and later eager calls replay them with their own tensors (_fwd_eager).
    result, records = record_launches(
        lambda: run_fwd(plan, q, kv, indices, scale, attn_sink, topk_length, ctx=ctx)
    )
    keep_replay(plan.replays, records, (q, kv, indices, attn_sink, topk_length, *result), scale * LOG2E, ctx)
    return result


def _fwd_eager(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
    attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None, q_start_index: int, k_stride: int,
    causal: bool, options: tuple[Any, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """A repeated eager call on a CUDA stream: the launches its plan recorded on this device, stream and
    thread (``FwdPlan.replays``), replayed with this call's tensors; ``None`` where the call takes the op
    (a new signature or stream, tracing, graph capture, launch hooks, inputs that require grad). The
    caller checked the argument types and that ``sm_scale`` is a float."""
    where = eager_stream(q)
    if where is None or (
        torch.is_grad_enabled()
        and (q.requires_grad or kv.requires_grad or (attn_sink is not None and attn_sink.requires_grad))
    ):
        return None
    key = _fwd_key(q, kv, indices, attn_sink, topk_length, d_v, q_start_index, k_stride, causal, options)
    plan = _PLANS.get(key)
    replay = plan_replay(plan, where, sm_scale)
    if replay is None or plan is None:
        return None
    dims = plan.dims
    dev = q.device
    out = torch.empty(dims.s_q, dims.h_q, dims.d_v, dtype=q.dtype, device=dev)
    max_logits = torch.empty(dims.s_q, dims.h_q, dtype=torch.float32, device=dev)
    lse = torch.empty(dims.s_q, dims.h_q, dtype=torch.float32, device=dev)
    replay.run(
        q.data_ptr(), kv.data_ptr(), indices.data_ptr(), 0 if attn_sink is None else attn_sink.data_ptr(),
        0 if topk_length is None else topk_length.data_ptr(), out.data_ptr(), max_logits.data_ptr(),
        lse.data_ptr(), sm_scale * LOG2E,
    )  # fmt: skip
    return out, max_logits, lse


def sparse_mla_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    *,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    q_start_index: int = 0,
    k_stride: int = 1,
    causal: bool = False,
    config: Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA forward (DeepSeek sparse attention): each query attends to its own top-k KV rows.

    Arguments and results follow FlashMLA's ``flash_mla_sparse_fwd``, except that ``lse`` and
    ``max_logits`` are in natural-log units and a query with no valid index reports ``lse = -inf``.
    Multiply by ``log2(e)`` for base 2. Batches are flattened: concatenate the tokens of all sequences
    into ``q`` and their KV rows into ``kv``, and give each token global row indices.

    Args:
        q: ``[s_q, h_q, d_qk]`` bf16 (or fp16), ``d_qk`` 576 (512 latent + 64 rope) or 512,
            ``1 <= h_q <= 128``; last dim contiguous.
        kv: ``[s_kv, 1, d_qk]`` q's dtype, the single latent KV head; its first ``d_v`` channels are the
            values. Last dim contiguous.
        indices: ``[s_q, 1, topk]`` int32, any ``topk >= 1``. An index ``< 0`` or ``>= s_kv`` is invalid:
            it is skipped and its row is never read. Duplicates count as many times as they appear.
        sm_scale: softmax scale applied to ``q · k``.
        d_v: value dim; must be 512.
        attn_sink: optional ``[h_q]`` float32 sink logit per head, added to the softmax denominator only:
            ``out *= 1 / (1 + exp(attn_sink - lse))``; ``lse`` and ``max_logits`` do not include it.
        topk_length: optional ``[s_q]`` int32; only the first ``topk_length[i]`` indices of query ``i``
            are used.
        q_start_index: position of query 0 in its sequence (used when ``causal``).
        k_stride: query positions per KV entry, e.g. for a compressed KV (used when ``causal``).
        causal: also skip indices above ``(q_start_index + i + 1 - k_stride) / k_stride`` (C integer
            division, the same limit as :func:`attn_dist`).
        config: tuning options (:class:`~sparse_mla_attn.Config`: backend, split-K factor,
            ``fwd_persistent``, ``fwd_tail_split``).

    Returns:
        ``out [s_q, h_q, d_v]`` q's dtype; ``max_logits [s_q, h_q]`` float32, the largest
        ``sm_scale * q·k`` over valid indices; ``lse [s_q, h_q]`` float32, natural-log
        log-sum-exp of the same logits. A query with no valid index gives ``out = 0`` and
        ``max_logits = lse = -inf``.

    Raises:
        ValueError, TypeError: on a wrong shape, dtype, device or layout (the message names the argument).
    """
    cfg = config or DEFAULT
    options = (cfg.backend, cfg.num_splits, cfg.fwd_persistent, cfg.fwd_tail_split)
    T = torch.Tensor
    # A repeated eager call replays its plan's launches (the checks below are those of its first call).
    if (type(q) is T and type(kv) is T and type(indices) is T and type(sm_scale) is float and type(d_v) is int
            and type(q_start_index) is int and type(k_stride) is int and type(causal) is bool
            and (attn_sink is None or type(attn_sink) is T) and (topk_length is None or type(topk_length) is T)):  # fmt: skip
        done = _fwd_eager(
            q, kv, indices, sm_scale, d_v, attn_sink, topk_length, q_start_index, k_stride, causal, options
        )
        if done is not None:
            return done
    check_arg_types({"q": q, "kv": kv, "indices": indices}, {"d_v": d_v, "q_start_index": q_start_index,
                    "k_stride": k_stride}, optional={"attn_sink": attn_sink, "topk_length": topk_length})  # fmt: skip
    check_sm_scale(sm_scale)
    return _fwd_op(
        q, kv, indices, sm_scale, d_v, attn_sink, topk_length, q_start_index, k_stride, causal, *options
    )
