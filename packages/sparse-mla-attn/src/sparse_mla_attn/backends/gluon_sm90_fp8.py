"""Hopper (sm_90) sparse decode over FlashMLA's FP8 KV cache, in Gluon.

The bf16 decode's pipeline (64 heads per program, blocks of 64 top-k rows in a ring of two bf16
shared-memory slots, warp specialised) with a producer warpgroup that dequantizes
(``_fp8_producer``): it loads each 128-channel tile of a block's latent bytes into registers (16-byte
loads) three tiles before it dequantizes it (``_dequant_e4m3_pairs``: bit operations and bf16 products,
exact for power-of-two scales) into the block's slot, so the next tiles' loads are in flight while one is
dequantized; the rope values go straight into the rope slot (``cp.async``) and the rows of the block
after next are prefetched into L2. Each slot is four allocations of 128 channels: the compiler orders
stores to one allocation with warpgroup barriers, to four not.

Consumer warpgroup 0 computes each block's scores, softmax and P·V for value channels 0..255, consumer
warpgroup 1 P·V for channels 256..511 with the P warpgroup 0 publishes, so both are done with block ``b``
before ``b + 1`` starts and its slot can take block ``b + 2`` while they work on ``b + 1``. Split-K
partials are merged by the forward's merge kernel. The kernel uses the bf16 kernel's shared memory. Rows
whose index is invalid are zero-filled (never read).
"""

from __future__ import annotations

from typing import Any

import torch

