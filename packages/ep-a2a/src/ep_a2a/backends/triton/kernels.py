"""Triton kernels of the intra-node fast path.

Every kernel takes ``table_ptr``: an int64 tensor ``[world_size]`` holding the base address of every
rank's symmetric heap (as mapped in this process), plus byte offsets of the regions inside a heap (see
:class:`ep_a2a.backends.triton.engine.HeapLayout`). A peer's region is reached by casting
``table[r] + offset`` to a typed pointer, so the kernels run over any heap that can hand out peer
addresses: ``torch.distributed._symmetric_memory``, nvshmem4py, or plain CPU buffers in the
single-process simulation under ``TRITON_INTERPRET=1``.

Signalling: every flag is monotone. A call number (epoch) lives in the device ``state`` tensor, each
producer writes its epoch into the consumer's flag with a release atomic at system scope after a CTA
barrier, and each consumer spins with acquire atomics until the flag reaches its own epoch. Words that
carry their own epoch (``(epoch << 32) | value``: counts, base rows) are pushed with relaxed stores and
polled with acquire loads at system scope (inline PTX, ``_store_relaxed_sys`` / ``_load_acquire_sys``,
selected by ``USE_TIMER``, which is true on a GPU; the interpreter runs the atomics they stand for).
Nothing is reset between calls. Every spin is bounded (``%globaltimer`` on the GPU, an iteration count in the
interpreter); a spin that runs out records ``1 + step * 65536 + peer`` in ``state[STATE_ERR]`` and the
kernel skips the work that depended on it (no garbage row indices are ever used). Every later kernel
sees the error and does nothing; the host raises a timeout naming the peer and the step.

Remote peers (other nodes, or forced; the compile-time bit set ``REMOTE``, 0 for intra-node groups, which
then compile exactly as before): the kernels never address them. What would be stored into a remote peer's
heap is written to this rank's staging regions instead (counts, base rows, one packed record per token
and destination rank, combine rows), the host puts it with a signal after the kernel, and the consumer
waits on that signal (same epochs, same bounded waits) before reading what the put delivered.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

#: kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` when this module is imported)
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))

# device state slots (int64)
STATE_DISPATCH_EPOCH = 0
STATE_COMBINE_EPOCH = 1
STATE_COMBINE_ARRIVE = 2
STATE_ERR = 3
STATE_BARRIER_EPOCH = 4
STATE_COUNTS_READY = 5  # merged dispatch: epoch whose receive layout program 0 has written
STATE_DISPATCH_ARRIVE = 6  # merged dispatch: CTAs finished (the last one publishes the epoch)
STATE_STEAL_SEND = 8  # work stealing (STEAL): next send chunk to claim
STATE_STEAL_WRITE = 9  # next write chunk to claim
STATE_STEAL_ARRIVE = 10  # CTAs finished (the last one resets the counters for the next launch)
STATE_STEAL_SCATTER = 11  # next block of token_dst_scatter_idx to claim
STATE_SIZE = 16

# error steps encoded in state[STATE_ERR] = 1 + step * 65536 + peer
STEP_COUNTS = 1
STEP_DISPATCH = 2
STEP_OFFSETS = 3
STEP_COMBINE = 4
STEP_BARRIER = 5
STEP_LAYOUT = 6  # (a program of this rank's own layout kernel: a bug, not a missing peer)
STEP_NAMES = {
    STEP_COUNTS: "dispatch/counts",
    STEP_DISPATCH: "dispatch/payload",
    STEP_OFFSETS: "dispatch/offsets",
    STEP_COMBINE: "combine",
    STEP_BARRIER: "barrier",
    STEP_LAYOUT: "dispatch/layout",
}

# remote peers (inter-node, or forced): signal words in the heap's ``sig [4, W]`` region, one per source
# (constexpr globals: the kernels read them)
SIG_CNT = tl.constexpr(0)  # counts of a dispatch arrived (value: dispatch epoch)
SIG_BACK = tl.constexpr(1)  # base rows of a dispatch arrived
SIG_DATA = tl.constexpr(2)  # packed token records of a dispatch arrived
SIG_COMB = tl.constexpr(3)  # packed combine rows arrived (value: combine epoch)
# sources up to which the row kernel's receive step is unrolled (a loop beyond: see _dispatch_kernel)
RECV_UNROLL_MAX = tl.constexpr(4)


_EPOCH_SHIFT = 32
_LOW_MASK = 0xFFFFFFFF


@triton.jit
def _now(USE_TIMER: tl.constexpr):
    if USE_TIMER:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def _peer_ptr(table_ptr, r, byte_offset, ty: tl.constexpr):
    """Typed pointer to ``byte_offset`` inside rank ``r``'s heap (heaps are 256-byte aligned)."""
    base = tl.load(table_ptr + r) + byte_offset
    return tl.multiple_of(base.to(tl.pointer_type(ty)), 16)


@triton.jit
def _load_ids(ids_ptr, slot, m, id64, E: tl.constexpr):
    """Expert ids of ``slot`` ([...] int32; -1 where ``m`` is false). ``ids_ptr`` is the caller's int32
    ids (``id64`` 0), or its int64 ids seen as int32 words (``id64`` 1), so one compiled variant reads
    both (a runtime branch). An int64 id is read as its two 4-byte words (little-endian: low word
    first), each an int32 load in the int32 ids' register layout (an int64 load's layout would cost a
    conversion wherever the ids meet int32 tensors); one outside ``[-1, E)`` comes back as ``E``:
    counted as invalid by the layout kernel and dropped everywhere, never wrapped into range."""
    if id64 != 0:
        lo = tl.load(ids_ptr + 2 * slot, mask=m, other=-1)
        hi = tl.load(ids_ptr + 2 * slot + 1, mask=m, other=-1)
        # in range: the high word is the low word's sign extension and the low word is in [-1, E)
        ids = tl.where((hi == (lo >> 31)) & (lo >= -1) & (lo < E), lo, E)
    else:
        ids = tl.load(ids_ptr + slot, mask=m, other=-1)
    return ids


@triton.jit
def _set_error(state_ptr, code):
    """Record the first error only (later ones keep the first culprit)."""
    zero = tl.full([], 0, tl.int64)
    tl.atomic_cas(state_ptr + 3, zero, zero + code, sem="relaxed", scope="gpu")


@triton.jit
def _wait_flag(flag_ptr, target, state_ptr, step, peer, timeout, USE_TIMER: tl.constexpr):
    """Spin until ``*flag_ptr >= target`` (acquire, system scope). Returns True on success.

    On timeout records the error in ``state[STATE_ERR]``; returns False immediately when an error is
    already recorded.
    """
    err = tl.atomic_add(state_ptr + 3, 0, sem="relaxed", scope="gpu")
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    start = _now(USE_TIMER)
    elapsed = tl.full([], 0, tl.int64)
    while (v < target) & (elapsed < timeout) & (err == 0):
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        if USE_TIMER:
            elapsed = _now(USE_TIMER) - start
        else:
            elapsed += 1
    ok = (v >= target) & (err == 0)
    if (v < target) & (err == 0):
        _set_error(state_ptr, 1 + step * 65536 + peer)
    tl.debug_barrier()
    return ok


@triton.jit
def _load_acquire_sys(ptrs, m, GPU: tl.constexpr):
    """``*ptrs`` (int64 words) with acquire semantics at system scope, 0 where ``m`` is false. On a
    GPU a plain ``ld.acquire.sys`` (a load, not a read-modify-write: nothing waits for an atomic unit);
    in the interpreter an atomic add of 0."""
    if GPU:
        v = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b64 $0, 0; @p ld.acquire.sys.global.b64 $0, [$1]; }",
            "=l,l,r",
            [ptrs, m.to(tl.int32)],
            dtype=tl.int64,
            is_pure=False,
            pack=1,
        )
    else:
        v = tl.atomic_add(ptrs, tl.zeros(ptrs.shape, tl.int64), mask=m, sem="acquire", scope="sys")
    return v


@triton.jit
def _store_relaxed_sys(ptrs, vals, m, GPU: tl.constexpr):
    """``*ptrs = vals`` (int64) where ``m``: a strong relaxed store at system scope. On a GPU a plain
    ``st.relaxed.sys`` that nothing waits for (an exchange waits for the old value to come back over
    NVLink); in the interpreter an exchange."""
    if GPU:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.relaxed.sys.global.b64 [$1], $3; mov.b32 $0, 0; }",
            "=r,l,r,l",
            [ptrs, m.to(tl.int32), vals],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.atomic_xchg(ptrs, vals, mask=m, sem="relaxed", scope="sys")


@triton.jit
def _spin_epoch(ptrs, m, ep, err, timeout, USE_TIMER: tl.constexpr):
    """Poll the packed words at ``ptrs`` (acquire, system scope) until every one under ``m`` carries
    epoch ``ep`` or later in its high half, the bound runs out, or ``err`` is nonzero. Returns the words
    and the mask of those still stale (the caller names the missing peer).

    Where the words are fewer than the CTA's threads, each is held (and loaded) by several threads, and
    the loop's exit is decided for the whole CTA by a reduction over one of those copies: a thread whose
    copy was loaded just before a word landed would go on with the older word (the counts of the call
    two before, or a peer taken for late although it signalled), and the CTA's later reductions and
    layout changes would mix both. So once the decision says every word is fresh, every thread loads
    the words once more: those loads all return the same values, since a word that carries epoch ``ep``
    keeps its value until this rank has finished the call. The bound is decided by the same reduction
    (the largest over the CTA), so every thread leaves in the same poll."""
    v = _load_acquire_sys(ptrs, m, USE_TIMER)
    stale = ((v >> 32) < ep) & m
    start = _now(USE_TIMER)
    elapsed = tl.full([], 0, tl.int64)
    # 2 while a word is stale, + 1 once the bound ran out: one decision for every thread
    wait = tl.max(stale.to(tl.int32) * 2 + (elapsed >= timeout).to(tl.int32))
    while (wait == 2) & (err == 0):
        v = _load_acquire_sys(ptrs, m, USE_TIMER)
        stale = ((v >> 32) < ep) & m
        if USE_TIMER:
            elapsed = _now(USE_TIMER) - start
        else:
            elapsed += 1
        wait = tl.max(stale.to(tl.int32) * 2 + (elapsed >= timeout).to(tl.int32))
    if wait < 2:
        v = _load_acquire_sys(ptrs, m, USE_TIMER)
        stale = ((v >> 32) < ep) & m
    return v, stale


@triton.jit
def _wait_started(state_ptr, table_ptr, off_cnt, rank, ep, timeout, W: tl.constexpr, WP: tl.constexpr,
                  L: tl.constexpr, CW: tl.constexpr, USE_TIMER: tl.constexpr, REMOTE: tl.constexpr):  # fmt: skip
    """Spin until every peer reached by stores has started dispatch ``ep``: its layout kernel's token-count
    word (program 0's, the first it pushes) carries the epoch. On timeout records ``dispatch/counts``
    naming the first missing peer, as the receive layout would."""
    ss = tl.arange(0, WP)
    m = (ss < W) & (ss != rank) & ~_is_remote(ss, REMOTE, W)
    ptrs = _peer_ptr(table_ptr, rank, off_cnt, tl.int64) + (ep % 2) * (W * CW) + ss * CW + L
    _, late = _spin_epoch(ptrs, m, ep, 0, timeout, USE_TIMER)
    if tl.sum(late.to(tl.int32), 0) > 0:
        _set_error(state_ptr, 1 + 1 * 65536 + tl.min(tl.where(late, ss, WP), 0).to(tl.int64))
    tl.debug_barrier()


@triton.jit
def _tokens_from_peers(info_ptr, ss, rank, W: tl.constexpr, known):
    """[WP] tokens each peer sends this rank (``info[2 + s]``, written by the receive layout); 0 for this
    rank, and where ``known`` is false (the layout may not be written yet)."""
    mask = _and(((ss < W) & (ss != rank)), known)
    return tl.load(info_ptr + 2 + ss, mask=mask, other=0, cache_modifier=".cg")


