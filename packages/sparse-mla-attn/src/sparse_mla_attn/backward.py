"""Sparse MLA backward: ``dq`` and ``dkv`` for DeepSeek sparse attention, in Triton.

Forward (for one query ``s``, head ``h`` and its top-k slots ``t``; ``K_t = kv[indices[s, 0, t]]``,
``V_t = K_t[:d_v]``)::

    S[h, t] = sm_scale * q[s, h] · K_t          P = exp(S - lse)          out[s, h] = Σ_t P[h, t] V_t

Backward, with ``D[h] = Σ_d dout[s, h, d] * out[s, h, d]``::

    dP[h, t] = dout[s, h] · V_t                  dS = P * (dP - D)
    dq[s, h]  = sm_scale * Σ_t dS[h, t] K_t
    dkv[r]   += Σ_{(s, t): indices[s, 0, t] = r}  sm_scale * Σ_h dS[h, t] q[s, h]   (all d_qk channels)
              + Σ_h P[h, t] dout[s, h]                                             (first d_v channels)

Invalid slots (index ``< 0`` or ``>= s_kv``, or above the causal limit) carry ``P = 0`` and are never
dereferenced. ``D = rowsum(dout * out)`` comes first; then, per chunk of query tokens, a main kernel (one
program per token and head block) recomputes ``S``/``P``, forms ``dS`` and writes it (scaled, in the input
dtype) and ``P`` to workspaces; a ``dq`` kernel multiplies the workspace ``dS`` by the gathered rows; and a
``dkv`` kernel (one program per token and block of slots, with all its heads, up to 128) sums
``dS^T q + P^T dout`` over the heads and adds each (token, slot) row into an fp32 ``dkv`` with atomics (on
sm_90 a warp-specialised Gluon kernel, ``backends/gluon_sm90_bwd.py``, ``Config.bwd_dkv_backend``). Above
128 heads the main kernel forms the ``dkv`` products itself, per head block. Up to 128 heads each token's
slots are first sorted by index, and the ``dkv`` programs in flight work on the same slot block of
neighbouring tokens, so that their atomics touch a narrow range of rows that stays in L2 (``attn_sum`` is
put back in the caller's slot order). In the deterministic mode the per-(token, slot) ``dkv`` contributions
go to a workspace instead (for bf16 inputs up to 128 heads fp16, each 64-channel piece times a power of two
that puts its largest value in ``[2^14, 2^15)``, the factor's inverse stored beside it; fp32 otherwise), and
a reduction kernel sums them per KV row in fp32 in a fixed order (pairs sorted by (row, token, slot)), so the
result is bit-identical from run to run. No step makes the host wait for the GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from sparse_mla_attn._runtime import (
    LaunchContext,
    cached,
    call_signature,
    causal_max_k,
    cdiv,
    check_kernel_device,
    define_op,
    dot,
    interpreting,
    launch,
    launch_context,
    mask_and,
    next_power_of_2,
    record_launch,
)
from sparse_mla_attn._validate import check_arg_types, check_bwd_inputs, check_sm_scale
from sparse_mla_attn.backends import gluon_sm90
from sparse_mla_attn.backends.gluon_sm90_bwd import dkv_gluon_eligible, launch_dkv_gluon
from sparse_mla_attn.config import DEFAULT, Config, config_of
from sparse_mla_attn.reference import valid_slots

# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _slot_index(idx_row_ptr, offs_t, topk, s_kv, max_k, CAUSAL: tl.constexpr):
    """Load a block of top-k indices; return (safe int64 row, valid mask). Invalid rows point at row 0."""
    in_topk = offs_t < topk
    idx = tl.load(idx_row_ptr + offs_t, mask=in_topk, other=-1)
    valid = in_topk & (idx >= 0) & (idx < s_kv)
    if CAUSAL:
        valid = valid & (idx <= max_k)
    return tl.where(valid, idx, 0).to(tl.int64), valid


@triton.jit
def _delta_kernel(
    out_ptr, dout_ptr, delta_ptr,
    stride_os, stride_oh, stride_dos, stride_doh,
    h_q,
    D_V: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_V)
    hmask = offs_h < h_q
    o = tl.load(out_ptr + s * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :], mask=hmask[:, None])
    do = tl.load(
        dout_ptr + s * stride_dos + offs_h[:, None] * stride_doh + offs_d[None, :], mask=hmask[:, None]
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + s * h_q + offs_h, delta, mask=hmask)


@triton.jit
def _p_ds(q_row, do_row, k_row, valid, hmask, lse2, delta, scale_log2, sm_scale,
              D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_DV: tl.constexpr, CHUNK_STAGES: tl.constexpr, ROPE_IN_LOOP: tl.constexpr):  # fmt: skip
    """Recompute ``P`` and ``sm_scale * dS`` (``[BLOCK_H, BLOCK_T]``, input dtype) for one head block."""
    # The channel-chunk loops are real loops, not unrolled: unrolled, the compiler hoists every chunk's
    # loads at once and runs out of registers. With ROPE_IN_LOOP the rope channels are the loop's last
    # chunk (dout masked to 0 there), so their loads are pipelined with the others.
    offs_dv = tl.arange(0, BLOCK_DV)
    scores = tl.zeros([BLOCK_H, BLOCK_T], dtype=tl.float32)
    dp = tl.zeros([BLOCK_H, BLOCK_T], dtype=tl.float32)
    N_CH: tl.constexpr = (D_V + D_ROPE) // BLOCK_DV if ROPE_IN_LOOP else D_V // BLOCK_DV
    for c in tl.range(0, N_CH, num_stages=CHUNK_STAGES):
        offs_d = c * BLOCK_DV + offs_dv
        k = tl.load(k_row + offs_d[None, :], mask=valid[:, None], other=0.0)
        qc = tl.load(q_row + offs_d[None, :], mask=hmask[:, None], other=0.0)
        if ROPE_IN_LOOP:
            doc = tl.load(do_row + offs_d[None, :], mask=hmask[:, None] & (offs_d < D_V)[None, :], other=0.0)
        else:
            doc = tl.load(do_row + offs_d[None, :], mask=hmask[:, None], other=0.0)
        kt = tl.trans(k)
        scores = dot(qc, kt, scores)
        dp = dot(doc, kt, dp)
    if D_ROPE > 0 and not ROPE_IN_LOOP:
        offs_r = D_V + tl.arange(0, D_ROPE)
        kr = tl.load(k_row + offs_r[None, :], mask=valid[:, None], other=0.0)
        qr = tl.load(q_row + offs_r[None, :], mask=hmask[:, None], other=0.0)
        scores = dot(qr, tl.trans(kr), scores)
    keep = hmask[:, None] & valid[None, :]
    p = tl.where(keep, tl.exp2(scores * scale_log2 - lse2[:, None]), 0.0)
    ds = p * (dp - delta[:, None]) * sm_scale
    # The column sums of P are the head-summed attention (the indexer target); unused ones are compiled away.
    return p.to(q_row.dtype.element_ty), ds.to(q_row.dtype.element_ty), tl.sum(p, axis=0)


@triton.jit
def half_exponent(amax):
    """The power-of-two scale exponent ``k`` that puts ``amax`` (>= 0, fp32) in ``[2^14, 2^15)``, at most
    126 (so ``2^-k`` is a normal fp32): ``x * 2^k`` is then a finite fp16 for every ``|x| <= amax``."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.minimum(141 - e, 126)


