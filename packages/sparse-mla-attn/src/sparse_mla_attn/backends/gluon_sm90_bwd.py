"""The backward's ``dkv`` products on Hopper (sm_90), written in Gluon (see ``gluon_sm90`` for why Gluon).

For one token ``s`` and a block of ``64 * N_WG`` of its (sorted) top-k slots, with all of its heads::

    dkv[idx[s, t], c] += sum_h dS[s, h, t] * q[s, h, c] + P[s, h, t] * dout[s, h, c]

(the second term only for the first ``d_v`` channels). ``dS`` / ``P`` come from the main kernel's bf16
workspaces ``[s, h, t]``; the products run on the tensor cores with ``dS`` / ``P`` as the A operand read
transposed from shared memory. The kernel is warp specialised: a producer warpgroup copies the token's
``dS`` / ``P`` columns once and then streams the token's ``q`` / ``dout`` channel chunks through a ring of
shared-memory slots, and ``N_WG`` consumer warpgroups (64 slots each, all reading the same chunk) issue
the products of chunk ``c + 1`` before adding chunk ``c``'s fp32 results into ``dkv`` with vector atomics
(or, in the deterministic mode, storing them to the per-(token, slot) workspace), so the atomics overlap
the tensor cores and each chunk of ``q`` / ``dout`` is read once per ``64 * N_WG`` slots.
"""

from __future__ import annotations

from typing import Any

import torch

from sparse_mla_attn._runtime import LaunchContext, cdiv, launch
from sparse_mla_attn.backends.gluon_sm90 import HAVE_GLUON