@triton.jit
def _await_receive_layout(state_ptr, info_ptr, ss, rank, ep, timeout, n_chunks_send, W: tl.constexpr,
                          CH: tl.constexpr, USE_TIMER: tl.constexpr):  # fmt: skip
    """A row-kernel program that started before the receive layout: wait for program 0 to publish it,
    then the tokens each peer sends ([WP]), the received chunks and all chunks of this dispatch."""
    # twice the bound: program 0's own wait for a missing peer runs out first and names it
    _wait_flag(state_ptr + 5, ep, state_ptr, 1, rank, 2 * timeout, USE_TIMER)
    n_src_all = _tokens_from_peers(info_ptr, ss, rank, W, tl.program_id(0) >= 0)
    n_chunks_recv = tl.cdiv(tl.max(n_src_all, 0), CH)
    return n_src_all, n_chunks_recv, tl.maximum(n_chunks_send, n_chunks_recv)


@triton.jit
def _and(mask, cond):
    """``mask & cond`` for a boolean tensor and a scalar condition: the interpreter of newer Triton types
    that as int32 (not a mask), so there it is a ``where``; compiled, the same ``&`` as ever."""
    if INTERPRETING:
        res = tl.where(cond, mask, False)
    else:
        res = mask & cond
    return res


@triton.jit
def _m(rows_mask, h0, hh, H: tl.constexpr, EVEN_H: tl.constexpr):
    """2-D mask of a ``[rows, BH]`` tile; with ``EVEN_H`` it is constant along the row, which keeps
    loads and stores 16-byte vectors."""
    if EVEN_H:
        res = rows_mask[:, None]  # broadcast by the load/store: constant along the row
    else:
        res = rows_mask[:, None] & ((h0 + hh) < H)[None, :]
    return res


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _rank_bits(dest, valid):
    """Per row, the set of ranks (bit r) its valid slots go to: one reduction, reused across tiles."""
    one = tl.full(dest.shape, 1, tl.int64)
    return tl.reduce(tl.where(valid & (dest >= 0), one << dest.to(tl.int64), 0), 1, _or)


@triton.jit
def _column(tile, kk, k: tl.constexpr):
    """Column ``k`` of a ``[rows, KP]`` integer tile as a ``[rows]`` vector."""
    return tl.sum(tl.where(kk[None, :] == k, tile, 0), axis=1)


@triton.jit
def _store_tile_by_slot(xt, tab_rows, tm, out_ptr, h0, hh, H: tl.constexpr, K: tl.constexpr,
                        EVEN_H: tl.constexpr):  # fmt: skip
    """Tile ``h0`` of each token row to its output row of every slot, the rows re-read from the slot
    table (``tab_rows [CH]``: pointers to each token's ``K`` entries; < 0: not here) rather than held.
    Streaming stores (``.cs``, evict-first): the rows of large layers outgrow L2, and keeping them out of
    it leaves the token rows and received rows that are read twice or later in L2."""
    for k in tl.static_range(K):
        rk = tl.load(tab_rows + k, mask=tm, other=-1).to(tl.int64)
        tl.store(out_ptr + rk[:, None] * H + h0 + hh[None, :], xt, mask=_m((rk >= 0), h0, hh, H, EVEN_H),
                 cache_modifier=".cs")  # fmt: skip


@triton.jit
def _store_by_slot(xt, rows, kk, out_ptr, hh, H: tl.constexpr, K: tl.constexpr, EVEN_H: tl.constexpr):
    """``out[rows[i, k]] = xt[i]`` for every slot ``k`` with ``rows[i, k] >= 0``: whole token rows
    ``xt [CH, BH >= H]`` held in registers, written once per slot (no reload of rows or slot table)."""
    for k in tl.static_range(K):
        rk = _column(rows, kk, k)
        tl.store(out_ptr + rk[:, None] * H + hh[None, :], xt, mask=_m(rk >= 0, 0, hh, H, EVEN_H))