@triton.jit
def pow2(k):
    """``2^k`` as fp32 for an int32 ``k`` in ``[-126, 127]`` (exact, by its exponent bits)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dkv_update(dkv_row, part_row, scale_row, valid, offs_t, d0, offs_d, part, topk,
                DETERMINISTIC: tl.constexpr, HALF: tl.constexpr, G: tl.constexpr,
                EVICT: tl.constexpr):  # fmt: skip
    """Add a ``[BLOCK_T, W]`` fp32 tile of dkv contributions (channels ``d0 ..``, ``offs_d``) into dkv with
    atomics, or store it to the deterministic workspace: fp32, or with ``HALF`` fp16 scaled by a power of two
    per ``G`` channels (the ``2^-k`` factors to ``scale_row``, one per group). ``EVICT``: the workspace
    stores marked evict-first in L2 (read back only after the whole chunk)."""
    if DETERMINISTIC:
        tmask = (offs_t < topk)[:, None]
        if HALF:
            BT: tl.constexpr = part.shape[0]
            W: tl.constexpr = part.shape[1]
            grouped = tl.reshape(part, [BT, W // G, G])
            k = half_exponent(tl.max(tl.abs(grouped), axis=2))
            vals = tl.reshape(grouped * pow2(k)[:, :, None], [BT, W]).to(tl.float16)
            offs_g = d0 // G + tl.arange(0, W // G)
            if EVICT:
                tl.store(part_row + offs_d[None, :], vals, mask=tmask, eviction_policy="evict_first")
            else:
                tl.store(part_row + offs_d[None, :], vals, mask=tmask)
            tl.store(scale_row + offs_g[None, :], pow2(-k), mask=tmask)
        elif EVICT:
            tl.store(part_row + offs_d[None, :], part, mask=tmask, eviction_policy="evict_first")
        else:
            tl.store(part_row + offs_d[None, :], part, mask=tmask)
    else:
        tl.atomic_add(dkv_row + offs_d[None, :], part, mask=valid[:, None], sem="relaxed")


@triton.jit
def _main_kernel(
    q_ptr, kv_ptr, dout_ptr, lse_ptr, delta_ptr, idx_ptr, ds_ptr, p_ptr, dkv_ptr, part_ptr, attn_ptr,
    n_tok,
    stride_qs, stride_qh, stride_kvs, stride_dos, stride_doh, stride_lses, stride_is, stride_part_hb,
    s_kv, h_q, q_start_index, k_stride, sm_scale,
    topk: tl.constexpr, CAUSAL: tl.constexpr, DETERMINISTIC: tl.constexpr, D_QK: tl.constexpr,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_DV: tl.constexpr, N_HB: tl.constexpr, CHUNK_STAGES: tl.constexpr, N_SUB: tl.constexpr,
    BLOCK_DV2: tl.constexpr, ATTN_SUM: tl.constexpr, SPLIT_DKV: tl.constexpr, ROPE_IN_LOOP: tl.constexpr,
    IDX_PREFETCH: tl.constexpr,
):  # fmt: skip
    # A program owns one token and N_SUB * BLOCK_H heads. With N_SUB = 2 the scores of the two head halves
    # are computed one after the other (registers for one [BLOCK_H, BLOCK_T] pair at a time), and their dkv
    # contributions are summed before the single atomic update: half the atomics and half the row gathers.
    pid = tl.program_id(0)
    hb = pid % N_HB
    s = (pid // N_HB).to(tl.int64)
    offs_h0 = hb * (N_SUB * BLOCK_H) + tl.arange(0, BLOCK_H)
    offs_h1 = offs_h0 + BLOCK_H
    hmask0 = offs_h0 < h_q
    hmask1 = (offs_h1 < h_q) & (N_SUB > 1)
    # Padded heads get lse = +inf so that their P is exactly 0.
    lse0 = tl.load(lse_ptr + s * stride_lses + offs_h0, mask=hmask0, other=float("inf")) * 1.4426950408889634
    delta0 = tl.load(delta_ptr + s * h_q + offs_h0, mask=hmask0, other=0.0)
    lse1 = tl.load(lse_ptr + s * stride_lses + offs_h1, mask=hmask1, other=float("inf")) * 1.4426950408889634
    delta1 = tl.load(delta_ptr + s * h_q + offs_h1, mask=hmask1, other=0.0)
    max_k = causal_max_k(q_start_index + s, k_stride)
    scale_log2 = sm_scale * 1.4426950408889634
    q_row0 = q_ptr + s * stride_qs + offs_h0[:, None] * stride_qh
    do_row0 = dout_ptr + s * stride_dos + offs_h0[:, None] * stride_doh
    q_row1 = q_ptr + s * stride_qs + offs_h1[:, None] * stride_qh
    do_row1 = dout_ptr + s * stride_dos + offs_h1[:, None] * stride_doh
    offs_dv = tl.arange(0, BLOCK_DV2)  # channel chunk of the dkv products
    # With IDX_PREFETCH the next block's indices are loaded while this block is computed.
    rows_next, valid_next = _slot_index(
        idx_ptr + s * stride_is, tl.arange(0, BLOCK_T), topk, s_kv, max_k, CAUSAL
    )
    for t0 in range(0, topk, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        if IDX_PREFETCH:
            rows, valid = rows_next, valid_next
            rows_next, valid_next = _slot_index(
                idx_ptr + s * stride_is, offs_t + BLOCK_T, topk, s_kv, max_k, CAUSAL
            )
        else:
            rows, valid = _slot_index(idx_ptr + s * stride_is, offs_t, topk, s_kv, max_k, CAUSAL)
        k_row = kv_ptr + rows[:, None] * stride_kvs
        tmask = (offs_t < topk)[None, :]
        ws_off = s * h_q * topk + offs_t[None, :]  # [s, h, t] offset in the dS (and P) workspace
        ds_row = ds_ptr + ws_off
        p0, ds0, psum = _p_ds(q_row0, do_row0, k_row, valid, hmask0, lse0, delta0, scale_log2, sm_scale,
                            D_V, D_ROPE, BLOCK_H, BLOCK_T, BLOCK_DV, CHUNK_STAGES, ROPE_IN_LOOP)  # fmt: skip
        tl.store(ds_row + offs_h0[:, None] * topk, ds0, mask=hmask0[:, None] & tmask)
        if SPLIT_DKV:  # P for the separate dkv kernel, same layout as dS
            tl.store(p_ptr + ws_off + offs_h0[:, None] * topk, p0, mask=hmask0[:, None] & tmask)
        ds0_t = tl.trans(ds0)
        p0_t = tl.trans(p0)
        if N_SUB > 1:
            p1, ds1, psum1 = _p_ds(q_row1, do_row1, k_row, valid, hmask1, lse1, delta1, scale_log2, sm_scale,
                                D_V, D_ROPE, BLOCK_H, BLOCK_T, BLOCK_DV, CHUNK_STAGES, ROPE_IN_LOOP)  # fmt: skip
            tl.store(ds_row + offs_h1[:, None] * topk, ds1, mask=hmask1[:, None] & tmask)
            if SPLIT_DKV:
                tl.store(p_ptr + ws_off + offs_h1[:, None] * topk, p1, mask=hmask1[:, None] & tmask)
            ds1_t = tl.trans(ds1)
            p1_t = tl.trans(p1)
            psum += psum1
        if ATTN_SUM:  # this program's heads' share of attn_sum[s, t]; the launcher adds the head blocks
            tl.store(attn_ptr + (hb * n_tok + s) * topk + offs_t, psum, mask=offs_t < topk)
        if not SPLIT_DKV:  # dkv products and update here (else: _dkv_kernel, all heads at once)
            # (The fp32 workspace: its per-head-block rows are the fused path's, above 128 heads.)
            part_row = part_ptr + hb * stride_part_hb + (s * topk + offs_t)[:, None].to(tl.int64) * D_QK
            dkv_row = dkv_ptr + rows[:, None] * D_QK
            for c in tl.range(0, D_V // BLOCK_DV2, num_stages=CHUNK_STAGES):
                offs_d = c * BLOCK_DV2 + offs_dv
                qc = tl.load(q_row0 + offs_d[None, :], mask=hmask0[:, None], other=0.0)
                doc = tl.load(do_row0 + offs_d[None, :], mask=hmask0[:, None], other=0.0)
                part = dot(ds0_t, qc)
                part = dot(p0_t, doc, part)
                if N_SUB > 1:
                    qc1 = tl.load(q_row1 + offs_d[None, :], mask=hmask1[:, None], other=0.0)
                    doc1 = tl.load(do_row1 + offs_d[None, :], mask=hmask1[:, None], other=0.0)
                    part = dot(ds1_t, qc1, part)
                    part = dot(p1_t, doc1, part)
                _dkv_update(dkv_row, part_row, part_row, valid, offs_t, 0, offs_d, part, topk, DETERMINISTIC,
                            False, 1, False)  # fmt: skip
            if D_ROPE > 0:
                offs_r = D_V + tl.arange(0, D_ROPE)
                qr = tl.load(q_row0 + offs_r[None, :], mask=hmask0[:, None], other=0.0)
                part_r = dot(ds0_t, qr)
                if N_SUB > 1:
                    qr1 = tl.load(q_row1 + offs_r[None, :], mask=hmask1[:, None], other=0.0)
                    part_r = dot(ds1_t, qr1, part_r)
                _dkv_update(dkv_row, part_row, part_row, valid, offs_t, 0, offs_r, part_r, topk, DETERMINISTIC,
                            False, 1, False)  # fmt: skip


@triton.jit
def _dkv_kernel(
    ds_ptr, p_ptr, q_ptr, dout_ptr, idx_ptr, dkv_ptr, part_ptr, scale_ptr,
    n_tok,
    stride_qs, stride_qh, stride_dos, stride_doh, stride_is,
    s_kv, h_q, q_start_index, k_stride,
    topk: tl.constexpr, CAUSAL: tl.constexpr, DETERMINISTIC: tl.constexpr, HALF: tl.constexpr,
    G: tl.constexpr, EVICT: tl.constexpr, D_QK: tl.constexpr,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr, N_TB: tl.constexpr, CHUNK_STAGES: tl.constexpr, N_CSPLIT: tl.constexpr,
    TOK_GROUP: tl.constexpr, ROPE_IN_LOOP: tl.constexpr,
):  # fmt: skip
    # One program per (token, block of BLOCK_T slots) with ALL heads (BLOCK_H >= h_q): the dkv contribution
    # of a slot, dS^T q + P^T dout summed over every head, is one [BLOCK_T, channels] product with K = h_q,
    # so each (token, slot) is added into dkv once instead of once per head block. dS and P come from the
    # main kernel's workspaces; the token's q / dout channel chunks are shared in L2 by its N_TB programs,
    # which run next to each other in launch order.
    # With N_CSPLIT > 1 the channel chunks (latent ones, then the rope as the last) are split into N_CSPLIT
    # groups, and the launch order is group-major: the programs in flight update only one group's columns
    # of dkv, a footprint that fits in L2 where the whole fp32 buffer does not (at the price of reading the
    # dS / P tile once per group).
    # With TOK_GROUP > 1 the launch order inside a channel group is (group of TOK_GROUP tokens, slot block,
    # token): with each token's indices sorted, the programs in flight share a slot block and so update
    # rows of a narrow index range (an L2-sized footprint of dkv), while the group's q / dout stay in L2.
    pid = tl.program_id(0)
    n_per_group = n_tok * N_TB
    cg = pid // n_per_group
    pid = pid % n_per_group
    if TOK_GROUP == 1:
        tb = pid % N_TB
        s = (pid // N_TB).to(tl.int64)
    else:
        grp = pid // (TOK_GROUP * N_TB)
        g0 = grp * TOK_GROUP
        g_n = tl.minimum(n_tok - g0, TOK_GROUP)  # the last group may be short
        r = pid - g0 * N_TB
        tb = r // g_n
        s = (g0 + r % g_n).to(tl.int64)
    N_LAT: tl.constexpr = D_V // BLOCK_C
    N_CHUNKS: tl.constexpr = N_LAT + (1 if D_ROPE > 0 else 0)
    PER_GROUP: tl.constexpr = (N_CHUNKS + N_CSPLIT - 1) // N_CSPLIT
    # Every group is non-empty (checked by the launcher), so only the last one holds the rope chunk or
    # ends early; bounds by arithmetic (the interpreter cannot range() over a tl.minimum).
    is_last = (cg == N_CSPLIT - 1).to(tl.int32)
    c_lo = cg * PER_GROUP
    c_hi_lat = c_lo + PER_GROUP + is_last * (N_LAT - c_lo - PER_GROUP)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < h_q
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    max_k = causal_max_k(q_start_index + s, k_stride)
    rows, valid = _slot_index(idx_ptr + s * stride_is, offs_t, topk, s_kv, max_k, CAUSAL)
    ws = s * h_q * topk + offs_h[:, None] * topk + offs_t[None, :]
    ws_mask = hmask[:, None] & valid[None, :]
    ds_t = tl.trans(tl.load(ds_ptr + ws, mask=ws_mask, other=0.0))  # [BLOCK_T, BLOCK_H]
    p_t = tl.trans(tl.load(p_ptr + ws, mask=ws_mask, other=0.0))
    q_row = q_ptr + s * stride_qs + offs_h[:, None] * stride_qh
    do_row = dout_ptr + s * stride_dos + offs_h[:, None] * stride_doh
    dkv_row = dkv_ptr + rows[:, None] * D_QK
    pair = (s * topk + offs_t)[:, None].to(tl.int64)
    part_row = part_ptr + pair * D_QK
    scale_row = scale_ptr + pair * (D_QK // G)
    offs_c = tl.arange(0, BLOCK_C)
    if N_CSPLIT == 1 and ROPE_IN_LOOP:  # the rope chunk last in the pipelined loop, dout masked to 0 there
        for c in tl.range(0, D_QK // BLOCK_C, num_stages=CHUNK_STAGES):
            offs_d = c * BLOCK_C + offs_c
            qc = tl.load(q_row + offs_d[None, :], mask=hmask[:, None], other=0.0)
            doc = tl.load(do_row + offs_d[None, :], mask=hmask[:, None] & (offs_d < D_V)[None, :], other=0.0)
            part = dot(p_t, doc, dot(ds_t, qc))
            _dkv_update(dkv_row, part_row, scale_row, valid, offs_t, c * BLOCK_C, offs_d, part, topk,
                        DETERMINISTIC, HALF, G, EVICT)  # fmt: skip
    elif N_CSPLIT == 1:
        for c in tl.range(0, N_LAT, num_stages=CHUNK_STAGES):
            offs_d = c * BLOCK_C + offs_c
            qc = tl.load(q_row + offs_d[None, :], mask=hmask[:, None], other=0.0)
            doc = tl.load(do_row + offs_d[None, :], mask=hmask[:, None], other=0.0)
            part = dot(p_t, doc, dot(ds_t, qc))
            _dkv_update(dkv_row, part_row, scale_row, valid, offs_t, c * BLOCK_C, offs_d, part, topk,
                        DETERMINISTIC, HALF, G, EVICT)  # fmt: skip
    else:
        # A constant trip count with the chunks past the group's end skipped (the last group may be short):
        # the interpreter cannot range() over bounds derived from program_id.
        LOOP_N: tl.constexpr = PER_GROUP if PER_GROUP < N_LAT else N_LAT
        for i in tl.range(0, LOOP_N, num_stages=CHUNK_STAGES):
            c = c_lo + i
            c_ok = c < c_hi_lat
            offs_d = c * BLOCK_C + offs_c
            c_mask = mask_and(hmask[:, None], c_ok)
            qc = tl.load(q_row + offs_d[None, :], mask=c_mask, other=0.0)
            doc = tl.load(do_row + offs_d[None, :], mask=c_mask, other=0.0)
            if c_ok:
                part = dot(p_t, doc, dot(ds_t, qc))
                _dkv_update(dkv_row, part_row, scale_row, valid, offs_t, c * BLOCK_C, offs_d, part, topk,
                            DETERMINISTIC, HALF, G, EVICT)  # fmt: skip
    if D_ROPE > 0 and not (N_CSPLIT == 1 and ROPE_IN_LOOP):  # noqa: SIM102 (a constexpr test, then a run-time one)
        if cg == N_CSPLIT - 1:  # the rope chunk belongs to the last group
            offs_r = D_V + tl.arange(0, D_ROPE)
            qr = tl.load(q_row + offs_r[None, :], mask=hmask[:, None], other=0.0)
            part_r = dot(ds_t, qr)
            _dkv_update(dkv_row, part_row, scale_row, valid, offs_t, D_V, offs_r, part_r, topk,
                        DETERMINISTIC, HALF, G, EVICT)  # fmt: skip


@triton.jit
def _dq_block(ds_row, kv_ptr, stride_kvs, idx_row, dq_row, hmask, d0, d_end, s_kv, max_k,
                  topk: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                  WIDTH: tl.constexpr):  # fmt: skip
    """``dq[heads, d0:d0 + WIDTH] = dS @ rows[:, d0:d0 + WIDTH]`` for one head block (columns >= d_end masked)."""
    offs_d = d0 + tl.arange(0, WIDTH)
    dmask = offs_d < d_end
    acc = tl.zeros([BLOCK_H, WIDTH], dtype=tl.float32)
    offs_b = tl.arange(0, BLOCK_T)
    # The rows of block t+1 are resolved during block t, so that the gather depends only on loop-carried
    # values and the pipeliner can issue it stages ahead. dS is 0 at invalid slots (the main kernel writes
    # every slot), so its load does not wait for the indices.
    rows, valid = _slot_index(idx_row, offs_b, topk, s_kv, max_k, CAUSAL)
    for t0 in range(0, topk, BLOCK_T):
        offs_t = t0 + offs_b
        ds = tl.load(ds_row + offs_t[None, :], mask=hmask[:, None] & (offs_t < topk)[None, :], other=0.0)
        k = tl.load(
            kv_ptr + rows[:, None] * stride_kvs + offs_d[None, :],
            mask=valid[:, None] & dmask[None, :],
            other=0.0,
        )
        rows, valid = _slot_index(idx_row, offs_t + BLOCK_T, topk, s_kv, max_k, CAUSAL)
        acc = dot(ds, k, acc)
    tl.store(dq_row + offs_d[None, :], acc.to(dq_row.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _dq_kernel(
    ds_ptr, kv_ptr, idx_ptr, dq_ptr,
    stride_kvs, stride_is, stride_dqs, stride_dqh,
    s_kv, h_q, q_start_index, k_stride,
    topk: tl.constexpr, CAUSAL: tl.constexpr, D_QK: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, N_HB: tl.constexpr, N_DB: tl.constexpr,
):  # fmt: skip
    # Programs of one token are adjacent in launch order so that its dS and gathered rows stay in L2.
    pid = tl.program_id(0)
    db = pid % N_DB
    hb = (pid // N_DB) % N_HB
    s = (pid // (N_DB * N_HB)).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < h_q
    max_k = causal_max_k(q_start_index + s, k_stride)
    ds_row = ds_ptr + s * h_q * topk + offs_h[:, None] * topk
    dq_row = dq_ptr + s * stride_dqs + offs_h[:, None] * stride_dqh
    idx_row = idx_ptr + s * stride_is
    _dq_block(ds_row, kv_ptr, stride_kvs, idx_row, dq_row, hmask, db * BLOCK_D, D_QK, s_kv, max_k,
              topk, CAUSAL, BLOCK_H, BLOCK_T, BLOCK_D)  # fmt: skip


@triton.jit
def _det_reduce_kernel(
    part_ptr, scale_ptr, order_ptr, seg_start_ptr, seg_end_ptr, dkv_ptr,
    stride_part_hb, stride_scale_hb,
    D_QK: tl.constexpr, G: tl.constexpr, GROUPS: tl.constexpr, N_HB: tl.constexpr, HALF: tl.constexpr,
    UNROLL: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """One program per (KV row, block of ``GROUPS`` channel groups of ``G``): sum the row's (token, slot)
    contributions in sorted order (with ``HALF``, fp16 values times their group's fp32 factor ``2^-k``)."""
    N_G: tl.constexpr = D_QK // G
    row = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    gmask = (offs_g < N_G)[:, None]
    offs_d = offs_g[:, None] * G + tl.arange(0, G)[None, :]  # [GROUPS, G]
    start = tl.load(seg_start_ptr + row)
    end = tl.load(seg_end_ptr + row)
    if end > start:  # rows this chunk's tokens did not select keep their value
        acc = tl.zeros([GROUPS, G], dtype=tl.float32)
        # A while loop: the trip count is data, and the interpreter cannot range() over a loaded value.
        # UNROLL independent loads per step keep several rows in flight; the additions stay in pair order.
        j = start
        while j < end:
            for u in tl.static_range(UNROLL):
                ok = j + u < end
                pair = tl.load(order_ptr + j + u, mask=ok, other=0).to(tl.int64)
                m = mask_and(gmask, ok)
                for hb in tl.static_range(N_HB):
                    src = part_ptr + hb * stride_part_hb + pair * D_QK + offs_d
                    if EVICT:  # read once
                        vals = tl.load(src, mask=m, other=0.0, eviction_policy="evict_first")
                    else:
                        vals = tl.load(src, mask=m, other=0.0)
                    if HALF:
                        f = tl.load(scale_ptr + hb * stride_scale_hb + pair * N_G + offs_g[:, None], mask=m,
                                    other=0.0)  # fmt: skip
                        acc += vals.to(tl.float32) * f
                    else:
                        acc += vals
            j += UNROLL
        # Each row is one program's per launch, and launches run in order: no race.
        dst = dkv_ptr + row * D_QK + offs_d
        tl.store(dst, tl.load(dst, mask=gmask, other=0.0) + acc, mask=gmask)


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------


# The Gluon dkv kernel (Config.bwd_dkv_backend): DKV_GLUON -1 follows the config, 0 / 1 force it (tests);
# 64-channel chunks, a ring of three of them, 168 registers per thread in every partition. The deterministic
# workspace: DET_HALF -1 follows the rule of launch_bwd (scaled fp16 for bf16 inputs), 0 / 1 force fp32 /
# fp16; DET_EVICT marks its stores and reads evict-first; on CUDA (DET_OVERLAP) each chunk's reduction runs
# on a side stream beside the next chunk's kernels, with at least DET_CHUNKS chunks of >= 256 tokens. Its
# reduction kernel: every channel group of a row in one program (16 groups of 64 on the GPU, 9 used at
# d_qk 576: programs of fewer groups each re-read the row's pair list), 4 pairs in flight, 4 warps.
_DKV_GLUON_TILES = {
    "DKV_GLUON": -1,
    "BLOCK_C_G": 64,
    "NUM_BUF_G": 3,
    "CONSUMER_REGS_G": 168,
    "PRODUCER_REGS_G": 168,
    "DET_HALF": -1,
    "DET_OVERLAP": 1,
    "DET_EVICT": 1,
    "DET_CHUNKS": 4,
    "GROUPS_RED": 16,
    "UNROLL_RED": 4,
    "num_warps_red": 4,
}


@functools.lru_cache(maxsize=64)
def bwd_config(h_q: int, topk: int, d_v: int, deterministic: bool) -> dict[str, int]:
    """Tiles of the backward's kernels for a head count and mode (tests override them through
    :func:`launch_bwd`'s ``tiles``)."""
    block_h = max(16, next_power_of_2(min(h_q, 64)))
    if interpreting():
        return {"BLOCK_H": block_h, "BLOCK_T": 16, "BLOCK_DV": min(d_v, 64), "BLOCK_D": 32,
                "BLOCK_H_DQ": block_h, "BLOCK_T_DQ": 16, "num_warps": 4, "num_warps_dq": 4,
                "num_stages": 1, "num_stages_dq": 1, "chunk_stages": 1, "N_SUB": 1, "BLOCK_DV2": min(d_v, 64),
                "SPLIT_DKV": 1, "BLOCK_T_DKV": 16, "BLOCK_C_DKV": min(d_v, 32), "num_warps_dkv": 4, "chunk_stages_dkv": 1, "N_CSPLIT": 1,
                "SORT_IDX": int(h_q <= 128), "TOK_GROUP": 3 if h_q <= 128 else 1,
                "ROPE_IN_LOOP": int(h_q <= 128), "IDX_PREFETCH": int(h_q <= 128), **_DKV_GLUON_TILES}  # fmt: skip
    # h_q <= 128: each token's slots sorted by index. Main kernel: 64 heads x 256 slots (64 heads x 128 below
    # 33 heads), 64-channel chunks (the rope one last) four in flight, the next block's indices loaded ahead.
    # Triton dkv kernel (the Gluon one, _DKV_GLUON_TILES, on sm_90): all heads x 64 slots, 4 warps, 112 KB of
    # shared memory (two programs per SM), every channel in one launch, launched as (64 tokens, slot block,
    # token) (the Gluon kernel too, with 128-slot blocks): the programs in flight share a slot block,
    # so with sorted slots their atomics hit a narrow range of rows that stays in L2. The deterministic mode
    # writes a contiguous workspace instead: 128 slots / 8 warps. The fused kernel (h_q > 128): 64-head x
    # 128-slot blocks; deterministic two 64-head halves (N_SUB 2).
    cfg = {"BLOCK_H": block_h, "BLOCK_T": 128, "BLOCK_DV": min(d_v, 64), "BLOCK_D": 128,
           "BLOCK_H_DQ": max(16, next_power_of_2(min(h_q, 128))), "BLOCK_T_DQ": 64,
           "num_warps": 8, "num_warps_dq": 8, "num_stages": 1, "num_stages_dq": 3,
           "chunk_stages": 3, "N_SUB": 1, "BLOCK_DV2": min(d_v, 64),
           "SPLIT_DKV": 1, "BLOCK_T_DKV": 64, "BLOCK_C_DKV": min(d_v, 64), "num_warps_dkv": 4, "chunk_stages_dkv": 2, "N_CSPLIT": 2,
           "SORT_IDX": 0, "TOK_GROUP": 1, "ROPE_IN_LOOP": 0, "IDX_PREFETCH": 0, **_DKV_GLUON_TILES}  # fmt: skip
    if h_q <= 128:  # separate all-heads dkv kernel: the main kernel is the same in both modes
        cfg.update(chunk_stages=4, N_CSPLIT=1, SORT_IDX=1, TOK_GROUP=64, ROPE_IN_LOOP=1, IDX_PREFETCH=1)
        if block_h == 64:
            cfg.update(BLOCK_T=256)
        if deterministic:  # the dkv kernel writes a contiguous workspace
            cfg.update(BLOCK_T_DKV=128, num_warps_dkv=8, chunk_stages_dkv=3)
    elif deterministic:  # the fused kernel (dkv products in the main kernel), h_q > 128
        cfg.update(N_SUB=2, SPLIT_DKV=0)
    else:  # four channel chunks in flight
        cfg.update(chunk_stages=4, SPLIT_DKV=0)
    return cfg


def launch_bwd(
    q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, indices: torch.Tensor,
    lse: torch.Tensor, sm_scale: float, d_v: int, *, q_start_index: int = 0, k_stride: int = 1,
    causal: bool = False, deterministic: bool = False, return_attn_sum: bool = False,
    config: Config = DEFAULT, tiles: dict[str, int] | None = None, slots: dict[Any, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Launch the backward on validated inputs; ``tiles`` overrides :func:`bwd_config` (tests); ``slots``: the
    compiled-kernel slots of the caller's call signature (see :func:`sparse_mla_attn._runtime.launch`);
    ``None``: nothing is cached.

    ``attn_sum`` is ``[s_q, topk]`` when asked for, else an empty ``[0, topk]`` tensor.
    """
    s_q, h_q, d_qk = q.shape
    s_kv = kv.shape[0]
    topk = indices.shape[2]
    dev = q.device
    if tiles is not None:
        slots = None
    # (The cached tile dict is read, never changed.)
    cfg = (
        bwd_config(h_q, topk, d_v, deterministic)
        if tiles is None
        else {**bwd_config(h_q, topk, d_v, deterministic), **tiles}
    )
    block_h, block_h_dq = cfg["BLOCK_H"], cfg["BLOCK_H_DQ"]
    if cfg["N_SUB"] not in (1, 2):
        raise ValueError(f"N_SUB must be 1 or 2, got {cfg['N_SUB']}")
    n_hb = cdiv(h_q, block_h * cfg["N_SUB"])
    n_hb_dq = cdiv(h_q, block_h_dq)
    # The separate dkv kernel holds every head of a token in one tile: up to 128 heads.
    split_dkv = bool(cfg["SPLIT_DKV"]) and h_q <= 128
    block_h_dkv = max(16, next_power_of_2(h_q))
    n_part_hb = 1 if split_dkv else n_hb  # head blocks whose dkv contributions the deterministic mode stores
    n_db = cdiv(d_qk, cfg["BLOCK_D"])
    if cfg["TOK_GROUP"] < 1:
        raise ValueError(f"TOK_GROUP must be >= 1, got {cfg['TOK_GROUP']}")
    # Each token's slots in ascending index order: every per-slot quantity is computed in that order (attn_sum
    # is permuted back at the end), and programs working on the same slot block touch nearby rows.
    perm = None
    if cfg["SORT_IDX"]:
        indices, perm = torch.sort(indices, dim=2, stable=True)

    dkv_gluon = split_dkv and _use_dkv_gluon(cfg, config, q, dout, h_q, d_qk, d_v, topk)
    ctx = launch_context(dev)
    # The Triton dkv kernel's slot blocks and channel groups.
    n_tb = cdiv(topk, cfg["BLOCK_T_DKV"])
    n_chunks = d_v // cfg["BLOCK_C_DKV"] + (1 if d_qk > d_v else 0)
    n_csplit = min(cfg["N_CSPLIT"], n_chunks)
    if (
        split_dkv
        and not dkv_gluon
        and (n_csplit < 1 or (n_csplit - 1) * cdiv(n_chunks, n_csplit) >= n_chunks)
    ):
        raise ValueError(f"N_CSPLIT {n_csplit} leaves a channel group empty ({n_chunks} chunks)")

    def rope_in_loop(chunk: int) -> bool:  # the rope channels as one more chunk of the channel loops
        return bool(cfg["ROPE_IN_LOOP"]) and d_qk > d_v and d_v % chunk == 0 and (d_qk - d_v) % chunk == 0

    delta = torch.empty(s_q, h_q, dtype=torch.float32, device=dev)
    kernel = launch(
        _delta_kernel, (s_q, cdiv(h_q, 16)), slots, "delta",
        (out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), h_q),
        {"D_V": d_v, "BLOCK_H": 16}, ctx,
    )  # fmt: skip
    record_launch("bwd.delta", kernel)
    dq = torch.empty_like(q)
    dkv32 = torch.zeros(s_kv, d_qk, dtype=torch.float32, device=dev)
    ds_dtype = q.dtype
    n_ws = 2 if split_dkv else 1  # dS, and P for the separate dkv kernel
    chunk = max(1, min(s_q, config.bwd_workspace_bytes // (n_ws * h_q * topk * q.element_size())))
    # The deterministic workspace: fp16 scaled by a power of two per group of `group` channels (the width
    # of the dkv kernels' channel chunks, and of the rope chunk) for bf16 inputs, whose final rounding
    # dwarfs fp16's; fp32 otherwise.
    # The fused path (dkv products per head block, above 128 heads) keeps the fp32 workspace.
    if cfg["DET_HALF"] == 1 and deterministic and not split_dkv:
        raise ValueError("DET_HALF 1 needs the separate dkv kernel (SPLIT_DKV 1, at most 128 heads)")
    half = (
        deterministic
        and split_dkv
        and (cfg["DET_HALF"] == 1 or (cfg["DET_HALF"] == -1 and kv.dtype == torch.bfloat16))
    )
    emit = cfg["BLOCK_C_G"] if dkv_gluon else cfg["BLOCK_C_DKV"]
    group = min(emit, d_qk - d_v) if d_qk > d_v else emit
    if half and (d_v % group or d_qk % group):
        raise ValueError(f"dkv channel chunks of {emit} do not tile d_v {d_v} and d_qk {d_qk}")
    pair_bytes = d_qk * 2 + (d_qk // group) * 4 if half else d_qk * 4
    if deterministic:
        chunk = max(
            1, min(chunk, config.bwd_deterministic_workspace_bytes // (n_part_hb * topk * pair_bytes))
        )
        if cfg["DET_OVERLAP"] and dev.type == "cuda":  # DET_CHUNKS chunks of at least 256 tokens: the last
            chunk = min(chunk, max(256, cdiv(s_q, cfg["DET_CHUNKS"])))  # one's reduction overlaps nothing
    ds_ws = torch.empty(min(chunk, s_q), h_q, topk, dtype=ds_dtype, device=dev)
    p_ws = torch.empty_like(ds_ws) if split_dkv else ds_ws  # unused by the fused path
    n_pairs = min(chunk, s_q) * topk
    part = (
        torch.empty(n_part_hb, n_pairs, d_qk, dtype=torch.float16 if half else torch.float32, device=dev)
        if deterministic
        else dkv32  # unused by the atomic path
    )
    # The fp16 workspace's factors 2^-k, one per (head block, pair, channel group).
    scale = torch.empty(n_part_hb, n_pairs, d_qk // group, dtype=torch.float32, device=dev) if half else part
    attn_sum = torch.empty(s_q if return_attn_sum else 0, topk, dtype=torch.float32, device=dev)
    attn_part = (
        torch.empty(n_hb, min(chunk, s_q), topk, dtype=torch.float32, device=dev)
        if return_attn_sum
        else attn_sum
    )
    # With DET_OVERLAP (CUDA) the deterministic reduction of chunk i (and the row sort of its pairs) runs
    # on a side stream while the main and dq kernels of chunk i + 1 run; the kernel that writes `part`
    # next waits for it. The order of every addition stays fixed: only the kernels' overlap changes.
    overlap = deterministic and cfg["DET_OVERLAP"] and dev.type == "cuda"
    side = _side_stream(dev) if overlap else None
    main_stream = torch.cuda.current_stream(dev) if side is not None else None
    reduced: torch.cuda.Event | None = None  # the last reduction on the side stream
    for s0 in range(0, s_q, chunk):
        s1 = min(s_q, s0 + chunk)
        n = s1 - s0
        if n == s_q:  # one chunk: the tensors themselves (the same memory and strides as their slices)
            q_c, do_c, idx_c, lse_c, delta_c, dq_c = q, dout, indices, lse, delta, dq
        else:
            q_c, do_c, idx_c, lse_c = q[s0:s1], dout[s0:s1], indices[s0:s1], lse[s0:s1]
            delta_c, dq_c = delta[s0:s1], dq[s0:s1]
        if side is not None and main_stream is not None:  # the chunk's row segments on the side stream,
            ready = torch.cuda.Event()  # beside its main and dq kernels
            ready.record(main_stream)
            with torch.cuda.stream(side):
                side.wait_event(ready)
                segments = _det_segments(idx_c, s_kv, q_start_index + s0, k_stride, causal)
        if main_stream is not None and reduced is not None and not split_dkv:  # the main kernel writes
            main_stream.wait_event(reduced)  # `part`, which the last reduction reads
        kernel = launch(
            _main_kernel, (n * n_hb,), slots, ("main", s0),  # a chunk's views and positions depend on s0
            (q_c, kv, do_c, lse_c, delta_c, idx_c, ds_ws, p_ws, dkv32, part, attn_part,
             n if return_attn_sum else 0,
             q_c.stride(0), q_c.stride(1), kv.stride(0), do_c.stride(0), do_c.stride(1), lse_c.stride(0),
             idx_c.stride(0), part.stride(0) if deterministic else 0,
             s_kv, h_q, q_start_index + s0, k_stride, float(sm_scale)),
            lambda: dict(topk=topk, CAUSAL=causal, DETERMINISTIC=deterministic, D_QK=d_qk, D_V=d_v, D_ROPE=d_qk - d_v,
                 BLOCK_H=block_h, BLOCK_T=cfg["BLOCK_T"], BLOCK_DV=cfg["BLOCK_DV"], N_HB=n_hb,
                 CHUNK_STAGES=cfg["chunk_stages"], N_SUB=cfg["N_SUB"], BLOCK_DV2=cfg["BLOCK_DV2"],
                 ATTN_SUM=return_attn_sum, SPLIT_DKV=split_dkv, num_warps=cfg["num_warps"],
                 ROPE_IN_LOOP=rope_in_loop(cfg["BLOCK_DV"]), IDX_PREFETCH=bool(cfg["IDX_PREFETCH"]),
                 num_stages=cfg["num_stages"]),
            ctx,
        )  # fmt: skip
        record_launch("bwd.main", kernel)
        _launch_dq(cfg, ds_ws, kv, idx_c, dq_c, s_kv, h_q, q_start_index + s0, k_stride, topk, causal,
                   d_qk, n, n_hb_dq, n_db, slots, s0, ctx)  # fmt: skip
        if main_stream is not None and reduced is not None and split_dkv:  # the dkv kernel writes `part`,
            main_stream.wait_event(reduced)  # which the last reduction reads
        if split_dkv and dkv_gluon:
            kernel = launch_dkv_gluon(
                ds_ws, p_ws, q_c, do_c, idx_c, dkv32, part, scale, n, s_kv, h_q, q_start_index + s0, k_stride,
                topk, causal, deterministic, half, d_qk, d_v, cfg, slots, ("dkv_gluon", s0), ctx,
            )  # fmt: skip
            record_launch("bwd.dkv", kernel, backend="gluon")
        elif split_dkv:
            kernel = launch(
                _dkv_kernel, (n_csplit * n * n_tb,), slots, ("dkv", s0),
                (ds_ws, p_ws, q_c, do_c, idx_c, dkv32, part, scale, n,
                 q_c.stride(0), q_c.stride(1), do_c.stride(0), do_c.stride(1), idx_c.stride(0),
                 s_kv, h_q, q_start_index + s0, k_stride),
                lambda: dict(topk=topk, CAUSAL=causal, DETERMINISTIC=deterministic, HALF=half, G=group,
                     EVICT=bool(cfg["DET_EVICT"]) and deterministic, D_QK=d_qk,
                     D_V=d_v, D_ROPE=d_qk - d_v, BLOCK_H=block_h_dkv, BLOCK_T=cfg["BLOCK_T_DKV"],
                     BLOCK_C=cfg["BLOCK_C_DKV"], N_TB=n_tb,
                     CHUNK_STAGES=cfg["chunk_stages_dkv"], N_CSPLIT=n_csplit, TOK_GROUP=cfg["TOK_GROUP"],
                     ROPE_IN_LOOP=rope_in_loop(cfg["BLOCK_C_DKV"]),
                     num_warps=cfg["num_warps_dkv"], num_stages=1),
                ctx,
            )  # fmt: skip
            record_launch("bwd.dkv", kernel)
        if deterministic and side is not None and main_stream is not None:  # the chunk's reduction on the
            written = torch.cuda.Event()  # side stream, once its contributions are written
            written.record(main_stream)
            with torch.cuda.stream(side):
                side.wait_event(written)
                _det_reduce(cfg, part, scale, half, group, segments, dkv32, n_part_hb, d_qk, slots, s0)
                reduced = torch.cuda.Event()
                reduced.record(side)
        elif deterministic:
            segments = _det_segments(idx_c, s_kv, q_start_index + s0, k_stride, causal)
            _det_reduce(cfg, part, scale, half, group, segments, dkv32, n_part_hb, d_qk, slots, s0)
        if return_attn_sum:  # head blocks added in a fixed order: deterministic
            torch.sum(attn_part[:, :n], dim=0, out=attn_sum[s0:s1])
    if main_stream is not None and reduced is not None:  # join: dkv32 complete, no side-stream work left
        main_stream.wait_event(reduced)
    if return_attn_sum and perm is not None:  # back to the caller's slot order
        attn_sum = torch.empty_like(attn_sum).scatter_(1, perm[:, 0], attn_sum)
    return dq, dkv32.to(kv.dtype).unsqueeze(1), attn_sum


@functools.lru_cache(maxsize=16)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The deterministic reduction's side stream on ``device`` (one per device, made once)."""
    return torch.cuda.Stream(device=device)


def _use_dkv_gluon(
    cfg: dict[str, int], config: Config, q: torch.Tensor, dout: torch.Tensor, h_q: int, d_qk: int, d_v: int,
    topk: int,
) -> bool:  # fmt: skip
    """Whether the all-heads dkv products run in the Gluon kernel (``Config.bwd_dkv_backend``, or the
    ``DKV_GLUON`` tile when a test forces it).

    Raises:
        ValueError: ``bwd_dkv_backend == "gluon"`` (or ``DKV_GLUON`` 1) where the Gluon kernel cannot run.
    """
    backend = {-1: config.bwd_dkv_backend, 0: "triton", 1: "gluon"}[cfg["DKV_GLUON"]]
    if backend == "triton":
        return False
    eligible = dkv_gluon_eligible(h_q, d_qk, d_v, topk, cfg["BLOCK_C_G"]) and not (
        q.stride(1) % 8 or dout.stride(1) % 8
    )
    usable = eligible and gluon_sm90.gluon_usable(q, q, dout)
    if backend == "gluon" and not usable:
        raise ValueError(
            "sparse_mla_bwd: Config(bwd_dkv_backend='gluon') needs an sm_90 GPU, a Triton release in "
            f"{gluon_sm90.GLUON_TRITON_VERSIONS} (installed: {triton.__version__}), at most 128 heads, d_v and d_qk "
            f"multiples of 64, topk a multiple of 8 and 16-byte aligned q / dout rows (got h_q {h_q}, d_qk "
            f"{d_qk}, d_v {d_v}, topk {topk})"
        )
    return usable


def _launch_dq(
    cfg: dict[str, int], ds_ws: torch.Tensor, kv: torch.Tensor, idx_c: torch.Tensor, dq_c: torch.Tensor,
    s_kv: int, h_q: int, q_start_index: int, k_stride: int, topk: int, causal: bool, d_qk: int, n: int,
    n_hb_dq: int, n_db: int, slots: dict[Any, Any] | None, s0: int, ctx: LaunchContext | None = None,
) -> None:  # fmt: skip
    """``dq = dS @ rows`` for the chunk of tokens starting at ``s0``, on the current stream (``ctx``: its
    :func:`~sparse_mla_attn._runtime.launch_context`, if known)."""
    kernel = launch(
        _dq_kernel, (n * n_hb_dq * n_db,), slots, ("dq", s0),
        (ds_ws, kv, idx_c, dq_c, kv.stride(0), idx_c.stride(0), dq_c.stride(0), dq_c.stride(1),
         s_kv, h_q, q_start_index, k_stride),
        lambda: dict(topk=topk, CAUSAL=causal, D_QK=d_qk, BLOCK_H=cfg["BLOCK_H_DQ"], BLOCK_T=cfg["BLOCK_T_DQ"],
             BLOCK_D=cfg["BLOCK_D"], N_HB=n_hb_dq, N_DB=n_db,
             num_warps=cfg["num_warps_dq"], num_stages=cfg["num_stages_dq"]),
        ctx,
    )  # fmt: skip
    record_launch("bwd.dq", kernel)


def _det_segments(
    idx_c: torch.Tensor, s_kv: int, q_start_index: int, k_stride: int, causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The chunk's (token, slot) pairs grouped by KV row in a fixed order: ``order`` (pair numbers sorted by
    (row, token, slot)) and each row's segment ``[seg_start, seg_end)`` of it. No host synchronisation:
    invalid pairs sort last (key ``s_kv``) and each row finds its segment by binary search."""
    valid = valid_slots(idx_c[:, 0], s_kv, q_start_index, k_stride, causal).reshape(-1)
    keys = torch.where(valid, idx_c[:, 0].reshape(-1), s_kv)  # int32
    # Stable sort by row keeps (token, slot) order inside a row: the reduction order is fixed.
    keys, order = torch.sort(keys, stable=True)
    rows = torch.arange(s_kv, dtype=keys.dtype, device=keys.device)
    return order, torch.searchsorted(keys, rows), torch.searchsorted(keys, rows, right=True)


def _det_reduce(
    cfg: dict[str, int], part: torch.Tensor, scale: torch.Tensor, half: bool, group: int,
    segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor], dkv32: torch.Tensor, n_hb: int, d_qk: int,
    slots: dict[Any, Any] | None, s0: int,
) -> None:  # fmt: skip
    """Add this chunk's per-(token, slot) contributions into ``dkv32``, each row's in the order of
    ``segments`` (:func:`_det_segments`)."""
    order, seg_start, seg_end = segments
    n_groups = d_qk // group
    groups = min(cfg["GROUPS_RED"], next_power_of_2(n_groups))
    kernel = launch(
        _det_reduce_kernel, (dkv32.shape[0], cdiv(n_groups, groups)), slots, ("det_reduce", s0),
        (part, scale, order, seg_start, seg_end, dkv32, part.stride(0), scale.stride(0) if half else 0),
        dict(D_QK=d_qk, G=group, GROUPS=groups, N_HB=n_hb, HALF=half, EVICT=bool(cfg["DET_EVICT"]),
             UNROLL=2 if interpreting() else cfg["UNROLL_RED"], num_warps=cfg["num_warps_red"]),
    )  # fmt: skip
    record_launch("bwd.det_reduce", kernel)


def _bwd_fake(
    q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, indices: torch.Tensor,
    lse: torch.Tensor, sm_scale: float, d_v: int, q_start_index: int, k_stride: int, causal: bool,
    deterministic: bool, return_attn_sum: bool, *_: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    check_bwd_inputs(q, kv, out, dout, indices, lse, d_v, q_start_index, k_stride)
    n_attn = q.shape[0] if return_attn_sum else 0
    return (
        torch.empty_like(q),
        kv.new_empty(kv.shape),
        q.new_empty((n_attn, indices.shape[2]), dtype=torch.float32),
    )


def _check_bwd(
    q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, indices: torch.Tensor,
    lse: torch.Tensor, d_v: int, q_start_index: int, k_stride: int,
) -> dict[Any, Any]:  # fmt: skip
    """Validate; return the (empty) compiled-kernel slots of this call signature."""
    check_bwd_inputs(q, kv, out, dout, indices, lse, d_v, q_start_index, k_stride)
    check_kernel_device(q, "sparse_mla_bwd")
    return {}


_SLOTS: dict[Any, dict[Any, Any]] = {}


@define_op("sparse_mla_bwd", _bwd_fake)
def _bwd_op(
    q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, indices: torch.Tensor,
    lse: torch.Tensor, sm_scale: float, d_v: int, q_start_index: int, k_stride: int, causal: bool,
    deterministic: bool, return_attn_sum: bool, workspace_bytes: int, deterministic_workspace_bytes: int,
    dkv_backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    # Validation and every launch's specialisation depend only on the call signature: checked once per signature.
    key = (*call_signature(q, kv, out, dout, indices, lse), d_v, q_start_index, k_stride, causal, deterministic,
           return_attn_sum, workspace_bytes, deterministic_workspace_bytes, dkv_backend)  # fmt: skip
    slots = cached(
        _SLOTS, key, lambda: _check_bwd(q, kv, out, dout, indices, lse, d_v, q_start_index, k_stride)
    )
    config = config_of(
        DEFAULT.backend, DEFAULT.num_splits, DEFAULT.split_merge, workspace_bytes, deterministic_workspace_bytes,
        DEFAULT.split_fill, dkv_backend,
    )  # fmt: skip
    return launch_bwd(
        q, kv, out, dout, indices, lse, check_sm_scale(sm_scale), d_v, q_start_index=q_start_index,
        k_stride=k_stride, causal=causal, deterministic=deterministic, return_attn_sum=return_attn_sum,
        config=config, slots=slots,
    )  # fmt: skip


def sparse_mla_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    *,
    q_start_index: int = 0,
    k_stride: int = 1,
    causal: bool = False,
    deterministic: bool = False,
    return_attn_sum: bool = False,
    config: Config | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward of sparse MLA attention (DeepSeek sparse attention over top-k KV rows).

    Args:
        q: ``[s_q, h_q, d_qk]`` bf16 (fp16 and fp32 accepted), ``d_qk`` = 576 (512 latent + 64 rope) or 512.
        kv: ``[s_kv, 1, d_qk]``, same dtype; the first ``d_v`` channels are the values.
        out: ``[s_q, h_q, d_v]`` forward output.
        dout: ``[s_q, h_q, d_v]`` gradient of the loss with respect to ``out``.
        indices: ``[s_q, 1, topk]`` int32, global KV row indices; an index ``< 0`` or ``>= s_kv`` is
            invalid (contributes nothing and is never read). Batches are flattened into tokens.
        lse: ``[s_q, h_q]`` fp32 forward log-sum-exp in natural log (-inf for a query with no usable slot).
        sm_scale: the softmax scale that the forward applied to ``q · k``.
        d_v: value head dim (a power of two; 512 for DeepSeek-V3.2).
        q_start_index: position of query 0, for the causal limit.
        k_stride: KV compression stride, for the causal limit.
        causal: also treat slot ``t`` as invalid when ``index > (q_pos + 1 - k_stride) / k_stride``
            (C integer division), ``q_pos = q_start_index + s``, as FlashMLA's attn_dist does.
        deterministic: sum the ``dkv`` contributions in a fixed order (bit-identical from run to run,
            whatever order the GPU runs its programs in) instead of with fp32 atomics. Each (token, slot)
            contribution ``c`` goes to a workspace (``Config.bwd_deterministic_workspace_bytes``) and each
            KV row's are summed in fp32. For bf16 inputs up to 128 heads the workspace is fp16 with a
            power-of-two factor per 64 channels (per channel chunk): every element of ``dkv`` (before its
            bf16 rounding) is within ``2^-11 * Σ|c|`` of the fp32 workspace's sum (plus fp32 summation
            error), an eighth of bf16's rounding bound; otherwise the workspace is fp32.
        return_attn_sum: also return ``attn_sum [s_q, topk]`` fp32, the attention probability summed over
            heads at each slot (``Σ_h P[h, t]``, 0 at invalid slots): the lightning indexer's KL target, the
            same quantity as ``attn_dist(..., causal=causal)``, taken from the ``P`` the backward recomputes
            anyway (deterministic).
        config: tuning options (:class:`~sparse_mla_attn.Config`; the ``bwd_*`` fields apply).

    Returns:
        ``dq [s_q, h_q, d_qk]`` in q's dtype and ``dkv [s_kv, 1, d_qk]`` in kv's dtype (and ``attn_sum`` if
        asked). ``dkv`` sums the contributions of every (query, slot) that selected a row, accumulated in
        fp32; rows nobody selected get 0.

    Raises:
        ValueError, TypeError: on a wrong shape, dtype, device or layout (the message names the argument).
    """
    T = torch.Tensor
    if not (type(q) is T and type(kv) is T and type(out) is T and type(dout) is T and type(indices) is T
            and type(lse) is T and type(d_v) is int and type(q_start_index) is int and type(k_stride) is int):  # fmt: skip
        check_arg_types({"q": q, "kv": kv, "out": out, "dout": dout, "indices": indices, "lse": lse},
                        {"d_v": d_v, "q_start_index": q_start_index, "k_stride": k_stride})  # fmt: skip
    check_sm_scale(sm_scale)
    cfg = config or DEFAULT
    dq, dkv, attn_sum = _bwd_op(
        q, kv, out, dout, indices, lse, sm_scale, d_v, q_start_index, k_stride, causal, deterministic,
        return_attn_sum, cfg.bwd_workspace_bytes, cfg.bwd_deterministic_workspace_bytes, cfg.bwd_dkv_backend,
    )  # fmt: skip
    return (dq, dkv, attn_sum) if return_attn_sum else (dq, dkv)
