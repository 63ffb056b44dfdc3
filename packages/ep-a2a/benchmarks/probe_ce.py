"""Probe: can the copy engine carry dispatch's NVLink bytes while every SM expands rows locally?

Run under torchrun on 2 GPUs. Each rank has 4096 tokens of hidden 7168 (bf16) and expands every token
row into ``KL`` scattered output rows, its own tokens and the peer's, as dispatch does at the
DeepSeek-V3 shape on 2 GPUs (top-8 of 256 experts: about 4 of a token's 8 slots per rank). Measured
(median of ``--iters`` after a device barrier and a device-side lead, slowest rank):

* ``ce``: the copy engine copying the 58.7 MB of token rows into the peer's symmetric buffer;
* ``local_copy``: a 470 MB device-to-device copy (the local-memory roofline of the expansion);
* ``expand``: the expansion kernel alone on ``num_sm`` CTAs (peer rows already in place);
* ``ce+expand``: both at once, the copy on a side stream, no ordering between them;
* ``pipe-N``: the copy in N pieces on a side stream, each followed by an 8-byte copy of the epoch into
  the peer's flag; the kernel expands its own rows, then each piece once its flag holds the epoch;
* ``backend-graph``: ep-a2a's Triton backend at the same shape, ``dispatch_static`` replayed in a graph.

``python -m torch.distributed.run --standalone --nproc-per-node=2 probe_ce.py``
"""

from __future__ import annotations

import argparse
import json
import statistics

import run_record
import torch
import torch.distributed as dist
import triton
import triton.language as tl

LEAD_CYCLES = 200_000


@triton.jit
def _now():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _wait(f, ep, err_ptr, timeout_ns):
    v = tl.atomic_add(f, 0, sem="acquire", scope="sys")
    t0 = _now()
    el = t0 - t0
    while (v < ep) & (el < timeout_ns):
        v = tl.atomic_add(f, 0, sem="acquire", scope="sys")
        el = _now() - t0
    if v < ep:
        tl.atomic_add(err_ptr, 1)
    return v >= ep