# --------------------------------------------------------------------------------------------------
# FP8 quantization on send: bf16 / fp16 / fp32 token rows become packed FP8 rows (DeepEP's format: the
# float8_e4m3fn bytes of the row, then one float32 scale per 128 channels) in the row kernel's registers.
# A tile is [CH, BQ / 64, 64] pairs of channels: one 128-channel block per (token, block), so the block
# maximum is a reduction inside a warp and its broadcast back needs no exchange between threads.
# --------------------------------------------------------------------------------------------------
FP8_MAX = tl.constexpr(448.0)
#: float32(1 / 448): a scale is ``amax`` times it, as torch computes ``amax / 448`` on CUDA devices
FP8_RECIP_MAX = tl.constexpr(0.0022321429569274187)
FP8_AMAX_FLOOR = tl.constexpr(1e-4)
FP8_NAN = tl.constexpr(0x7F)  # the one NaN byte written (float8_e4m3fn has two)
F32_NAN = tl.constexpr(0x7FC00000)  # the one NaN scale written


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _load_pairs(x_ptr, toks, ld, h0, QH: tl.constexpr, BQ: tl.constexpr):
    """Pairs of channels ``[h0, h0 + BQ)`` of rows ``toks`` (``ld``) of ``x [n, QH]`` (2- or 4-byte floats)
    as ``[CH, BQ / 64, 64]`` int32 / int64 words, a pair each: 16-byte vector loads, split into the two
    channels by bit operations; blocks past the row read as zeros."""
    if x_ptr.dtype.element_ty.primitive_bitwidth == 16:
        xp = x_ptr.to(tl.pointer_type(tl.int32))
    else:
        xp = x_ptr.to(tl.pointer_type(tl.int64))
    off = h0 + tl.arange(0, BQ // 64) * 64
    jj = tl.arange(0, 64)
    row = toks.to(tl.int64) * (QH // 2)
    mask = ld[:, None, None] & (off < QH // 2)[None, :, None]
    return tl.load(xp + row[:, None, None] + off[None, :, None] + jj[None, None, :], mask=mask, other=0)


@triton.jit
def _to_e4m3(v):
    """float32 -> float8_e4m3fn bits (int32 0..255) by torch's rule (``c10::Float8_e4m3fn``: round to
    nearest even, 480 and beyond NaN) in integer operations, on the GPU as in the interpreter (whose own
    float8 cast does not round to nearest even); NaN -> ``FP8_NAN``."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    odd = (a >> 20) & 1
    normal = ((a + ((7 - 127) << 23) + 0x7FFFF + odd) >> 20) & 0xFF  # (rebias, round, take 7 bits)
    # below 2^-6 (subnormal in e4m3): add 2^14, whose float32 ulp is e4m3's 2^-9, and take the bits
    sub = ((a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)) & 0xFF
    res = tl.where(a >= (1087 << 20), FP8_NAN, tl.where(a < (121 << 23), sub, normal)) | sign
    return tl.where(a > 0x7F800000, FP8_NAN, res)


@triton.jit
def _quantize_pairs(raw, src_ty: tl.constexpr):
    """A tile of pairs of channels (:func:`_load_pairs`) as packed FP8: int16 pairs of FP8 bytes (little-
    endian) of the same shape and ``[CH, BQ / 64]`` int32 scale bits, by DeepEP's rule as torch runs it
    on CUDA: per 128 channels ``amax = max(|x|)`` (NaN if any is; at least 1e-4), bytes ``e4m3(x *
    (reciprocal(amax) * 448))``, scale ``amax * float32(1 / 448)``; NaN in one encoding each."""
    if src_ty == tl.bfloat16:
        lo = (raw << 16).to(tl.float32, bitcast=True)  # (bf16 is float32's upper half)
        hi = (raw & -65536).to(tl.float32, bitcast=True)
    elif src_ty == tl.float16:
        lo = raw.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (raw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = raw.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (raw >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    amax = tl.reduce(_max_nan(tl.abs(lo), tl.abs(hi)), 2, _max_nan)
    amax = _max_nan(amax, FP8_AMAX_FLOOR)
    inv = (tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax) * FP8_MAX)[:, :, None]
    q = _to_e4m3(lo * inv) | (_to_e4m3(hi * inv) << 8)
    s = amax * FP8_RECIP_MAX
    return q.to(tl.int16), tl.where(s != s, F32_NAN, s.to(tl.int32, bitcast=True))


@triton.jit
def _store_quantized(rows_ptr, rows, rmask, xq, st, h0, S: tl.constexpr, QH: tl.constexpr, BQ: tl.constexpr,
                     STREAM: tl.constexpr):  # fmt: skip
    """One tile of packed FP8 rows (:func:`_quantize_pairs`: pairs ``[h0, h0 + BQ)`` and their scales) into
    rows ``rows`` (``[CH]`` int64; ``rmask``: ``[CH, 1, 1]`` or the tile's shape) of a buffer of int16 rows
    of ``S`` elements: the pairs at ``h0``, the scales after the row's ``QH`` FP8 bytes. ``STREAM``:
    streaming stores (``.cs``)."""
    blk = tl.arange(0, BQ // 64)
    off = h0 + blk * 64
    mask = rmask & (off < QH // 2)[None, :, None]
    ptr = rows_ptr + rows[:, None, None] * S + off[None, :, None] + tl.arange(0, 64)[None, None, :]
    if STREAM:
        tl.store(ptr, xq, mask=mask, cache_modifier=".cs")
    else:
        tl.store(ptr, xq, mask=mask)
    # each block's scale by the thread holding its first pair, in the tile's layout (a store of the
    # [CH, BQ / 64] scales would first move them between threads: shared memory and a CTA barrier)
    sp = rows_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None, None] * (S // 2) + (QH // 4 + h0 // 64)
    sp = tl.broadcast_to(sp + blk[None, :, None], xq.shape)
    sm = tl.broadcast_to(mask & (tl.arange(0, 64) == 0)[None, None, :], xq.shape)
    sv = tl.broadcast_to(st[:, :, None], xq.shape)
    if INTERPRETING:
        tl.store(sp, sv, mask=sm)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.global.b32 [$1], $3; mov.b32 $0, 0; }",
            "=r,l,r,r",
            [sp, sm.to(tl.int32), sv],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _store_peers_quantized(xq, st, h0, toks, tm, bits, pk_ptr, table_ptr, rank, max_tokens, off_x, off_srec,
                           W: tl.constexpr, H: tl.constexpr, REMOTE: tl.constexpr, RECX: tl.constexpr,
                           QH: tl.constexpr, BQ: tl.constexpr):  # fmt: skip
    """:func:`_store_peers` for a tile of packed FP8 rows quantized on send (``bits``: ``[CH, 1, 1]``, or
    broadcast to the tile's shape, in its layout, ahead of a tile loop)."""
    for r in tl.static_range(W):
        if (REMOTE >> r) & 1:
            j = tl.load(pk_ptr + r * max_tokens + toks, mask=tm, other=-1)
            prec = _peer_ptr(table_ptr, rank, off_srec, tl.int16)
            _store_quantized(prec, (r * max_tokens + j).to(tl.int64), (j >= 0)[:, None, None], xq, st, h0, RECX,
                             QH, BQ, False)  # fmt: skip
        elif r != rank:
            need = ((bits >> r) & 1) != 0
            px = _peer_ptr(table_ptr, r, off_x, tl.int16)
            _store_quantized(px, (rank * max_tokens + toks).to(tl.int64), need, xq, st, h0, H, QH, BQ, False)


@triton.jit
def _is_remote(r, REMOTE: tl.constexpr, W: tl.constexpr):
    """Whether rank ``r`` (scalar or tensor) is in the bit set ``REMOTE`` (ranks reached by host puts)."""
    res = r < 0
    for q in tl.static_range(W):
        if (REMOTE >> q) & 1:
            res = res | (r == q)
    return res


# --------------------------------------------------------------------------------------------------
# dispatch step 1: per-expert positions of this rank's slots, counts pushed to the expert owners
# --------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["n_tokens", "rank", "nprog", "timeout", "id64"])
def _layout_kernel(
    ids_ptr,  # [n, K] int32, or int64 ids seen as int32 (id64)
    pos_ptr,  # [max_tokens, K] int32 out: rank of slot (t, k) among this rank's slots of its expert
    n_tokens,
    table_ptr,
    state_ptr,
    off_cnt,
    rank,
    info_ptr,  # [2 + 2W + L + 1] int64: the last entry gets the number of slots with invalid expert ids
    E: tl.constexpr,
    L: tl.constexpr,
    W: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    TB: tl.constexpr,  # tokens per program
    EP: tl.constexpr,  # next_pow2(E): a histogram row
    NP: tl.constexpr,  # next_pow2(nprog)
    WRITE_POS: tl.constexpr,
    BAD_SLOT: tl.constexpr,
    nprog,
    hist_ptr,  # [nprog, EP] int32 workspace: each program's histogram
    bad_ptr,  # [nprog] int32 workspace: each program's count of invalid ids
    hflag_ptr,  # [nprog] int64 workspace: epoch of the histogram a program published
    timeout,
    USE_TIMER: tl.constexpr,
    off_scnt,  # staging of the words bound for remote owners (put by the host after this kernel)
    CW: tl.constexpr,  # words per source in ``cnt``: L counts, token count (+ packed token count)
    REMOTE: tl.constexpr,  # bit set of the ranks reached by host puts (0: every peer by stores)
    PDL: tl.constexpr = False,  # let the next launch (the row kernel, launched with PDL) start early
    id64=0,  # 1: ids_ptr points at int64 ids (see _load_ids)
):
    """Program ``p`` owns tokens ``[p * TB, (p + 1) * TB)``: it publishes the histogram of their slots'
    experts, sums the histograms of programs ``< p`` (the slots of each expert before its block), and
    sorts its slots by (expert, slot) to give each slot its position among its expert's slots. The
    last program also has every histogram: it pushes the per-expert counts to their owners. Waits only
    on lower programs, so it runs in the interpreter's sequential order too."""
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    ep = tl.load(state_ptr + 0) + 1
    parity = ep % 2
    S: tl.constexpr = TB * KP
    ss = tl.arange(0, S)
    tok = pid * TB + ss // KP
    kk = ss % KP
    m = (tok < n_tokens) & (kk < K)
    v = _load_ids(ids_ptr, tok * K + kk, m, id64, E)
    valid = (v >= 0) & (v < E) & m
    # ids outside [-1, E): counted (the host raises), treated as dropped everywhere
    n_bad = tl.sum((((v < -1) | (v >= E)) & m).to(tl.int32), 0)
    ee = tl.arange(0, EP)
    e32 = tl.where(valid, v, 0)
    hist = tl.histogram(e32, EP, mask=valid)
    tl.store(hist_ptr + pid * EP + ee, hist)
    tl.store(bad_ptr + pid, n_bad)
    tl.debug_barrier()
    tl.atomic_xchg(hflag_ptr + pid, ep, sem="release", scope="gpu")
    # every lower program's histogram (bounded wait: they run beside this one, or ran before it)
    qq = tl.arange(0, NP)
    low = qq < pid
    f = tl.atomic_add(hflag_ptr + qq, 0, mask=low, sem="acquire", scope="gpu")
    late = tl.sum((low & (f < ep)).to(tl.int32), 0)
    start = _now(USE_TIMER)
    elapsed = tl.full([], 0, tl.int64)
    while (late > 0) & (elapsed < timeout):
        f = tl.atomic_add(hflag_ptr + qq, 0, mask=low, sem="acquire", scope="gpu")
        late = tl.sum((low & (f < ep)).to(tl.int32), 0)
        if USE_TIMER:
            elapsed = _now(USE_TIMER) - start
        else:
            elapsed += 1
    if late > 0:
        _set_error(state_ptr, 1 + 6 * 65536 + rank)
    else:
        before = tl.zeros([EP], tl.int32)
        for q0 in tl.static_range(0, NP, 16):  # (unrolled: the loads overlap; bounds free of pid)
            rows = q0 + tl.arange(0, 16)
            blk = tl.load(hist_ptr + rows[:, None] * EP + ee[None, :], mask=(rows < pid)[:, None], other=0)
            before += tl.sum(blk, 0)
        if WRITE_POS:
            # sorted by (expert, slot): the i-th key of expert e is that expert's slot number
            # i - (slots of smaller experts in this block), after the `before[e]` of lower blocks
            key = tl.where(valid, e32 * S + ss, E * S + ss)
            key = tl.sort(key)
            e_s = key // S
            s_s = key - e_s * S
            excl = tl.cumsum(hist, 0) - hist
            off = before - excl
            got = tl.gather(off, tl.minimum(e_s, E - 1), 0) + ss
            slot = (pid * TB + s_s // KP) * K + s_s % KP
            tl.store(pos_ptr + slot, got, mask=e_s < E)
        if pid == nprog - 1:
            total = before + hist
            bad = tl.load(bad_ptr + qq, mask=qq < nprog, other=0)
            tl.store(info_ptr + BAD_SLOT, tl.sum(bad, 0).to(tl.int64))
            e = ee
            owner = e // L
            word = (ep << 32) | total.to(tl.int64)
            me = e < E
            if REMOTE != 0:
                # a remote owner's word goes to this rank's staging row for it (as int addresses: the
                # table holds no usable address for a remote rank)
                peer = (
                    tl.load(table_ptr + owner, mask=me, other=0)
                    + off_cnt
                    + (parity * (W * CW) + rank * CW + e - owner * L) * 8
                )
                stage = tl.load(table_ptr + rank) + off_scnt + (owner * CW + e - owner * L) * 8
                addr = tl.where(_is_remote(owner, REMOTE, W), stage, peer)
                dst = addr.to(tl.pointer_type(tl.int64))
            else:
                base = tl.load(table_ptr + owner, mask=me, other=0) + off_cnt
                dst = base.to(tl.pointer_type(tl.int64)) + parity * (W * CW) + rank * CW + (e - owner * L)
            # (relaxed: each word carries its epoch, and nothing else is read on its arrival)
            _store_relaxed_sys(dst, word, me, USE_TIMER)
    if pid == 0:
        for r in tl.static_range(W):
            if (REMOTE >> r) & 1:
                dst = _peer_ptr(table_ptr, rank, off_scnt, tl.int64) + r * CW + L
            else:
                dst = _peer_ptr(table_ptr, r, off_cnt, tl.int64) + parity * (W * CW) + rank * CW + L
            # a store, not an exchange: the kernel's end would wait for the old value over NVLink
            _store_relaxed_sys(dst, (ep << 32) | n_tokens.to(tl.int64), tl.full([], 1, tl.int1), USE_TIMER)


@triton.jit(do_not_specialize=["n_tokens", "rank", "max_tokens", "id64"])
def _pack_kernel(
    ids_ptr,  # [n, K] int32, or int64 ids seen as int32 (id64)
    pk_ptr,  # [W, max_tokens] int32 out: packed index of token t among this rank's tokens bound for r
    pinfo_ptr,  # [2W] int64 out: [r] packed tokens bound for remote rank r
    n_tokens,
    table_ptr,
    state_ptr,
    off_scnt,
    rank,
    max_tokens,
    L: tl.constexpr,
    W: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BT: tl.constexpr,
    CW: tl.constexpr,
    REMOTE: tl.constexpr,
    id64=0,  # 1: ids_ptr points at int64 ids (see _load_ids)
):
    """Remote peers only (one program): for every remote rank ``r``, each token's position among this
    rank's tokens with a slot on ``r`` (in token order; -1: none), and their number, also staged as the
    last word of ``r``'s counts."""
    ep = tl.load(state_ptr + 0) + 1
    kk = tl.arange(0, KP)
    for r in tl.static_range(W):
        if (REMOTE >> r) & 1:
            running = tl.full([], 0, tl.int32)
            start = tl.full([], 0, tl.int32)
            while start < n_tokens:
                toks = start + tl.arange(0, BT)
                tm = toks < n_tokens
                m2 = tm[:, None] & (kk[None, :] < K)
                ids = _load_ids(ids_ptr, toks[:, None].to(tl.int64) * K + kk[None, :], m2, id64, L * W)
                ids = tl.where(ids < L * W, ids, -1)  # invalid ids are dropped everywhere
                dest = tl.where(ids >= 0, ids // L, -1)
                hit = (tl.sum(((dest == r) & m2).to(tl.int32), axis=1) > 0) & tm
                h32 = hit.to(tl.int32)
                c = tl.cumsum(h32, 0)
                tl.store(pk_ptr + r * max_tokens + toks, tl.where(hit, running + c - 1, -1), mask=tm)
                running += tl.sum(h32, 0)
                start += BT
            tl.store(pinfo_ptr + r, running.to(tl.int64))
            stage = _peer_ptr(table_ptr, rank, off_scnt, tl.int64) + r * CW + L + 1
            tl.atomic_xchg(stage, (ep << 32) | running.to(tl.int64), sem="relaxed", scope="gpu")


# --------------------------------------------------------------------------------------------------
# dispatch step 2 (one program): wait for every source's counts, build the receive layout
# --------------------------------------------------------------------------------------------------
@triton.jit
def _counts_body(
    info_ptr,
    offs_ptr,
    table_ptr,
    state_ptr,
    off_cnt,
    off_back,
    rank,
    ep,
    timeout,
    pinfo_ptr,
    off_sig,
    off_sback,
    W: tl.constexpr,
    L: tl.constexpr,
    WP: tl.constexpr,
    LP: tl.constexpr,
    USE_TIMER: tl.constexpr,
    CW: tl.constexpr,
    REMOTE: tl.constexpr,
):
    """Wait for every source's counts of epoch ``ep``, write the receive layout (one program).

    Writes ``info`` (total rows, error, tokens / rows per source, rows per local expert) and
    ``offs[e, s]`` (first output row of local expert ``e``'s block from source ``s``), and gives every
    source its blocks' base rows (its ``token_dst_scatter_idx``). On timeout records the error.
    Remote sources' counts arrive by a host put whose signal is waited for first; their packed token
    counts go to ``pinfo[W + s]``, and their base rows to this rank's staging (the host puts them).
    """
    parity = ep % 2
    if REMOTE != 0:
        for s in tl.static_range(W):
            if (REMOTE >> s) & 1:
                sig = _peer_ptr(table_ptr, rank, off_sig, tl.int64) + SIG_CNT * W + s
                _wait_flag(sig, ep, state_ptr, 1, s, timeout, USE_TIMER)
    cnt = _peer_ptr(table_ptr, rank, off_cnt, tl.int64) + parity * (W * CW)
    ss = tl.arange(0, WP)
    ee = tl.arange(0, LP)
    # [WP, LP]: entry (s, e) for e <= L (column L carries the source's token count; column L + 1 a
    # remote source's packed token count)
    rem_s = _is_remote(ss, REMOTE, W)
    if REMOTE != 0:
        m2 = (ss[:, None] < W) & ((ee[None, :] <= L) | ((ee[None, :] == L + 1) & rem_s[:, None]))
    else:
        m2 = (ss[:, None] < W) & (ee[None, :] <= L)
    ptrs = cnt + ss[:, None] * CW + ee[None, :]
    err = tl.atomic_add(state_ptr + 3, 0, sem="relaxed", scope="gpu")
    v, stale = _spin_epoch(ptrs, m2, ep, err, timeout, USE_TIMER)
    n_stale = tl.sum(stale.to(tl.int32))
    if (n_stale > 0) & (err == 0):
        missing = tl.min(tl.where(tl.max(stale.to(tl.int32), axis=1) > 0, ss, WP))
        err = 1 + 1 * 65536 + missing.to(tl.int64)
        _set_error(state_ptr, err)
    tl.store(info_ptr + 1, err)
    if err == 0:
        vals = v & 0xFFFFFFFF
        is_cnt = ee[None, :] < L
        counts = tl.where(is_cnt & m2, vals, 0)  # [WP, LP]
        n_src = tl.sum(tl.where((ee[None, :] == L) & m2, vals, 0), axis=1)  # [WP]
        rows_src = tl.sum(counts, axis=1)  # [WP]
        rows_exp = tl.sum(counts, axis=0)  # [LP]
        # expert-major exclusive prefix over (e, s): the rows of the experts before e, then those of
        # expert e from the sources before s (two scans in the words' own layout, no transpose)
        excl = (tl.cumsum(rows_exp, 0) - rows_exp)[None, :] + (tl.cumsum(counts, axis=0) - counts)  # [WP, LP]
        om = (ss[:, None] < W) & (ee[None, :] < L)
        tl.store(offs_ptr + ee[None, :] * W + ss[:, None], excl, mask=om)
        tl.store(info_ptr + 0, tl.sum(rows_src, 0))
        tl.store(info_ptr + 2 + ss, n_src, mask=ss < W)
        tl.store(info_ptr + 2 + W + ss, rows_src, mask=ss < W)
        tl.store(info_ptr + 2 + 2 * W + ee, rows_exp, mask=ee < L)
        if REMOTE != 0:
            npk = tl.sum(tl.where((ee[None, :] == L + 1) & m2, vals, 0), axis=1)  # [WP]
            tl.store(pinfo_ptr + W + ss, npk, mask=(ss < W) & rem_s)
        # give every source its slots' base rows here (for its token_dst_scatter_idx)
        for s in tl.static_range(W):
            col = tl.sum(tl.where(ss[:, None] == s, excl, 0), axis=0)  # [LP]
            if (REMOTE >> s) & 1:
                dst = _peer_ptr(table_ptr, rank, off_sback, tl.int64) + s * L + ee
            else:
                dst = _peer_ptr(table_ptr, s, off_back, tl.int64) + rank * L + ee
            _store_relaxed_sys(dst, (ep << 32) | col, ee < L, USE_TIMER)


@triton.jit(do_not_specialize=["rank", "timeout"])
def _counts_kernel(
    info_ptr,  # [2 + 2W + L] int64 out: total rows, error, n per source, rows per source, rows per expert
    offs_ptr,  # [L, W] int64 out: first output row of (local expert, source)
    table_ptr,
    state_ptr,
    off_cnt,
    off_back,
    rank,
    timeout,
    W: tl.constexpr,
    L: tl.constexpr,
    WP: tl.constexpr,
    LP: tl.constexpr,
    USE_TIMER: tl.constexpr,
    pinfo_ptr,  # [2W] int64 out: [W + s] packed tokens from remote source s
    off_sig,
    off_sback,
    CW: tl.constexpr,
    REMOTE: tl.constexpr,
):
    ep = tl.load(state_ptr + 0) + 1
    _counts_body(
        info_ptr,
        offs_ptr,
        table_ptr,
        state_ptr,
        off_cnt,
        off_back,
        rank,
        ep,
        timeout,
        pinfo_ptr,
        off_sig,
        off_sback,
        W,
        L,
        WP,
        LP,
        USE_TIMER,
        CW,
        REMOTE,
    )
    tl.store(state_ptr + 0, ep)


# --------------------------------------------------------------------------------------------------
# dispatch step 3: tokens out once per destination rank, expanded to expert rows on the receiver
# --------------------------------------------------------------------------------------------------
@triton.jit
def _dispatch_send_chunk(
    c,
    x_ptr,
    ids_ptr,
    id64,
    w_ptr,
    pos_ptr,
    n_tokens,
    out_ptr,
    out_w_ptr,
    out_e_ptr,
    tab_ptr,
    skip_ptr,
    offs_ptr,
    table_ptr,
    rank,
    ep,
    max_tokens,
    nchunks,
    cap_rows,
    off_x,
    off_ids,
    off_pos,
    off_w,
    off_flag,
    W: tl.constexpr,
    L: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    H: tl.constexpr,
    BH: tl.constexpr,
    CH: tl.constexpr,
    EVEN_H: tl.constexpr,
    HAS_W: tl.constexpr,
    CALLER_SCATTER: tl.constexpr,
    PEERS: tl.constexpr,
    LOCAL: tl.constexpr,
    pk_ptr,
    off_srec,
    REMOTE: tl.constexpr,
    RECX: tl.constexpr,
    RECI: tl.constexpr,
    ROWB: tl.constexpr,
    WHOLE_ROW: tl.constexpr,
    QH: tl.constexpr,
    BQ: tl.constexpr,
):
    """Chunk ``c`` of this rank's tokens: with ``PEERS`` each token row (and its slots' metadata) to
    every peer hosting one of its experts, then the chunk's ready flag; with ``LOCAL`` the slot table,
    ``skip``, and the rows of this rank's own experts straight into the output.

    A remote peer ``r`` (bit ``r`` of ``REMOTE``) gets no stores: the token's record (row, then token
    index, ids, positions, float32 weights) goes to this rank's staging ``srec[r, pk[r, t]]``, packed in
    token order, and the host puts the first ``pinfo[r]`` records to ``r`` after the kernel.

    ``QH > 0``: ``x`` holds rows of ``QH`` bf16 / fp16 / fp32 channels, quantized here into the packed FP8
    rows (``H`` int16 wide) that are stored, in tiles of ``BQ`` pairs of channels (whole rows: every pair
    of the row)."""
    toks = c * CH + tl.arange(0, CH)
    tm = toks < n_tokens
    kk = tl.arange(0, KP)
    hh = tl.arange(0, BH)
    xrow = toks.to(tl.int64) * H
    if WHOLE_ROW:  # the rows' load first: in flight while the slots' metadata is worked out
        if QH:
            raw = _load_pairs(x_ptr, toks, tm, 0, QH, BQ)
        else:
            xt = tl.load(x_ptr + xrow[:, None] + hh[None, :], mask=_m(tm, 0, hh, H, EVEN_H))
    m2 = tm[:, None] & (kk[None, :] < K)
    slot = toks[:, None].to(tl.int64) * K + kk[None, :]
    ids = _load_ids(ids_ptr, slot, m2, id64, L * W)
    ids = tl.where(ids < L * W, ids, -1)  # invalid ids (counted by _layout_kernel) are dropped
    pos = tl.load(pos_ptr + slot, mask=m2 & (ids >= 0), other=0)
    dest = tl.where(ids >= 0, ids // L, -1)
    e_loc = ids - dest * L
    is_self = (dest == rank) & m2
    bits = _rank_bits(dest, m2)
    ld = tm  # tokens whose row this call needs
    if HAS_W:
        w = tl.load(w_ptr + slot, mask=m2, other=0)
    if LOCAL:
        if CALLER_SCATTER:
            row = pos.to(tl.int64)
        else:
            row = tl.load(offs_ptr + e_loc * W + rank, mask=is_self, other=0, cache_modifier=".cg") + pos
        row = tl.where(is_self & (row >= 0) & (row < cap_rows), row, -1)
        # first slot k' <= k of the same token bound for the same rank
        first = tl.full([CH, KP], KP, tl.int32)
        for k2 in tl.static_range(K):
            d2 = _column(dest, kk, k2)
            hitk = (dest == d2[:, None]) & (kk[None, :] >= k2) & (first == KP)
            first = tl.where(hitk, k2, first)
        tl.store(skip_ptr + slot, tl.where(ids >= 0, first, -1), mask=m2)
        tl.store(tab_ptr + rank * max_tokens * K + slot, row.to(tl.int32), mask=m2)
        kept = row >= 0
        tl.store(out_e_ptr + row, e_loc.to(tl.int32), mask=kept)
        if HAS_W:
            tl.store(out_w_ptr + row, w, mask=kept)
        if not PEERS:
            ld = ld & (((bits >> rank) & 1) != 0)
    if PEERS:
        # metadata of every token goes to every peer (the receiver finds its slots in it)
        remote_base = rank * max_tokens * K + slot
        for r in tl.static_range(W):
            if (REMOTE >> r) & 1:
                # the metadata of the tokens bound for r, in their packed records
                j = tl.load(pk_ptr + r * max_tokens + toks, mask=tm, other=-1)
                jm = j >= 0
                rec = (r * max_tokens + j).to(tl.int64) * RECI
                meta = _peer_ptr(table_ptr, rank, off_srec + ROWB, tl.int32) + rec
                jm2 = jm[:, None] & (kk[None, :] < K)
                tl.store(meta, toks, mask=jm)
                tl.store(meta[:, None] + 1 + kk[None, :], ids, mask=jm2)
                tl.store(meta[:, None] + 1 + K + kk[None, :], pos, mask=jm2)
                if HAS_W:
                    mw = (meta + 1 + 2 * K).to(tl.pointer_type(tl.float32))  # (4-byte aligned only)
                    tl.store(mw[:, None] + kk[None, :], w.to(tl.float32), mask=jm2)
            elif r != rank:
                tl.store(_peer_ptr(table_ptr, r, off_ids, tl.int32) + remote_base, ids, mask=m2)
                tl.store(_peer_ptr(table_ptr, r, off_pos, tl.int32) + remote_base, pos, mask=m2)
                if HAS_W:
                    tl.store(_peer_ptr(table_ptr, r, off_w, w_ptr.dtype.element_ty) + remote_base, w, mask=m2)
        if not LOCAL:
            ld = ld & ((bits & ~(1 << rank)) != 0)
    peer_row = (rank * max_tokens + toks).to(tl.int64) * H
    tab_row = (rank * max_tokens + toks).to(tl.int64) * K
    if WHOLE_ROW:
        # decode-sized chunks (BH >= H): the whole rows (loaded above) to the peers and their flag
        # first, then this rank's own rows from registers
        if QH:
            xq, st = _quantize_pairs(raw, x_ptr.dtype.element_ty)
            if PEERS:
                _store_peers_quantized(xq, st, 0, toks, tm, bits[:, None, None], pk_ptr, table_ptr, rank,
                                       max_tokens, off_x, off_srec, W, H, REMOTE, RECX, QH, BQ)  # fmt: skip
        elif PEERS:
            _store_peers(xt, 0, hh, toks, tm, bits, peer_row, pk_ptr, table_ptr, rank, max_tokens, off_x,
                         off_srec, W, H, EVEN_H, REMOTE, RECX)  # fmt: skip
    elif QH:
        # packed FP8 rows made here: each tile quantized between its load and its stores
        tl.debug_barrier()  # (as below)
        raw = _load_pairs(x_ptr, toks, ld, 0, QH, BQ)
        # (the peers' bits in the tiles' layout once, not converted in every tile)
        bits3 = tl.broadcast_to(bits[:, None, None], raw.shape)
        for h0 in range(0, QH // 2, BQ):
            hn = h0 + BQ
            nxt = _load_pairs(x_ptr, toks, _and(ld, hn < QH // 2), hn, QH, BQ)
            xq, st = _quantize_pairs(raw, x_ptr.dtype.element_ty)
            if PEERS:
                _store_peers_quantized(xq, st, h0, toks, tm, bits3, pk_ptr, table_ptr, rank, max_tokens, off_x,
                                       off_srec, W, H, REMOTE, RECX, QH, BQ)  # fmt: skip
            if LOCAL:
                for k in tl.static_range(K):
                    rk = tl.load(tab_ptr + tab_row + k, mask=tm, other=-1).to(tl.int64)
                    _store_quantized(out_ptr, rk, (rk >= 0)[:, None, None], xq, st, h0, H, QH, BQ, True)
            raw = nxt
    else:
        tl.debug_barrier()  # the tab rows written above are re-read per tile below (no per-tile reductions)
        # one tile ahead: the next tile's load is in flight while this one is stored
        xt = tl.load(x_ptr + xrow[:, None] + hh[None, :], mask=_m(ld, 0, hh, H, EVEN_H))
        for h0 in range(0, H, BH):
            hn = h0 + BH
            nxt = tl.load(
                x_ptr + xrow[:, None] + hn + hh[None, :], mask=_m(_and(ld, hn < H), hn, hh, H, EVEN_H)
            )
            if PEERS:
                _store_peers(xt, h0, hh, toks, tm, bits, peer_row, pk_ptr, table_ptr, rank, max_tokens, off_x,
                             off_srec, W, H, EVEN_H, REMOTE, RECX)  # fmt: skip
            if LOCAL:
                _store_tile_by_slot(xt, tab_ptr + tab_row, tm, out_ptr, h0, hh, H, K, EVEN_H)
            xt = nxt
    if PEERS:
        tl.debug_barrier()
        for r in tl.static_range(W):
            if ((REMOTE >> r) & 1) == 0:  # noqa: SIM102 (a constexpr test, then a runtime one)
                if r != rank:
                    f = _peer_ptr(table_ptr, r, off_flag, tl.int64) + rank * nchunks + c
                    tl.atomic_xchg(f, ep, sem="release", scope="sys")
    if WHOLE_ROW and LOCAL:
        if QH:
            for k in tl.static_range(K):
                rk = _column(row, kk, k)
                _store_quantized(
                    out_ptr, rk.to(tl.int64), (rk >= 0)[:, None, None], xq, st, 0, H, QH, BQ, False
                )
        else:
            _store_by_slot(xt, row, kk, out_ptr, hh, H, K, EVEN_H)


@triton.jit
def _store_peers(xt, h0, hh, toks, tm, bits, peer_row, pk_ptr, table_ptr, rank, max_tokens, off_x, off_srec,
                 W: tl.constexpr, H: tl.constexpr, EVEN_H: tl.constexpr, REMOTE: tl.constexpr,
                 RECX: tl.constexpr):  # fmt: skip
    """Tile ``h0`` of the chunk's rows to every peer hosting one of their experts (``bits``): into its
    heap, or for a remote peer into this rank's staging record of the token."""
    for r in tl.static_range(W):
        if (REMOTE >> r) & 1:
            j = tl.load(pk_ptr + r * max_tokens + toks, mask=tm, other=-1)
            prec = _peer_ptr(table_ptr, rank, off_srec, xt.dtype)
            prow = (r * max_tokens + j).to(tl.int64) * RECX
            tl.store(prec + prow[:, None] + h0 + hh[None, :], xt, mask=_m(j >= 0, h0, hh, H, EVEN_H))
        elif r != rank:
            need = ((bits >> r) & 1) != 0
            px = _peer_ptr(table_ptr, r, off_x, xt.dtype)
            tl.store(px + peer_row[:, None] + h0 + hh[None, :], xt, mask=_m(need, h0, hh, H, EVEN_H))


@triton.jit
def _scatter_block(toks, kk, ids_ptr, id64, pos_ptr, n_tokens, scat_ptr, table_ptr, state_ptr, rank, ep, timeout,
                   off_back, W: tl.constexpr, L: tl.constexpr, K: tl.constexpr, WP: tl.constexpr,
                   CALLER_SCATTER: tl.constexpr, USE_TIMER: tl.constexpr):  # fmt: skip
    """``token_dst_scatter_idx`` of the tokens ``toks``: each slot's base row at its destination (pushed
    by that rank's receive-layout step; ``dispatch/offsets`` names a destination that never pushed it)
    plus its position, or the caller's index."""
    m2 = (toks < n_tokens)[:, None] & (kk[None, :] < K)
    slot = toks[:, None].to(tl.int64) * K + kk[None, :]
    ids = _load_ids(ids_ptr, slot, m2, id64, L * W)
    ids = tl.where(ids < L * W, ids, -1)
    pos = tl.load(pos_ptr + slot, mask=m2 & (ids >= 0), other=0)
    if CALLER_SCATTER:
        tl.store(scat_ptr + slot, tl.where(ids >= 0, pos, -1), mask=m2)
    else:
        dest = tl.where(ids >= 0, ids // L, 0)
        e_loc = ids - dest * L
        back = _peer_ptr(table_ptr, rank, off_back, tl.int64)
        v, stale = _spin_epoch(back + dest * L + e_loc, m2 & (ids >= 0), ep, 0, timeout, USE_TIMER)
        n_stale = tl.sum(stale.to(tl.int32))
        if n_stale > 0:
            missing = tl.min(tl.min(tl.where(stale, dest, WP), axis=1), 0)
            _set_error(state_ptr, 1 + 3 * 65536 + missing.to(tl.int64))
        scat = (v & 0xFFFFFFFF) + pos
        tl.store(scat_ptr + slot, tl.where((ids >= 0) & ~stale, scat, -1).to(tl.int32), mask=m2)


@triton.jit
def _slot_rows(ids, pos, m2, s, offs_ptr, rank, cap_rows, L: tl.constexpr, W: tl.constexpr,
               CALLER_SCATTER: tl.constexpr):  # fmt: skip
    """Output row of each received slot (``-1``: not for this rank, or outside the output) and its local
    expert: the caller's row, or the block base of (local expert, source ``s``) plus the position."""
    dest = tl.where(ids >= 0, ids // L, -1)
    e_loc = ids - dest * L
    mine = (dest == rank) & m2
    if CALLER_SCATTER:
        row = pos.to(tl.int64)
    else:
        row = tl.load(offs_ptr + e_loc * W + s, mask=mine, other=0, cache_modifier=".cg") + pos
    row = tl.where(mine & (row >= 0) & (row < cap_rows), row, -1)
    return row, e_loc


@triton.jit
def _dispatch_recv_chunk(
    c,
    fc,
    s,
    n_src,
    out_ptr,
    out_w_ptr,
    out_e_ptr,
    tab_ptr,
    offs_ptr,
    table_ptr,
    state_ptr,
    rank,
    ep,
    max_tokens,
    nchunks,
    cap_rows,
    timeout,
    off_x,
    off_ids,
    off_pos,
    off_w,
    off_flag,
    w_ty: tl.constexpr,
    W: tl.constexpr,
    L: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    H: tl.constexpr,
    BH: tl.constexpr,
    CH: tl.constexpr,
    EVEN_H: tl.constexpr,
    HAS_W: tl.constexpr,
    CALLER_SCATTER: tl.constexpr,
    USE_TIMER: tl.constexpr,
    WHOLE_ROW: tl.constexpr,
):
    # ``fc``: the flag covering chunk ``c`` (the chunk's own, or its copy-engine piece's)
    flag = _peer_ptr(table_ptr, rank, off_flag, tl.int64) + s * nchunks + fc
    ok = _wait_flag(flag, ep, state_ptr, 2, s, timeout, USE_TIMER)
    if ok:
        toks = c * CH + tl.arange(0, CH)
        tm = toks < n_src
        kk = tl.arange(0, KP)
        hh = tl.arange(0, BH)
        px = _peer_ptr(table_ptr, rank, off_x, out_ptr.dtype.element_ty)
        src_row = (s * max_tokens + toks).to(tl.int64) * H
        if WHOLE_ROW:  # the rows' load first: in flight while the slots' metadata is read
            xt = tl.load(
                px + src_row[:, None] + hh[None, :], mask=_m(tm, 0, hh, H, EVEN_H), cache_modifier=".cg"
            )
        m2 = tm[:, None] & (kk[None, :] < K)
        slot = (s * max_tokens + toks)[:, None].to(tl.int64) * K + kk[None, :]
        ids = tl.load(
            _peer_ptr(table_ptr, rank, off_ids, tl.int32) + slot, mask=m2, other=-1, cache_modifier=".cg"
        )
        pos = tl.load(
            _peer_ptr(table_ptr, rank, off_pos, tl.int32) + slot, mask=m2, other=0, cache_modifier=".cg"
        )
        row, e_loc = _slot_rows(ids, pos, m2, s, offs_ptr, rank, cap_rows, L, W, CALLER_SCATTER)
        tl.store(tab_ptr + slot, row.to(tl.int32), mask=m2)
        kept = row >= 0
        tl.store(out_e_ptr + row, e_loc.to(tl.int32), mask=kept)
        if HAS_W:
            w = tl.load(
                _peer_ptr(table_ptr, rank, off_w, w_ty) + slot, mask=m2, other=0, cache_modifier=".cg"
            )
            tl.store(out_w_ptr + row, w, mask=kept)
        if WHOLE_ROW:
            _store_by_slot(xt, row, kk, out_ptr, hh, H, K, EVEN_H)
        else:
            need = tl.sum(kept.to(tl.int32), axis=1) > 0
            xt = tl.load(
                px + src_row[:, None] + hh[None, :], mask=_m(need, 0, hh, H, EVEN_H), cache_modifier=".cg"
            )
            tab_row = (s * max_tokens + toks).to(tl.int64) * K
            tl.debug_barrier()  # tab rows re-read per tile below
            for h0 in range(0, H, BH):
                hn = h0 + BH
                nxt = tl.load(
                    px + src_row[:, None] + hn + hh[None, :],
                    mask=_m(_and(need, hn < H), hn, hh, H, EVEN_H),
                    cache_modifier=".cg",
                )
                _store_tile_by_slot(xt, tab_ptr + tab_row, tm, out_ptr, h0, hh, H, K, EVEN_H)
                xt = nxt


@triton.jit
def _dispatch_recv_source(
    c, s, n_src_all, ss, half, ce_tokens, out_ptr, out_w_ptr, out_e_ptr, tab_ptr, offs_ptr, table_ptr,
    state_ptr, rank, ep, max_tokens, nchunks, cap_rows, timeout, off_x, off_ids, off_pos, off_w, off_flag,
    w_ty: tl.constexpr, W: tl.constexpr, L: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, H: tl.constexpr,
    BH: tl.constexpr, CH: tl.constexpr, EVEN_H: tl.constexpr, HAS_W: tl.constexpr,
    CALLER_SCATTER: tl.constexpr, USE_TIMER: tl.constexpr, WHOLE_ROW: tl.constexpr, REMOTE: tl.constexpr,
    CE: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """The row kernel's receive step of chunk ``c`` from source ``s``: a remote source's slots marked
    absent, a peer's rows written once its flag carries the epoch (``half`` >= 0 with ``TAIL``: that half
    of the chunk), nothing for this rank's own rows."""
    n_s = tl.sum(tl.where(ss == s, n_src_all, 0), 0)
    if (REMOTE >> s) & 1:
        # a remote source's slots: none here until _remote_expand_kernel fills them
        if c * CH < n_s:
            rt = c * CH + tl.arange(0, CH)
            rk2 = tl.arange(0, KP)
            rslot = (s * max_tokens + rt)[:, None].to(tl.int64) * K + rk2[None, :]
            rm = (rt < n_s)[:, None] & (rk2[None, :] < K)
            tl.store(tab_ptr + rslot, tl.full([CH, KP], -1, tl.int32), mask=rm)
    elif (s != rank) & (c * CH < n_s):
        if TAIL > 0:  # (no copy engine with the split)
            if half >= 0:
                _dispatch_recv_chunk(
                    2 * c + half, c, s, n_s, out_ptr, out_w_ptr, out_e_ptr, tab_ptr, offs_ptr, table_ptr,
                    state_ptr, rank, ep, max_tokens, nchunks, cap_rows, timeout, off_x, off_ids, off_pos,
                    off_w, off_flag, w_ty, W, L, K, KP, H, BH, CH // 2, EVEN_H, HAS_W, CALLER_SCATTER,
                    USE_TIMER, WHOLE_ROW,
                )  # fmt: skip
            else:
                _dispatch_recv_chunk(
                    c, c, s, n_s, out_ptr, out_w_ptr, out_e_ptr, tab_ptr, offs_ptr, table_ptr, state_ptr,
                    rank, ep, max_tokens, nchunks, cap_rows, timeout, off_x, off_ids, off_pos, off_w,
                    off_flag, w_ty, W, L, K, KP, H, BH, CH, EVEN_H, HAS_W, CALLER_SCATTER, USE_TIMER,
                    WHOLE_ROW,
                )  # fmt: skip
        else:
            _dispatch_recv_chunk(
                c, (c * CH) // ce_tokens if CE else c, s, n_s, out_ptr, out_w_ptr, out_e_ptr, tab_ptr,
                offs_ptr, table_ptr, state_ptr, rank, ep, max_tokens, nchunks, cap_rows, timeout, off_x,
                off_ids, off_pos, off_w, off_flag, w_ty, W, L, K, KP, H, BH, CH, EVEN_H, HAS_W,
                CALLER_SCATTER, USE_TIMER, WHOLE_ROW,
            )  # fmt: skip


@triton.jit(
    do_not_specialize=[
        "n_tokens",
        "rank",
        "max_tokens",
        "nchunks",
        "cap_rows",
        "timeout",
        "G",
        "GS",
        "ce_tokens",
        "mirror_addr",
        "id64",
    ]
)
def _dispatch_kernel(
    x_ptr,  # [n, H]
    ids_ptr,  # [n, K] int32, or int64 ids seen as int32 (id64)
    w_ptr,  # [n, K] weight dtype (dummy when not HAS_W)
    pos_ptr,  # [max_tokens, K] int32 from _layout_kernel, or the caller's scatter indices
    n_tokens,
    out_ptr,  # [cap_rows, H]
    out_w_ptr,  # [cap_rows]
    out_e_ptr,  # [cap_rows] int32 local expert of each row
    tab_ptr,  # [W, max_tokens, K] int32 out: output row of slot (s, t, k), -1 if not here
    skip_ptr,  # [n, K] int32 out
    scat_ptr,  # [n, K] int32 out: token_dst_scatter_idx
    info_ptr,
    offs_ptr,
    table_ptr,
    state_ptr,
    rank,
    max_tokens,
    nchunks,
    cap_rows,
    timeout,
    off_x,
    off_ids,
    off_pos,
    off_w,
    off_flag,
    off_back,
    off_cnt,
    W: tl.constexpr,
    L: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    WP: tl.constexpr,
    LP: tl.constexpr,
    H: tl.constexpr,
    BH: tl.constexpr,
    CH: tl.constexpr,
    EVEN_H: tl.constexpr,
    HAS_W: tl.constexpr,
    CALLER_SCATTER: tl.constexpr,
    SEND: tl.constexpr,
    RECV: tl.constexpr,
    LAG: tl.constexpr,
    COUNTS: tl.constexpr,
    SPLIT: tl.constexpr,
    SEND_LOCAL: tl.constexpr,  # not SPLIT: the senders also write this rank's own rows
    USE_TIMER: tl.constexpr,
    G,
    GS,
    pk_ptr,  # [W, max_tokens] int32 from _pack_kernel (remote peers only)
    pinfo_ptr,  # [2W] int64 (remote peers only)
    off_sig,
    off_sback,
    off_srec,
    CW: tl.constexpr,
    REMOTE: tl.constexpr,
    RECX: tl.constexpr,  # record stride in row elements
    RECI: tl.constexpr,  # record stride in 4-byte words
    ROWB: tl.constexpr,  # bytes of a record's row (then its metadata)
    CE: tl.constexpr = False,  # the peers' rows and metadata arrive by copy-engine copies (not SPLIT)
    STEAL: tl.constexpr = False,  # SPLIT: chunks claimed from shared counters, each role taking the
    # other's once its own queue is empty (instead of the fixed chunk c = q + j * stride)
    REWRITE: tl.constexpr = False,  # a writing pass of its own (not SEND) that also writes this rank's
    # own rows: the second pass of a speculative exact-shape dispatch, into outputs re-sized after it
    ce_tokens=1,  # tokens per copy-engine piece (a multiple of CH): one flag per piece and source
    WHOLE_ROW: tl.constexpr = False,  # decode-sized chunks: BH >= H, whole rows held in registers
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch: wait for the launch before
    EARLY_SEND: tl.constexpr = False,  # COUNTS, not SPLIT: programs other than 0 send their first chunk
    # to the peers before the receive layout is known, then write its own rows once it is
    MIRROR: tl.constexpr = False,  # COUNTS: program 0 also copies info to the host (mirror_addr)
    INFO_LEN: tl.constexpr = 1,  # MIRROR: info's length
    INFO_P2: tl.constexpr = 1,  # MIRROR: the next power of 2
    mirror_addr=0,  # MIRROR: address of pinned host int64 [INFO_LEN + 1] (info, then the epoch)
    id64=0,  # 1: ids_ptr points at int64 ids (see _load_ids)
    QH: tl.constexpr = 0,  # > 0: x holds rows of QH bf16 / fp16 / fp32 channels, quantized to the packed
    # FP8 rows of out on send, in tiles of BQ pairs of channels (see _dispatch_send_chunk)
    BQ: tl.constexpr = 64,
    ST: tl.constexpr = 1,  # STEAL: tokens per block of token_dst_scatter_idx claimed from a shared counter
    TAIL: tl.constexpr = 0,  # STEAL: the last TAIL write chunks are claimed as two halves each (CH >= 2)
):
    pid = tl.program_id(0)
    if PDL:
        # resident while the previous kernel (the layout) finishes; everything it wrote is visible after
        gdc_wait()
    err = tl.atomic_add(state_ptr + 3, 0, sem="relaxed", scope="gpu")
    if COUNTS:
        # merged with step 2 (one launch fewer): program 0 builds the receive layout, the others wait
        ep = tl.load(state_ptr + 0) + 1
        if pid == 0:
            # (writes info[1], the error word the host reads, even when an earlier call failed)
            _counts_body(
                info_ptr,
                offs_ptr,
                table_ptr,
                state_ptr,
                off_cnt,
                off_back,
                rank,
                ep,
                timeout,
                pinfo_ptr,
                off_sig,
                off_sback,
                W,
                L,
                WP,
                LP,
                USE_TIMER,
                CW,
                REMOTE,
            )
            tl.debug_barrier()
            tl.atomic_xchg(state_ptr + 5, ep, sem="release", scope="gpu")
            if MIRROR:
                # info (with the layout kernel's invalid-id count) into pinned host memory, then this
                # dispatch's epoch after it: the host polls that word instead of synchronizing the stream,
                # so it has the counts while the rows still move
                mirror = mirror_addr.to(tl.pointer_type(tl.int64))
                ii = tl.arange(0, INFO_P2)
                iv = tl.load(info_ptr + ii, mask=ii < INFO_LEN, other=0, cache_modifier=".cg")
                tl.store(mirror + ii, iv, mask=ii < INFO_LEN)
                tl.debug_barrier()
                tl.atomic_xchg(mirror + INFO_LEN, ep, sem="release", scope="sys")
        if SPLIT:
            early = (pid > 0) & (pid < GS)
        elif EARLY_SEND:
            early = pid > 0
        else:
            early = pid < 0
        if err == 0:
            if early:
                # a sending CTA needs no receive layout, only peers that have started this dispatch
                # (their layout's token-count word: their previous call is done with what it overwrites)
                _wait_started(
                    state_ptr, table_ptr, off_cnt, rank, ep, timeout, W, WP, L, CW, USE_TIMER, REMOTE
                )
            else:
                # twice the bound: program 0's own wait for a missing peer runs out first and names it
                _wait_flag(state_ptr + 5, ep, state_ptr, 1, rank, 2 * timeout, USE_TIMER)
            err = tl.atomic_add(state_ptr + 3, 0, sem="relaxed", scope="gpu")
    else:
        ep = tl.load(state_ptr + 0)  # bumped by _counts_kernel
        early = pid < 0
    ss = tl.arange(0, WP)
    # (an early sender must not read info: program 0 may not have written it yet)
    n_src_all = _tokens_from_peers(info_ptr, ss, rank, W, ~early)
    n_recv_max = tl.max(n_src_all, 0)
    n_chunks_send = tl.cdiv(n_tokens, CH)
    n_chunks_recv = tl.cdiv(n_recv_max, CH)
    n_chunks = tl.maximum(n_chunks_send, n_chunks_recv)
    if SPLIT:
        # CTAs [0, GS) only feed the peers (their system-scope release waits for NVLink), the others only
        # write this rank's output (own rows, then received ones): the two overlap instead of alternating
        do_send = pid < GS
        do_recv = pid >= GS
        q = tl.where(do_send, pid, pid - GS)
        stride = tl.where(do_send, GS, G - GS)
        n_steps = tl.cdiv(n_chunks, tl.minimum(GS, G - GS))
        lag = LAG
    else:
        do_send = pid >= 0
        do_recv = pid >= 0
        q = pid
        stride = G
        if CE:
            # nothing to send: every own chunk first, then the received ones, piece by piece as they land
            lag = tl.cdiv(n_chunks_send, G)
        else:
            lag = LAG
        n_steps = tl.cdiv(n_chunks, G) + lag
    if err == 0:
        j = tl.full([], 0, tl.int32)
        # STEAL: mode 0 sends, 1 writes, 2 is done; the CTAs that start by sending write once the send
        # queue is empty (after_send), those that start by writing send once the write queue is
        if RECV:
            first_send = do_send
            after_send = tl.where(do_send, 1, 2)
        else:
            first_send = pid >= 0
            after_send = tl.full([], 2, tl.int32)
        if SEND:
            mode = tl.where(first_send, 0, 1)
            after_write = tl.where(first_send, 2, 0)
        else:
            mode = tl.full([], 1, tl.int32)
            after_write = tl.full([], 2, tl.int32)
        layout_known = tl.where(early, 0, 1)
        if STEAL:
            go = mode < 2
        else:
            go = j < n_steps
        while go:
            half = tl.full([], -1, tl.int32)  # TAIL: a tail item's half of its chunk (-1: the whole chunk)
            if STEAL:
                cs = tl.full([], -1, tl.int32)
                cw = tl.full([], -1, tl.int32)
                if mode == 0:  # (state[8]: STATE_STEAL_SEND, [9]: STATE_STEAL_WRITE)
                    cl = tl.atomic_add(state_ptr + 8, 1, sem="relaxed", scope="gpu").to(tl.int32)
                    cs = tl.where(cl < n_chunks_send, cl, -1)
                    mode = tl.where(cl < n_chunks_send, 0, after_send)
                else:
                    if layout_known == 0:
                        # an early sender about to write: the receive layout (and info) first
                        n_src_all, n_chunks_recv, n_chunks = _await_receive_layout(
                            state_ptr, info_ptr, ss, rank, ep, timeout, n_chunks_send, W, CH, USE_TIMER
                        )
                        layout_known = tl.full([], 1, tl.int32)
                    cl = tl.atomic_add(state_ptr + 9, 1, sem="relaxed", scope="gpu").to(tl.int32)
                    if TAIL > 0:
                        # the last TAIL chunks are two items each (the first and the second half of their
                        # tokens): the expansions that end the launch take two CTAs each
                        n_tail = tl.minimum(n_chunks, TAIL).to(tl.int32)
                        base = n_chunks.to(tl.int32) - n_tail
                        n_items = base + 2 * n_tail
                        half = tl.where((cl >= base) & (cl < n_items), (cl - base) % 2, -1)
                        cw = tl.where(cl < n_items, tl.where(cl >= base, base + (cl - base) // 2, cl), -1)
                        mode = tl.where(cl < n_items, 1, after_write)
                    else:
                        cw = tl.where(cl < n_chunks, cl, -1)
                        mode = tl.where(cl < n_chunks, 1, after_write)
                cr = cw
            else:
                c = q + j * stride
                cs = tl.where(do_send, c, -1)
                cw = tl.where(do_recv, c, -1)
                cr = c - lag * stride
            if SEND:
                send_now = (cs >= 0) & (cs < n_chunks_send)
                if EARLY_SEND:  # noqa: SIM102 (a constexpr test, then a runtime one)
                    # the first chunk goes to the peers before the receive layout is known (it needs
                    # only peers that have started this dispatch), and into this rank's output after it
                    if layout_known == 0:
                        if send_now:
                            _dispatch_send_chunk(
                                cs, x_ptr, ids_ptr, id64, w_ptr, pos_ptr, n_tokens, out_ptr, out_w_ptr,
                                out_e_ptr, tab_ptr, skip_ptr, offs_ptr, table_ptr, rank, ep, max_tokens,
                                nchunks, cap_rows, off_x, off_ids, off_pos, off_w, off_flag, W, L, K, KP, H,
                                BH, CH, EVEN_H, HAS_W, CALLER_SCATTER, True, False, pk_ptr, off_srec, REMOTE,
                                RECX, RECI, ROWB, WHOLE_ROW, QH, BQ,
                            )  # fmt: skip
                        n_src_all, n_chunks_recv, n_chunks = _await_receive_layout(
                            state_ptr, info_ptr, ss, rank, ep, timeout, n_chunks_send, W, CH, USE_TIMER
                        )
                        n_steps = tl.cdiv(n_chunks, G) + lag
                        layout_known = tl.full([], 1, tl.int32)
                        if send_now:
                            _dispatch_send_chunk(
                                cs, x_ptr, ids_ptr, id64, w_ptr, pos_ptr, n_tokens, out_ptr, out_w_ptr,
                                out_e_ptr, tab_ptr, skip_ptr, offs_ptr, table_ptr, rank, ep, max_tokens,
                                nchunks, cap_rows, off_x, off_ids, off_pos, off_w, off_flag, W, L, K, KP, H,
                                BH, CH, EVEN_H, HAS_W, CALLER_SCATTER, False, True, pk_ptr, off_srec, REMOTE,
                                RECX, RECI, ROWB, WHOLE_ROW, QH, BQ,
                            )  # fmt: skip
                        send_now = send_now & (cs < 0)  # (sent)
                if send_now:
                    _dispatch_send_chunk(
                        cs,
                        x_ptr,
                        ids_ptr,
                        id64,
                        w_ptr,
                        pos_ptr,
                        n_tokens,
                        out_ptr,
                        out_w_ptr,
                        out_e_ptr,
                        tab_ptr,
                        skip_ptr,
                        offs_ptr,
                        table_ptr,
                        rank,
                        ep,
                        max_tokens,
                        nchunks,
                        cap_rows,
                        off_x,
                        off_ids,
                        off_pos,
                        off_w,
                        off_flag,
                        W,
                        L,
                        K,
                        KP,
                        H,
                        BH,
                        CH,
                        EVEN_H,
                        HAS_W,
                        CALLER_SCATTER,
                        not CE,  # (copy engine: the peers get this rank's rows by host-issued copies)
                        SEND_LOCAL,
                        pk_ptr,
                        off_srec,
                        REMOTE,
                        RECX,
                        RECI,
                        ROWB,
                        WHOLE_ROW,
                        QH,
                        BQ,
                    )
            if RECV:
                # this rank's own rows into its output (the senders only feed the peers, or nothing sends)
                if SPLIT or REWRITE:
                    if TAIL > 0:
                        if (cw >= 0) & (cw < n_chunks_send):
                            if half >= 0:  # (half a chunk: a chunk of CH // 2 tokens)
                                _dispatch_send_chunk(
                                    2 * cw + half, x_ptr, ids_ptr, id64, w_ptr, pos_ptr, n_tokens, out_ptr,
                                    out_w_ptr, out_e_ptr, tab_ptr, skip_ptr, offs_ptr, table_ptr, rank, ep,
                                    max_tokens, nchunks, cap_rows, off_x, off_ids, off_pos, off_w, off_flag,
                                    W, L, K, KP, H, BH, CH // 2, EVEN_H, HAS_W, CALLER_SCATTER, False, True,
                                    pk_ptr, off_srec, REMOTE, RECX, RECI, ROWB, WHOLE_ROW, QH, BQ,
                                )  # fmt: skip
                            else:
                                _dispatch_send_chunk(
                                    cw, x_ptr, ids_ptr, id64, w_ptr, pos_ptr, n_tokens, out_ptr, out_w_ptr,
                                    out_e_ptr, tab_ptr, skip_ptr, offs_ptr, table_ptr, rank, ep, max_tokens,
                                    nchunks, cap_rows, off_x, off_ids, off_pos, off_w, off_flag, W, L, K, KP,
                                    H, BH, CH, EVEN_H, HAS_W, CALLER_SCATTER, False, True, pk_ptr, off_srec,
                                    REMOTE, RECX, RECI, ROWB, WHOLE_ROW, QH, BQ,
                                )  # fmt: skip
                    elif (cw >= 0) & (cw < n_chunks_send):
                        _dispatch_send_chunk(
                            cw,
                            x_ptr,
                            ids_ptr,
                            id64,
                            w_ptr,
                            pos_ptr,
                            n_tokens,
                            out_ptr,
                            out_w_ptr,
                            out_e_ptr,
                            tab_ptr,
                            skip_ptr,
                            offs_ptr,
                            table_ptr,
                            rank,
                            ep,
                            max_tokens,
                            nchunks,
                            cap_rows,
                            off_x,
                            off_ids,
                            off_pos,
                            off_w,
                            off_flag,
                            W,
                            L,
                            K,
                            KP,
                            H,
                            BH,
                            CH,
                            EVEN_H,
                            HAS_W,
                            CALLER_SCATTER,
                            False,
                            True,
                            pk_ptr,
                            off_srec,
                            REMOTE,
                            RECX,
                            RECI,
                            ROWB,
                            WHOLE_ROW,
                            QH,
                            BQ,
                        )
                c = cr
                if (cw >= 0) & (c >= 0) & (c < n_chunks_recv):
                    # unrolled up to RECV_UNROLL_MAX sources, a loop beyond: the unrolled step's compile time
                    # grows with the square of W (Triton's coalescing pass; minutes per variant at 8 ranks).
                    # (Two loops: Triton picks a loop's kind from its iterator's name.)
                    if W <= RECV_UNROLL_MAX:
                        for s in tl.static_range(W):
                            _dispatch_recv_source(
                                c, s, n_src_all, ss, half, ce_tokens, out_ptr, out_w_ptr, out_e_ptr, tab_ptr,
                                offs_ptr, table_ptr, state_ptr, rank, ep, max_tokens, nchunks, cap_rows,
                                timeout, off_x, off_ids, off_pos, off_w, off_flag, w_ptr.dtype.element_ty, W,
                                L, K, KP, H, BH, CH, EVEN_H, HAS_W, CALLER_SCATTER, USE_TIMER, WHOLE_ROW,
                                REMOTE, CE, TAIL,
                            )  # fmt: skip
                    else:
                        for s in range(W):
                            _dispatch_recv_source(
                                c, s, n_src_all, ss, half, ce_tokens, out_ptr, out_w_ptr, out_e_ptr, tab_ptr,
                                offs_ptr, table_ptr, state_ptr, rank, ep, max_tokens, nchunks, cap_rows,
                                timeout, off_x, off_ids, off_pos, off_w, off_flag, w_ptr.dtype.element_ty, W,
                                L, K, KP, H, BH, CH, EVEN_H, HAS_W, CALLER_SCATTER, USE_TIMER, WHOLE_ROW,
                                REMOTE, CE, TAIL,
                            )  # fmt: skip
            j += 1
            if STEAL:
                go = mode < 2
            else:
                go = j < n_steps
        if RECV:
            # token_dst_scatter_idx: base rows of every destination, pushed by its receive-layout step
            # (in the receiving half: in the CPU simulation every rank's sending half has run by then)
            kk = tl.arange(0, KP)
            if REMOTE != 0:
                # remote destinations' base rows arrive by a host put: wait for its signal first (also the
                # guard of the records' reuse: a peer puts this call's records only after this wait, and
                # the receiver signals it only after expanding the previous call's records)
                for d in tl.static_range(W):
                    if (REMOTE >> d) & 1:
                        sig = _peer_ptr(table_ptr, rank, off_sig, tl.int64) + SIG_BACK * W + d
                        _wait_flag(sig, ep, state_ptr, 3, d, timeout, USE_TIMER)
            if STEAL:
                # blocks of ST tokens claimed from a shared counter (state[11]: STATE_STEAL_SCATTER): the
                # CTAs whose loop ended first take them, not the one still expanding the last received chunk
                n_blocks = tl.cdiv(n_tokens, ST)
                c = tl.atomic_add(state_ptr + 11, 1, sem="relaxed", scope="gpu").to(tl.int32)
                while c < n_blocks:
                    _scatter_block(c * ST + tl.arange(0, ST), kk, ids_ptr, id64, pos_ptr, n_tokens, scat_ptr,
                                   table_ptr, state_ptr, rank, ep, timeout, off_back, W, L, K, WP,
                                   CALLER_SCATTER, USE_TIMER)  # fmt: skip
                    c = tl.atomic_add(state_ptr + 11, 1, sem="relaxed", scope="gpu").to(tl.int32)
            else:
                j = tl.full([], 0, tl.int32)
                while j < tl.cdiv(n_chunks_send, G):
                    c = pid + j * G
                    _scatter_block(c * CH + tl.arange(0, CH), kk, ids_ptr, id64, pos_ptr, n_tokens, scat_ptr,
                                   table_ptr, state_ptr, rank, ep, timeout, off_back, W, L, K, WP,
                                   CALLER_SCATTER, USE_TIMER)  # fmt: skip
                    j += 1
    if STEAL:
        # the last CTA resets the claim counters for the next launch (an engine's launches are
        # stream-ordered; every CTA has made its last claim before it arrives here)
        # (literal offsets: STATE_STEAL_SEND / _WRITE / _ARRIVE / _SCATTER; a compiled kernel cannot read
        # globals)
        arrived = tl.atomic_add(state_ptr + 10, 1, sem="acq_rel", scope="gpu")
        if arrived == G - 1:
            tl.atomic_xchg(state_ptr + 8, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(state_ptr + 9, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(state_ptr + 10, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(state_ptr + 11, 0, sem="relaxed", scope="gpu")
    if COUNTS and RECV:
        # the last CTA to finish publishes the epoch (every CTA read the old one first); launches of
        # one engine are stream-ordered, so the arrivals come in whole grids of G
        old = tl.atomic_add(state_ptr + 6, 1, sem="acq_rel", scope="gpu")
        if (old + 1) % G == 0:
            tl.store(state_ptr + 0, ep)


# --------------------------------------------------------------------------------------------------
# dispatch, remote sources: expand the packed records a host put delivered (after the row kernel)
# --------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["rank", "max_tokens", "cap_rows", "timeout", "G"])
def _remote_expand_kernel(
    out_ptr,  # [cap_rows, H]
    out_w_ptr,  # [cap_rows]
    out_e_ptr,  # [cap_rows] int32
    tab_ptr,  # [W, max_tokens, K] int32 (remote sources' rows set to -1 by the row kernel)
    rtok_ptr,  # [W, max_tokens] int32 out: token index of packed record j from remote source s
    pinfo_ptr,  # [2W] int64: [W + s] records from remote source s
    offs_ptr,
    table_ptr,
    state_ptr,
    rank,
    max_tokens,
    cap_rows,
    timeout,
    off_rrec,
    off_sig,
    W: tl.constexpr,
    L: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    H: tl.constexpr,
    BH: tl.constexpr,
    CH: tl.constexpr,
    EVEN_H: tl.constexpr,
    HAS_W: tl.constexpr,
    CALLER_SCATTER: tl.constexpr,
    USE_TIMER: tl.constexpr,
    REMOTE: tl.constexpr,
    RECX: tl.constexpr,
    RECI: tl.constexpr,
    ROWB: tl.constexpr,
    G,
):
    """Every remote source's records (``pinfo[W + s]`` of them, in ``rrec[s]``), once its put's signal
    carries this dispatch's epoch: exactly the intra-node receiver's expansion, one record per token."""
    pid = tl.program_id(0)
    err = tl.atomic_add(state_ptr + 3, 0, sem="relaxed", scope="gpu")
    ep = tl.load(state_ptr + 0)  # bumped by _counts_kernel
    kk = tl.arange(0, KP)
    hh = tl.arange(0, BH)
    ty = out_ptr.dtype.element_ty
    if err == 0:
        for s in tl.static_range(W):
            if (REMOTE >> s) & 1:
                npk = tl.load(pinfo_ptr + W + s)
                i = tl.full([], 0, tl.int32)
                while i < tl.cdiv(tl.cdiv(npk, CH), G):
                    c = pid + i * G
                    if c * CH < npk:
                        sig = _peer_ptr(table_ptr, rank, off_sig, tl.int64) + SIG_DATA * W + s
                        ok = _wait_flag(sig, ep, state_ptr, 2, s, timeout, USE_TIMER)
                        if ok:
                            jj = c * CH + tl.arange(0, CH)
                            jm = jj < npk
                            m2 = jm[:, None] & (kk[None, :] < K)
                            rec = (s * max_tokens + jj).to(tl.int64) * RECI
                            meta = _peer_ptr(table_ptr, rank, off_rrec + ROWB, tl.int32) + rec
                            toks = tl.load(meta, mask=jm, other=0, cache_modifier=".cg")
                            ids = tl.load(
                                meta[:, None] + 1 + kk[None, :], mask=m2, other=-1, cache_modifier=".cg"
                            )
                            pos = tl.load(
                                meta[:, None] + 1 + K + kk[None, :], mask=m2, other=0, cache_modifier=".cg"
                            )
                            row, e_loc = _slot_rows(
                                ids, pos, m2, s, offs_ptr, rank, cap_rows, L, W, CALLER_SCATTER
                            )
                            tslot = (s * max_tokens + toks)[:, None].to(tl.int64) * K + kk[None, :]
                            tl.store(tab_ptr + tslot, row.to(tl.int32), mask=m2)
                            tl.store(rtok_ptr + s * max_tokens + jj, toks, mask=jm)
                            kept = row >= 0
                            tl.store(out_e_ptr + row, e_loc.to(tl.int32), mask=kept)
                            if HAS_W:
                                mw = (meta + 1 + 2 * K).to(tl.pointer_type(tl.float32))  # (4-byte aligned)
                                w = tl.load(mw[:, None] + kk[None, :], mask=m2, other=0, cache_modifier=".cg")
                                tl.store(out_w_ptr + row, w.to(out_w_ptr.dtype.element_ty), mask=kept)
                            need = tl.sum(kept.to(tl.int32), axis=1) > 0
                            px = (
                                _peer_ptr(table_ptr, rank, off_rrec, ty)
                                + (s * max_tokens + jj).to(tl.int64) * RECX
                            )
                            for h0 in range(0, H, BH):
                                xt = tl.load(
                                    px[:, None] + h0 + hh[None, :],
                                    mask=_m(need, h0, hh, H, EVEN_H),
                                    cache_modifier=".cg",
                                )
                                for k in tl.static_range(K):
                                    rk = _column(row, kk, k)
                                    tl.store(
                                        out_ptr + rk[:, None] * H + h0 + hh[None, :],
                                        xt,
                                        mask=_m((rk >= 0), h0, hh, H, EVEN_H),
                                    )
                    i += 1


@triton.jit
def _slots_tile(y_ptr, rows, h0, hh, H: tl.constexpr, EVEN_H: tl.constexpr):
    """Tile ``h0`` of the rows ``rows [CH, KP]`` (int64, < 0: none) of ``y`` as one ``[CH, KP, BH]``
    gather, zero where there is no row and past the end of the row (all of it once ``h0 >= H``). The
    expert rows are read once: evict-first, so the peers' rows arriving in L2 stay there."""
    if EVEN_H:
        m = _and((rows >= 0)[:, :, None], h0 < H)  # constant along the row: 16-byte vectors
    else:
        m = (rows >= 0)[:, :, None] & ((h0 + hh) < H)[None, None, :]
    return tl.load(
        y_ptr + (rows * H)[:, :, None] + h0 + hh[None, None, :],
        mask=m,
        other=0,
        eviction_policy="evict_first",
    )


@triton.jit
def _reduce_rows(y_ptr, rows, dst, keep, hh, H: tl.constexpr, BH: tl.constexpr, EVEN_H: tl.constexpr):
    """``dst[i] = sum_k y[rows[i, k]]`` (float32 sum, rows < 0 skipped) for the rows ``i`` with ``keep``.

    Every slot of a tile is one gather, and the next tile's gather is issued before this one is summed,
    so a CTA keeps two tiles of loads in flight."""
    cur = _slots_tile(y_ptr, rows, 0, hh, H, EVEN_H)
    for h0 in range(0, H, BH):
        nxt = _slots_tile(y_ptr, rows, h0 + BH, hh, H, EVEN_H)
        acc = tl.sum(cur.to(tl.float32), axis=1)
        tl.store(dst + h0 + hh[None, :], acc.to(y_ptr.dtype.element_ty), mask=_m(keep, h0, hh, H, EVEN_H))
        cur = nxt


# --------------------------------------------------------------------------------------------------
# combine: expert side pre-reduces per (token, source rank) in fp32, one row back per pair
# --------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["n_tokens", "rank", "max_tokens", "nchunks", "timeout", "G", "GS", "id64"])
def _combine_kernel(
    y_ptr,  # [R, H] expert outputs, dispatch-output order
    tab_ptr,  # [W, max_tokens, K] int32 from the dispatch
    ids_ptr,  # [n, K] int32 this rank's expert indices (or int64: id64)
    nsrc_ptr,  # [W] int64 tokens of every source in the dispatch
    n_tokens,
    out_ptr,  # [n, H]
    table_ptr,
    state_ptr,
    rank,
    max_tokens,
    nchunks,
    timeout,
    off_cx,
    off_cflag,
    W: tl.constexpr,
    L: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    WP: tl.constexpr,
    H: tl.constexpr,
    BH: tl.constexpr,
    CH: tl.constexpr,
    EVEN_H: tl.constexpr,
    SEND: tl.constexpr,
    RECV: tl.constexpr,
    LAG: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_TIMER: tl.constexpr,
    G,
    GS,
    pk_ptr,  # [W, max_tokens] int32 from the dispatch (remote peers only)
    rtok_ptr,  # [W, max_tokens] int32 from the dispatch (remote peers only)
    pinfo_ptr,  # [2W] int64 from the dispatch (remote peers only)
    off_scx,
    off_sig,
    REMOTE: tl.constexpr,
    id64=0,  # 1: ids_ptr points at int64 ids (see _load_ids)
):
    pid = tl.program_id(0)
    ep = tl.load(state_ptr + 1) + 1
    err = tl.atomic_add(state_ptr + 3, 0, sem="relaxed", scope="gpu")
    ss = tl.arange(0, WP)
    n_src_all = tl.load(nsrc_ptr + ss, mask=(ss < W) & (ss != rank), other=0)
    n_chunks_send = tl.cdiv(tl.max(n_src_all, 0), CH)
    n_chunks_recv = tl.cdiv(n_tokens, CH)
    n_chunks = tl.maximum(n_chunks_send, n_chunks_recv)
    if SPLIT:
        # CTAs [0, GS) only pre-reduce and send the peers' rows, the others only sum this rank's tokens
        do_send = pid < GS
        do_recv = pid >= GS
        q = tl.where(do_send, pid, pid - GS)
        stride = tl.where(do_send, GS, G - GS)
        n_steps = tl.cdiv(n_chunks, tl.minimum(GS, G - GS))
    else:
        do_send = pid >= 0
        do_recv = pid >= 0
        q = pid
        stride = G
        n_steps = tl.cdiv(n_chunks, G) + LAG
    kk = tl.arange(0, KP)
    hh = tl.arange(0, BH)
    ty = y_ptr.dtype.element_ty
    if err == 0:
        j = tl.full([], 0, tl.int32)
        while j < n_steps:
            if SEND:
                c = q + j * stride
                for s in tl.static_range(W):
                    n_s = tl.sum(tl.where(ss == s, n_src_all, 0), 0)
                    if (REMOTE >> s) & 1:
                        # a remote source: its rows in the order of its packed records, staged here (the
                        # host puts them after the kernel)
                        npk = tl.load(pinfo_ptr + W + s)
                        if do_send & (c * CH < npk):
                            jj = c * CH + tl.arange(0, CH)
                            jm = jj < npk
                            toks = tl.load(rtok_ptr + s * max_tokens + jj, mask=jm, other=0)
                            m2 = jm[:, None] & (kk[None, :] < K)
                            rows = tl.load(
                                tab_ptr + (s * max_tokens + toks)[:, None].to(tl.int64) * K + kk[None, :],
                                mask=m2,
                                other=-1,
                            ).to(tl.int64)
                            dst = (
                                _peer_ptr(table_ptr, rank, off_scx, ty)
                                + (s * max_tokens + jj).to(tl.int64)[:, None] * H
                            )
                            _reduce_rows(y_ptr, rows, dst, jm, hh, H, BH, EVEN_H)
                    elif (s != rank) & do_send & (c * CH < n_s):
                        toks = c * CH + tl.arange(0, CH)
                        m2 = (toks < n_s)[:, None] & (kk[None, :] < K)
                        rows = tl.load(
                            tab_ptr + (s * max_tokens + toks)[:, None].to(tl.int64) * K + kk[None, :],
                            mask=m2,
                            other=-1,
                        )
                        rows = rows.to(tl.int64)
                        need = tl.sum((rows >= 0).to(tl.int32), axis=1) > 0
                        dst = (
                            _peer_ptr(table_ptr, s, off_cx, ty)
                            + (rank * max_tokens + toks).to(tl.int64)[:, None] * H
                        )
                        _reduce_rows(y_ptr, rows, dst, need, hh, H, BH, EVEN_H)
                        tl.debug_barrier()
                        f = _peer_ptr(table_ptr, s, off_cflag, tl.int64) + rank * nchunks + c
                        tl.atomic_xchg(f, ep, sem="release", scope="sys")
            if RECV:
                c = q + (j - LAG) * stride
                if do_recv & (c >= 0) & (c < n_chunks_recv):
                    toks = c * CH + tl.arange(0, CH)
                    tm = toks < n_tokens
                    m2 = tm[:, None] & (kk[None, :] < K)
                    slot = toks[:, None].to(tl.int64) * K + kk[None, :]
                    ids = _load_ids(ids_ptr, slot, m2, id64, L * W)
                    ok = m2 & (ids >= 0) & (ids < L * W)  # (invalid ids are dropped)
                    # per token the ranks its slots went to, and over the chunk: two reductions, so the
                    # tiles' masks below are elementwise (a reduction per tile synchronises the CTA)
                    bits = _rank_bits(ids // L, ok)
                    bits_all = tl.reduce(bits, 0, _or)
                    ok_all = True
                    for r in tl.static_range(W):
                        if (REMOTE >> r) & 1:
                            if ((bits_all >> r) & 1) != 0:
                                f = _peer_ptr(table_ptr, rank, off_sig, tl.int64) + SIG_COMB * W + r
                                ok_all = ok_all & _wait_flag(f, ep, state_ptr, 4, r, timeout, USE_TIMER)
                        elif r != rank and ((bits_all >> r) & 1) != 0:
                            f = _peer_ptr(table_ptr, rank, off_cflag, tl.int64) + r * nchunks + c
                            ok_all = ok_all & _wait_flag(f, ep, state_ptr, 4, r, timeout, USE_TIMER)
                    if ok_all:
                        rows = tl.load(tab_ptr + rank * max_tokens * K + slot, mask=m2, other=-1).to(tl.int64)
                        cur = _slots_tile(y_ptr, rows, 0, hh, H, EVEN_H)
                        for h0 in range(0, H, BH):
                            # this rank's slots: one gather per tile, the next one in flight (_reduce_rows)
                            nxt = _slots_tile(y_ptr, rows, h0 + BH, hh, H, EVEN_H)
                            acc = tl.sum(cur.to(tl.float32), axis=1)
                            for r in tl.static_range(W):
                                need = ((bits >> r) & 1) != 0
                                if (REMOTE >> r) & 1:
                                    # r's row of token t is its packed record pk[r, t]
                                    jr = tl.load(pk_ptr + r * max_tokens + toks, mask=need, other=0)
                                    src = (
                                        _peer_ptr(table_ptr, rank, off_cx, ty)
                                        + (r * max_tokens + jr).to(tl.int64)[:, None] * H
                                    )
                                    acc += tl.load(
                                        src + h0 + hh[None, :],
                                        mask=_m(need, h0, hh, H, EVEN_H),
                                        other=0,
                                        cache_modifier=".cg",
                                    ).to(tl.float32)
                                elif r != rank:
                                    src = (
                                        _peer_ptr(table_ptr, rank, off_cx, ty)
                                        + (r * max_tokens + toks).to(tl.int64)[:, None] * H
                                    )
                                    acc += tl.load(
                                        src + h0 + hh[None, :],
                                        mask=_m(need, h0, hh, H, EVEN_H),
                                        other=0,
                                        cache_modifier=".cg",
                                    ).to(tl.float32)
                            tl.store(
                                out_ptr + toks.to(tl.int64)[:, None] * H + h0 + hh[None, :],
                                acc.to(out_ptr.dtype.element_ty),
                                mask=_m(tm, h0, hh, H, EVEN_H),
                            )
                            cur = nxt
            j += 1
    if RECV:
        # the last CTA to finish publishes the epoch (every CTA read the old one first)
        old = tl.atomic_add(state_ptr + 2, 1, sem="acq_rel", scope="gpu")
        if old == ep * G - 1:
            tl.store(state_ptr + 1, ep)


# --------------------------------------------------------------------------------------------------
# barrier (one program)
# --------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["rank", "timeout"])
def _barrier_kernel(
    table_ptr,
    state_ptr,
    off_bar,
    rank,
    timeout,
    W: tl.constexpr,
    SEND: tl.constexpr,
    RECV: tl.constexpr,
    USE_TIMER: tl.constexpr,
    REMOTE: tl.constexpr,
):
    ep = tl.load(state_ptr + 4) + 1
    if SEND:
        for r in tl.static_range(W):
            if ((REMOTE >> r) & 1) == 0:  # remote peers: a host signal after this kernel
                tl.atomic_xchg(
                    _peer_ptr(table_ptr, r, off_bar, tl.int64) + rank, ep, sem="release", scope="sys"
                )
    if RECV:
        for r in tl.static_range(W):
            _wait_flag(
                _peer_ptr(table_ptr, rank, off_bar, tl.int64) + r, ep, state_ptr, 5, r, timeout, USE_TIMER
            )
        tl.store(state_ptr + 4, ep)
