"""Masked split-KV flash decoding: Triton kernels, launcher, torch custom op and the public function.

One program handles one (split, KV head, sequence): all ``G = Hq / Hkv`` query heads of the KV head sit in
one ``[BLOCK_G, D]`` tile, so every K/V row read from memory serves the whole group. Each split covers a
fixed ``chunk`` of positions; the grid depends only on shapes, and the run-time ``seqlens`` only decide
which programs find work, so a captured CUDA graph replays correctly when lengths change.

Two inner loops share the per-tile attention step:

* dense: walks the chunk ``BLOCK_N`` positions at a time; the K/V loads are predicated on the mask, so
  excluded rows (and so whole excluded tiles) are never read from memory;
* sparse: one pass over the chunk's mask writes the indices of its visible positions, in order, to a
  scratch list; the loop then walks that list, gathering ``BLOCK_NS`` visible rows per tile (the next
  tile's indices are fetched one iteration ahead, so its K/V rows stream while the current tile is
  computed), so its work scales with the visible rows.

With ``path="auto"`` and a mask, the same pass counts the visible positions, and each split takes the
sparse loop when their fraction is at most ``sparse_threshold``: the choice is made on the device, per
split. With several splits, each program writes its partial result to a workspace and takes a ticket from
a per-(sequence, KV head) counter; the last one to finish merges the partials with the log-sum-exp rule
and resets the counter, so one launch does the whole call. While a CUDA graph is being captured (and on
a signature's first eager call on a GPU, which compiles that path before any capture) the split kernel
only writes the partials and a merge kernel, one program per query head and head-dim slice, launched
with programmatic dependent launch on Hopper, merges them: a replay pays no launch cost, and the merge is
spread over many SMs instead of running serially in the last split. When every split takes the sparse loop
(threshold 1, the default, or ``path="sparse"``) the split kernel is compiled without the dense loop;
otherwise, on a GPU, the dense tile is autotuned per shape class on first use. The launch knobs and their
tuned defaults are in :mod:`triton_masked_decode.config`.

FP8 caches (``float8_e4m3fn`` K/V) are read at one byte per value and converted exactly to q's dtype in
registers; the per-tensor K scale multiplies the scores, the V scale the output, and optional
per-(position, KV head) scales each row's score or probability.

Eager calls cache, per signature of shapes, strides, dtypes, alignments and devices, the validation, the
launch plan and the compiled kernel's launcher: after the first call a call allocates its outputs and
launches the compiled kernel directly, without Triton's argument binding.
"""

from __future__ import annotations

import functools
import math
import time
from typing import List, NamedTuple, NoReturn  # noqa: UP035 (the custom op schema of _launch, torch < 2.7)

import torch
import triton
import triton.language as tl
from triton import knobs as _triton_knobs

from triton_masked_decode._utils import (
    ENABLE_FP_FUSION,
    capability,
    device_name,
    install_interpreter_fix,
    interpreting,
    num_sms,
)
from triton_masked_decode.config import MaskedDecodeConfig, tuned_defaults

install_interpreter_fix()

__all__ = ["check_errors", "choose_num_splits", "masked_decode"]

_LOG2E = 1.4426950408889634
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
_PATH_CODES = {"auto": 0, "dense": 1, "sparse": 2}
_MASK_NONE, _MASK_BOOL, _MASK_PACKED = 0, 1, 2
# Bits of the error word the split kernel sets (see check_errors).
_ERR_PAGE: tl.constexpr = tl.constexpr(1)  # a used block-table entry outside [0, num_pages)
_ERR_SEQLEN: tl.constexpr = tl.constexpr(2)  # a seqlens value outside [0, L]
_MAX_GROUP = 64
_MAX_SPLITS = 256
_MAX_CHUNK = 4096  # bounds per-program work so ragged batches balance across SMs
_MAX_BLOCK_C = 2048  # mask positions compacted per step (one step per chunk up to this length)
# A launch is "one wave" when it has at most this many times programs_per_sm programs per SM.
_ONE_WAVE_SLACK = 1.25
_DEFAULT_CONFIG = MaskedDecodeConfig()


# --------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _excluded(mask_base, pos, inb, stride_ml, MASK_MODE: tl.constexpr):
    """True where position ``pos`` is excluded (out-of-bounds lanes read as excluded)."""
    if MASK_MODE == 1:
        m = tl.load(mask_base + pos * stride_ml, mask=inb, other=1)
        ex = m != 0
    else:
        byte = tl.load(mask_base + (pos >> 3) * stride_ml, mask=inb, other=255)
        ex = ((byte.to(tl.int32) >> (pos & 7)) & 1) != 0
    return ex