from sparse_mla_attn._runtime import LaunchContext, cdiv, launch
from sparse_mla_attn._validate import SparseDims
from sparse_mla_attn.backends.gluon_sm90 import HAVE_GLUON
from sparse_mla_attn.fp8_cache import FP8_TOKEN_BYTES

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from sparse_mla_attn.backends.gluon_sm90 import (
        _FwdItems,
        _load_q_rows,
        _online_softmax,
        _ws_wait_full,
        async_load,
        cta_barrier,
        opaque_zero,
    )

    # ``shared_memory_descriptor._reinterpret`` is public (``reinterpret``) from Triton 3.9 on.
    SMEM_REINTERPRET_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def _as_int64_tiles(kt, NUM_BUF: gl.constexpr, BLOCK_T: gl.constexpr, layout: gl.constexpr):
        """The ring's bf16 tiles ``kt`` ``[NUM_BUF, BLOCK_T, 128]`` viewed as int64s (4 bf16 each)."""
        if SMEM_REINTERPRET_PUBLIC:
            return kt.reinterpret(gl.int64, [NUM_BUF, BLOCK_T, 32], layout)
        else:
            return kt._reinterpret(gl.int64, [NUM_BUF, BLOCK_T, 32], layout)

    @gluon.jit
    def _fp8_rows(idx, hi, kv_block_size: gl.constexpr, stride_kv_block, TOKEN_BYTES: gl.constexpr):
        """Byte offsets of cache rows ``idx`` (row ``block * kv_block_size + t``) and their validity."""
        valid = (idx >= 0) & (idx < hi)
        safe = gl.where(valid, idx, 0)
        row = (safe // kv_block_size).to(gl.int64) * stride_kv_block + (safe % kv_block_size).to(
            gl.int64
        ) * TOKEN_BYTES
        return row, valid

    @gluon.jit
    def _prefetch_lines(
        KV8,
        idx_row,
        k,
        n_blocks,
        n_t,
        hi,
        kv_block_size: gl.constexpr,
        stride_kv_block,
        BLOCK_T: gl.constexpr,
    ):
        """Prefetch the cache rows of block ``k`` (if ``k < n_blocks``) into L2, 128-byte line by line
        (``prefetch.global.L2``: per-thread addresses, 6 lines per 656-byte row, 3 per thread)."""
        pf_l: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])
        offs = k * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, pf_l))
        line = gl.arange(0, 8, layout=gl.SliceLayout(0, pf_l))
        row, valid = _fp8_rows(
            gl.load(idx_row + offs, mask=offs < n_t, other=-1), hi, kv_block_size, stride_kv_block, 656
        )
        ok = (valid & (k < n_blocks))[:, None] & (line < 6)[None, :]
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
            "=r,l,r",
            [KV8 + row[:, None] + 128 * line[None, :], ok.to(gl.int32)],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _scale_pairs(scale):
        """The two bf16 factors of ``_dequant_e4m3_pairs`` for the float32 row scales ``scale``, each as a bf16
        pair in an int32 (``min(scale, 1) * 2**120`` and ``max(scale, 1)``): converted once per row, not
        once per value."""
        lo = gl.minimum(scale, 1.0) * 1.329227995784916e36  # 2**120
        hi = gl.maximum(scale, 1.0)
        return gl.inline_asm_elementwise(
            "cvt.rn.bf16x2.f32 $0, $2, $2; cvt.rn.bf16x2.f32 $1, $3, $3;",
            "=r,=r,f,f",
            [lo, hi],
            dtype=(gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _dequant_e4m3_pairs(x32, lo2, hi2):
        """``float8_e4m3fn`` bytes packed four to an int32 (``x32 [R, C]``, value ``i`` in byte ``i``) times
        the float32 row scales whose factors ``_scale_pairs`` gives (``lo2``, ``hi2`` ``[R]``), in bf16: the
        four values of each int32 packed in an int64 (value ``i`` in bits ``16 i ..``).

        Without conversion instructions (few per clock on sm_90): each byte's sign, exponent and mantissa
        are moved into a bf16 (its value times ``2**-120``, subnormals included) by three integer
        operations per two values (a byte permute that sign-extends, a shift, a mask), which is multiplied by
        ``min(scale, 1) * 2**120`` and by ``max(scale, 1)``, both rounded to bf16. For power-of-two
        scales both products are exact, so this is ``fp8 * scale`` exactly; other scales are rounded to
        bf16 first."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1;
            prmt.b32 t0, $1, 0, 0x9180;
            prmt.b32 t1, $1, 0, 0xB3A2;
            shl.b32 t0, t0, 4;
            shl.b32 t1, t1, 4;
            and.b32 t0, t0, 0x87F087F0;
            and.b32 t1, t1, 0x87F087F0;
            mul.rn.bf16x2 t0, t0, $2;
            mul.rn.bf16x2 t1, t1, $2;
            mul.rn.bf16x2 t0, t0, $3;
            mul.rn.bf16x2 t1, t1, $3;
            mov.b64 $0, {t0, t1};
            }""",
            "=l,r,r,r",
            [x32, lo2[:, None], hi2[:, None]],
            dtype=gl.int64,
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _dequant_tile(x32, scale):
        """``_dequant_e4m3_pairs`` of a tile with its float32 row scales."""
        lo2, hi2 = _scale_pairs(scale)
        return _dequant_e4m3_pairs(x32, lo2, hi2)

    @gluon.jit
    def _fp8_tile(KV32, row, valid, cols, j: gl.constexpr):
        """Latent bytes ``[128 j, 128 j + 128)`` of the cache rows at byte offsets ``row``, four to an int32
        (zeros where not ``valid``; 16-byte loads), and their float32 scale ``j`` (0 where not ``valid``)."""
        base = row // 4
        x32 = gl.load(KV32 + base[:, None] + (32 * j + cols)[None, :], mask=valid[:, None] & (cols[None, :] >= 0),
                      other=0)  # fmt: skip
        scale = gl.load(
            KV32.to(gl.pointer_type(gl.float32), bitcast=True) + base + 128 + j, mask=valid, other=0.0
        )
        return x32, scale

    @gluon.jit
    def _fp8_producer(
        kt0,
        kt1,
        kt2,
        kt3,
        kr_smem,
        full_bars,
        empty_bars,
        KV,
        kv_block_size: gl.constexpr,
        stride_kv_block,
        idx_row,
        n_t,
        hi,
        n_blocks,
        BLOCK_T: gl.constexpr,
        NUM_BUF: gl.constexpr,
    ):
        """Producer warpgroup of the FP8 decode: the latent bytes of a block arrive in four 128-channel tiles
        (16-byte loads into registers, one scale each), each loaded three tiles before it is dequantized
        (``_dequant_e4m3_pairs``) and stored in bf16 into the block's slot of its tile allocation (``kt0``
        .. ``kt3``); the rope values go straight into the rope slot (``cp.async``), and the rows of block
        ``b + 2`` are prefetched into L2 (``_prefetch_lines``). ``full_bars[s]`` completes once per block:
        one arrive after the stores, and one ``cp.async`` arrival per thread for the rope rows."""
        D_NOPE: gl.constexpr = 512
        # A warp covers 4 rows x 128 latent bytes (4 int32 per thread) or x 64 bf16 rope values (8 per thread).
        ld_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        KV8 = KV.to(gl.pointer_type(gl.uint8), bitcast=True)
        KV16 = KV.to(gl.pointer_type(gl.bfloat16), bitcast=True)
        KV32 = KV.to(gl.pointer_type(gl.int32), bitcast=True)
        # The slots' tiles as int64s (4 bf16 each, the bytes of the bf16 view).
        i64_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=64, rank=2)
        k64_0 = _as_int64_tiles(kt0, NUM_BUF, BLOCK_T, i64_l)
        k64_1 = _as_int64_tiles(kt1, NUM_BUF, BLOCK_T, i64_l)
        k64_2 = _as_int64_tiles(kt2, NUM_BUF, BLOCK_T, i64_l)
        k64_3 = _as_int64_tiles(kt3, NUM_BUF, BLOCK_T, i64_l)
        offs_t = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, ld_l))
        cols = gl.arange(0, 32, layout=gl.SliceLayout(0, ld_l))
        cols_r = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_l))
        # Block 0's rows and first tiles, block 1's indices.
        row_c, valid_c = _fp8_rows(
            gl.load(idx_row + offs_t, mask=offs_t < n_t, other=-1), hi, kv_block_size, stride_kv_block, 656
        )
        nxt = BLOCK_T + offs_t
        idx_n = gl.load(idx_row + nxt, mask=nxt < n_t, other=-1)
        x0, s0 = _fp8_tile(KV32, row_c, valid_c, cols, 0)
        x1, s1 = _fp8_tile(KV32, row_c, valid_c, cols, 1)
        x2, s2 = _fp8_tile(KV32, row_c, valid_c, cols, 2)
        _prefetch_lines(KV8, idx_row, 1, n_blocks, n_t, hi, kv_block_size, stride_kv_block, BLOCK_T)
        for b in range(n_blocks):
            slot = b % NUM_BUF
            row_n, valid_n = _fp8_rows(idx_n, hi, kv_block_size, stride_kv_block, 656)
            valid_n = valid_n & (b + 1 < n_blocks)
            nxt = (b + 2) * BLOCK_T + offs_t
            idx_n = gl.load(idx_row + nxt, mask=nxt < n_t, other=-1)
            # Slot free: its readers arrived for block b - NUM_BUF (a fresh barrier passes parity 1 at once).
            mbarrier.wait(empty_bars.index(slot), ((b // NUM_BUF) & 1) ^ 1)
            row_r = gl.convert_layout(row_c, gl.SliceLayout(1, rope_l), assert_trivial=True)
            valid_r = gl.convert_layout(valid_c, gl.SliceLayout(1, rope_l), assert_trivial=True)
            async_load(
                kr_smem.index(slot),
                KV16 + ((row_r + D_NOPE + 16) // 2)[:, None] + cols_r[None, :],
                mask=valid_r[:, None] & (cols_r[None, :] >= 0),
            )
            # The rope rows complete the block's barrier themselves (128 arrivals without count, see the
            # kernel), so the producer never waits for them.
            cp.mbarrier_arrive(full_bars.index(slot), increment_count=False)
            # The rows of the block after next into L2, so their loads do not wait on HBM.
            _prefetch_lines(KV8, idx_row, b + 2, n_blocks, n_t, hi, kv_block_size, stride_kv_block, BLOCK_T)
            # Each tile: the gather three tiles ahead issued, then this tile dequantized and stored.
            x3, s3 = _fp8_tile(KV32, row_c, valid_c, cols, 3)
            k64_0.index(slot).store(_dequant_tile(x0, s0))
            x0, s0 = _fp8_tile(KV32, row_n, valid_n, cols, 0)
            k64_1.index(slot).store(_dequant_tile(x1, s1))
            x1, s1 = _fp8_tile(KV32, row_n, valid_n, cols, 1)
            k64_2.index(slot).store(_dequant_tile(x2, s2))
            x2, s2 = _fp8_tile(KV32, row_n, valid_n, cols, 2)
            k64_3.index(slot).store(_dequant_tile(x3, s3))
            row_c, valid_c = row_n, valid_n
            # The bf16 tile (generic-proxy writes of 128 threads) is read next by wgmma: fence, meet, arrive.
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(full_bars.index(slot))

    @gluon.jit
    def _softmax_publish(s, t_idx, hi, m_i, l_i, sm_scale_log2, p_smem, a_smem, p_ready, p_free, b):
        """Consumer warpgroup 0's online softmax of a block's scores ``s`` (columns whose index ``t_idx``
        is invalid masked), its P and rescale factors published to warpgroup 1 (``p_smem`` / ``a_smem``,
        ``p_ready``, once warpgroup 1 has read the previous block's: ``p_free``). Returns P in bf16, the
        factors and the new row maxima and sums."""
        p, alpha, m_new, l_i = _online_softmax(s, t_idx, hi, m_i, l_i, sm_scale_log2)
        p16 = p.to(p_smem.dtype)
        # Warpgroup 1 has read the previous block's P and factors (a fresh barrier passes parity 1).
        mbarrier.wait(p_free, (b & 1) ^ 1)
        p_smem.store(p16)
        a_smem.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready)
        return p16, alpha, m_new, l_i

    @gluon.jit
    def _sv_epilogue(m_i, l_i, l_smem, end_bar, MAX_LOGITS, LSE, item):
        """Consumer warpgroup 0's end: the row sums to warpgroup 1, the lse and row maxima stored (natural
        log, or base 2 for split-K partials); returns the rows' output factors ``1 / l`` (0 for empty
        rows)."""
        l_smem.store(l_i)
        mbarrier.arrive(end_bar)
        offs_hs = item.h0 + gl.arange(0, 64, layout=m_i.type.layout)
        hs_ok = offs_hs < item.h_q
        m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
        has_any = l_i > 0.0
        scale = gl.where(has_any, 1.0 / gl.where(has_any, l_i, 1.0), 0.0)
        if item.SPLIT_K:
            to_out = 1.0
        else:
            to_out = 0.6931471805599453
        lse2 = gl.where(has_any, m_use + gl.log2(gl.where(has_any, l_i, 1.0)), float("-inf"))
        gl.store(LSE + item.lse_base + offs_hs, lse2 * to_out, mask=hs_ok)
        gl.store(MAX_LOGITS + item.lse_base + offs_hs, m_i * to_out, mask=hs_ok)
        return scale

    @gluon.jit
    def _sv_consumer(
        qn_smem,
        qr_smem,
        kt0,
        kt1,
        kt2,
        kt3,
        kr_smem,
        p_smem,
        a_smem,
        l_smem,
        full_bars,
        empty_bars,
        p_ready,
        p_free,
        end_bar,
        item,
        OUT,
        MAX_LOGITS,
        LSE,
        n_blocks,
        sm_scale_log2,
        BLOCK_T: gl.constexpr,
    ):
        """Consumer warpgroup 0: for every block, S (m64n64 from shared memory, four 128-channel k-chunks
        and the rope), the online softmax, P and the rescale factors published to warpgroup 1 (``p_smem`` /
        ``a_smem``, ``p_ready``), and P·V for value channels 0..255 (tiles 0 and 1) from registers; then
        the block's slot is released. Both warpgroups are done with block ``b`` before block ``b + 1`` is
        consumed, so while they work on ``b + 1`` the producer fills ``b``'s slot with ``b + 2``. Writes the
        outputs as ``_pp_consumer`` does (split-K partials with ``SPLIT_K``)."""
        BLOCK_H: gl.constexpr = 64
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_T, 16]
        )
        o_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]
        )
        pa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_l)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BLOCK_H], gl.float32, row_l)
        acc0 = gl.zeros([BLOCK_H, 128], gl.float32, o_l)
        acc1 = gl.zeros([BLOCK_H, 128], gl.float32, o_l)
        offs_c = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, s_l))
        for b in range(n_blocks):
            slot = b % 2
            z = opaque_zero(b)  # (keeps the S descriptors from being hoisted out of the loop)
            _ws_wait_full(full_bars, b, 2)
            t_idx = gl.load(
                item.idx_row + b * BLOCK_T + offs_c, mask=b * BLOCK_T + offs_c < item.n_t, other=-1
            )
            q = qn_smem.index(z)
            s = gl.zeros([BLOCK_H, BLOCK_T], gl.float32, s_l)
            s = warpgroup_mma(q.slice(0, 128, dim=1), kt0.index(slot + z).permute((1, 0)), s, use_acc=False,
                              is_async=True)  # fmt: skip
            s = warpgroup_mma(q.slice(128, 128, dim=1), kt1.index(slot + z).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(q.slice(256, 128, dim=1), kt2.index(slot + z).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(q.slice(384, 128, dim=1), kt3.index(slot + z).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qr_smem.index(z), kr_smem.index(slot + z).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p16, alpha, m_i, l_i = _softmax_publish(
                s, t_idx, item.hi, m_i, l_i, sm_scale_log2, p_smem, a_smem, p_ready, p_free, b
            )
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            p_op = gl.convert_layout(p16, pa_l)
            acc0 = warpgroup_mma(p_op, kt0.index(slot), acc0 * alpha_o, is_async=True)
            acc1 = warpgroup_mma(p_op, kt1.index(slot), acc1 * alpha_o, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            mbarrier.arrive(empty_bars.index(slot))
        scale = gl.convert_layout(
            _sv_epilogue(m_i, l_i, l_smem, end_bar, MAX_LOGITS, LSE, item),
            gl.SliceLayout(1, o_l),
        )[:, None]
        _store_cols(acc0 * scale, OUT, item, 0, o_l)
        _store_cols(acc1 * scale, OUT, item, 128, o_l)

    @gluon.jit
    def _v_consumer(
        kt2,
        kt3,
        p_smem,
        a_smem,
        l_smem,
        empty_bars,
        p_ready,
        p_free,
        end_bar,
        OUT,
        item,
        n_blocks,
    ):
        """Consumer warpgroup 1: P·V for value channels 256..511 (tiles 2 and 3) of every block, with P and
        the rescale factors warpgroup 0 published; the row sums come from warpgroup 0 at the end."""
        BLOCK_H: gl.constexpr = 64
        o_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]
        )
        acc2 = gl.zeros([BLOCK_H, 128], gl.float32, o_l)
        acc3 = gl.zeros([BLOCK_H, 128], gl.float32, o_l)
        for b in range(n_blocks):
            slot = b % 2
            mbarrier.wait(p_ready, b & 1)
            alpha = a_smem.load(gl.SliceLayout(1, o_l))[:, None]
            acc2 = warpgroup_mma(p_smem, kt2.index(slot), acc2 * alpha, is_async=True)
            acc3 = warpgroup_mma(p_smem, kt3.index(slot), acc3 * alpha, is_async=True)
            acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc2, acc3))
            mbarrier.arrive(p_free)
            mbarrier.arrive(empty_bars.index(slot))
        mbarrier.wait(end_bar, 0)
        l_i = l_smem.load(gl.SliceLayout(1, o_l))
        scale = gl.where(l_i > 0.0, 1.0 / gl.where(l_i > 0.0, l_i, 1.0), 0.0)[:, None]
        _store_cols(acc2 * scale, OUT, item, 256, o_l)
        _store_cols(acc3 * scale, OUT, item, 384, o_l)

    @gluon.jit
    def _store_cols(out, OUT, item, COL0: gl.constexpr, o_l: gl.constexpr):
        """Store value channels ``COL0 ..`` (as many as ``out`` has columns) of a 64-head output tile (rows
        past ``h_q`` masked)."""
        N: gl.constexpr = out.shape[1]
        offs_ho = item.h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_l))
        offs_d = COL0 + gl.arange(0, N, layout=gl.SliceLayout(0, o_l))
        o_ptr = OUT + item.out_base + offs_ho[:, None] * item.stride_o_h + offs_d[None, :]
        gl.store(
            o_ptr, out.to(OUT.dtype.element_ty), mask=(offs_ho < item.h_q)[:, None] & (offs_d[None, :] >= 0)
        )

    @gluon.jit
    def _sparse_mla_decode_fp8_kernel(
        Q,
        KV,
        IDX,
        OUT,
        MAX_LOGITS,
        LSE,
        stride_q_s,
        stride_q_h,
        stride_idx_s,
        stride_o_s,
        stride_o_h,
        h_q,
        n_head_tiles,
        topk,
        s_kv,
        stride_kv_block,
        sm_scale_log2,
        n_tok,
        split_len,
        KV_BLOCK: gl.constexpr,
        BLOCK_T: gl.constexpr,
        V_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
        SPLIT_K: gl.constexpr = False,
    ):
        """Decode over an FP8 cache for one token and 64 heads (or one split of its top-k list, as the bf16
        kernel), 12 warp-specialised warps: default partition = consumer warpgroup 0 (``_sv_consumer``),
        worker 0 = consumer warpgroup 1 (``_v_consumer``), worker 1 = the FP8 producer
        (``_fp8_producer``). ``KV`` is the cache's bytes (``float8_e4m3fn`` or ``uint8``), ``IDX`` cache
        rows (``[0, s_kv)`` valid)."""
        gl.static_assert(num_warps == 4)
        gl.static_assert(BLOCK_T == 64)
        D_NOPE: gl.constexpr = 512
        D_ROPE: gl.constexpr = 64
        BLOCK_H: gl.constexpr = 64
        pid = gl.program_id(0)
        item = _FwdItems(  # type: ignore[call-arg]
            IDX, IDX, stride_idx_s, stride_o_s, stride_o_h, h_q, n_head_tiles, topk, s_kv, 0, 1, n_tok,
            split_len, None, None, None, None, None, None, None, D_NOPE, BLOCK_T, False, False, SPLIT_K, False,
            False, False,
        ).get(pid)  # fmt: skip
        n_blocks = gl.cdiv(item.n_t, BLOCK_T)
        smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        stat_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        dtype: gl.constexpr = Q.dtype.element_ty
        # Leading axis of 1: the consumer indexes it with opaque_zero.
        qn_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_NOPE], smem_l)
        qr_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_ROPE], smem_l)
        # The two slots, as one allocation per 128-channel tile (see the module docstring).
        kt0 = gl.allocate_shared_memory(dtype, [2, BLOCK_T, 128], smem_l)
        kt1 = gl.allocate_shared_memory(dtype, [2, BLOCK_T, 128], smem_l)
        kt2 = gl.allocate_shared_memory(dtype, [2, BLOCK_T, 128], smem_l)
        kt3 = gl.allocate_shared_memory(dtype, [2, BLOCK_T, 128], smem_l)
        kr_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_T, D_ROPE], smem_l)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_T], smem_l)
        a_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], stat_l)  # P's rescale factors
        l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], stat_l)  # row sums
        full_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_sync = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(2):
            # The producer's one arrive per block and its threads' rope copies (cp.async arrivals).
            mbarrier.init(full_bars.index(j), count=129)
            mbarrier.init(empty_bars.index(j), count=2)  # both consumers read every block
        for j in gl.static_range(3):
            mbarrier.init(p_sync.index(j), count=1)  # P ready, P read, row sums ready
        for w in gl.static_range(2):
            _load_q_rows(
                w, qn_smem, qr_smem, Q, stride_q_s, stride_q_h, item.pid_s, item.h0, h_q, D_NOPE, D_ROPE
            )
        fence_async_shared()  # the query tile and the barriers, before the partitions use them
        gl.warp_specialize(
            [
                (_sv_consumer, (
                    qn_smem, qr_smem, kt0, kt1, kt2, kt3, kr_smem, p_smem, a_smem, l_smem, full_bars, empty_bars,
                    p_sync.index(0), p_sync.index(1), p_sync.index(2), item, OUT, MAX_LOGITS, LSE, n_blocks,
                    sm_scale_log2, BLOCK_T,
                )),
                (_v_consumer, (
                    kt2, kt3, p_smem, a_smem, l_smem, empty_bars, p_sync.index(0), p_sync.index(1),
                    p_sync.index(2), OUT, item, n_blocks,
                )),
                (_fp8_producer, (
                    kt0, kt1, kt2, kt3, kr_smem, full_bars, empty_bars, KV, KV_BLOCK, stride_kv_block,
                    item.idx_row, item.n_t, item.hi, n_blocks, BLOCK_T, 2,
                )),
            ],
            [4, 4],
            [V_REGS, PRODUCER_REGS],
        )  # fmt: skip