@triton.jit
def _expand_phase(
    src,
    rows_ptr,
    out_ptr,
    flag_ptr,
    err_ptr,
    ep,
    n_tok,
    tpc,
    timeout_ns,
    phase,
    H: tl.constexpr,
    BH: tl.constexpr,
    CH: tl.constexpr,
    KL: tl.constexpr,
    WAIT: tl.constexpr,
    EVICT: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    hh = tl.arange(0, BH)
    nch = tl.cdiv(n_tok, CH)
    for c in range(pid, nch, G):
        toks = c * CH + tl.arange(0, CH)
        tm = toks < n_tok
        if WAIT:
            ok = _wait(flag_ptr + (c * CH) // tpc, ep, err_ptr, timeout_ns)
            tm = tm & ok
        xrow = toks.to(tl.int64) * H
        rbase = (phase * n_tok + toks) * KL
        m0 = tm[:, None] & (hh < H)[None, :]
        xt = tl.load(src + xrow[:, None] + hh[None, :], mask=m0, cache_modifier=".cg")
        for h0 in range(0, H, BH):
            hn = h0 + BH
            nxt = tl.load(
                src + xrow[:, None] + hn + hh[None, :],
                mask=tm[:, None] & ((hn + hh) < H)[None, :],
                cache_modifier=".cg",
            )
            m = tm[:, None] & ((h0 + hh) < H)[None, :]
            for k in tl.static_range(KL):
                r = tl.load(rows_ptr + rbase + k, mask=tm, other=-1).to(tl.int64)
                mk = m & (r >= 0)[:, None]
                if EVICT:
                    tl.store(
                        out_ptr + r[:, None] * H + h0 + hh[None, :],
                        xt,
                        mask=mk,
                        eviction_policy="evict_first",
                    )
                else:
                    tl.store(out_ptr + r[:, None] * H + h0 + hh[None, :], xt, mask=mk)
            xt = nxt


@triton.jit
def _expand_kernel(
    x_ptr,
    recv_ptr,
    rows_ptr,
    out_ptr,
    flag_ptr,
    err_ptr,
    ep_ptr,
    n_tok,
    tpc,
    timeout_ns,
    H: tl.constexpr,
    BH: tl.constexpr,
    CH: tl.constexpr,
    KL: tl.constexpr,
    WAIT: tl.constexpr,
    EVICT: tl.constexpr,
):
    ep = tl.load(ep_ptr)
    _expand_phase(
        x_ptr,
        rows_ptr,
        out_ptr,
        flag_ptr,
        err_ptr,
        ep,
        n_tok,
        tpc,
        timeout_ns,
        0,
        H,
        BH,
        CH,
        KL,
        False,
        EVICT,
    )
    _expand_phase(
        recv_ptr,
        rows_ptr,
        out_ptr,
        flag_ptr,
        err_ptr,
        ep,
        n_tok,
        tpc,
        timeout_ns,
        1,
        H,
        BH,
        CH,
        KL,
        WAIT,
        EVICT,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--kl", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-backend", action="store_true")
    args = ap.parse_args()
    rank, world, dev = run_record.start_ranks()
    assert world == 2, "the probe runs on 2 GPUs"
    import torch.distributed._symmetric_memory as symm_mem

    n, H, KL = args.tokens, args.hidden, args.kl
    nflags = 64
    heap_bytes = n * H * 2 + nflags * 8
    buf = symm_mem.empty(heap_bytes, dtype=torch.uint8, device=dev)
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peer = 1 - rank
    recv_local = hdl.get_buffer(rank, (n, H), torch.bfloat16)
    flags_local = hdl.get_buffer(rank, (nflags,), torch.int64, storage_offset=n * H * 2 // 8)
    recv_peer = hdl.get_buffer(peer, (n, H), torch.bfloat16)
    flags_peer = hdl.get_buffer(peer, (nflags,), torch.int64, storage_offset=n * H * 2 // 8)
    flags_local.zero_()
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randn(n, H, device=dev).to(torch.bfloat16)
    recv_local.copy_(torch.randn(n, H, device=dev).to(torch.bfloat16))
    rows = torch.randperm(2 * n * KL, generator=g).to(torch.int32).to(dev)
    out = torch.empty(2 * n * KL, H, device=dev, dtype=torch.bfloat16)
    scratch = torch.empty_like(out)
    err = torch.zeros(1, device=dev, dtype=torch.int32)
    epv = torch.zeros(1, device=dev, dtype=torch.int64)
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    side = torch.cuda.Stream()
    dist.barrier()
    torch.cuda.synchronize()

    def barrier():
        dist.barrier()

    def med(fn, lead=True, iters=args.iters, setup=None):
        ts = []
        for _ in range(iters):
            if setup is not None:
                setup()
            barrier()
            if lead:
                torch.cuda._sleep(LEAD_CYCLES)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(s)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e3)
        t = torch.tensor([statistics.median(ts)], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def expand(G, wait, tpc=n, ch=8, bh=1024, warps=8, evict=False, rows=rows, kl=KL):
        _expand_kernel[(G,)](
            x,
            recv_local,
            rows,
            out,
            flags_local,
            err,
            epv,
            n,
            tpc,
            2_000_000_000,
            H=H,
            BH=bh,
            CH=ch,
            KL=kl,
            WAIT=wait,
            EVICT=evict,
            num_warps=warps,
        )

    def ce(s):
        recv_peer.copy_(x)

    def local_copy(s):
        out.copy_(scratch)

    def ce_expand(G):
        def f(s):
            side.wait_event(s)
            with torch.cuda.stream(side):
                recv_peer.copy_(x)
            expand(G, False)
            torch.cuda.current_stream().wait_stream(side)

        return f

    def pipe(G, pieces):
        tpc = n // pieces

        def f(s):
            epv.add_(1)
            ev = torch.cuda.Event()
            ev.record()
            side.wait_event(ev)
            with torch.cuda.stream(side):
                for p in range(pieces):
                    recv_peer[p * tpc : (p + 1) * tpc].copy_(x[p * tpc : (p + 1) * tpc])
                    flags_peer[p : p + 1].copy_(epv)
            expand(G, True, tpc)
            torch.cuda.current_stream().wait_stream(side)

        return f

    # warm up / compile
    expand(nsm, False)
    expand(nsm, True, n)
    torch.cuda.synchronize()
    res = {
        **run_record.header(dev, world_size=world),
        "tokens": n,
        "hidden": H,
        "kl": KL,
        "sms": nsm,
    }
    bytes_ce = n * H * 2
    bytes_local = 2 * n * H * 2 + 2 * n * KL * H * 2 + n * H * 2  # reads of x and recv, writes, incoming
    res["ce_us"] = med(ce)
    res["local_copy_us"] = med(local_copy)
    sorted_rows = torch.arange(2 * n * KL, device=dev, dtype=torch.int32)
    # the real kernel's layout: 2 * KL slots per token, KL of them here (random), the others -1 (masked)
    keep = torch.rand(2 * n, 2 * KL, generator=g).argsort(1)[:, :KL]
    rows_masked = torch.full((2 * n, 2 * KL), -1, dtype=torch.int32)
    rows_masked.scatter_(1, keep, rows.cpu().view(2 * n, KL))
    rows_masked = rows_masked.to(dev)
    import time as _time

    flat = scratch.view(-1)[: x.numel()]
    for name, fn in (("peer", lambda: recv_peer.copy_(x)), ("local", lambda: flat.copy_(x.view(-1)))):
        torch.cuda.synchronize()
        hs = []
        for _ in range(5):
            t0 = _time.perf_counter()
            fn()
            hs.append((_time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        res[f"host_us_copy_{name}"] = sorted(hs)[2]
    variants = {
        "masked8": {"rows": rows_masked, "kl": 2 * KL},
        "masked8-c16b512": {"rows": rows_masked, "kl": 2 * KL, "ch": 16, "bh": 512},
        "base": {},
        "sorted": {"rows": sorted_rows},
        "c2b4096": {"ch": 2, "bh": 4096},
        "c1b8192": {"ch": 1, "bh": 8192},
        "c8b1024w16": {"warps": 16},
        "c16b512": {"ch": 16, "bh": 512},
    }
    for G in (nsm, 32):
        for name, kw in variants.items():
            res[f"expand-{name}_sm{G}_us"] = med(lambda s, G=G, kw=kw: expand(G, False, **kw))
        res[f"ce+expand_sm{G}_us"] = med(ce_expand(G))
        for pieces in (1, 4, 8, 16):
            f = pipe(G, pieces)
            f(None)
            torch.cuda.synchronize()
            dist.barrier()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                f(None)
            dist.barrier()
            res[f"pipe{pieces}-graph_sm{G}_us"] = med(lambda s, gr=gr: gr.replay())
    # correctness of the pipelined run: every output row is its source row
    torch.cuda.synchronize()
    dist.barrier()
    pipe(nsm, 8)(None)
    torch.cuda.synchronize()
    dist.barrier()
    both = torch.cat([x, recv_local])  # recv_local now holds the peer's x
    xs = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(xs, x)
    ok_recv = bool(torch.equal(recv_local, xs[peer]))
    ok_rows = bool(torch.equal(out[rows.long()], both.repeat_interleave(KL, 0)))
    res["check"] = {"recv_equal": ok_recv, "rows_equal": ok_rows, "wait_errors": int(err.item())}
    if not args.no_backend:
        from ep_a2a.config import EPConfig
        from ep_a2a.triton_backend import TritonBackend

        cfg = EPConfig(
            max_tokens=n,
            hidden=H,
            topk=8,
            num_tot_experts=256,
            rank=rank,
            world_size=2,
            local_world_size=2,
            token_dtype=torch.bfloat16,
        )
        ids = torch.stack([torch.randperm(256, generator=g)[:8] for _ in range(n)]).to(torch.int32).to(dev)
        w = torch.rand(n, 8, device=dev)
        be = TritonBackend(
            cfg, dist.group.WORLD, num_sm=nsm, enable_local_combine=True, use_aot=False, timeout_s=60.0
        )
        for _ in range(2):
            d = be.dispatch_static(x, ids, w)
            be.combine_static(d.output, d)
        torch.cuda.synchronize()
        gd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gd):
            dd = be.dispatch_static(x, ids, w)
        gc = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gc):
            be.combine_static(dd.output, dd)

        def rt(s):
            gd.replay()

        res["backend_graph_dispatch_us"] = med(rt)
        res["backend_graph_combine_us"] = med(lambda s: gc.replay(), setup=gd.replay)
        be.check_errors()
        be.finalize()
    res["ce_GBps"] = bytes_ce / res["ce_us"] / 1e3
    res["local_bytes"] = bytes_local
    if rank == 0:
        print(json.dumps(res, indent=1))
    run_record.finish(res, args.json, rank=rank)


if __name__ == "__main__":
    main()
