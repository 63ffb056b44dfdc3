"""Low-latency mode of the Triton backend (``TritonTuning(low_latency=True)``): one kernel per dispatch
and one per combine, no exchange of counts or layouts before the rows move, no barrier between calls.

Each rank's symmetric heap holds two copies (by the parity of the call number) of fixed receive slots
sized for ``max_tokens``:

* dispatch: ``x [2, W, T, row_bytes]`` the token rows by source rank and token, ``slot / w [2, W, T *
  K]`` per source the slots it sends here in (local expert, token, slot) order (their flat index ``t *
  K + k`` and weight), and ``cnt [2, W, L + 1]`` one word per (source, local expert) holding
  ``(epoch << 32) | rows``, plus one holding the source's token count.
* combine: ``cx [2, W, T, H]`` one row per (expert rank, token): the expert side's float32 sum of the
  token's rows, in the rows' dtype; ``cflag [2, W]`` one word per expert rank.

Dispatch: every CTA takes chunks of tokens, works out from the expert ids alone where each slot's row
goes in its destination's per-source list (the position of the slot among this rank's slots of the
same destination, in (local expert, token, slot) order: a count over the ids, no exchange), and stores
each token row once per destination rank and each slot's index and weight straight into the peers'
fixed slots. The last CTA to finish (an arrival counter) pushes the per-expert counts and the token
count, tagged with the epoch, with release stores: the counts travel with the data. Each CTA then waits
until every source's words carry the epoch (bounded: a missing rank is named), builds the receive
layout from the counts and copies the received rows into the output in the layer's usual order (local
expert, source rank, token, slot), recording each received slot's row for the combine.

Combine: the expert side sums each received token's rows in float32 and stores one row per (token,
source) into the source's fixed slot; the last CTA pushes the epoch to every rank, and each rank adds,
per token, the rows of the ranks its slots went to. A call's receive slots are those of the parity of
its call number; every call is a complete exchange (every rank signals every rank), so a rank can only
write slots of call ``c + 2`` after every peer has finished reading those of call ``c``: no barrier.

Tokens beyond ``max_tokens`` are refused on the host; the refusing rank still runs the exchange with
no rows and a marked token count, so that every peer records a clear error naming it (instead of
waiting for rows that never come).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ep_a2a.backends.triton.engine import (
    FP8_ROW_DTYPE,
    EPTimeoutFromDevice,
    KernelLaunch,
    QuantizeOnSend,
    TritonEPEngine,
    _ids_arg,
    _next_pow2,
    compile_all,
    interpreting,
)
from ep_a2a.backends.triton.kernels import (
    _and,
    _load_ids,
    _load_pairs,
    _peer_ptr,
    _quantize_pairs,
    _rank_bits,
    _set_error,
    _spin_epoch,
)

# device state slots (int64); ERR is kernels' STATE_ERR (``kernels._set_error`` writes it)
LL_DISPATCH_EPOCH = tl.constexpr(0)
LL_COMBINE_EPOCH = tl.constexpr(1)
LL_DISPATCH_ARRIVE = tl.constexpr(2)
LL_ERR = tl.constexpr(3)
LL_COMBINE_ARRIVE = tl.constexpr(4)
LL_STATE_SIZE = 8

# error steps in state[LL_ERR] = 1 + step * 65536 + peer
STEP_LL_DISPATCH = tl.constexpr(2)  # (kernels.STEP_DISPATCH: "dispatch/payload")
STEP_LL_COMBINE = tl.constexpr(4)  # (kernels.STEP_COMBINE)
STEP_LL_TOO_MANY = tl.constexpr(7)  # a source dispatched more than max_tokens tokens (refused)
_TOO_MANY = tl.constexpr(0xFFFFFFFF)  # the token-count word of a refused dispatch
_ALIGN = 256


class LowLatencyInputError(ValueError):
    """A rank's dispatch was refused (more tokens than ``max_tokens``); raised on every rank."""


@dataclass(frozen=True)
class LowLatencyLayout:
    """Byte offsets of the low-latency heap's regions (identical on every rank; see the module docs).

    ``row_bytes``: bytes of a dispatched row's slot; ``comb_bytes``: bytes per channel of a combine row.
    """

    cnt: int
    cflag: int
    x: int
    slot: int
    w: int
    cx: int
    nbytes: int
    row_bytes: int
    comb_bytes: int

    @classmethod
    def build(
        cls, *, world_size: int, max_tokens: int, hidden: int, topk: int, experts_per_rank: int,
        row_bytes: int, comb_bytes: int,
    ) -> LowLatencyLayout:  # fmt: skip
        W, T, L = world_size, max_tokens, experts_per_rank
        sizes = {
            "cnt": 2 * W * (L + 1) * 8,
            "cflag": 2 * W * 8,
            "x": 2 * W * T * row_bytes,
            "slot": 2 * W * T * topk * 4,
            "w": 2 * W * T * topk * 4,
            "cx": 2 * W * T * hidden * comb_bytes,
        }
        offs, cur = {}, 0
        for name, size in sizes.items():
            offs[name] = cur
            cur += (size + _ALIGN - 1) // _ALIGN * _ALIGN
        return cls(nbytes=cur, row_bytes=row_bytes, comb_bytes=comb_bytes, **offs)


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _ll_ids(ids_ptr, flat, m, id64, E: tl.constexpr):
    """Expert ids at ``flat`` (int32 or int64 input, :func:`kernels._load_ids`), ``-1`` where ``m`` is
    false or the id is dropped, and whether each was outside ``[-1, E)`` (dropped and counted)."""
    ids = _load_ids(ids_ptr, flat, m, id64, E)
    bad = m & ((ids < -1) | (ids >= E))
    return tl.where(m & (ids >= 0) & (ids < E), ids, -1), bad