@triton.jit
def _attend_rows(
    acc,
    l_i,
    m_i,
    q,
    pos,
    vis,
    k_base,
    v_base,
    bt_base,
    num_pages,
    stride_kn,
    stride_kp,
    stride_vn,
    stride_vp,
    ks_base,
    vs_base,
    stride_ksn,
    stride_ksp,
    stride_vsn,
    stride_vsp,
    qk_scale,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOK_SCALE: tl.constexpr,
):
    """Online-softmax update with the K/V rows at positions ``pos``; rows are loaded only where ``vis``.

    Paged: a row whose block-table entry is outside ``[0, num_pages)`` is treated as excluded, so an
    out-of-range page id is never dereferenced (:func:`_flag_bad_pages` reports it). K/V rows of another
    dtype than ``q`` (FP8) are converted exactly to it; with ``TOK_SCALE`` each row's dequantization scale
    multiplies its score (K) or its probability (V).
    """
    if PAGED:
        page = tl.load(bt_base + pos // PAGE_SIZE, mask=vis, other=0)
        vis = vis & (page >= 0) & (page < num_pages)
        page = page.to(tl.int64)
        row = (pos % PAGE_SIZE).to(tl.int64)
        k_off = page * stride_kp + row * stride_kn
        v_off = page * stride_vp + row * stride_vn
        ks_off = page * stride_ksp + row * stride_ksn
        vs_off = page * stride_vsp + row * stride_vsn
    else:
        k_off = pos.to(tl.int64) * stride_kn
        v_off = pos.to(tl.int64) * stride_vn
        ks_off = pos.to(tl.int64) * stride_ksn
        vs_off = pos.to(tl.int64) * stride_vsn
    if BLOCK_D == HEAD_DIM:
        ld_mask = vis[:, None]
    else:
        ld_mask = vis[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_base + k_off[:, None] + offs_d[None, :], mask=ld_mask, other=0.0).to(q.dtype)
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    if TOK_SCALE:
        qk = qk * tl.load(ks_base + ks_off, mask=vis, other=0.0)[None, :]
    qk = tl.where(vis[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # keeps -inf - -inf out of exp2
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(qk - m_use[:, None])
    v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=ld_mask, other=0.0).to(q.dtype)
    if TOK_SCALE:
        pv = p * tl.load(vs_base + vs_off, mask=vis, other=0.0)[None, :]
    else:
        pv = p
    acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


@triton.jit
def _dense_loop(
    acc,
    l_i,
    m_i,
    q,
    lo,
    hi,
    k_base,
    v_base,
    bt_base,
    num_pages,
    mask_base,
    stride_kn,
    stride_kp,
    stride_vn,
    stride_vp,
    stride_ml,
    ks_base,
    vs_base,
    stride_ksn,
    stride_ksp,
    stride_vsn,
    stride_vsp,
    qk_scale,
    offs_d,
    MASK_MODE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOK_SCALE: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    # The K/V loads of a tile are predicated on its mask bits: fetch the bits one tile ahead so that
    # their latency overlaps the current tile instead of preceding every K/V load.
    pos0 = lo + offs_n
    ex_next = pos0 >= hi
    if MASK_MODE != 0:
        ex_next = _excluded(mask_base, pos0, pos0 < hi, stride_ml, MASK_MODE)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        inb = pos < hi
        vis = inb
        if MASK_MODE != 0:
            vis = inb & (ex_next == 0)
            nxt = pos + BLOCK_N
            ex_next = _excluded(mask_base, nxt, nxt < hi, stride_ml, MASK_MODE)
        acc, l_i, m_i = _attend_rows(
            acc, l_i, m_i, q, pos, vis, k_base, v_base, bt_base, num_pages,
            stride_kn, stride_kp, stride_vn, stride_vp,
            ks_base, vs_base, stride_ksn, stride_ksp, stride_vsn, stride_vsp, qk_scale, offs_d,
            HEAD_DIM, BLOCK_D, PAGED, PAGE_SIZE, TOK_SCALE,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _compact_visible(lo, hi, mask_base, idx_base, stride_ml, MASK_MODE: tl.constexpr, BLOCK_C: tl.constexpr):
    """Write the visible positions of ``[lo, hi)`` in order to ``idx_base``; returns how many there are.

    One pass over the mask serves both the density decision of ``path="auto"`` and the sparse loop's list.
    """
    offs_c = tl.arange(0, BLOCK_C)
    n = lo * 0
    for start in range(lo, hi, BLOCK_C):
        pos = start + offs_c
        inb = pos < hi
        vis = (inb & (_excluded(mask_base, pos, inb, stride_ml, MASK_MODE) == 0)).to(tl.int32)
        csum = tl.cumsum(vis, 0)
        tl.store(idx_base + n + csum - 1, pos, mask=vis != 0)
        n += tl.sum(vis, 0)
    return n


@triton.jit
def _sparse_loop(
    acc,
    l_i,
    m_i,
    q,
    n_vis,
    k_base,
    v_base,
    bt_base,
    num_pages,
    idx_base,
    stride_kn,
    stride_kp,
    stride_vn,
    stride_vp,
    ks_base,
    vs_base,
    stride_ksn,
    stride_ksp,
    stride_vsn,
    stride_vsp,
    qk_scale,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_NS: tl.constexpr,
    SPARSE_STAGES: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOK_SCALE: tl.constexpr,
):
    """Walk the compacted list of ``n_vis`` visible positions, gathering ``BLOCK_NS`` K/V rows per tile."""
    tl.debug_barrier()  # the list was written by other threads of this program
    offs_n = tl.arange(0, BLOCK_NS)
    pos_next = tl.load(idx_base + offs_n, mask=offs_n < n_vis, other=0)
    for start in tl.range(0, n_vis, BLOCK_NS, num_stages=SPARSE_STAGES):
        j = start + offs_n
        valid = j < n_vis
        pos = pos_next
        j_next = j + BLOCK_NS
        pos_next = tl.load(idx_base + j_next, mask=j_next < n_vis, other=0)
        acc, l_i, m_i = _attend_rows(
            acc, l_i, m_i, q, pos, valid, k_base, v_base, bt_base, num_pages,
            stride_kn, stride_kp, stride_vn, stride_vp,
            ks_base, vs_base, stride_ksn, stride_ksp, stride_vsn, stride_vsp, qk_scale, offs_d,
            HEAD_DIM, BLOCK_D, PAGED, PAGE_SIZE, TOK_SCALE,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _flag_bad_pages(bt_base, lo, hi, num_pages, err_ptr, PAGE_SIZE: tl.constexpr):
    """Set bit 1 of the error word when a block-table entry used by positions ``[lo, hi)`` is outside
    ``[0, num_pages)`` (the rows behind it are treated as excluded)."""
    offs = tl.arange(0, 128)
    first, end = lo // PAGE_SIZE, (hi + PAGE_SIZE - 1) // PAGE_SIZE
    n_bad = lo * 0
    for p0 in range(first, end, 128):
        slot = p0 + offs
        used = slot < end
        page = tl.load(bt_base + slot, mask=used, other=0)
        n_bad += tl.sum((used & ((page < 0) | (page >= num_pages))).to(tl.int32), 0)
    if n_bad > 0:
        tl.atomic_or(err_ptr, _ERR_PAGE)


@triton.jit
def _empty_or_nan(total):
    """The LSE of a row whose softmax weight ``total`` is not positive: -inf when 0 (no visible key), NaN
    when NaN (a NaN or +inf score or LSE), so that a poisoned row never reads as empty."""
    return tl.where(total == 0.0, float("-inf"), float("nan"))


@triton.jit
def _normalize(acc, l_i, m_log2):
    """(acc / l, natural-log LSE) of an online-softmax state; rows with no weight give (0, -inf), rows
    whose weight is NaN (a NaN or +inf score) give (NaN, NaN)."""
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_log2 + tl.math.log2(tl.where(seen, l_i, 1.0))) * _LN2, _empty_or_nan(l_i))
    return out, lse


@triton.jit
def _masked_decode_split_kernel(
    Q,
    K,
    V,
    Mask,
    Seqlens,
    BlockTable,
    Idx,
    Out,
    Lse,
    OutPart,
    LsePart,
    Counter,
    Err,
    KScale,
    VScale,
    KTokScale,
    VTokScale,
    seqlen_const,
    max_len,
    num_pages,
    chunk,
    qk_scale,
    k_scale,
    v_scale,
    sparse_threshold,
    size_class,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_mb,
    stride_mh,
    stride_ml,
    stride_btb,
    stride_ksb,
    stride_ksh,
    stride_ksn,
    stride_vsb,
    stride_vsh,
    stride_vsn,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_NS: tl.constexpr,
    SPARSE_STAGES: tl.constexpr,
    BLOCK_C: tl.constexpr,
    MASK_MODE: tl.constexpr,
    HAS_SEQLENS: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    COMPACT: tl.constexpr,
    SPARSE_ONLY: tl.constexpr,
    UPCAST: tl.constexpr,
    SCALE_T: tl.constexpr,
    TOK_SCALE: tl.constexpr,
    MERGE: tl.constexpr,
    G_P2: tl.constexpr,
    MERGE_S: tl.constexpr,
    SEPARATE_MERGE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        # Let the merge kernel's programs be scheduled as soon as every split program has started; they
        # wait (griddepcontrol.wait) for this grid to finish before reading the partials.
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0)
    head = tl.program_id(1)
    bidx = tl.program_id(2)
    num_heads = tl.num_programs(1)
    num_splits = tl.num_programs(0)
    if HAS_SEQLENS:
        # Out-of-range lengths are clamped to [0, L] and reported in bit 2 of the error word.
        seqlen_raw = tl.load(Seqlens + bidx)
        if ((seqlen_raw < 0) | (seqlen_raw > max_len)) & (split == 0) & (head == 0):
            tl.atomic_or(Err, _ERR_SEQLEN)
        seqlen = tl.minimum(tl.maximum(seqlen_raw, 0), max_len)
    else:
        seqlen = seqlen_const
    lo = split * chunk
    # Split 0 always writes (a zero-length row still needs out = 0, lse = -inf); the others only with work.
    if (lo < seqlen) | (split == 0):
        hi = tl.minimum(lo + chunk, seqlen)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_mask = offs_g < G
        d_mask = offs_d < HEAD_DIM
        qh = head * G + offs_g
        q = tl.load(
            Q + bidx.to(tl.int64) * stride_qb + qh[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        # Per-tensor dequantization scales (1 for fp16/bf16 caches): K's scales the scores, V's the output.
        k_mul = k_scale
        v_mul = v_scale
        if SCALE_T:
            k_mul = k_mul * tl.load(KScale).to(tl.float32)
            v_mul = v_mul * tl.load(VScale).to(tl.float32)
        if PAGED:
            k_base = K + head.to(tl.int64) * stride_kh
            v_base = V + head.to(tl.int64) * stride_vh
            ks_base = KTokScale + head.to(tl.int64) * stride_ksh
            vs_base = VTokScale + head.to(tl.int64) * stride_vsh
            bt_base = BlockTable + bidx.to(tl.int64) * stride_btb
        else:
            k_base = K + bidx.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh
            v_base = V + bidx.to(tl.int64) * stride_vb + head.to(tl.int64) * stride_vh
            ks_base = KTokScale + bidx.to(tl.int64) * stride_ksb + head.to(tl.int64) * stride_ksh
            vs_base = VTokScale + bidx.to(tl.int64) * stride_vsb + head.to(tl.int64) * stride_vsh
            bt_base = BlockTable
        mask_base = Mask + bidx.to(tl.int64) * stride_mb + head.to(tl.int64) * stride_mh
        if PAGED:
            _flag_bad_pages(bt_base, lo, hi, num_pages, Err, PAGE_SIZE)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        if COMPACT:
            # path auto / sparse (the launcher passes a threshold above 1 for "sparse"): compact the
            # chunk's visible positions, then gather them if they are few enough, else walk the chunk.
            idx_base = Idx + ((bidx.to(tl.int64) * num_heads + head) * num_splits + split) * chunk
            n_vis = _compact_visible(lo, hi, mask_base, idx_base, stride_ml, MASK_MODE, BLOCK_C)
            if SPARSE_ONLY:
                # Every split takes the sparse loop (sparse_threshold >= 1): a compile-time True, so the
                # dense loop is not compiled and its tile (shared memory, registers) cannot limit how many
                # programs share an SM.
                go_sparse = True
            else:
                go_sparse = n_vis.to(tl.float32) <= sparse_threshold * (hi - lo).to(tl.float32)
        else:
            idx_base = Idx
            n_vis = lo * 0
            go_sparse = False
        if go_sparse:
            acc, l_i, m_i = _sparse_loop(
                acc, l_i, m_i, q, n_vis, k_base, v_base, bt_base, num_pages, idx_base,
                stride_kn, stride_kb, stride_vn, stride_vb,
                ks_base, vs_base, stride_ksn, stride_ksb, stride_vsn, stride_vsb, qk_scale * k_mul, offs_d,
                HEAD_DIM, BLOCK_D, BLOCK_NS, SPARSE_STAGES, PAGED, PAGE_SIZE, TOK_SCALE,
            )  # fmt: skip
        else:
            acc, l_i, m_i = _dense_loop(
                acc, l_i, m_i, q, lo, hi, k_base, v_base, bt_base, num_pages, mask_base,
                stride_kn, stride_kb, stride_vn, stride_vb, stride_ml,
                ks_base, vs_base, stride_ksn, stride_ksb, stride_vsn, stride_vsb, qk_scale * k_mul, offs_d,
                MASK_MODE, HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, PAGE_SIZE, TOK_SCALE,
            )  # fmt: skip

        out, lse = _normalize(acc, l_i, m_i)  # m_i is in log2 units (q·k was scaled by log2 e)
        out = out * v_mul
        # Rows of contiguous [B, Hq, D] outputs, or of [B, Hq, S, D] partials with several splits.
        row = bidx.to(tl.int64) * (num_heads * G) + qh
        gd_mask = g_mask[:, None] & d_mask[None, :]
        if MERGE:
            prow = row * num_splits + split
            tl.store(OutPart + prow[:, None] * HEAD_DIM + offs_d[None, :], out, mask=gd_mask)
            tl.store(LsePart + prow, lse, mask=g_mask)
            if not SEPARATE_MERGE:  # else the merge kernel, launched after this grid, merges them
                # The last split of this (sequence, KV head) to finish merges the partials: every thread's
                # stores precede the counter's release, and the acquire by the last one orders its reads.
                tl.debug_barrier()
                slot = Counter + bidx * num_heads + head
                ticket = tl.atomic_add(slot, 1, sem="acq_rel")
                # Splits at or past the sequence end wrote nothing; split 0 always wrote.
                n_active = tl.minimum(tl.maximum((seqlen + chunk - 1) // chunk, 1), num_splits)
                if ticket == n_active - 1:
                    tl.atomic_xchg(slot, 0)  # ready for the next launch (and the next graph replay)
                    _merge_partials(
                        OutPart, LsePart, Out, Lse, bidx.to(tl.int64) * (num_heads * G) + head * G, n_active,
                        num_splits, G, G_P2, MERGE_S, HEAD_DIM, BLOCK_D,
                    )  # fmt: skip
        else:
            tl.store(
                Out + row[:, None] * HEAD_DIM + offs_d[None, :], out.to(Out.dtype.element_ty), mask=gd_mask
            )
            tl.store(Lse + row, lse, mask=g_mask)


@triton.jit
def _merge_partials(
    OutPart,
    LsePart,
    Out,
    Lse,
    row0,
    n_active,
    num_splits,
    G: tl.constexpr,
    G_P2: tl.constexpr,
    MERGE_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Log-sum-exp merge of the ``n_active`` partial results of query-head rows ``row0 .. row0 + G - 1``,
    ``MERGE_S`` splits of every head per step, with online rescaling (each partial is read once)."""
    offs_g = tl.arange(0, G_P2)
    offs_s = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < HEAD_DIM
    rows = row0 + offs_g
    m = tl.full([G_P2], float("-inf"), dtype=tl.float32)
    tot = tl.zeros([G_P2], dtype=tl.float32)
    acc = tl.zeros([G_P2, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_active, MERGE_S):
        s = s0 + offs_s
        gs_mask = g_mask[:, None] & (s < n_active)[None, :]
        prow = rows[:, None] * num_splits + s[None, :]
        # .cg: read from L2, where the other programs' partials are (never a stale L1 line)
        lse_s = tl.load(LsePart + prow, mask=gs_mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(
            OutPart + prow[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=gs_mask[:, :, None] & d_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, tl.max(lse_s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lse_s - m_use[:, None])  # 0 for empty splits (lse = -inf; their out was written as 0)
        alpha = tl.exp(m - m_use)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        tot = tot * alpha + tl.sum(w, 1)
        m = m_new
    seen = tot > 0.0
    m_fin = tl.where(m == float("-inf"), 0.0, m)
    out = acc / tl.where(seen, tot, 1.0)[:, None]
    lse = tl.where(seen, m_fin + tl.log(tl.where(seen, tot, 1.0)), _empty_or_nan(tot))
    tl.store(
        Out + rows[:, None] * HEAD_DIM + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )
    tl.store(Lse + rows, lse, mask=g_mask)


# Autotuned launch of the split kernel (GPU only): tile length, warps and pipelining depth are timed on the
# first call of each (group, head dim, mask layout, path, paging, size class) and cached. The chunk length is
# a multiple of 128 positions, so every BLOCK_N divides it and the grid does not depend on the choice.
_AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=nw, num_stages=ns)
    for bn, nw, ns in (
        (128, 4, 3), (128, 4, 2), (128, 8, 3),
        (64, 4, 3), (64, 4, 2), (64, 8, 3),
        (32, 4, 3), (32, 4, 2), (32, 8, 3),
    )
]  # fmt: skip
_CANDIDATES = {  # (BLOCK_N, num_warps, num_stages) worth timing per head-dim tile; the first is the default
    16: [(128, 4, 3), (128, 4, 2), (64, 4, 3)],
    32: [(128, 4, 3), (128, 4, 2), (64, 4, 3)],
    64: [(128, 4, 3), (128, 4, 2), (64, 4, 3), (128, 8, 3)],
    128: [(64, 4, 3), (64, 4, 2), (128, 8, 3), (32, 4, 3)],
    256: [(32, 4, 3), (32, 4, 2), (64, 8, 3), (32, 8, 3)],
}


def _bench_config(kernel_call, quantiles):
    import triton.testing

    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def _prune_configs(configs, named_args, **kwargs):
    want = _CANDIDATES[kwargs["BLOCK_D"]]
    if kwargs["BLOCK_G"] * kwargs["BLOCK_D"] >= 8192:  # large accumulators: 8 warps only
        want = [(bn, 8, ns) for bn, _, ns in want]
    keep = [c for c in configs if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in want]
    return keep or [configs[0]]


@functools.cache
def _split_kernel_tuned() -> triton.runtime.Autotuner:
    """The autotuned split kernel, built on first use (an autotuner queries the GPU driver when built)."""
    return triton.autotune(
        configs=_AUTOTUNE_CONFIGS,
        key=["G", "HEAD_DIM", "MASK_MODE", "COMPACT", "PAGED", "PAGE_SIZE", "size_class"],
        prune_configs_by={"early_config_prune": _prune_configs},
        do_bench=lambda kernel_call, quantiles: _bench_config(kernel_call, quantiles),
    )(_masked_decode_split_kernel)


# Merge kernel of the two-launch path (CUDA graph capture): one program per (query head, sequence,
# head-dim slice) merges that head's partial results, so the merge runs on many SMs at once.
@triton.jit
def _merge_splits_kernel(
    OutPart,
    LsePart,
    Out,
    Lse,
    Seqlens,
    seqlen_const,
    max_len,
    chunk,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_sb,
    stride_sh,
    stride_ss,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SEQLENS: tl.constexpr,
    PDL: tl.constexpr,
):
    head = tl.program_id(0)
    bidx = tl.program_id(1)
    d_blk = tl.program_id(2)  # head-dim slice: BLOCK_D may cover only part of HEAD_DIM
    if HAS_SEQLENS:
        seqlen = tl.minimum(tl.maximum(tl.load(Seqlens + bidx), 0), max_len)
    else:
        seqlen = seqlen_const
    if PDL:
        tl.extra.cuda.gdc_wait()  # launched early (programmatic dependent launch): wait for the partials
    # Splits at or past the sequence end wrote nothing; split 0 always wrote.
    n_active = tl.minimum(tl.maximum((seqlen + chunk - 1) // chunk, 1), num_splits)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = d_blk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse_base = LsePart + bidx.to(tl.int64) * stride_sb + head * stride_sh
    o_base = OutPart + bidx.to(tl.int64) * stride_pb + head * stride_ph
    # One pass with online rescaling: each block of splits is read once (all of them when S <= BLOCK_S).
    m = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), 0)
    tot = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_active, BLOCK_S):
        s = s0 + offs_s
        s_mask = s < n_active
        lse_s = tl.load(lse_base + s * stride_ss, mask=s_mask, other=float("-inf"))
        o = tl.load(
            o_base + s[:, None] * stride_ps + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lse_s - m_use)  # 0 for empty splits (lse = -inf; their out was written as 0)
        alpha = tl.exp(m - m_use)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        tot = tot * alpha + tl.sum(w, 0)
        m = m_new
    seen = tot > 0.0
    m_fin = tl.where(m == float("-inf"), 0.0, m)
    out = acc / tl.where(seen, tot, 1.0)
    lse = tl.where(seen, m_fin + tl.log(tl.where(seen, tot, 1.0)), _empty_or_nan(tot))
    tl.store(
        Out + bidx.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=d_mask,
    )
    if d_blk == 0:
        tl.store(Lse + bidx.to(tl.int64) * stride_lb + head * stride_lh, lse)


# --------------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------------


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_len: int,
    block_n: int,
    num_sms: int,
    num_splits: int | None = None,
    *,
    max_chunk: int = _MAX_CHUNK,
    programs_per_sm: int = 4,
) -> tuple[int, int]:
    """Split count and chunk length (positions per split) for a launch; depends on shapes only.

    Aims at ``programs_per_sm`` programs per SM and at most ``max_chunk`` positions per program, so batch
    1 fills the GPU through splits and a ragged large batch balances through many short programs.

    Args:
        batch: number of sequences ``B`` (>= 1).
        num_kv_heads: ``Hkv`` (>= 1).
        max_len: positions to cover (``L``, or the host-int ``seqlens``), >= 0.
        block_n: granularity of the chunk length (128 on GPU, so that every autotuned tile divides it).
        num_sms: streaming multiprocessors of the device (132 on an H100 SXM).
        num_splits: requested split count instead of the heuristic.
        max_chunk: most positions per split (4096; :func:`masked_decode` passes 2048 when a mask is given).
        programs_per_sm: programs per SM the split count aims at.

    Returns:
        ``(num_splits, chunk)`` with ``chunk`` a multiple of ``block_n`` and
        ``(num_splits - 1) * chunk < max_len <= num_splits * chunk`` (one split when ``max_len`` is 0).

    Raises:
        ValueError: an argument out of its range (the message names it).
    """
    for name, val, lo in (
        ("batch", batch, 1), ("num_kv_heads", num_kv_heads, 1), ("max_len", max_len, 0),
        ("block_n", block_n, 1), ("num_sms", num_sms, 1), ("max_chunk", max_chunk, 1),
        ("programs_per_sm", programs_per_sm, 1), ("num_splits", 1 if num_splits is None else num_splits, 1),
    ):  # fmt: skip
        if isinstance(val, bool) or not isinstance(val, int) or val < lo:
            raise ValueError(f"choose_num_splits: {name} must be an int >= {lo}, got {val!r}")
    tiles = max(1, triton.cdiv(max_len, block_n))
    if num_splits is None:
        want = max(
            triton.cdiv(programs_per_sm * num_sms, batch * num_kv_heads), triton.cdiv(max_len, max_chunk)
        )
    else:
        want = num_splits
    splits = max(1, min(want, tiles, _MAX_SPLITS))
    chunk = triton.cdiv(tiles, splits) * block_n
    return max(1, triton.cdiv(max_len, chunk)), chunk


class _Launch(NamedTuple):
    """A launch resolved from shapes, the device and a config; passed to the custom op as ints."""

    splits: int
    chunk: int
    one_wave: int
    path: int
    compact: int
    sparse_only: int
    block_n: int
    num_warps: int
    num_stages: int
    autotune: int
    block_ns: int
    sparse_stages: int
    block_c: int
    merge_s: int


class _Device(NamedTuple):
    """What a launch needs to know of its device."""

    sms: int
    name: str


def _device_facts(device: torch.device) -> _Device:
    return _Device(num_sms(device), device_name(device))


@functools.lru_cache(maxsize=512)
def _plan_launch(
    batch: int,
    hq: int,
    hkv: int,
    head_dim: int,
    max_len: int,
    masked: bool,
    config: MaskedDecodeConfig,
    dev: _Device,
    fp8: bool = False,
) -> tuple[_Launch, float]:
    """(launch, sparse threshold) of a call: the config's fields, or the tuned defaults of the device."""
    interp = interpreting()
    tuned = tuned_defaults(dev.name)
    block_g = max(16, triton.next_power_of_2(hq // hkv))
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Dense-loop tile: the first autotuning candidate (8 warps for large accumulators); tiny when interpreting.
    block_n, num_warps, num_stages = (16, 4, 1) if interp else _CANDIDATES[block_d][0]
    if not interp and block_g * block_d >= 8192:
        num_warps = 8
    block_n = config.block_n or block_n
    num_warps = config.num_warps or num_warps
    num_stages = config.num_stages or num_stages
    # Chunk lengths are multiples of the granularity, so every candidate BLOCK_N divides them.
    granularity = 16 if interp else max(128, config.block_n or 128)
    per_sm = config.programs_per_sm or tuned.programs_per_sm
    splits, chunk = choose_num_splits(
        batch, hkv, max_len, granularity, dev.sms, config.num_splits,
        max_chunk=config.max_chunk or (tuned.max_chunk_masked if masked else _MAX_CHUNK),
        programs_per_sm=per_sm,
    )  # fmt: skip
    one_wave = batch * hkv * splits <= _ONE_WAVE_SLACK * per_sm * dev.sms
    cls = tuned.one_wave if one_wave else tuned.multi_wave
    threshold = cls.sparse_threshold if config.sparse_threshold is None else config.sparse_threshold
    # Sparse gather tile: tuned at head dim 128; other head dims keep its bytes per tile (16 to 64 rows).
    if interp:
        block_ns, sparse_stages, block_c = 16, 1, config.block_c or 32
    else:
        block_ns = min(64, max(16, cls.block_ns * 128 // block_d))
        if fp8:  # half the rows: converting FP8 tiles takes registers (at 64 rows, 3 programs per SM fit)
            block_ns = max(16, block_ns // 2)
        sparse_stages = cls.sparse_stages
        block_c = min(config.block_c or _MAX_BLOCK_C, triton.next_power_of_2(max(chunk, 128)))
    path = _PATH_CODES[config.path]
    compact = masked and config.path in ("auto", "sparse")
    if config.path == "sparse":
        threshold = 2.0  # every split takes the sparse loop (visible <= 2 * length always holds)
    # A threshold of 1 or more sends every split to the sparse loop (visible <= length always holds): the
    # kernel is then compiled without the dense loop and launched without autotuning its (unused) tile.
    sparse_only = compact and threshold >= 1.0
    launch = _Launch(
        splits=splits,
        chunk=chunk,
        one_wave=int(one_wave),
        path=path,
        compact=int(compact),
        sparse_only=int(sparse_only),
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        autotune=int(config.autotune and not interp and not config.fixed_dense_tile and not sparse_only),
        block_ns=config.block_ns or block_ns,
        sparse_stages=config.sparse_stages or sparse_stages,
        block_c=block_c,
        merge_s=config.merge_splits or _merge_splits(triton.next_power_of_2(hq // hkv), block_g, block_d),
    )
    return launch, threshold


def _merge_splits(g_p2: int, block_g: int, block_d: int) -> int:
    """Splits per step of the last program's merge: a step of ``g_p2 x splits x block_d`` partial values
    sized so that it adds few registers to the kernel (offline sm_90 compiles: 8192 values at D 128 add
    none, 16384 take 96 -> 166 registers; at D 256 and at small tiles 4096 values keep it within 10)."""
    budget = min(8192, 4 * block_g * block_d) if block_d <= 128 else 4096
    return max(1, min(64, budget // (g_p2 * block_d)))


def _pow2(x: int) -> int:
    """Smallest power of two >= x (``triton.next_power_of_2`` without its JIT-function call cost)."""
    return 1 << (x - 1).bit_length() if x > 1 else 1


class _Scales(NamedTuple):
    """Dequantization scales of an FP8 cache (1.0 and None for fp16/bf16): per-tensor factors as Python
    floats and/or one-element float32 tensors, and optional per-(token, KV head) float32 tensors."""

    k_mul: float
    v_mul: float
    k_tensor: torch.Tensor | None
    v_tensor: torch.Tensor | None
    k_token: torch.Tensor | None
    v_token: torch.Tensor | None


_NO_SCALES = _Scales(1.0, 1.0, None, None, None, None)


class _Static(NamedTuple):
    """What a launch derives from shapes, strides and its plan: the same for every call of a signature."""

    batch: int
    hq: int
    hkv: int
    head_dim: int
    num_pages: int
    strides: tuple[int, ...]  # q, k, v, mask, block table, token scales of K and V (the kernel's order)
    size_class: int
    idx_numel: int
    part_numel: int
    grid: tuple[int, int, int]
    meta: dict  # the split kernel's constexprs and launch options


def _static(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    scales: _Scales,
    plan: _Launch,
) -> _Static:
    batch, hq, d = q.shape
    paged = block_table is not None
    hkv = k.shape[2] if paged else k.shape[1]
    splits, chunk = plan.splits, plan.chunk
    mask_mode = _MASK_NONE if mask is None else _MASK_PACKED if mask.dtype == torch.uint8 else _MASK_BOOL
    mstrides = (0, 0, 0) if mask is None else tuple(mask.stride())
    if paged:
        # Paged [P, page_size, Hkv, D] (scales [P, page_size, Hkv]): "batch" slots carry the page stride.
        def bhn(t: torch.Tensor) -> tuple[int, int, int]:
            return (t.stride(0), t.stride(2), t.stride(1))

        page_size = k.shape[1]
    else:

        def bhn(t: torch.Tensor) -> tuple[int, int, int]:
            return (t.stride(0), t.stride(1), t.stride(2))

        page_size = 1
    kts, vts = scales.k_token, scales.v_token
    strides = (
        q.stride(0), q.stride(1), *bhn(k), *bhn(v), *mstrides,
        block_table.stride(0) if block_table is not None else 1,
        *(bhn(kts) if kts is not None else (0, 0, 0)), *(bhn(vts) if vts is not None else (0, 0, 0)),
    )  # fmt: skip
    g = hq // hkv
    meta = dict(
        G=g, BLOCK_G=max(16, _pow2(g)), HEAD_DIM=d, BLOCK_D=max(16, _pow2(d)),
        BLOCK_NS=plan.block_ns, SPARSE_STAGES=plan.sparse_stages, BLOCK_C=plan.block_c, MASK_MODE=mask_mode,
        HAS_SEQLENS=seqlens is not None, PAGED=paged, PAGE_SIZE=page_size, COMPACT=bool(plan.compact),
        SPARSE_ONLY=bool(plan.sparse_only), UPCAST=interpreting() and q.dtype == torch.bfloat16,
        SCALE_T=scales.k_tensor is not None or scales.v_tensor is not None,
        TOK_SCALE=kts is not None or vts is not None,
        MERGE=splits > 1, G_P2=_pow2(g), MERGE_S=plan.merge_s, SEPARATE_MERGE=False, PDL=False,
        enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    if not plan.autotune:
        meta.update(BLOCK_N=plan.block_n, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return _Static(
        batch=batch,
        hq=hq,
        hkv=hkv,
        head_dim=d,
        num_pages=k.shape[0] if paged else 0,
        strides=strides,
        size_class=_pow2(batch * hkv * splits) * 1_000_000 + chunk,
        idx_numel=batch * hkv * splits * chunk if plan.compact else 0,
        part_numel=batch * hq * splits if splits > 1 else 0,
        grid=(splits, hkv, batch),
        meta=meta,
    )


_DUMMIES: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_ALIGN = 256  # workspace pieces start on 256-byte boundaries, like fresh allocations


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _dummies(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8, int32, float32) one-element tensors standing in for absent optional inputs (never read)."""
    dummies = _DUMMIES.get(device)
    if dummies is None:
        dummies = (
            torch.zeros(1, dtype=torch.uint8, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.ones(1, dtype=torch.float32, device=device),
        )
        if not _capturing(device):
            _DUMMIES[device] = dummies
    return dummies


class _Workspace:
    """The split kernel's scratch, reused by the calls made on one stream (stream order keeps them apart):
    a byte buffer carved per layout into the sparse loop's index lists and the partial results, and the
    per-(sequence, KV head) arrival counters of the in-kernel merge, zero between launches (the merging
    program resets its counter). A workspace made during CUDA graph capture has counters only when the
    captured launch merges in the split kernel: zeroing them would add a node to every replay."""

    def __init__(self, nbytes: int, ncounters: int, device: torch.device) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.counters = torch.zeros(ncounters, dtype=torch.int32, device=device) if ncounters > 0 else None
        self.views: dict[tuple[int, int, int], tuple[torch.Tensor | None, ...]] = {}

    def carve(self, idx_bytes: int, part_bytes: int, lse_bytes: int) -> tuple[torch.Tensor | None, ...]:
        """(index lists int32, partial outputs float32, partial LSEs float32), each None when empty."""
        layout = (idx_bytes, part_bytes, lse_bytes)
        views = self.views.get(layout)
        if views is None:
            o_at = -(-idx_bytes // _ALIGN) * _ALIGN
            l_at = o_at + -(-part_bytes // _ALIGN) * _ALIGN
            views = self.views[layout] = tuple(
                self.buf[at : at + n].view(dtype) if n else None
                for at, n, dtype in (
                    (0, idx_bytes, torch.int32), (o_at, part_bytes, torch.float32), (l_at, lse_bytes, torch.float32)
                )
            )  # fmt: skip
        return views


_WORKSPACES: dict[tuple[int, int], _Workspace] = {}  # (CUDA device index or -1, stream)


def _scratch(
    device: torch.device, index: int, stream: int, st: _Static, capturing: bool, counters: bool
) -> tuple[tuple[torch.Tensor | None, ...], torch.Tensor | None, _Workspace]:
    """Scratch views, merge counters and their workspace for a launch: from the stream's cached workspace,
    or fresh while a CUDA graph is being captured (the graph keeps its own; with ``counters`` only when
    the captured launch uses them)."""
    idx_bytes, part_bytes, lse_bytes = 4 * st.idx_numel, 4 * st.part_numel * st.head_dim, 4 * st.part_numel
    ncounters = st.batch * st.hkv
    nbytes = -(-idx_bytes // _ALIGN) * _ALIGN + -(-part_bytes // _ALIGN) * _ALIGN + lse_bytes
    if capturing:
        ws = _Workspace(nbytes, ncounters if counters else 0, device)
    else:
        key = (index, stream)
        cached = _WORKSPACES.get(key)
        if cached is None or cached.buf.numel() < nbytes or cached.counters.numel() < ncounters:  # type: ignore[union-attr]
            cached = _WORKSPACES[key] = _Workspace(nbytes, ncounters, device)
        ws = cached
    return ws.carve(idx_bytes, part_bytes, lse_bytes), ws.counters, ws


def _raw_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as the driver handle Triton launches on."""
    return triton.runtime.driver.active.get_current_stream(index)


class _Entry:
    """A cached signature: its validation result and, once its first launch has compiled the split kernel,
    a launcher of that compiled kernel with the grid bound (no argument binding or cache lookup per call);
    ``bound``: that launch bound to one stream's workspace (:class:`_Bound`); ``two_launch_ready`` once an
    eager call has compiled the two-launch path that graph capture takes."""

    __slots__ = ("bound", "launcher", "sig", "two_launch_ready")

    def __init__(self, sig: _Signature) -> None:
        self.sig = sig
        self.launcher: tuple | None = None  # see _direct_launcher
        self.bound: _Bound | None = None
        self.two_launch_ready = False


class _Bound(NamedTuple):
    """The arguments of a signature's direct launch that are the same for every call on one stream: the
    launcher's leading arguments, the device pointers (as ints: no pointer query per launch) of the
    stream's workspace, merge counters, error word and the stand-ins for absent inputs, then the scalars,
    strides and constexprs. Valid while ``ws`` is the stream's workspace (a larger one replaces it)."""

    stream: int
    ws: _Workspace
    run: object  # the compiled kernel's launcher
    pre: tuple  # grid, stream, CUDA function, packed metadata, no launch metadata, no hooks
    absent: tuple  # stand-ins for an absent mask, seqlens, block table: uint8, int32, int32
    idx: int
    mid: tuple  # partial outputs, partial LSEs, counters, error word
    no_scales: tuple  # the four scale arguments of a cache without scales
    f32: int  # stand-in for one absent scale tensor
    tail: tuple  # scalars, strides, constexprs


def _bind(
    entry: _Entry,
    dev: torch.device,
    index: int,
    stream: int,
    st: _Static,
    error_flag: torch.Tensor,
    scalars: tuple,
) -> _Bound:
    """Bind a signature's compiled split kernel (``entry.launcher``) to the workspace of ``stream``."""
    run, function, packed_metadata, consts, _ = entry.launcher  # type: ignore[misc]
    (idx, o_part, l_part), counters, ws = _scratch(dev, index, stream, st, capturing=False, counters=True)
    u8, i32, f32 = (t.data_ptr() for t in _dummies(dev))

    def ptr(t: torch.Tensor | None, dummy: int) -> int:
        return dummy if t is None else t.data_ptr()

    return _Bound(
        stream=stream,
        ws=ws,
        run=run,
        pre=(*st.grid, stream, function, packed_metadata, None, None, None),
        absent=(u8, i32, i32),
        idx=ptr(idx, i32),
        mid=(ptr(o_part, f32), ptr(l_part, f32), ptr(counters, i32), error_flag.data_ptr()),
        no_scales=(f32, f32, f32, f32),
        f32=f32,
        tail=(*scalars, *st.strides, *consts),
    )


def _launch_bound(
    bound: _Bound,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    scales: _Scales,
    st: _Static,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs and launch the bound kernel (on the current device)."""
    dev = q.device
    # out is [B, Hq, D] with standard strides: empty_like is the cheaper allocation when q has that shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(st.batch, st.hq, dtype=torch.float32, device=dev)
    u8, i32, bt = bound.absent
    if scales is _NO_SCALES:
        sc = bound.no_scales
    else:
        f32 = bound.f32
        sc = tuple(f32 if t is None else t for t in scales[2:])
    # A bool mask is passed as is: the compiled kernel reads its bytes (the first launch saw it as uint8).
    bound.run(  # type: ignore[operator]
        *bound.pre, q, k, v, u8 if mask is None else mask, i32 if seqlens is None else seqlens,
        bt if block_table is None else block_table, bound.idx, out, lse, *bound.mid, *sc, *bound.tail,
    )  # fmt: skip
    return out, lse


_MERGE_BLOCK_D = 32  # the merge kernel's head-dim slice per program (one warp: 64 partial values a thread)
_MERGE_WARPS = 1


# Launches without a cached signature (the custom op under torch.compile) that took the two-launch path.
_TWO_LAUNCH_COMPILED: set[tuple] = set()


def _two_launch_compiled(entry: _Entry | None, index: int, st: _Static) -> bool:
    """Whether the two-launch path of this launch has run (so graph capture will not compile it)."""
    if entry is not None:
        return entry.two_launch_ready
    return (index, st.grid, tuple(st.meta.items())) in _TWO_LAUNCH_COMPILED


def _pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled kernels on Hopper and newer."""
    return device.type == "cuda" and not interpreting() and capability(device)[0] >= 9


def _no_launch_hooks() -> bool:
    """True when no launch hook is registered with Triton (profilers such as Proton register some)."""
    rt = _triton_knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is None or getattr(enter, "calls", True) == []) and (
        leave is None or getattr(leave, "calls", True) == []
    )


def _direct_launcher(compiled, consts: tuple) -> tuple:
    """(launch function, CUDA function, packed metadata, constexpr values, the compiled kernel): what
    Triton's JIT passes to the compiled kernel's launcher, taken once."""
    run = compiled.run  # loads the module on first access
    return (run, compiled.function, compiled.packed_metadata, consts, compiled)


def _constexprs(meta: dict, extra: dict) -> tuple:
    """The split kernel's constexpr arguments in signature order (Triton's launcher takes every argument)."""
    names = _masked_decode_split_kernel.arg_names
    full = {**meta, **extra}
    return tuple(full[n] for n in names if n in full)


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    error_flag: torch.Tensor,
    scales: _Scales,
    seqlen_const: int,
    sm_scale: float,
    max_len: int,
    sparse_threshold: float,
    plan: _Launch,
    st: _Static,
    entry: _Entry | None = None,
    readback: _FlagReadback | None = None,
    two_launch: bool | None = None,
    capturing: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel on validated inputs. With one split it writes the result; with several, either
    the last split of each sequence and KV head merges them in the same launch, or (``two_launch``) a
    separate merge kernel does, launched with programmatic dependent launch where the GPU has it.
    ``two_launch`` defaults to True while a CUDA graph is being captured and for the first call of a
    signature on a GPU outside capture (which compiles that path before any capture), else False. With ``entry`` (eager
    calls on a GPU), the compiled kernel of its first one-launch call is kept and later calls launch it
    directly, bound to the stream's workspace; with ``readback``, the error word's copy to the host starts
    after the launches."""
    dev = q.device
    batch, hq, d = st.batch, st.hq, st.head_dim
    cuda = dev.type == "cuda"
    index = (dev.index if dev.index is not None else torch.cuda.current_device()) if cuda else -1
    stream = _raw_stream(index) if cuda else 0
    if capturing is None:
        capturing = cuda and _capturing(dev)
    # A signature whose one-launch kernel is compiled launches it directly outside capture (its two-launch
    # path, when it has one, ran on its first call).
    if (
        entry is not None
        and entry.launcher is not None
        and two_launch is None
        and not capturing
        and _no_launch_hooks()
    ):
        bound = entry.bound
        if bound is None or bound.stream != stream or bound.ws is not _WORKSPACES.get((index, stream)):
            scalars = (
                seqlen_const, max_len, st.num_pages, plan.chunk, sm_scale * _LOG2E, scales.k_mul, scales.v_mul,
                sparse_threshold, st.size_class,
            )  # fmt: skip
            bound = entry.bound = _bind(entry, dev, index, stream, st, error_flag, scalars)
        if cuda and torch.cuda.current_device() != index:  # Triton launches on the current device
            with torch.cuda.device(index):
                out, lse = _launch_bound(bound, q, k, v, mask, seqlens, block_table, scales, st)
        else:
            out, lse = _launch_bound(bound, q, k, v, mask, seqlens, block_table, scales, st)
        if readback is not None:
            readback.start()
        return out, lse
    if two_launch is None:
        # In a graph the launch count costs nothing at replay, but the one-launch path's serial merge by
        # the last split does: captures take the split kernel + a merge kernel spread over every query head.
        two_launch = cuda and plan.splits > 1 and (capturing or not _two_launch_compiled(entry, index, st))
    two_launch = two_launch and plan.splits > 1
    dummy_u8, dummy_i32, dummy_f32 = _dummies(dev)
    out = torch.empty(batch, hq, d, dtype=q.dtype, device=dev)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=dev)
    # Counters only for the in-kernel merge (a captured two-launch graph then has no node zeroing them).
    (idx, o_part, l_part), counters, _ = _scratch(
        dev, index, stream, st, capturing, counters=plan.splits > 1 and not two_launch
    )
    args = (
        q, k, v, dummy_u8 if mask is None else mask if mask.dtype == torch.uint8 else mask.view(torch.uint8), dummy_i32 if seqlens is None else seqlens,
        dummy_i32 if block_table is None else block_table, dummy_i32 if idx is None else idx, out, lse,
        out if o_part is None else o_part, lse if l_part is None else l_part,
        dummy_i32 if counters is None else counters, error_flag,
        dummy_f32 if scales.k_tensor is None else scales.k_tensor,
        dummy_f32 if scales.v_tensor is None else scales.v_tensor,
        dummy_f32 if scales.k_token is None else scales.k_token,
        dummy_f32 if scales.v_token is None else scales.v_token,
        seqlen_const, max_len, st.num_pages, plan.chunk, sm_scale * _LOG2E, scales.k_mul, scales.v_mul,
        sparse_threshold, st.size_class, *st.strides,
    )  # fmt: skip
    if two_launch:
        if entry is not None:
            entry.two_launch_ready = True
        elif cuda:
            if len(_TWO_LAUNCH_COMPILED) > 4096:
                _TWO_LAUNCH_COMPILED.clear()
            _TWO_LAUNCH_COMPILED.add((index, st.grid, tuple(st.meta.items())))
        merge_args = (
            o_part, l_part, out, lse, dummy_i32 if seqlens is None else seqlens, seqlen_const, max_len,
            plan.chunk, plan.splits,
        )  # fmt: skip
        pdl = _pdl_available(dev)
        if cuda and torch.cuda.current_device() != index:
            with torch.cuda.device(index):
                _launch_two(args, merge_args, plan, st, pdl, readback)
        else:
            _launch_two(args, merge_args, plan, st, pdl, readback)
    elif cuda and torch.cuda.current_device() != index:  # Triton launches on the current device
        with torch.cuda.device(index):
            _launch_split(args, plan, st, stream, cuda, entry, readback)
    else:
        _launch_split(args, plan, st, stream, cuda, entry, readback)
    return out, lse


def _launch_two(
    args: tuple, merge_args: tuple, plan: _Launch, st: _Static, pdl: bool, readback: _FlagReadback | None
) -> None:
    """The split kernel writing every partial result, then the merge kernel (through Triton's JIT: this
    path is taken at graph capture, where host time does not recur)."""
    meta = {**st.meta, "SEPARATE_MERGE": True, "PDL": pdl}
    if plan.autotune:
        _split_kernel_tuned()[st.grid](*args, **meta)
    else:
        _masked_decode_split_kernel[st.grid](*args, **meta)
    d, hq, splits = st.head_dim, st.hq, plan.splits
    block_dm = min(max(16, _pow2(d)), _MERGE_BLOCK_D)
    # Partials [B, Hq, S, D] / [B, Hq, S] and outputs [B, Hq, D] / [B, Hq], all contiguous.
    strides = (hq * splits * d, splits * d, d, hq * splits, splits, 1, hq * d, d, hq, 1)
    _merge_splits_kernel[(hq, st.batch, -(-max(16, _pow2(d)) // block_dm))](
        *merge_args, *strides, HEAD_DIM=d, BLOCK_D=block_dm,
        BLOCK_S=min(max(_MERGE_WARPS * 32 * 64 // block_dm, 1), _pow2(splits)),
        HAS_SEQLENS=st.meta["HAS_SEQLENS"], PDL=pdl, num_warps=_MERGE_WARPS, launch_pdl=pdl,
        enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    if readback is not None:
        readback.start()


def _launch_split(
    args: tuple,
    plan: _Launch,
    st: _Static,
    stream: int,
    cuda: bool,
    entry: _Entry | None,
    readback: _FlagReadback | None,
) -> None:
    """Launch the split kernel on the current device: directly when ``entry`` holds its compiled kernel,
    else through Triton's JIT (keeping the compiled kernel in ``entry`` on a GPU)."""
    launcher = entry.launcher if entry is not None else None
    if launcher is not None and _no_launch_hooks():
        run, function, packed_metadata, consts, _ = launcher
        g0, g1, g2 = st.grid
        run(g0, g1, g2, stream, function, packed_metadata, None, None, None, *args, *consts)
    elif launcher is not None:  # a profiler's launch hooks: Triton's own launch path calls them
        compiled, consts = launcher[4], launcher[3]
        compiled[st.grid](*args, *consts, stream=stream)
    elif plan.autotune:
        tuned = _split_kernel_tuned()
        compiled = tuned[st.grid](*args, **st.meta)
        if entry is not None and cuda:
            entry.launcher = _direct_launcher(compiled, _constexprs(st.meta, tuned.best_config.all_kwargs()))
    else:
        compiled = _masked_decode_split_kernel[st.grid](*args, **st.meta)
        if entry is not None and cuda:
            entry.launcher = _direct_launcher(compiled, _constexprs(st.meta, {}))
    if readback is not None:
        readback.start()


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    error_flag: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_token_scale: torch.Tensor | None,
    v_token_scale: torch.Tensor | None,
    k_mul: float,
    v_mul: float,
    seqlen_const: int,
    sm_scale: float,
    max_len: int,
    sparse_threshold: float,
    launch: List[int],  # noqa: UP006 (torch < 2.7 infers a custom op's schema from typing.List only)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom op: :func:`_run` on validated inputs, with the plan as a list of ints.

    ``error_flag`` (int32 ``[1]``) gets the ``_ERR_*`` bits of out-of-range values the kernel met;
    ``launch`` is a :class:`_Launch` as a list (the custom op's schema has no named tuples).
    """
    if q.shape[0] == 0:
        return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)
    plan = _Launch(*launch)
    scales = _Scales(k_mul, v_mul, k_scale, v_scale, k_token_scale, v_token_scale)
    st = _static(q, k, v, mask, seqlens, block_table, scales, plan)
    return _run(
        q, k, v, mask, seqlens, block_table, error_flag, scales, seqlen_const, sm_scale, max_len,
        sparse_threshold, plan, st,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------
# torch custom op (torch.compile / CUDA graphs)
# --------------------------------------------------------------------------------------------------------


_masked_decode_op = torch.library.custom_op(
    "triton_masked_decode::masked_decode", _launch, mutates_args=("error_flag",)
)


@_masked_decode_op.register_fake
def _masked_decode_fake(q: torch.Tensor, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    batch, hq, d = q.shape
    return q.new_empty(batch, hq, d), q.new_empty(batch, hq, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------------
# Validation and the public function
# --------------------------------------------------------------------------------------------------------


def _fail(msg: str) -> NoReturn:
    raise ValueError(f"masked_decode: {msg}")


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)


def _check_q(q: torch.Tensor) -> torch.Tensor:
    """q as ``[B, Hq, D]``."""
    if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4) or (q.dim() == 4 and q.shape[2] != 1):
        _fail(f"q must be [B, Hq, D] or [B, Hq, 1, D], got {_shape(q)}")
    q3 = q.squeeze(2) if q.dim() == 4 else q
    d = q3.shape[-1]
    if q3.dtype not in (torch.float16, torch.bfloat16):
        _fail(f"q must be float16 or bfloat16, got {q3.dtype}")
    if d % 8 != 0 or not 16 <= d <= 256:
        _fail(f"head dim D must be a multiple of 8 in [16, 256], got {d}")
    if q3.stride(-1) != 1:
        _fail(f"q's last dim must be contiguous (stride 1), got strides {tuple(q3.stride())}")
    if q3.device.type != "cuda" and not interpreting():
        _fail(f"tensors must be on a CUDA device (CPU needs TRITON_INTERPRET=1), got {q3.device}")
    return q3


def _check_cache(
    q3: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None
) -> tuple[int, int]:
    """(Hkv, L) of a dense or paged cache."""
    batch, hq, d = q3.shape
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            _fail(f"{name} must be a 4-d tensor, got {_shape(t)}")
        if t.dtype not in (q3.dtype, torch.float8_e4m3fn):
            _fail(f"{name} dtype {t.dtype} must be q's dtype {q3.dtype} or torch.float8_e4m3fn")
        if t.device != q3.device:
            _fail(f"{name} is on {t.device}, q on {q3.device}")
        if t.shape[-1] != d:
            _fail(f"{name} head dim {t.shape[-1]} must match q's {d}")
        if t.stride(-1) != 1:
            _fail(f"{name}'s last dim must be contiguous (stride 1), got strides {tuple(t.stride())}")
    if k.shape != v.shape:
        _fail(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.dtype != v.dtype:
        _fail(f"k ({k.dtype}) and v ({v.dtype}) must have the same dtype")
    if block_table is None:
        if k.shape[0] != batch:
            _fail(f"dense k must be [B, Hkv, L, D] with B={batch}, got {tuple(k.shape)}")
        hkv, max_len = k.shape[1], k.shape[2]
    else:
        if (
            not isinstance(block_table, torch.Tensor)
            or block_table.dim() != 2
            or block_table.shape[0] != batch
        ):
            _fail(f"block_table must be [B={batch}, max_pages], got {_shape(block_table)}")
        if block_table.dtype != torch.int32:
            _fail(f"block_table must be int32, got {block_table.dtype}")
        if block_table.device != q3.device:
            _fail(f"block_table is on {block_table.device}, q on {q3.device}")
        if block_table.stride(-1) != 1:
            _fail("block_table's last dim must be contiguous (stride 1)")
        page_size = k.shape[1]
        if page_size & (page_size - 1):
            _fail(f"page_size (k.shape[1]) must be a power of two, got {page_size}")
        hkv, max_len = k.shape[2], block_table.shape[1] * page_size
    if hkv == 0 or hq % hkv != 0:
        _fail(f"q heads ({hq}) must be a multiple of KV heads ({hkv})")
    if hq // hkv > _MAX_GROUP:
        _fail(f"GQA group size Hq/Hkv = {hq // hkv} exceeds {_MAX_GROUP}")
    return hkv, max_len


def _check_mask(mask: torch.Tensor | None, q3: torch.Tensor, hkv: int, max_len: int) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        _fail(f"mask must be a tensor or None, got {type(mask)}")
    if mask.device != q3.device:
        _fail(f"mask is on {mask.device}, q on {q3.device}")
    if mask.dtype == torch.bool:
        want = (q3.shape[0], hkv, max_len)
    elif mask.dtype == torch.uint8:
        want = (q3.shape[0], hkv, triton.cdiv(max_len, 8))
    else:
        _fail(f"mask must be bool [B, Hkv, L] or bit-packed uint8 [B, Hkv, ceil(L/8)], got {mask.dtype}")
    if tuple(mask.shape) != want:
        _fail(f"mask ({mask.dtype}) must have shape {want}, got {tuple(mask.shape)}")


def _check_seqlens(seqlens: torch.Tensor | int | None, q3: torch.Tensor, max_len: int) -> int:
    """The host-int length (``L`` unless ``seqlens`` is an int)."""
    if seqlens is None:
        return max_len
    if isinstance(seqlens, bool):
        _fail("seqlens must be an int or an int32 tensor, got bool")
    if isinstance(seqlens, int):
        if not 0 <= seqlens <= max_len:
            _fail(f"seqlens={seqlens} must be in [0, L={max_len}]")
        return seqlens
    batch = q3.shape[0]
    if (
        not isinstance(seqlens, torch.Tensor)
        or seqlens.dtype != torch.int32
        or tuple(seqlens.shape) != (batch,)
    ):
        _fail(f"seqlens must be an int32 tensor of shape [{batch}] or an int")
    if seqlens.device != q3.device:
        _fail(f"seqlens is on {seqlens.device}, q on {q3.device}")
    return max_len


_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_scales(
    k_scale: object,
    v_scale: object,
    k_token_scale: object,
    v_token_scale: object,
    q3: torch.Tensor,
    k: torch.Tensor,
    block_table: torch.Tensor | None,
) -> None:
    """Per-tensor scales: finite Python numbers or one-element float tensors on q's device; per-token
    scales: float32 ``[num_pages, page_size, Hkv]`` (paged) or ``[B, Hkv, L]`` (dense)."""
    for name, val in (("k_scale", k_scale), ("v_scale", v_scale)):
        if val is None:
            continue
        if isinstance(val, torch.Tensor):
            if val.numel() != 1 or val.dim() > 1 or val.dtype not in _SCALE_DTYPES:
                _fail(
                    f"{name} must be a float, or a 0-d or [1] float32 tensor, got {val.dtype} {tuple(val.shape)}"
                )
            if val.device != q3.device:
                _fail(f"{name} is on {val.device}, q on {q3.device}")
        elif isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
            _fail(f"{name} must be a finite float or a one-element tensor, got {val!r}")
    want = tuple(k.shape[:3]) if block_table is not None else (q3.shape[0], k.shape[1], k.shape[2])
    layout = "[num_pages, page_size, Hkv]" if block_table is not None else "[B, Hkv, L]"
    for name, val in (("k_token_scale", k_token_scale), ("v_token_scale", v_token_scale)):
        if val is None:
            continue
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32 or tuple(val.shape) != want:
            _fail(
                f"{name} must be a float32 tensor {layout} = {want}, got {_shape(val)} {getattr(val, 'dtype', '')}"
            )
        if val.device != q3.device:
            _fail(f"{name} is on {val.device}, q on {q3.device}")


def _scales(k_scale: object, v_scale: object, k_token_scale: object, v_token_scale: object) -> _Scales:
    """The kernel's view of validated scales: tensors by pointer (graph-safe), numbers as factors."""
    k_t = k_scale if isinstance(k_scale, torch.Tensor) else None
    v_t = v_scale if isinstance(v_scale, torch.Tensor) else None
    k_mul = 1.0 if k_t is not None or k_scale is None else float(k_scale)  # type: ignore[arg-type]
    v_mul = 1.0 if v_t is not None or v_scale is None else float(v_scale)  # type: ignore[arg-type]
    return _Scales(k_mul, v_mul, k_t, v_t, k_token_scale, v_token_scale)  # type: ignore[arg-type]


def _check_values(
    k: torch.Tensor,
    seqlens: torch.Tensor | int | None,
    seqlen_const: int,
    block_table: torch.Tensor | None,
    max_len: int,
) -> None:
    """``seqlens`` within ``[0, L]`` and the used ``block_table`` entries within ``[0, num_pages)``."""
    batch = block_table.shape[0] if block_table is not None else k.shape[0]
    if isinstance(seqlens, torch.Tensor) and batch > 0:
        lo, hi = int(seqlens.min()), int(seqlens.max())
        if lo < 0 or hi > max_len:
            _fail(f"seqlens values must be in [0, L={max_len}], got min {lo}, max {hi}")
    if block_table is not None and batch > 0:
        dev = block_table.device
        page_size = k.shape[1]
        if isinstance(seqlens, torch.Tensor):
            need = (seqlens.long() + page_size - 1) // page_size
        else:
            need = torch.full((batch,), triton.cdiv(seqlen_const, page_size), device=dev)
        used = torch.arange(block_table.shape[1], device=dev)[None, :] < need[:, None]
        bad = used & ((block_table < 0) | (block_table >= k.shape[0]))
        if bool(bad.any()):
            bi, pi = (int(x) for x in bad.nonzero()[0])
            _fail(
                f"block_table[{bi}, {pi}] = {int(block_table[bi, pi])} is out of range for {k.shape[0]} pages"
            )


_ERROR_FLAGS: dict[torch.device, torch.Tensor] = {}


@torch.compiler.assume_constant_result  # torch.compile: the same tensor, taken at trace time
def _error_flag(device: torch.device) -> torch.Tensor:
    """The device's error word (int32 ``[1]``), allocated once so that CUDA graphs capture its address."""
    flag = _ERROR_FLAGS.get(device)
    if flag is None:
        flag = _ERROR_FLAGS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


class _FlagReadback:
    """Reads a CUDA device's error word without stopping the host: after a call, an asynchronous copy into
    pinned memory, at most one in flight and one per ``_READBACK_PERIOD_NS``; a later call looks at it once
    the copy has landed (an event query, no sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flag = _error_flag(device)
        self.host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.host_view = self.host.numpy()
        self.event = torch.cuda.Event()
        self.pending = False
        self.last_ns = 0

    def start(self) -> None:
        """After the launch (on the current stream of the device): copy the word unless one is in flight
        or the last one started less than a period ago."""
        if not self.pending:
            now = time.monotonic_ns()
            if now - self.last_ns >= _READBACK_PERIOD_NS:
                self.host.copy_(self.flag, non_blocking=True)
                self.event.record()
                self.pending = True
                self.last_ns = now

    def landed_bits(self) -> int:
        """The bits of the last copy if it has landed, else 0 (and nothing waits)."""
        if not self.pending or not self.event.query():
            return 0
        self.pending = False
        return int(self.host_view[0])


# The error word's copy to the host costs a stream operation: eager calls in a tight loop start one per
# millisecond, so a flagged value is reported within about a millisecond of calls.
_READBACK_PERIOD_NS = 1_000_000


_READBACKS: dict[torch.device, _FlagReadback] = {}


def check_errors(device: torch.device | str | None = None) -> None:
    """Raise if a :func:`masked_decode` call on ``device`` since the last report met out-of-range values.

    The kernel never reads memory through an out-of-range value: a ``seqlens`` entry outside ``[0, L]`` is
    clamped into it, and a used ``block_table`` entry outside ``[0, num_pages)`` makes its rows count as
    excluded. It records either case in a per-device error word. Calls with ``check_values=True`` report
    it without a host sync, at a later call (on a GPU, once the word's copy to the host has landed); this
    function reads it now (a host sync) and clears it. Use it after calls made with
    ``check_values=False``, in a CUDA graph or under ``torch.compile``, or to get the report at once.

    Args:
        device: the device of the calls; default the current CUDA device, or the CPU without CUDA.

    Raises:
        ValueError: naming what was out of range (the calls' outputs treated those values as described).
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    flag = _ERROR_FLAGS.get(dev)
    if flag is None:
        return
    readback = _READBACKS.get(dev)
    if readback is not None:
        readback.pending = False  # the word is read here; an in-flight copy is stale
    bits = int(flag.item())
    if bits:
        flag.zero_()
        _raise_flagged(bits)


def _raise_flagged(bits: int) -> None:
    what = []
    if bits & 1:
        what.append(
            "block_table held page ids outside [0, num_pages) in used slots (their rows were excluded)"
        )
    if bits & 2:
        what.append("seqlens held values outside [0, L] (they were clamped into it)")
    _fail("a call since the last check met out-of-range values: " + "; ".join(what))


class _Signature(NamedTuple):
    """A validated call signature and what it determines (cached; see :func:`_signature_key`)."""

    q_is_4d: bool
    hkv: int
    max_len: int
    seqlen_const: int
    grid_len: int
    scale: float
    plan: _Launch
    threshold: float
    static: _Static | None  # None for an empty batch


_SIGNATURES: dict[tuple, _Entry] = {}


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    # The pointer's 16-byte alignment is part of the compiled kernel's specialisation.
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _value_key(x: object) -> tuple | None:
    return _tensor_key(x) if isinstance(x, torch.Tensor) else (type(x), x)  # type: ignore[arg-type]


def _signature_key(
    q, k, v, mask, seqlens, block_table, sm_scale, k_scale, v_scale, k_token_scale, v_token_scale, config
) -> tuple | None:
    """Everything validation and planning depend on (shapes, strides, dtypes, devices, alignments, the
    host-int length, the scales' kinds and numbers, the config or None); None when an argument is not even a
    tensor (validation reports it)."""
    try:
        key = (
            _tensor_key(q), _tensor_key(k), _tensor_key(v), _tensor_key(mask), _value_key(seqlens),
            _tensor_key(block_table), type(sm_scale), sm_scale, config,
        )  # fmt: skip
        if k_scale is None and v_scale is None and k_token_scale is None and v_token_scale is None:
            return key
        return (
            *key, _value_key(k_scale), _value_key(v_scale), _tensor_key(k_token_scale), _tensor_key(v_token_scale),
        )  # fmt: skip
    except (AttributeError, TypeError):
        return None


def _validate_and_plan(
    q, k, v, mask, seqlens, block_table, sm_scale, k_scale, v_scale, k_token_scale, v_token_scale, config,
    cached: bool,
) -> _Signature:  # fmt: skip
    q3 = _check_q(q)
    hkv, max_len = _check_cache(q3, k, v, block_table)
    _check_mask(mask, q3, hkv, max_len)
    seqlen_const = _check_seqlens(seqlens, q3, max_len)
    _check_scales(k_scale, v_scale, k_token_scale, v_token_scale, q3, k, block_table)
    scale = q3.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    if not math.isfinite(scale):
        raise ValueError(f"masked_decode: sm_scale must be finite, got {sm_scale}")
    seq_t = seqlens if isinstance(seqlens, torch.Tensor) else None
    # A host-int length shortens the grid (it is baked into any captured graph anyway).
    grid_len = max_len if seq_t is not None else seqlen_const
    batch, hq, d = q3.shape
    if batch == 0:
        plan, threshold, static = _Launch(*[0] * len(_Launch._fields)), 0.0, None
    else:
        # (torch.compile traces the planner itself: its cache is a host-side shortcut of eager calls)
        plan_launch = _plan_launch if cached else _plan_launch.__wrapped__
        plan, threshold = plan_launch(
            batch, hq, hkv, d, grid_len, mask is not None, config, _device_facts(q3.device),
            fp8=k.dtype == torch.float8_e4m3fn,
        )  # fmt: skip
        scales = _scales(k_scale, v_scale, k_token_scale, v_token_scale)
        static = _static(q3, k, v, mask, seq_t, block_table, scales, plan) if cached else None
    return _Signature(q.dim() == 4, hkv, max_len, seqlen_const, grid_len, scale, plan, threshold, static)


def _report_flagged_values(
    device: torch.device,
    k: torch.Tensor,
    seqlens: torch.Tensor | int | None,
    sig: _Signature,
    block_table: torch.Tensor | None,
) -> None:
    """``check_values`` after a launch on the CPU: the error word is already final, so a flagged call is
    reported at once, naming the entry (the full check runs only then)."""
    flag = _ERROR_FLAGS[device]
    bits = int(flag[0])
    if bits:
        flag.zero_()
        _check_values(k, seqlens, sig.seqlen_const, block_table, sig.max_len)
        _raise_flagged(bits)


def masked_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    seqlens: torch.Tensor | int | None = None,
    block_table: torch.Tensor | None = None,
    sm_scale: float | None = None,
    return_lse: bool = True,
    check_values: bool = True,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    k_token_scale: torch.Tensor | None = None,
    v_token_scale: torch.Tensor | None = None,
    config: MaskedDecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """Decode attention of one query token per sequence over a KV cache with excluded positions.

    For each sequence ``b`` and query head ``h`` (KV head ``h // G``, ``G = Hq / Hkv``)::

        out[b, h] = softmax(sm_scale * K[b, h//G, vis] @ q[b, h]) @ V[b, h//G, vis]

    over the visible positions ``vis``: those below ``seqlens[b]`` that the mask does not exclude.
    Excluded K/V rows are never read (they may hold anything, NaN included).

    Args:
        q: ``[B, Hq, D]`` or ``[B, Hq, 1, D]``, float16 or bfloat16, last dim contiguous.
        k: dense ``[B, Hkv, L, D]`` with any strides (last dim contiguous), e.g. a ``[B, L, Hkv, D]``
            buffer transposed; or paged ``[num_pages, page_size, Hkv, D]`` together with ``block_table``.
            Same dtype as ``q``, or ``torch.float8_e4m3fn`` (an FP8 cache, dequantized with the scales
            below). ``D`` a multiple of 8 in ``[16, 256]``.
        v: same layout, shape and dtype as ``k``.
        mask: optional exclusion mask, ``True``/set bit = position excluded. Either ``[B, Hkv, L]`` bool
            (any strides) or bit-packed ``[B, Hkv, ceil(L/8)]`` uint8 where bit ``j`` (least significant
            first) of byte ``i`` is position ``8*i + j`` (see :func:`pack_mask`).
        seqlens: valid length per sequence, an int32 ``[B]`` tensor on the device (read by the kernel, no
            host sync) or a Python int; default ``L``. Positions at or past it are ignored.
        block_table: ``[B, max_pages]`` int32 page ids for a paged cache; ``L = max_pages * page_size``
            (``page_size`` a power of two).
        sm_scale: softmax scale, default ``D ** -0.5``.
        return_lse: return ``(out, lse)`` when True (default), ``out`` alone when False.
        check_values: report tensor *values* out of range (``seqlens`` outside ``[0, L]``, used
            ``block_table`` entries outside ``[0, num_pages)``) without a host sync: the kernel records
            them, and a ``ValueError`` is raised by a later call once the record has reached the host
            (on the CPU, by this call, naming the entry); :func:`check_errors` reports at once. With False
            nothing is reported unless :func:`check_errors` is called. Either way the kernel never reads
            through such a value: it clamps ``seqlens`` into ``[0, L]`` and treats the rows behind an
            out-of-range page id as excluded.
        k_scale, v_scale: per-tensor dequantization scales of K and V (the cache holds ``K / k_scale``), as
            vLLM and FlashInfer pass them: a finite Python float, or a 0-d or ``[1]`` float tensor on the
            device (read by the kernel: no host sync, and a CUDA graph replays the tensor's current value).
            Default 1. They apply to any cache dtype.
        k_token_scale, v_token_scale: optional per-(position, KV head) float32 dequantization scales,
            ``[num_pages, page_size, Hkv]`` for a paged cache or ``[B, Hkv, L]`` for a dense one (any
            strides), multiplying the per-tensor ones. The scales of excluded positions are never read.
        config: launch knobs (:class:`MaskedDecodeConfig`: loop choice, split count, tiles); default:
            the tuned defaults of the device.

    Returns:
        ``out [B, Hq, D]`` (``[B, Hq, 1, D]`` for a 4-d ``q``) in ``q.dtype`` and ``lse [B, Hq]`` float32
        (natural log). A row with no visible position gets ``out = 0`` and ``lse = -inf``; a row with a
        NaN or ``+inf`` score (non-finite values in ``q`` or in a visible K row) gets ``out = NaN`` and
        ``lse = NaN``, as :func:`masked_decode_ref` does.

    Raises:
        ValueError: a shape, dtype, device or stride that does not fit (the message names the argument),
            or, with ``check_values``, out-of-range values met by this or an earlier call.
        TypeError: ``config`` is not a :class:`MaskedDecodeConfig`.
    """
    cfg = _DEFAULT_CONFIG if config is None else config
    if not isinstance(cfg, MaskedDecodeConfig):
        raise TypeError(f"masked_decode: config must be a MaskedDecodeConfig or None, got {type(config)}")
    if torch.compiler.is_compiling():  # traced: the custom op, no host-side caches or checks
        sig = _validate_and_plan(
            q, k, v, mask, seqlens, block_table, sm_scale, k_scale, v_scale, k_token_scale, v_token_scale, cfg,
            cached=False,
        )  # fmt: skip
        q3 = q.squeeze(2) if sig.q_is_4d else q
        sc = _scales(k_scale, v_scale, k_token_scale, v_token_scale)
        out, lse = torch.ops.triton_masked_decode.masked_decode(
            q3, k, v, mask, seqlens if isinstance(seqlens, torch.Tensor) else None, block_table,
            _error_flag(q3.device), sc.k_tensor, sc.v_tensor, sc.k_token, sc.v_token, sc.k_mul, sc.v_mul,
            sig.seqlen_const, sig.scale, sig.grid_len, sig.threshold, list(sig.plan),
        )  # fmt: skip
    else:
        # config None (the defaults) keys as None: no dataclass hash or comparison per call
        key = _signature_key(
            q, k, v, mask, seqlens, block_table, sm_scale, k_scale, v_scale, k_token_scale, v_token_scale, config,
        )  # fmt: skip
        entry = _SIGNATURES.get(key) if key is not None else None
        if entry is None:
            entry = _Entry(
                _validate_and_plan(
                    q, k, v, mask, seqlens, block_table, sm_scale, k_scale, v_scale, k_token_scale,
                    v_token_scale, cfg, cached=True,
                )
            )  # fmt: skip
            if key is not None:
                if len(_SIGNATURES) > 4096:
                    _SIGNATURES.clear()
                _SIGNATURES[key] = entry
        sig = entry.sig
        q3 = q.squeeze(2) if sig.q_is_4d else q
        dev = q3.device
        if sig.static is None:  # empty batch
            out, lse = q3.new_empty(q3.shape), q3.new_empty(q3.shape[:2], dtype=torch.float32)
        else:
            flag = _error_flag(dev)
            readback = None
            capturing = dev.type == "cuda" and _capturing(dev)
            if check_values and dev.type == "cuda" and not capturing:
                readback = _READBACKS.get(dev)
                if readback is None:
                    readback = _READBACKS[dev] = _FlagReadback(dev)
                bits = readback.landed_bits()
                if bits:
                    flag.zero_()
                    _raise_flagged(bits)
            if k_scale is None and v_scale is None and k_token_scale is None and v_token_scale is None:
                scales = _NO_SCALES
            else:
                scales = _scales(k_scale, v_scale, k_token_scale, v_token_scale)
            out, lse = _run(
                q3, k, v, mask, seqlens if isinstance(seqlens, torch.Tensor) else None, block_table, flag, scales,
                sig.seqlen_const, sig.scale, sig.grid_len, sig.threshold, sig.plan, sig.static, entry, readback,
                capturing=capturing,
            )  # fmt: skip
            if check_values and dev.type != "cuda":
                _report_flagged_values(dev, k, seqlens, sig, block_table)
    if sig.q_is_4d:
        out = out.unsqueeze(2)
    return (out, lse) if return_lse else out