if HAVE_GLUON:  # the Gluon modules and names as gluon_sm90 imported them
    from sparse_mla_attn.backends.gluon_sm90 import (
        async_load,
        cp,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        opaque_zero,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    @gluon.jit
    def _dkv_item(item, n_tok, s_kv, q_start_index, k_stride, N_TB: gl.constexpr, TOK_GROUP: gl.constexpr,
                  SLOTS: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
        """Work item ``item`` in launch order (group of ``TOK_GROUP`` tokens, slot block, token): its token
        (int64), first slot and exclusive upper bound of valid indices (causal limit)."""
        grp = item // (TOK_GROUP * N_TB)
        g0 = grp * TOK_GROUP
        g_n = gl.minimum(n_tok - g0, TOK_GROUP)  # the last group may be short
        r = item - g0 * N_TB
        s = (g0 + r % g_n).to(gl.int64)
        t0 = (r // g_n) * SLOTS
        hi = s_kv
        if CAUSAL:
            num = q_start_index + s + 1 - k_stride
            hi = gl.minimum(hi, gl.maximum(num, 0) // k_stride + 1)
        return s, t0, hi

    @gluon.jit
    def _dkv_producer(
        ds_smem, p_smem, q_smem, do_smem, a_bar, full_bars, empty_bars,
        DS, P, Q, DOUT, n_tok, stride_qs, stride_qh, stride_dos, stride_doh, h_q, topk, s_kv,
        q_start_index, k_stride,
        D_V: gl.constexpr, N_CH: gl.constexpr, BLOCK_HD: gl.constexpr, BLOCK_C: gl.constexpr,
        N_WG: gl.constexpr, NUM_BUF: gl.constexpr, N_TB: gl.constexpr, TOK_GROUP: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):  # fmt: skip
        """Producer warpgroup: the token's dS / P columns of the slot block (``a_bar``), then the ``q`` /
        ``dout`` channel chunks into the ring (``full_bars`` / ``empty_bars``). Heads past ``h_q``, slots
        past ``topk`` and ``dout`` past ``D_V`` are zero-filled (``cp.async`` with zero source size)."""
        item = gl.program_id(0)
        s, t0, _ = _dkv_item(item, n_tok, s_kv, q_start_index, k_stride, N_TB, TOK_GROUP, 64 * N_WG, CAUSAL)
        z = opaque_zero(item)  # (else every copy's address is hoisted into the kernel's prologue and spills)
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_h = z + gl.arange(0, BLOCK_HD, layout=gl.SliceLayout(1, ld_l))
        h_ok = offs_h < h_q
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, ld_l))
        ws_base = s * h_q * topk
        for w in gl.static_range(N_WG):
            t = t0 + w * 64 + cols
            m = h_ok[:, None] & (t < topk)[None, :]
            off = ws_base + (offs_h[:, None] * topk + t[None, :])
            async_load(ds_smem.index(w), DS + off, mask=m)
            async_load(p_smem.index(w), P + off, mask=m)
        cp.mbarrier_arrive(a_bar, increment_count=False)
        # The chunks' copies: 16-byte vectors, BLOCK_C // 8 threads per row.
        ldc_l: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BLOCK_C, BLOCK_C // 8], [4, 1], [1, 0])
        offs_hc = z + gl.arange(0, BLOCK_HD, layout=gl.SliceLayout(1, ldc_l))
        hc_ok = offs_hc < h_q
        ccols = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, ldc_l))
        q_rows = Q + s * stride_qs + offs_hc[:, None] * stride_qh
        do_rows = DOUT + s * stride_dos + offs_hc[:, None] * stride_doh
        for c in range(N_CH):
            slot = c % NUM_BUF
            mbarrier.wait(empty_bars.index(slot), ((c // NUM_BUF) & 1) ^ 1)
            ch = c * BLOCK_C + ccols
            async_load(q_smem.index(slot), q_rows + ch[None, :], mask=hc_ok[:, None] & (ch >= 0)[None, :])
            # The rope channels' chunks get a zero dout (their P^T dout term vanishes).
            async_load(do_smem.index(slot), do_rows + ch[None, :], mask=hc_ok[:, None] & (ch < D_V)[None, :])
            cp.mbarrier_arrive(full_bars.index(slot), increment_count=False)

    @gluon.jit
    def _dkv_emit(DKV, PART, SCALE, out_ptrs_row, part_row, scale_row, acc, valid, in_topk, c, cols,
                  st_l: gl.constexpr, BLOCK_C: gl.constexpr, DETERMINISTIC: gl.constexpr,
                  HALF: gl.constexpr, EVICT: gl.constexpr):  # fmt: skip
        """Add one chunk's ``[64, BLOCK_C]`` fp32 products into dkv (atomics), or store them to the
        deterministic workspace: fp32, or with ``HALF`` fp16 times ``2^k`` per (slot, chunk), ``2^-k`` to
        ``SCALE`` (as ``backward._dkv_update``); ``EVICT``: workspace stores evict-first in L2."""
        vals = gl.convert_layout(acc, st_l)
        ch = c * BLOCK_C + cols
        if DETERMINISTIC:
            m = in_topk[:, None] & (ch >= 0)[None, :]
            if HALF:
                e = (gl.max(gl.abs(vals), axis=1).to(gl.int32, bitcast=True) >> 23) & 0xFF
                k = gl.minimum(141 - e, 126)
                up = ((k + 127) << 23).to(gl.float32, bitcast=True)
                half = (vals * up[:, None]).to(gl.float16)
                if EVICT:
                    gl.store(
                        PART + part_row[:, None] + ch[None, :], half, mask=m, eviction_policy="evict_first"
                    )
                else:
                    gl.store(PART + part_row[:, None] + ch[None, :], half, mask=m)
                gl.store(SCALE + scale_row + c, ((127 - k) << 23).to(gl.float32, bitcast=True), mask=in_topk)
            elif EVICT:
                gl.store(PART + part_row[:, None] + ch[None, :], vals, mask=m, eviction_policy="evict_first")
            else:
                gl.store(PART + part_row[:, None] + ch[None, :], vals, mask=m)
        else:
            gl.atomic_add(
                DKV + out_ptrs_row[:, None] + ch[None, :],
                vals,
                mask=valid[:, None] & (ch >= 0)[None, :],
                sem="relaxed",
            )

    @gluon.jit
    def _dkv_consumer(
        WG: gl.constexpr, ds_smem, p_smem, q_smem, do_smem, a_bar, full_bars, empty_bars,
        IDX, DKV, PART, SCALE, n_tok, stride_is, topk, s_kv, q_start_index, k_stride,
        D_QK: gl.constexpr, N_CH: gl.constexpr, BLOCK_C: gl.constexpr, N_WG: gl.constexpr,
        NUM_BUF: gl.constexpr, N_TB: gl.constexpr, TOK_GROUP: gl.constexpr, CAUSAL: gl.constexpr,
        DETERMINISTIC: gl.constexpr, HALF: gl.constexpr, EVICT: gl.constexpr,
    ):  # fmt: skip
        """Consumer warpgroup ``WG``: slots ``t0 + 64 WG ..`` of the token, every channel chunk. The
        products of chunk ``c`` are issued before chunk ``c - 1``'s results are added."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_C, 16]
        )
        # Each thread adds 4 consecutive fp32 (one 16-byte vector atomic) per row.
        st_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // BLOCK_C, BLOCK_C // 4], [4, 1], [1, 0])
        item = gl.program_id(0)
        s, t0, hi = _dkv_item(item, n_tok, s_kv, q_start_index, k_stride, N_TB, TOK_GROUP, 64 * N_WG, CAUSAL)
        z = opaque_zero(item)
        # An opaque zero keeps the column offsets in the partition (see the producer); the hints keep
        # the 16-byte vector atomics.
        cols = gl.max_contiguous(
            gl.multiple_of(z + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, st_l)), BLOCK_C), BLOCK_C
        )
        zero = gl.zeros([64, BLOCK_C], gl.float32, acc_l)
        offs_t = t0 + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, st_l))
        in_topk = offs_t < topk
        idx = gl.load(IDX + s * stride_is + offs_t, mask=in_topk, other=-1)
        valid = (idx >= 0) & (idx < hi)
        rows = gl.where(valid, idx, 0).to(gl.int64) * D_QK
        part_row = (s * topk + offs_t) * D_QK
        scale_row = (s * topk + offs_t) * N_CH
        mbarrier.wait(a_bar, 0)
        fence_async_shared()  # the producer's cp.async writes, read next by wgmma (async proxy)
        a_ds = ds_smem.index(WG).permute((1, 0))  # [64 slots, heads], slots contiguous
        a_p = p_smem.index(WG).permute((1, 0))
        mbarrier.wait(full_bars.index(0), 0)
        fence_async_shared()
        acc = warpgroup_mma(a_ds, q_smem.index(0), zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(a_p, do_smem.index(0), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty_bars.index(0))
        for c in range(1, N_CH):
            slot = c % NUM_BUF
            mbarrier.wait(full_bars.index(slot), (c // NUM_BUF) & 1)
            fence_async_shared()
            nxt = warpgroup_mma(a_ds, q_smem.index(slot), zero, use_acc=False, is_async=True)
            nxt = warpgroup_mma(a_p, do_smem.index(slot), nxt, is_async=True)
            _dkv_emit(DKV, PART, SCALE, rows, part_row, scale_row, acc, valid, in_topk, c - 1, cols, st_l,
                      BLOCK_C, DETERMINISTIC, HALF, EVICT)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt,))
            mbarrier.arrive(empty_bars.index(slot))
        _dkv_emit(DKV, PART, SCALE, rows, part_row, scale_row, acc, valid, in_topk, N_CH - 1, cols, st_l,
                  BLOCK_C, DETERMINISTIC, HALF, EVICT)  # fmt: skip

    @gluon.jit
    def _dkv_ws_kernel(
        DS, P, Q, DOUT, IDX, DKV, PART, SCALE,
        n_tok, stride_qs, stride_qh, stride_dos, stride_doh, stride_is,
        s_kv, h_q, q_start_index, k_stride,
        topk: gl.constexpr, CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr, HALF: gl.constexpr,
        EVICT: gl.constexpr, D_QK: gl.constexpr, D_V: gl.constexpr, BLOCK_HD: gl.constexpr,
        BLOCK_C: gl.constexpr, N_WG: gl.constexpr,
        NUM_BUF: gl.constexpr, N_TB: gl.constexpr, TOK_GROUP: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """dkv products of one (token, block of ``64 * N_WG`` slots) work item per program, every head
        (``BLOCK_HD >= h_q``).

        Launch order as the Triton dkv kernel's: (group of ``TOK_GROUP`` tokens, slot block, token), so the
        programs in flight share a slot block and, with sorted slots, add into a narrow range of rows.
        Default partition = consumer warpgroup 0, workers = the other consumer and the producer."""
        gl.static_assert(num_warps == 4)
        gl.static_assert(N_WG == 2)
        N_CH: gl.constexpr = D_QK // BLOCK_C
        dtype: gl.constexpr = Q.dtype.element_ty
        a_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        b_l: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=min(128, 2 * BLOCK_C), element_bitwidth=16, rank=2
        )
        ds_smem = gl.allocate_shared_memory(dtype, [N_WG, BLOCK_HD, 64], a_l)
        p_smem = gl.allocate_shared_memory(dtype, [N_WG, BLOCK_HD, 64], a_l)
        q_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_HD, BLOCK_C], b_l)
        do_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_HD, BLOCK_C], b_l)
        a_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
        mbarrier.init(a_bar, count=128)
        full_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(NUM_BUF):
            mbarrier.init(full_bars.index(j), count=128)
            mbarrier.init(empty_bars.index(j), count=N_WG)
        fence_async_shared()  # barrier initialisation, before any partition uses them
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        gl.warp_specialize(
            [
                (_dkv_consumer, (
                    WG0, ds_smem, p_smem, q_smem, do_smem, a_bar, full_bars, empty_bars, IDX, DKV, PART,
                    SCALE, n_tok, stride_is, topk, s_kv, q_start_index, k_stride, D_QK, N_CH, BLOCK_C, N_WG,
                    NUM_BUF, N_TB, TOK_GROUP, CAUSAL, DETERMINISTIC, HALF, EVICT,
                )),
                (_dkv_consumer, (
                    WG1, ds_smem, p_smem, q_smem, do_smem, a_bar, full_bars, empty_bars, IDX, DKV, PART,
                    SCALE, n_tok, stride_is, topk, s_kv, q_start_index, k_stride, D_QK, N_CH, BLOCK_C, N_WG,
                    NUM_BUF, N_TB, TOK_GROUP, CAUSAL, DETERMINISTIC, HALF, EVICT,
                )),
                (_dkv_producer, (
                    ds_smem, p_smem, q_smem, do_smem, a_bar, full_bars, empty_bars, DS, P, Q, DOUT, n_tok,
                    stride_qs, stride_qh, stride_dos, stride_doh, h_q, topk, s_kv, q_start_index, k_stride, D_V,
                    N_CH, BLOCK_HD, BLOCK_C, N_WG, NUM_BUF, N_TB, TOK_GROUP, CAUSAL,
                )),
            ],
            [4, 4],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


def dkv_gluon_eligible(h_q: int, d_qk: int, d_v: int, topk: int, block_c: int) -> bool:
    """Whether the Gluon dkv kernel covers this problem: at most 128 heads, channel counts and ``topk``
    that its 16-byte copies and ``block_c``-channel chunks tile exactly."""
    return h_q <= 128 and d_v % block_c == 0 and d_qk % block_c == 0 and topk % 8 == 0 and d_qk <= 1024


def launch_dkv_gluon(
    ds_ws: torch.Tensor, p_ws: torch.Tensor, q_c: torch.Tensor, do_c: torch.Tensor, idx_c: torch.Tensor,
    dkv32: torch.Tensor, part: torch.Tensor, scale: torch.Tensor, n: int, s_kv: int, h_q: int,
    q_start_index: int, k_stride: int, topk: int, causal: bool, deterministic: bool, half: bool, d_qk: int,
    d_v: int, cfg: dict[str, int],
    slots: dict[Any, Any] | None, name: Any, ctx: LaunchContext | None = None,
) -> Any:  # fmt: skip
    """The dkv products of a chunk of ``n`` tokens (see ``_dkv_ws_kernel``); ``cfg`` gives ``BLOCK_C_G``
    (channels per chunk), ``NUM_BUF_G`` (ring slots), ``TOK_GROUP`` and the register split. ``ctx``: the
    call's :func:`~sparse_mla_attn._runtime.launch_context`, if known."""
    n_wg = 2
    n_tb = cdiv(topk, 64 * n_wg)
    block_hd = max(16, 1 << (h_q - 1).bit_length())
    return launch(
        _dkv_ws_kernel, (n * n_tb,), slots, name,
        (ds_ws, p_ws, q_c, do_c, idx_c, dkv32, part, scale, n, q_c.stride(0), q_c.stride(1), do_c.stride(0),
         do_c.stride(1), idx_c.stride(0), s_kv, h_q, q_start_index, k_stride),
        lambda: dict(topk=topk, CAUSAL=causal, DETERMINISTIC=deterministic, HALF=half,
             EVICT=bool(cfg["DET_EVICT"]) and deterministic, D_QK=d_qk, D_V=d_v,
             BLOCK_HD=block_hd,
             BLOCK_C=cfg["BLOCK_C_G"], N_WG=n_wg, NUM_BUF=cfg["NUM_BUF_G"], N_TB=n_tb,
             TOK_GROUP=cfg["TOK_GROUP"], CONSUMER_REGS=cfg["CONSUMER_REGS_G"],
             PRODUCER_REGS=cfg["PRODUCER_REGS_G"], num_warps=4),
        ctx,
    )  # fmt: skip