@triton.jit
def _ll_send_rows(x_ptr, toks, tm, dest, valid, table_ptr, rank, p, off_x, S: tl.constexpr, XS: tl.constexpr,
                  W: tl.constexpr, T: tl.constexpr, BH: tl.constexpr, QH: tl.constexpr, BQ: tl.constexpr):  # fmt: skip
    """Each token row of the chunk into slot ``[p, rank, t]`` of every rank its valid slots go to
    (``QH > 0``: ``x_ptr`` holds ``[n, QH]`` rows quantized here to packed FP8 rows)."""
    bits = _rank_bits(dest, valid)
    row = ((p * W + rank) * T + toks).to(tl.int64)
    if QH > 0:
        for h0 in range(0, QH // 2, BQ):
            raw = _load_pairs(x_ptr, toks, tm & (bits != 0), h0, QH, BQ)
            xq, st = _quantize_pairs(raw, x_ptr.dtype.element_ty)
            blk = tl.arange(0, BQ // 64)
            off = h0 + blk * 64
            inrow = (off < QH // 2)[None, :]
            for r in tl.static_range(W):
                need = (((bits >> r) & 1) != 0)[:, None]
                px = _peer_ptr(table_ptr, r, off_x, tl.int16)
                ptr = px + row[:, None, None] * XS + off[None, :, None] + tl.arange(0, 64)[None, None, :]
                tl.store(ptr, xq, mask=(need & inrow)[:, :, None])
                # the block scales after the row's FP8 bytes (a [CH, BQ / 64] store of their own)
                sp = (
                    px.to(tl.pointer_type(tl.int32))
                    + row[:, None] * (XS // 2)
                    + (QH // 4 + h0 // 64)
                    + blk[None, :]
                )
                tl.store(sp, st, mask=need & inrow)
    else:
        hh = tl.arange(0, BH)
        for h0 in range(0, S, BH):
            hm = (h0 + hh) < S
            xt = tl.load(x_ptr + toks.to(tl.int64)[:, None] * S + h0 + hh[None, :],
                         mask=(tm & (bits != 0))[:, None] & hm[None, :])  # fmt: skip
            for r in tl.static_range(W):
                need = ((bits >> r) & 1) != 0
                px = _peer_ptr(table_ptr, r, off_x, x_ptr.dtype.element_ty)
                tl.store(px + row[:, None] * XS + h0 + hh[None, :], xt, mask=need[:, None] & hm[None, :])


@triton.jit
def _ll_recv_rows(ii, total, incl, excl, sp, fi, slot_here, p, W: tl.constexpr, T: tl.constexpr, K_: tl.constexpr,
                  WP: tl.constexpr):  # fmt: skip
    """Output rows ``ii`` of a dispatch: whether each is valid, its local expert and source, the index of
    its entry in the source's slot list and that entry (``t * K + k``, loaded)."""
    im = ii < total
    f = tl.sum((incl[None, :] <= ii[:, None]).to(tl.int32), 1)  # its (local expert, source) block
    sel = fi[None, :] == f[:, None]
    base = tl.sum(tl.where(sel, excl[None, :], 0), 1)
    j = tl.sum(tl.where(sel, sp[None, :], 0), 1) + (ii - base)
    le, s = f // WP, f % WP
    at = (p * W + s) * (T * K_) + j
    sl = tl.load(slot_here + at, mask=im, other=0, cache_modifier=".cg")
    return ii, im, le, s, at, sl


@triton.jit(do_not_specialize=["n", "bad", "rank", "timeout", "id64", "G"])
def _ll_dispatch_kernel(
    x_ptr, ids_ptr, id64, w_ptr, n, bad,
    table_ptr, rank, state_ptr, scratch_ptr,
    out_ptr, out_w_ptr, out_e_ptr, info_ptr, tab_ptr,
    off_cnt, off_x, off_slot, off_w, timeout, G,
    W: tl.constexpr, L: tl.constexpr, K_: tl.constexpr, KP: tl.constexpr, T: tl.constexpr,
    S: tl.constexpr, XS: tl.constexpr, EP: tl.constexpr, WP: tl.constexpr, LP: tl.constexpr,
    CH: tl.constexpr, BH: tl.constexpr, BLK: tl.constexpr, RROWS: tl.constexpr,
    HAS_W: tl.constexpr, QH: tl.constexpr, BQ: tl.constexpr,
    SEND: tl.constexpr, RECV: tl.constexpr, USE_TIMER: tl.constexpr,
):  # fmt: skip
    """One low-latency dispatch (see the module docs). ``SEND`` / ``RECV``: the sending half (rows,
    slots, and by the last CTA the tagged counts) and the receiving half (wait, layout, copy); a GPU
    launch runs both, the CPU simulation one after the other on every rank. ``bad``: this rank's call
    was refused (``n`` is then 0): its token-count word carries the refusal."""
    pid = tl.program_id(0)
    E: tl.constexpr = W * L
    CW: tl.constexpr = L + 1
    if SEND:
        ep = tl.load(state_ptr + LL_DISPATCH_EPOCH) + 1
    else:
        ep = tl.load(state_ptr + LL_DISPATCH_EPOCH)
    p = ep % 2
    err0 = tl.atomic_add(state_ptr + LL_ERR, 0, sem="relaxed", scope="gpu")
    kk = tl.arange(0, KP)
    if SEND:
        if err0 == 0:
            nk = n * K_
            ee = tl.arange(0, EP)
            c = pid
            while c < tl.cdiv(n, CH):
                toks = c * CH + tl.arange(0, CH)
                tm = toks < n
                flat = toks[:, None] * K_ + kk[None, :]
                m2 = tm[:, None] & (kk < K_)[None, :]
                ids, badm = _ll_ids(ids_ptr, flat, m2, id64, E)
                valid = ids >= 0
                dest = tl.where(valid, ids // L, -1)
                lo = dest * L
                # position in the destination's list: this rank's slots of the same destination with a
                # lower local expert, or the same expert and an earlier (token, slot)
                jpos = tl.zeros([CH, KP], tl.int32)
                b0 = 0
                while b0 < nk:
                    f = b0 + tl.arange(0, BLK)
                    o, _unused = _ll_ids(ids_ptr, f, f < nk, id64, E)
                    o3 = o[None, None, :]
                    before = ((o3 >= lo[:, :, None]) & (o3 < ids[:, :, None])) | (
                        (o3 == ids[:, :, None]) & (f[None, None, :] < flat[:, :, None])
                    )
                    jpos += tl.sum(before.to(tl.int32), 2)
                    b0 += BLK
                _ll_send_rows(
                    x_ptr, toks, tm, dest, valid, table_ptr, rank, p, off_x, S, XS, W, T, BH, QH, BQ
                )
                if HAS_W:
                    wv = tl.load(w_ptr + flat, mask=valid, other=0.0).to(tl.float32)
                for r in tl.static_range(W):
                    here = valid & (dest == r)
                    at = (p * W + rank) * (T * K_) + jpos
                    tl.store(_peer_ptr(table_ptr, r, off_slot, tl.int32) + at, flat, mask=here)
                    if HAS_W:
                        tl.store(_peer_ptr(table_ptr, r, off_w, tl.float32) + at, wv, mask=here)
                # this chunk's rows per expert (and invalid ids) into the call's scratch counters
                hist = tl.sum(tl.sum((ids[None, :, :] == ee[:, None, None]).to(tl.int32), 2), 1)
                tl.atomic_add(scratch_ptr + ee, hist, mask=(hist > 0) & (ee < E), sem="relaxed", scope="gpu")
                nbad = tl.sum(tl.sum(badm.to(tl.int32), 1), 0)
                if nbad > 0:
                    tl.atomic_add(scratch_ptr + EP, nbad, sem="relaxed", scope="gpu")
                c += G
        tl.debug_barrier()
        old = tl.atomic_add(state_ptr + LL_DISPATCH_ARRIVE, 1, sem="acq_rel", scope="sys")
        if old == G - 1:  # the last CTA: every row and slot of this call is stored; push the counts
            tl.debug_barrier()
            tl.atomic_xchg(state_ptr + LL_DISPATCH_ARRIVE, 0, sem="relaxed", scope="gpu")
            ll = tl.arange(0, LP)
            tag = ep << 32
            nword = tl.where(bad != 0, tl.full([], _TOO_MANY, tl.int64), n.to(tl.int64))
            for r in tl.static_range(W):
                cnt = tl.atomic_xchg(
                    scratch_ptr + r * L + ll,
                    tl.zeros([LP], tl.int32),
                    mask=ll < L,
                    sem="relaxed",
                    scope="gpu",
                )
                word = tag | tl.where(ll < L, cnt.to(tl.int64), nword)
                ptrs = _peer_ptr(table_ptr, r, off_cnt, tl.int64) + (p * W + rank) * CW + ll
                if err0 == 0:
                    tl.atomic_xchg(ptrs, word, mask=ll < CW, sem="release", scope="sys")
            nbad_all = tl.atomic_xchg(scratch_ptr + EP, 0, sem="relaxed", scope="gpu")
            tl.store(info_ptr + 2 + 2 * W + L, nbad_all.to(tl.int64))
            tl.store(state_ptr + LL_DISPATCH_EPOCH, ep)
    if RECV:
        err = tl.atomic_add(state_ptr + LL_ERR, 0, sem="relaxed", scope="gpu")
        ss = tl.arange(0, WP)
        ll = tl.arange(0, LP)
        wm = (ss < W)[:, None] & (ll < CW)[None, :]
        words = _peer_ptr(table_ptr, rank, off_cnt, tl.int64) + (p * W + ss[:, None]) * CW + ll[None, :]
        v, stale = _spin_epoch(words, wm, ep, err, timeout, USE_TIMER)
        late = tl.max(stale.to(tl.int32), 1) > 0
        n_late = tl.sum(late.to(tl.int32), 0)
        if (n_late > 0) & (err == 0):
            _set_error(
                state_ptr, 1 + STEP_LL_DISPATCH * 65536 + tl.min(tl.where(late, ss, WP), 0).to(tl.int64)
            )
        low = v & tl.full([], _TOO_MANY, tl.int64)
        n_src = tl.sum(tl.where(wm & (ll == L)[None, :], low, 0), 1)
        refused = (ss < W) & (n_src == tl.full([], _TOO_MANY, tl.int64))
        n_refused = tl.sum(refused.to(tl.int32), 0)
        if (n_refused > 0) & (err == 0) & (n_late == 0):
            _set_error(
                state_ptr, 1 + STEP_LL_TOO_MANY * 65536 + tl.min(tl.where(refused, ss, WP), 0).to(tl.int64)
            )
        tl.debug_barrier()
        if (err == 0) & (n_late == 0) & (n_refused == 0):
            cnt = tl.where(wm & (ll < L)[None, :], low, 0)  # [WP, LP] rows per (source, local expert)
            ct = tl.trans(cnt)  # [LP, WP]: the output's order, local expert then source
            cflat = tl.reshape(ct, [LP * WP])
            incl = tl.cumsum(cflat, 0)
            excl = incl - cflat
            sp = tl.reshape(tl.cumsum(ct, 0) - ct, [LP * WP])  # a source's rows of lower local experts
            total = tl.sum(cflat, 0)
            if pid == 0:
                tl.store(info_ptr, total)
                tl.store(info_ptr + 1, 0)
                tl.store(info_ptr + 2 + ss, n_src, mask=ss < W)
                tl.store(info_ptr + 2 + W + ss, tl.sum(cnt, 1), mask=ss < W)
                tl.store(info_ptr + 2 + 2 * W + ll, tl.sum(ct, 1), mask=ll < L)
            fi = tl.arange(0, LP * WP)
            rr = tl.arange(0, RROWS)
            hh = tl.arange(0, BH)
            x_here = _peer_ptr(table_ptr, rank, off_x, out_ptr.dtype.element_ty)
            slot_here = _peer_ptr(table_ptr, rank, off_slot, tl.int32)
            w_here = _peer_ptr(table_ptr, rank, off_w, tl.float32)
            i0 = pid * RROWS
            ii, im, le, s, at, sl = _ll_recv_rows(
                i0 + rr, total, incl, excl, sp, fi, slot_here, p, W, T, K_, WP
            )
            while i0 < total:
                # the next rows' slots are loaded while these rows are copied (one round trip per step)
                nxt = _ll_recv_rows(
                    i0 + G * RROWS + rr, total, incl, excl, sp, fi, slot_here, p, W, T, K_, WP
                )
                t = sl // K_
                tl.store(out_e_ptr + ii, le.to(tl.int32), mask=im)
                if HAS_W:
                    tl.store(
                        out_w_ptr + ii,
                        tl.load(w_here + at, mask=im, other=0.0, cache_modifier=".cg"),
                        mask=im,
                    )
                tl.store(tab_ptr + s * (T * K_) + sl, (ep << 32) | ii.to(tl.int64), mask=im)
                src = ((p * W + s) * T + t).to(tl.int64) * XS
                for h0 in range(0, S, BH):
                    m = im[:, None] & ((h0 + hh) < S)[None, :]
                    xt = tl.load(x_here + src[:, None] + h0 + hh[None, :], mask=m, cache_modifier=".cg")
                    tl.store(out_ptr + ii.to(tl.int64)[:, None] * S + h0 + hh[None, :], xt, mask=m)
                i0 += G * RROWS
                ii, im, le, s, at, sl = nxt


@triton.jit
def _ll_comb_item(item, n_src, ss, kk, tab_ptr, dep, W: tl.constexpr, T: tl.constexpr, K_: tl.constexpr,
                  CH: tl.constexpr, NCH: tl.constexpr):  # fmt: skip
    """Work item ``item`` of a combine's expert side (source ``s``, a chunk of its tokens): the source, the
    tokens, which of their slots the latest dispatch (epoch ``dep``) brought here and their output rows
    (nothing past the last item or the source's tokens)."""
    s = item // NCH
    toks = (item % NCH) * CH + tl.arange(0, CH)
    ns = tl.sum(tl.where(ss == s, n_src, 0), 0)
    m2 = _and((toks < ns)[:, None] & (kk < K_)[None, :], item < W * NCH)
    e = tl.load(tab_ptr + (s * T + toks)[:, None] * K_ + kk[None, :], mask=m2, other=0)
    here = m2 & ((e >> 32) == dep)
    return s, toks, here, tl.where(here, e & tl.full([], _TOO_MANY, tl.int64), 0)


@triton.jit(do_not_specialize=["n", "rank", "timeout", "id64", "G"])
def _ll_combine_kernel(
    y_ptr, tab_ptr, info_ptr, ids_ptr, id64, n, out_ptr,
    table_ptr, rank, state_ptr, off_cflag, off_cx, timeout, G,
    W: tl.constexpr, L: tl.constexpr, K_: tl.constexpr, KP: tl.constexpr, T: tl.constexpr, H: tl.constexpr,
    WP: tl.constexpr, CH: tl.constexpr, BH: tl.constexpr,
    SEND: tl.constexpr, RECV: tl.constexpr, USE_TIMER: tl.constexpr,
):  # fmt: skip
    """One low-latency combine of the latest dispatch (see the module docs): ``SEND`` the expert side's
    per-(token, source) sums into the sources' slots, ``RECV`` this rank's per-token sums."""
    pid = tl.program_id(0)
    E: tl.constexpr = W * L
    if SEND:
        cep = tl.load(state_ptr + LL_COMBINE_EPOCH) + 1
    else:
        cep = tl.load(state_ptr + LL_COMBINE_EPOCH)
    p = cep % 2
    dep = tl.load(state_ptr + LL_DISPATCH_EPOCH)
    err0 = tl.atomic_add(state_ptr + LL_ERR, 0, sem="relaxed", scope="gpu")
    kk = tl.arange(0, KP)
    hh = tl.arange(0, BH)
    ss = tl.arange(0, WP)
    if SEND:
        if err0 == 0:
            n_src = tl.load(info_ptr + 2 + ss, mask=ss < W, other=0)
            nch: tl.constexpr = (T + CH - 1) // CH
            item = pid
            s, toks, here, rows = _ll_comb_item(item, n_src, ss, kk, tab_ptr, dep, W, T, K_, CH, nch)
            while item < W * nch:
                # the next item's slot-table row is loaded while this one's rows are summed and sent
                nxt = _ll_comb_item(item + G, n_src, ss, kk, tab_ptr, dep, W, T, K_, CH, nch)
                anyk = tl.max(here.to(tl.int32), 1) > 0
                dst = _peer_ptr(table_ptr, s, off_cx, y_ptr.dtype.element_ty)
                drow = ((p * W + rank) * T + toks).to(tl.int64) * H
                # (whole rows on a GPU: one pass, the slots' loads all in flight; slot order)
                for h0 in range(0, H, BH):
                    hm = (h0 + hh) < H
                    acc = tl.zeros([CH, BH], tl.float32)
                    for k in tl.static_range(K_):
                        hk = tl.sum(tl.where(kk[None, :] == k, here.to(tl.int32), 0), 1) > 0
                        rk = tl.sum(tl.where(kk[None, :] == k, rows, 0), 1)
                        acc += tl.load(y_ptr + rk[:, None] * H + h0 + hh[None, :], mask=hk[:, None] & hm[None, :],
                                       other=0.0).to(tl.float32)  # fmt: skip
                    tl.store(dst + drow[:, None] + h0 + hh[None, :], acc.to(y_ptr.dtype.element_ty),
                             mask=anyk[:, None] & hm[None, :])  # fmt: skip
                item += G
                s, toks, here, rows = nxt
        tl.debug_barrier()
        old = tl.atomic_add(state_ptr + LL_COMBINE_ARRIVE, 1, sem="acq_rel", scope="sys")
        if old == G - 1:
            tl.debug_barrier()
            tl.atomic_xchg(state_ptr + LL_COMBINE_ARRIVE, 0, sem="relaxed", scope="gpu")
            if err0 == 0:
                for r in tl.static_range(W):
                    flag = _peer_ptr(table_ptr, r, off_cflag, tl.int64) + p * W + rank
                    tl.atomic_xchg(flag, cep << 32, sem="release", scope="sys")
            tl.store(state_ptr + LL_COMBINE_EPOCH, cep)
    if RECV:
        err = tl.atomic_add(state_ptr + LL_ERR, 0, sem="relaxed", scope="gpu")
        fm = ss < W
        flags = _peer_ptr(table_ptr, rank, off_cflag, tl.int64) + p * W + ss
        _words, stale = _spin_epoch(flags, fm, cep, err, timeout, USE_TIMER)
        n_late = tl.sum(stale.to(tl.int32), 0)
        if (n_late > 0) & (err == 0):
            _set_error(
                state_ptr, 1 + STEP_LL_COMBINE * 65536 + tl.min(tl.where(stale, ss, WP), 0).to(tl.int64)
            )
        tl.debug_barrier()
        if (err == 0) & (n_late == 0):
            cx = _peer_ptr(table_ptr, rank, off_cx, y_ptr.dtype.element_ty)
            c = pid
            while c < tl.cdiv(n, CH):
                toks = c * CH + tl.arange(0, CH)
                tm = toks < n
                flat = toks[:, None] * K_ + kk[None, :]
                ids, _unused = _ll_ids(ids_ptr, flat, tm[:, None] & (kk < K_)[None, :], id64, E)
                bits = _rank_bits(tl.where(ids >= 0, ids // L, -1), ids >= 0)
                for h0 in range(0, H, BH):
                    hm = (h0 + hh) < H
                    acc = tl.zeros([CH, BH], tl.float32)
                    for r in tl.static_range(W):
                        has = tm & (((bits >> r) & 1) != 0)
                        src = ((p * W + r) * T + toks).to(tl.int64) * H
                        acc += tl.load(cx + src[:, None] + h0 + hh[None, :], mask=has[:, None] & hm[None, :],
                                       other=0.0, cache_modifier=".cg").to(tl.float32)  # fmt: skip
                    tl.store(out_ptr + toks.to(tl.int64)[:, None] * H + h0 + hh[None, :],
                             acc.to(out_ptr.dtype.element_ty), mask=tm[:, None] & hm[None, :])  # fmt: skip
                c += G


# --------------------------------------------------------------------------------------------------
# one rank's engine
# --------------------------------------------------------------------------------------------------
@dataclass
class LowLatencyDispatch:
    """Result of a low-latency dispatch (fixed shapes; the counts stay on the device).

    Attributes:
        output: ``[W * max_tokens * topk, S]`` rows, of which the first ``num_recv_rows`` are valid, in the
            layer's usual order (local expert, source rank, token, slot); ``S``: the row's elements
            (packed FP8 rows: :data:`~.engine.FP8_ROW_DTYPE`, ``fp8_row_bytes(hidden) / 2``).
        weights: ``[same rows]`` weight dtype, or ``None``.
        recv_expert_indices: ``[same rows]`` int32 local expert of each valid row.
        num_recv_tokens_per_expert: ``[experts_per_rank]`` int64 on the device.
        num_recv_rows: ``[]`` int64 on the device.
        num_recv_tokens_per_rank: ``[W]`` int64 on the device: rows received from each source.
        num_input_tokens_per_rank: ``[W]`` int64 on the device: tokens each source dispatched.
        num_invalid_ids: ``[]`` int64 on the device: this rank's slots with an id outside
            ``[-1, num_tot_experts)`` (dropped).
        exp_indices: this rank's expert ids of the call (the combine reads them).
        info: the call's counts (``[3 + 2 W + L]`` int64, the normal engine's ``info`` layout).
        epoch: the call number on the host (the combine checks it is the latest dispatch's).
        state: set by the backend (the layer it belongs to).
    """

    output: torch.Tensor
    weights: torch.Tensor | None
    recv_expert_indices: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    num_recv_rows: torch.Tensor
    num_recv_tokens_per_rank: torch.Tensor
    num_input_tokens_per_rank: torch.Tensor
    num_invalid_ids: torch.Tensor
    exp_indices: torch.Tensor
    info: torch.Tensor
    epoch: int
    state: Any = None  # the backend's record of who produced it


def _decode(code: int) -> tuple[int, int]:
    code -= 1
    return code // 65536, code % 65536


class LowLatencyEngine:
    """One rank's low-latency dispatch and combine over a heap of :class:`LowLatencyLayout`.

    Args:
        rank, world_size, max_tokens, hidden, topk, num_tot_experts: the group's shape.
        weight_dtype: dtype of routing weights (at most 4 bytes).
        heap_local: this rank's heap (``layout.nbytes`` bytes, zeroed before first use).
        ptr_table: ``[world_size]`` int64, every rank's heap base address as mapped here.
        layout: the heap's regions.
        num_sm: CTAs of both kernels.
        timeout_s: bound of every device-side wait.
        num_warps: warps per CTA (default 8).
    """

    def __init__(
        self, *, rank: int, world_size: int, max_tokens: int, hidden: int, topk: int, num_tot_experts: int,
        weight_dtype: torch.dtype, heap_local: torch.Tensor, ptr_table: torch.Tensor, layout: LowLatencyLayout,
        num_sm: int, timeout_s: float, num_warps: int | None = None,
    ) -> None:  # fmt: skip
        if num_tot_experts % world_size:
            raise ValueError(
                f"num_tot_experts {num_tot_experts} must be divisible by world_size {world_size}"
            )
        self.rank, self.world_size = rank, world_size
        self.max_tokens, self.hidden, self.topk = max_tokens, hidden, topk
        self.num_tot_experts = num_tot_experts
        self.experts_per_rank = num_tot_experts // world_size
        self.weight_dtype = weight_dtype
        self.heap_local, self.ptr_table, self.layout = heap_local, ptr_table, layout
        self.device = heap_local.device
        self.num_sm, self.timeout_s = max(1, int(num_sm)), timeout_s
        self.num_warps = num_warps or (4 if interpreting() else 8)
        self.use_timer = self.device.type == "cuda" and not interpreting()
        self.timeout_arg = int(timeout_s * 1e9) if self.use_timer else max(1, int(timeout_s * 1000))
        W, L = world_size, self.experts_per_rank
        self.wp, self.kp = _next_pow2(W), _next_pow2(topk)
        self.ep, self.lp = _next_pow2(num_tot_experts), _next_pow2(L + 1)
        dev = self.device
        self.state = torch.zeros(LL_STATE_SIZE, dtype=torch.int64, device=dev)
        self.scratch = torch.zeros(self.ep + 1, dtype=torch.int32, device=dev)
        #: per (source, token, slot) ``(epoch << 32) | output row`` of the slots received by the latest
        #: dispatch (older epochs: not received then)
        self.tab = torch.zeros(W, max_tokens, topk, dtype=torch.int64, device=dev)
        self.info_len = 3 + 2 * W + L
        self.info = torch.zeros(self.info_len, dtype=torch.int64, device=dev)
        self._outputs: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._dummy_w = torch.zeros(1, dtype=torch.float32, device=dev)
        # (what the normal engine's cached launch path keeps: see :meth:`_run`)
        self._plans: dict[tuple, Any] = {}
        self._device_index = dev.index or 0
        self.direct_launches = 0
        #: host count of dispatches and combines launched (the device epochs, when nothing failed)
        self.dispatches = self.combines = 0
        self.chunk = 1
        #: widest tile along a row: whole rows of up to 8192 elements on a GPU (one load per row)
        self.block_h = 64 if interpreting() else 8192
        # the id block of the position count: [chunk, KP, BLK] compares per step
        self.id_block = max(16, min(1024, 4096 // (self.chunk * self.kp)))

    def worst_case_rows(self) -> int:
        """Rows of the output buffers: ``world_size * max_tokens * topk``."""
        return self.world_size * self.max_tokens * self.topk

    # ------------------------------------------------------------------ errors
    def error_message(self, err: int) -> tuple[str, int, bool]:
        """``(message, peer, refused)`` of a nonzero device error word."""
        step, peer = _decode(err)
        if step == int(STEP_LL_TOO_MANY):
            return (
                f"ep_a2a low-latency dispatch, rank {self.rank}: rank {peer} dispatched more tokens than "
                f"max_tokens={self.max_tokens}; its call was refused and this dispatch returned no rows. "
                "The layer is unusable from now on.",
                peer,
                True,
            )
        what = {int(STEP_LL_DISPATCH): "dispatch", int(STEP_LL_COMBINE): "combine"}.get(step, f"step {step}")
        return (
            f"ep_a2a triton backend (low-latency mode), rank {self.rank}: timed out after {self.timeout_s:g} s "
            f"in '{what}' waiting for rank {peer} (it never signalled; did it crash, stop calling, or call "
            "with a different sequence of dispatch/combine?). The backend is unusable from now on.",
            peer,
            False,
        )

    def check_error(self, err: int | None = None) -> None:
        """Raise if a device wait ran out (:class:`~.engine.EPTimeoutFromDevice`) or a peer's dispatch
        was refused (:class:`LowLatencyInputError`)."""
        if err is None:
            err = int(self.state[int(LL_ERR)].item())
        if err:
            msg, peer, refused = self.error_message(err)
            if refused:
                raise LowLatencyInputError(msg)
            step = "dispatch/payload" if _decode(err)[0] == int(STEP_LL_DISPATCH) else "combine"
            raise EPTimeoutFromDevice(msg, step=step, peer=peer)

    # ------------------------------------------------------------------ launches
    def outputs(self, dtype: torch.dtype, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The worst-case output buffers of rows of ``dtype`` and ``width`` (reused by every call)."""
        key = (dtype, width)
        if key not in self._outputs:
            rows = self.worst_case_rows()
            self._outputs[key] = (
                torch.empty(rows, width, dtype=dtype, device=self.device),
                torch.empty(rows, dtype=self.weight_dtype, device=self.device),
                torch.empty(rows, dtype=torch.int32, device=self.device),
            )
        return self._outputs[key]

    def _dispatch_spec(
        self, x: torch.Tensor | QuantizeOnSend, ids: torch.Tensor, w: torch.Tensor | None, n: int, bad: bool,
        send: bool, recv: bool,
    ) -> KernelLaunch:  # fmt: skip
        lay, L, W = self.layout, self.experts_per_rank, self.world_size
        quant = isinstance(x, QuantizeOnSend)
        src = x.x if isinstance(x, QuantizeOnSend) else x
        width = x.shape[1]
        out, out_w, out_e = self.outputs(x.dtype, width)
        if width * x.element_size() > lay.row_bytes:
            raise ValueError(
                f"rows of {width * x.element_size()} bytes do not fit the low-latency receive slots of "
                f"{lay.row_bytes} bytes"
            )
        ids_arg, id64 = _ids_arg(ids)
        w_arg = w if w is not None else self._dummy_w

        def fixed() -> dict:  # (built only on a variant's first launch)
            qh = src.shape[1] if quant else 0
            bh = min(self.block_h, _next_pow2(width))
            return dict(
                table_ptr=self.ptr_table, rank=self.rank, state_ptr=self.state,
                scratch_ptr=self.scratch, out_ptr=out, out_w_ptr=out_w, out_e_ptr=out_e, info_ptr=self.info,
                tab_ptr=self.tab, off_cnt=lay.cnt, off_x=lay.x, off_slot=lay.slot, off_w=lay.w,
                timeout=self.timeout_arg, G=self.num_sm, W=W, L=L, K_=self.topk, KP=self.kp, T=self.max_tokens,
                S=width, XS=lay.row_bytes // x.element_size(), EP=self.ep, WP=self.wp, LP=self.lp, CH=self.chunk,
                BH=bh, BLK=self.id_block, RROWS=max(1, 2 * self.block_h // bh),
                HAS_W=w is not None, QH=qh, BQ=max(self.block_h // 4, 64),
                SEND=send, RECV=recv, USE_TIMER=self.use_timer,
            )  # fmt: skip

        key = (
            "ll_dispatch",
            w is not None,
            x.dtype,
            width,
            send,
            recv,
            TritonEPEngine._align(src, ids_arg, w_arg),
        )
        return KernelLaunch(
            key=key, kernel=_ll_dispatch_kernel, grid=(self.num_sm,), num_warps=self.num_warps,
            var_names=("x_ptr", "ids_ptr", "id64", "w_ptr", "n", "bad"),
            var_vals=(src, ids_arg, id64, w_arg, n, int(bad)), fixed=fixed,
        )  # fmt: skip

    def _combine_spec(
        self, y: torch.Tensor, d: LowLatencyDispatch, out: torch.Tensor, send: bool, recv: bool
    ) -> KernelLaunch:
        lay = self.layout
        ids_arg, id64 = _ids_arg(d.exp_indices)

        def fixed() -> dict:  # (built only on a variant's first launch)
            return dict(
                tab_ptr=self.tab, table_ptr=self.ptr_table, rank=self.rank, state_ptr=self.state,
                off_cflag=lay.cflag, off_cx=lay.cx, timeout=self.timeout_arg, G=self.num_sm, W=self.world_size,
                L=self.experts_per_rank, K_=self.topk, KP=self.kp, T=self.max_tokens, H=self.hidden, WP=self.wp,
                CH=self.chunk, BH=min(self.block_h, _next_pow2(self.hidden)), SEND=send, RECV=recv,
                USE_TIMER=self.use_timer,
            )  # fmt: skip

        key = ("ll_combine", send, recv, TritonEPEngine._align(y, ids_arg, out))
        return KernelLaunch(
            key=key, kernel=_ll_combine_kernel, grid=(self.num_sm,), num_warps=self.num_warps,
            var_names=("y_ptr", "info_ptr", "ids_ptr", "id64", "n", "out_ptr"),
            var_vals=(y, d.info, ids_arg, id64, d.exp_indices.shape[0], out), fixed=fixed,
        )  # fmt: skip

    def _run(self, spec: KernelLaunch) -> None:
        """Launch ``spec`` through the normal engine's cached launch path (after a variant's first launch,
        straight into its compiled kernel with only the per-call arguments replaced)."""
        TritonEPEngine._launch(self, spec)  # type: ignore[arg-type]

    def dispatch(
        self,
        x: torch.Tensor | QuantizeOnSend,
        exp_indices: torch.Tensor,
        weight: torch.Tensor | None = None,
        *,
        refuse: bool = False,
        send: bool = True,
        recv: bool = True,
    ) -> LowLatencyDispatch:
        """Launch one dispatch (both halves unless ``send`` / ``recv`` say otherwise: the simulation).

        Args:
            x: ``[n, S]`` rows as moved (the layer's dtype, or packed FP8 rows), or a
                :class:`~.engine.QuantizeOnSend` of bf16 / fp16 / fp32 rows; ``n <= max_tokens``.
            exp_indices: ``[n, topk]`` int32 or int64 global expert ids (-1 drops a slot).
            weight: ``[n, topk]`` weights or ``None``.
            refuse: run the exchange with no rows and mark the call refused on every peer (the caller
                found ``n > max_tokens``; ``x`` and the ids are then not read).

        Raises:
            ValueError: ``n > max_tokens`` without ``refuse``, or rows wider than the receive slots.
        """
        n = 0 if refuse else int(x.shape[0])
        if n > self.max_tokens:
            raise ValueError(f"input has {n} tokens, more than max_tokens={self.max_tokens}")
        if refuse:
            exp_indices = exp_indices[:0]
            weight = weight[:0] if weight is not None else None
        spec = self._dispatch_spec(x, exp_indices, weight, n, refuse, send, recv)
        self._run(spec)
        if send:
            self.dispatches += 1
        out, out_w, out_e = self.outputs(x.dtype, x.shape[1])
        W, L, info = self.world_size, self.experts_per_rank, self.info
        return LowLatencyDispatch(
            output=out, weights=out_w if weight is not None else None, recv_expert_indices=out_e,
            num_recv_tokens_per_expert=info[2 + 2 * W : 2 + 2 * W + L], num_recv_rows=info[0],
            num_recv_tokens_per_rank=info[2 + W : 2 + 2 * W], num_input_tokens_per_rank=info[2 : 2 + W],
            num_invalid_ids=info[2 + 2 * W + L], exp_indices=exp_indices, info=info, epoch=self.dispatches,
        )  # fmt: skip

    def combine(
        self, y: torch.Tensor, d: LowLatencyDispatch, *, out: torch.Tensor | None = None, send: bool = True,
        recv: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """Launch one combine of the latest dispatch ``d``: ``y [rows, hidden]`` floating rows in the order
        of ``d.output`` (only the valid ones are read); returns ``[n, hidden]`` in ``y``'s dtype.

        Raises:
            ValueError: ``d`` is not the latest dispatch, or ``y`` of a bad shape or too wide a dtype.
        """
        if d.epoch != self.dispatches:
            raise ValueError(
                "the low-latency combine takes the latest dispatch's result (a later dispatch reused its "
                "buffers)"
            )
        if y.dim() != 2 or y.shape[1] != self.hidden or y.shape[0] > self.worst_case_rows():
            raise ValueError(
                f"input must be [rows <= {self.worst_case_rows()}, {self.hidden}], got {list(y.shape)}"
            )
        if not y.dtype.is_floating_point or y.element_size() > self.layout.comb_bytes:
            raise ValueError(
                f"input: the low-latency combine slots hold rows of at most {self.layout.comb_bytes} bytes per "
                f"channel (floating), got {y.dtype}"
            )
        y = y.contiguous()
        n = d.exp_indices.shape[0]
        if out is None:
            out = torch.empty(n, self.hidden, dtype=y.dtype, device=self.device)
        self._run(self._combine_spec(y, d, out, send, recv))
        if send:
            self.combines += 1
        return out

    def variants(self, *, row_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
                 quantize_from: tuple[torch.dtype, ...] = (), combine_dtypes: tuple[torch.dtype, ...] = (
                     torch.bfloat16,), weights: tuple[bool, ...] = (True,)) -> list[KernelLaunch]:  # fmt: skip
        """Launch specifications of the variants a layer launches (for ahead-of-time compiles), on
        stand-in tensors: dispatch of each row dtype (and quantizing from each of ``quantize_from``), with
        and / or without weights (``weights``), combine of each dtype."""
        dev, T, Kk, H = self.device, self.max_tokens, self.topk, self.hidden
        from ep_a2a.backends.triton.engine import fp8_row_bytes

        ids = torch.zeros(T, Kk, dtype=torch.int64, device=dev)
        w = torch.zeros(T, Kk, dtype=self.weight_dtype, device=dev)
        rows: list[torch.Tensor | QuantizeOnSend] = [
            torch.zeros(1, fp8_row_bytes(H) // 2 if dt == FP8_ROW_DTYPE else H, dtype=dt, device=dev)
            for dt in row_dtypes
        ]
        rows += [QuantizeOnSend(torch.zeros(1, H, dtype=dt, device=dev)) for dt in quantize_from]
        specs = [
            self._dispatch_spec(x, ids, w if with_w else None, T, False, True, True)
            for x in rows
            for with_w in weights
        ]
        d = LowLatencyDispatch(
            output=self.info, weights=None, recv_expert_indices=self.info, num_recv_tokens_per_expert=self.info,
            num_recv_rows=self.info, num_recv_tokens_per_rank=self.info, num_input_tokens_per_rank=self.info,
            num_invalid_ids=self.info, exp_indices=ids, info=self.info, epoch=0,
        )  # fmt: skip
        for dt in combine_dtypes:
            y = torch.zeros(1, H, dtype=dt, device=dev)
            specs.append(self._combine_spec(y, d, torch.zeros(1, H, dtype=dt, device=dev), True, True))
        return specs

    def precompile(self, *, threads: int = 1, **variants: tuple) -> int:
        """Compile, without launching, the variants of :meth:`variants` (its arguments), with and without
        weights, so that the first calls do not compile, ``threads`` at a time (``compile_all``);
        returns how many (0 under the interpreter)."""
        if interpreting():
            return 0
        specs = self.variants(**variants, weights=(True, False))
        compile_all(
            [
                functools.partial(
                    spec.kernel.warmup, **spec.arguments(), grid=spec.grid, **spec.launch_options()
                )
                for spec in specs
            ],
            threads,
        )
        return len(specs)
