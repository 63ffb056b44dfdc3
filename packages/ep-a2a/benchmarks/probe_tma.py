"""Probe: do TMA (bulk tensor) loads and stores move dispatch's expansion and combine's reduction faster
per SM than the register copies of the row kernels?

One GPU, no communication. At the DeepSeek-V3 shape on 2 ranks a rank expands 8192 token rows (its own
4096 and the peer's 4096, hidden 7168 bf16) into ``KL`` = 4 per-expert rows each (470 MB written), and
combine reads those 32768 rows back and sums each token's ``KL`` rows in float32 into one row. Rows are
placed as dispatch places them: each token picks ``KL`` distinct local experts, and an expert's rows are
contiguous, in token order.

Variants, each on ``--sms`` persistent CTAs (CUDA events, median of ``--iters`` after a warm-up):

* ``lsu``: the row kernels' way -- a chunk of ``CH`` tokens, ``BH``-wide tiles, masked 2D loads and
  stores through registers (one tile ahead);
* ``tma``: one token at a time, the whole row as one ``[1, 32, 256]`` box of the ``[rows, 28, 256]`` view
  (the box is clipped to the row), loaded and stored through tensor descriptors made on the host;
* ``tma2``: two tokens' loads issued before their stores;
* ``tma-s*`` / ``tmald-lsust-*``: TMA loads software-pipelined ``s`` deep by ``tl.range(num_stages=s)``,
  stores by TMA or from registers;
* reductions shaped as the combine kernel's (``slots-*``, ``wide-*``): ``2 * KL`` slots per token, half
  of them not on this rank (``-1``), summed one load per slot or as one ``[CH, 2KL, BH]`` gather per
  tile (``wide``), optionally with the next tile's gather issued first (``pf``).

The roofline is a 470 MB device-to-device copy measured in the same run.

``python probe_tma.py --json probe-tma.json``
"""

from __future__ import annotations

import argparse
import statistics

import run_record
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

BOX_W = 256  # widest TMA box dimension