#: Register split (``setmaxnreg``) of the warpgroups of 384 threads (504 per thread in all): the S + P·V
#: consumer 208 (the default partition: the rest), the P·V consumer 160, the producer 136 (its tiles of
#: loads in flight).
FP8_V_REGS = 160
FP8_PRODUCER_REGS = 136


def launch_decode_fp8_gluon(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    max_logits: torch.Tensor,
    lse: torch.Tensor,
    dims: SparseDims,
    sm_scale_log2: float,
    *,
    kv_paging: tuple[int, int],
    strides: tuple[int, ...],
    slots: dict[Any, Any] | None = None,
    ctx: LaunchContext | None = None,
    splits: tuple[int, int] = (1, 0),
) -> Any:
    """Decode over an FP8 cache on sm_90 (``_sparse_mla_decode_fp8_kernel``): one program per token and
    64-head tile (and split). ``kv_cache``: the FP8 cache (``fp8_cache`` layout, any of its dtypes);
    ``kv_paging``: its ``(block_size, block stride in bytes)``; ``idx``: ``[n_tok, topk]`` int32 cache rows;
    ``strides``: the token and head strides of ``q``, the row stride of ``idx``, the token and head strides
    of ``out``; ``splits``: ``(n_splits, split_len)``, with more than one split ``out`` / ``max_logits`` /
    ``lse`` are the fp32 split-K partial buffers (merged by the forward's merge kernel). Same outputs as
    the bf16 Gluon kernel (``slots`` and ``ctx``: see :func:`sparse_mla_attn._runtime.launch`)."""
    assert kv_cache.shape[-1] == FP8_TOKEN_BYTES
    n_head_tiles = cdiv(dims.h_q, 64)
    n_splits, split_len = splits
    # The block size is a constant of the kernel: the row offsets divide by it (a shift for powers of two).
    consts = dict(
        KV_BLOCK=kv_paging[0], BLOCK_T=64, V_REGS=FP8_V_REGS, PRODUCER_REGS=FP8_PRODUCER_REGS, num_warps=4
    )
    if n_splits > 1:
        consts["SPLIT_K"] = True
    args = (q, kv_cache, idx, out, max_logits, lse, *strides, dims.h_q, n_head_tiles, dims.topk, dims.s_kv,
            kv_paging[1], sm_scale_log2, dims.s_q, split_len if n_splits > 1 else dims.topk)  # fmt: skip
    return launch(
        _sparse_mla_decode_fp8_kernel, (n_splits * dims.s_q * n_head_tiles,), slots,
        "gluon_fp8" if n_splits == 1 else "gluon_fp8_split", args, consts, ctx,
    )  # fmt: skip