@triton.jit
def _expand_lsu(
    x_ptr, rows_ptr, out_ptr, n_tok, H: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr, KL: tl.constexpr
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    hh = tl.arange(0, BH)
    for c in range(pid, tl.cdiv(n_tok, CH), G):
        toks = c * CH + tl.arange(0, CH)
        tm = toks < n_tok
        xrow = toks.to(tl.int64) * H
        xt = tl.load(
            x_ptr + xrow[:, None] + hh[None, :], mask=tm[:, None] & (hh < H)[None, :], cache_modifier=".cg"
        )
        for h0 in range(0, H, BH):
            hn = h0 + BH
            nxt = tl.load(
                x_ptr + xrow[:, None] + hn + hh[None, :],
                mask=tm[:, None] & ((hn + hh) < H)[None, :],
                cache_modifier=".cg",
            )
            m = tm[:, None] & ((h0 + hh) < H)[None, :]
            for k in tl.static_range(KL):
                r = tl.load(rows_ptr + toks * KL + k, mask=tm, other=-1).to(tl.int64)
                tl.store(out_ptr + r[:, None] * H + h0 + hh[None, :], xt, mask=m & (r >= 0)[:, None])
            xt = nxt


@triton.jit
def _expand_tma(x_desc, out_desc, rows_ptr, n_tok, KL: tl.constexpr, PAIR: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    if PAIR:
        for t in range(2 * pid, n_tok, 2 * G):
            a = x_desc.load([t, 0, 0])
            b = x_desc.load([t + 1, 0, 0])
            for k in tl.static_range(KL):
                r = tl.load(rows_ptr + t * KL + k)
                out_desc.store([r, 0, 0], a)
            for k in tl.static_range(KL):
                r = tl.load(rows_ptr + (t + 1) * KL + k)
                out_desc.store([r, 0, 0], b)
    else:
        for t in range(pid, n_tok, G):
            a = x_desc.load([t, 0, 0])
            for k in tl.static_range(KL):
                r = tl.load(rows_ptr + t * KL + k)
                out_desc.store([r, 0, 0], a)


@triton.jit
def _expand_tma_pipelined(
    x_desc,
    out_ptr,
    out_desc,
    rows_ptr,
    n_tok,
    H: tl.constexpr,
    KL: tl.constexpr,
    STAGES: tl.constexpr,
    TMA_STORE: tl.constexpr,
    NB: tl.constexpr,
    BW: tl.constexpr,
):
    """TMA loads software-pipelined ``STAGES`` deep; stores by TMA or from registers (LSU)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = (tl.arange(0, NB)[:, None] * BW + tl.arange(0, BW)[None, :]).reshape(NB * BW)
    for t in tl.range(pid, n_tok, G, num_stages=STAGES):
        a = x_desc.load([t, 0, 0])
        for k in tl.static_range(KL):
            r = tl.load(rows_ptr + t * KL + k)
            if TMA_STORE:
                out_desc.store([r, 0, 0], a)
            else:
                tl.store(out_ptr + r.to(tl.int64) * H + cols, a.reshape(NB * BW), mask=cols < H)


@triton.jit
def _reduce_lsu(
    rows_in_ptr, rows_ptr, y_ptr, n_tok, H: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr, KL: tl.constexpr
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    hh = tl.arange(0, BH)
    for c in range(pid, tl.cdiv(n_tok, CH), G):
        toks = c * CH + tl.arange(0, CH)
        tm = toks < n_tok
        for h0 in range(0, H, BH):
            m = tm[:, None] & ((h0 + hh) < H)[None, :]
            acc = tl.zeros([CH, BH], dtype=tl.float32)
            for k in tl.static_range(KL):
                r = tl.load(rows_ptr + toks * KL + k, mask=tm, other=0).to(tl.int64)
                acc += tl.load(rows_in_ptr + r[:, None] * H + h0 + hh[None, :], mask=m, other=0.0).to(
                    tl.float32
                )
            tl.store(y_ptr + toks.to(tl.int64)[:, None] * H + h0 + hh[None, :], acc.to(tl.bfloat16), mask=m)


@triton.jit
def _reduce_lsu_slots(
    rows_in_ptr,
    rows_ptr,
    y_ptr,
    n_tok,
    H: tl.constexpr,
    BH: tl.constexpr,
    CH: tl.constexpr,
    KP: tl.constexpr,
    WIDE: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The combine kernel's shape of work: ``KP`` slots per token (``-1``: not on this rank), summed per
    tile. ``WIDE``: all slots of a tile in one ``[CH, KP, BH]`` gather (else one load per slot);
    ``PREFETCH``: the next tile's gather issued before this tile is summed."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    hh = tl.arange(0, BH)
    kk = tl.arange(0, KP)
    for c in range(pid, tl.cdiv(n_tok, CH), G):
        toks = c * CH + tl.arange(0, CH)
        tm = toks < n_tok
        rows = tl.load(rows_ptr + toks[:, None] * KP + kk[None, :], mask=tm[:, None], other=-1).to(tl.int64)
        if WIDE:
            base = (rows * H)[:, :, None] + hh[None, None, :]
            ok = (rows >= 0)[:, :, None] & (hh < H)[None, None, :]
            if PREFETCH:
                cur = tl.load(rows_in_ptr + base, mask=ok, other=0.0)
            for h0 in range(0, H, BH):
                if PREFETCH:
                    hn = h0 + BH
                    nxt = tl.load(
                        rows_in_ptr + base + hn, mask=ok & ((hn + hh) < H)[None, None, :], other=0.0
                    )
                    tile = cur
                else:
                    tile = tl.load(
                        rows_in_ptr + base + h0, mask=ok & ((h0 + hh) < H)[None, None, :], other=0.0
                    )
                acc = tl.sum(tile.to(tl.float32), axis=1)
                m = tm[:, None] & ((h0 + hh) < H)[None, :]
                tl.store(
                    y_ptr + toks.to(tl.int64)[:, None] * H + h0 + hh[None, :], acc.to(tl.bfloat16), mask=m
                )
                if PREFETCH:
                    cur = nxt
        else:
            for h0 in range(0, H, BH):
                m = tm[:, None] & ((h0 + hh) < H)[None, :]
                acc = tl.zeros([CH, BH], dtype=tl.float32)
                for k in tl.static_range(KP):
                    rk = tl.sum(tl.where(kk[None, :] == k, rows, 0), axis=1)
                    acc += tl.load(
                        rows_in_ptr + rk[:, None] * H + h0 + hh[None, :],
                        mask=m & (rk >= 0)[:, None],
                        other=0.0,
                    ).to(tl.float32)
                tl.store(
                    y_ptr + toks.to(tl.int64)[:, None] * H + h0 + hh[None, :], acc.to(tl.bfloat16), mask=m
                )


@triton.jit
def _reduce_tma(in_desc, y_desc, rows_ptr, n_tok, KL: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    for t in tl.range(pid, n_tok, G, num_stages=STAGES):
        r = tl.load(rows_ptr + t * KL)
        acc = in_desc.load([r, 0, 0]).to(tl.float32)
        for k in tl.static_range(1, KL):
            r = tl.load(rows_ptr + t * KL + k)
            acc += in_desc.load([r, 0, 0]).to(tl.float32)
        y_desc.store([t, 0, 0], acc.to(tl.bfloat16))


def boxed(t: torch.Tensor) -> TensorDescriptor:
    """Descriptor of ``t: [R, H]`` viewed as ``[R, H / 256, 256]``, one row per box."""
    rows, h = t.shape
    v = t.view(rows, h // BOX_W, BOX_W)
    return TensorDescriptor(
        v, list(v.shape), list(v.stride()), [1, triton.next_power_of_2(h // BOX_W), BOX_W]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192, help="token rows expanded (own + received)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--kl", type=int, default=4, help="local slots per token")
    ap.add_argument("--experts", type=int, default=128, help="local experts")
    ap.add_argument("--sms", type=int, nargs="+", default=[16, 32, 66, 132])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n, H, KL = args.tokens, args.hidden, args.kl
    assert H % BOX_W == 0, "hidden must be a multiple of 256"
    g = torch.Generator(device="cpu").manual_seed(0)
    experts = torch.rand(n, args.experts, generator=g).argsort(1)[:, :KL]  # KL distinct local experts
    slot_order = torch.argsort(experts.flatten() * n + torch.arange(n).repeat_interleave(KL), stable=True)
    rows = torch.empty(n * KL, dtype=torch.int64)
    rows[slot_order] = torch.arange(n * KL)
    rows = rows.to(torch.int32).to(dev)
    # the combine kernel's view: 2 * KL slots per token, the KL local ones at random places, the others -1
    keep = torch.rand(n, 2 * KL, generator=g).argsort(1)[:, :KL]
    rows8 = torch.full((n, 2 * KL), -1, dtype=torch.int32)
    rows8.scatter_(1, keep, rows.cpu().view(n, KL))
    rows8 = rows8.to(dev)
    x = torch.randn(n, H, device=dev).to(torch.bfloat16)
    out = torch.empty(n * KL, H, device=dev, dtype=torch.bfloat16)
    y = torch.empty(n, H, device=dev, dtype=torch.bfloat16)
    scratch = torch.empty_like(out)
    x_desc, out_desc, y_desc = boxed(x), boxed(out), boxed(y)
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    NB = triton.next_power_of_2(H // BOX_W)

    def med(fn) -> float:
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(args.iters):
            torch.cuda._sleep(20_000)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e3)
        return statistics.median(ts)

    # correctness of every variant against torch before timing
    ref_out = torch.empty_like(out)
    ref_out[rows.long()] = x.repeat_interleave(KL, 0)
    ref_y = ref_out[rows.long()].view(n, KL, H).float().sum(1)
    res: dict = {
        **run_record.header(dev),
        "tokens": n,
        "hidden": H,
        "kl": KL,
        "device_sms": nsm,
        "expand_bytes": n * H * 2 * (1 + KL),
        "reduce_bytes": n * H * 2 * (1 + KL),
        "units": "us, median of --iters; GB/s of the bytes read plus written",
        "local_copy_us": med(lambda: out.copy_(scratch)),
        "check": {},
        "us": {},
    }
    res["local_copy_GBps"] = 2 * out.numel() * 2 / res["local_copy_us"] / 1e3

    def pipelined(stages, tma_store, warps):
        return lambda G: _expand_tma_pipelined[(G,)](
            x_desc, out, out_desc, rows, n, H=H, KL=KL, STAGES=stages, TMA_STORE=tma_store, NB=NB, BW=BOX_W,
            num_warps=warps,
        )  # fmt: skip

    expand = {
        "lsu-c8b1024w8": lambda G: _expand_lsu[(G,)](x, rows, out, n, H=H, BH=1024, CH=8, KL=KL, num_warps=8),
        "lsu-c2b4096w8": lambda G: _expand_lsu[(G,)](x, rows, out, n, H=H, BH=4096, CH=2, KL=KL, num_warps=8),
        "tma-w4": lambda G: _expand_tma[(G,)](x_desc, out_desc, rows, n, KL=KL, PAIR=False, num_warps=4),
        "tma-w8": lambda G: _expand_tma[(G,)](x_desc, out_desc, rows, n, KL=KL, PAIR=False, num_warps=8),
        "tma2-w8": lambda G: _expand_tma[(G,)](x_desc, out_desc, rows, n, KL=KL, PAIR=True, num_warps=8),
        "lsu-c16b1024w16": lambda G: _expand_lsu[(G,)](
            x, rows, out, n, H=H, BH=1024, CH=16, KL=KL, num_warps=16
        ),
        "tma-s3-w8": pipelined(3, True, 8),
        "tmald-lsust-s3-w8": pipelined(3, False, 8),
        "tmald-lsust-s4-w16": pipelined(4, False, 16),
    }
    reduce = {
        "lsu-c8b1024w8": lambda G: _reduce_lsu[(G,)](out, rows, y, n, H=H, BH=1024, CH=8, KL=KL, num_warps=8),
        "lsu-c2b2048w8": lambda G: _reduce_lsu[(G,)](out, rows, y, n, H=H, BH=2048, CH=2, KL=KL, num_warps=8),
        "lsu-c16b1024w16": lambda G: _reduce_lsu[(G,)](
            out, rows, y, n, H=H, BH=1024, CH=16, KL=KL, num_warps=16
        ),
        "tma-w4": lambda G: _reduce_tma[(G,)](out_desc, y_desc, rows, n, KL=KL, STAGES=1, num_warps=4),
        "tma-w8": lambda G: _reduce_tma[(G,)](out_desc, y_desc, rows, n, KL=KL, STAGES=1, num_warps=8),
        "tma-s2-w8": lambda G: _reduce_tma[(G,)](out_desc, y_desc, rows, n, KL=KL, STAGES=2, num_warps=8),
        "tma-s3-w8": lambda G: _reduce_tma[(G,)](out_desc, y_desc, rows, n, KL=KL, STAGES=3, num_warps=8),
    }

    def slots(ch, bh, w, wide, pf):
        return lambda G: _reduce_lsu_slots[(G,)](
            out, rows8, y, n, H=H, BH=bh, CH=ch, KP=2 * KL, WIDE=wide, PREFETCH=pf, num_warps=w
        )

    reduce.update(
        {
            "slots-c8b1024w8": slots(8, 1024, 8, False, False),
            "slots-c8b1024w16": slots(8, 1024, 16, False, False),
            "wide-c8b512w16": slots(8, 512, 16, True, False),
            "wide-pf-c8b512w16": slots(8, 512, 16, True, True),
            "wide-pf-c4b1024w16": slots(4, 1024, 16, True, True),
            "wide-pf-c8b256w8": slots(8, 256, 8, True, True),
            "wide-pf-c16b256w16": slots(16, 256, 16, True, True),
        }
    )
    checks = (
        ("expand", expand, out, lambda: torch.equal(out, ref_out)),
        ("reduce", reduce, y, lambda: torch.allclose(y.float(), ref_y, atol=0.05, rtol=0.01)),
    )
    for op, table, dst, correct in checks:
        if op == "reduce":
            out.copy_(ref_out)  # the reductions read the expanded rows
        for name, fn in list(table.items()):
            dst.fill_(float("nan"))
            try:
                fn(nsm)
                torch.cuda.synchronize()
            except Exception as e:  # a variant that does not compile (shared memory) is reported and skipped
                print(f"{op} {name}: {type(e).__name__}: {str(e)[:200]}")
                del table[name]
                continue
            res["check"][f"{op}-{name}"] = bool(correct())
    print("checks:", res["check"], flush=True)
    print(f"local copy {res['local_copy_us']:.1f} us  {res['local_copy_GBps']:.0f} GB/s")
    print(f"{'op':<8}{'variant':<16}" + "".join(f"{s:>14}" for s in args.sms))
    for op, table in (("expand", expand), ("reduce", reduce)):
        for name, fn in table.items():
            cells = []
            for G in args.sms:
                us = med(lambda fn=fn, G=G: fn(min(G, nsm)))
                res["us"][f"{op}-{name}-sm{G}"] = us
                cells.append(f"{us:7.1f} {res[op + '_bytes'] / us / 1e3:5.0f}")
            print(f"{op:<8}{name:<16}" + "".join(f"{c:>14}" for c in cells), flush=True)
    run_record.write(res, args.json)


if __name__ == "__main__":
    main()
