"""Probe: how fast can SM stores push token rows into the peer GPU's symmetric buffer, by CTA count and
store path (both ranks sending at once, as dispatch does)?

Run under torchrun on 2 GPUs. Each rank stores its ``--tokens`` rows of ``--hidden`` bf16 into the
peer's receive buffer (torch symmetric memory), token-indexed as dispatch's senders do, with ``G``
persistent CTAs. Paths:

* ``reg``: the senders' way -- ``[CH, BH]`` tiles loaded into registers (one tile ahead) and stored with
  plain stores into the peer's memory;
* ``tma``: the same register loads, stores through a host-made tensor descriptor of the peer's buffer
  (``[rows, 28, 256]`` view, one ``[CH, 4, 256]`` box per tile), so the bulk copy engine of the SM
  (TMA) moves the bytes out of shared memory;
* ``tma2``: TMA loads (software-pipelined ``tl.range(num_stages=3)``) and TMA stores.

The ceiling is the copy engine copying the same bytes into the peer's buffer (both ranks at once).
Times: median of ``--iters`` after a barrier and a device-side lead, the slower rank.

``python -m torch.distributed.run --standalone --nproc-per-node=2 probe_nvlink_store.py --json F``
"""

from __future__ import annotations

import argparse

import run_record
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from bench_triton import Timer
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _send_reg(x_ptr, dst_ptr, n_tok, H: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    hh = tl.arange(0, BH)
    c = pid
    while c < tl.cdiv(n_tok, CH):
        toks = c * CH + tl.arange(0, CH)
        tm = toks < n_tok
        row = toks.to(tl.int64) * H
        xt = tl.load(x_ptr + row[:, None] + hh[None, :], mask=tm[:, None] & (hh < H)[None, :])
        for h0 in range(0, H, BH):
            hn = h0 + BH
            nxt = tl.load(
                x_ptr + row[:, None] + hn + hh[None, :], mask=tm[:, None] & ((hn + hh) < H)[None, :]
            )
            tl.store(
                dst_ptr + row[:, None] + h0 + hh[None, :], xt, mask=tm[:, None] & ((h0 + hh) < H)[None, :]
            )
            xt = nxt
        c += G


@triton.jit
def _send_tma(x_ptr, dst_desc, n_tok, H: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr):
    """Register loads of ``[CH, NB, 256]`` tiles, TMA stores into the peer."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, NB)[:, None] * 256 + tl.arange(0, 256)[None, :]
    c = pid
    while c < tl.cdiv(n_tok, CH):
        toks = c * CH + tl.arange(0, CH)
        tm = toks < n_tok
        row = toks.to(tl.int64) * H
        for b0 in range(0, H // 256, NB):
            xt = tl.load(
                x_ptr + row[:, None, None] + b0 * 256 + cols[None, :, :],
                mask=tm[:, None, None] & ((b0 * 256 + cols) < H)[None, :, :],
            )
            dst_desc.store([c * CH, b0, 0], xt)
        c += G


@triton.jit
def _send_tma2(
    x_desc, dst_desc, n_tok, H: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr, STAGES: tl.constexpr
):
    """TMA loads (pipelined) and TMA stores of ``[CH, NB, 256]`` boxes."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    nb = H // 256 // NB
    n_chunks = tl.cdiv(n_tok, CH)
    n_mine = tl.cdiv(n_chunks - pid, G)
    for i in tl.range(0, n_mine * nb, num_stages=STAGES):
        c = pid + (i // nb) * G
        b0 = (i % nb) * NB
        xt = x_desc.load([c * CH, b0, 0])
        dst_desc.store([c * CH, b0, 0], xt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ctas", type=int, nargs="+", default=[16, 32, 44, 64, 88, 132])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rank, world, dev = run_record.start_ranks()
    assert world == 2, "the probe runs on 2 GPUs"
    import torch.distributed._symmetric_memory as symm_mem

    n, H = args.tokens, args.hidden
    assert H % 256 == 0, "--hidden must be a multiple of 256"
    buf = symm_mem.empty(n * H * 2, dtype=torch.uint8, device=dev)
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peer = 1 - rank
    recv_local = hdl.get_buffer(rank, (n, H), torch.bfloat16)
    recv_peer = hdl.get_buffer(peer, (n, H), torch.bfloat16)
    x = torch.randn(n, H, device=dev).to(torch.bfloat16)
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    H3 = (n, H // 256, 256)
    # the peer's buffer as [rows, H / 256, 256]; boxes [CH, NB, 256] are built per variant below

    def desc(t, ch, nb):
        return TensorDescriptor(t, list(H3), [H, 256, 1], [ch, nb, 256])

    def alloc(size: int, align: int, stream):
        return torch.empty(size, device=dev, dtype=torch.int8)

    triton.set_allocator(alloc)
    dist.barrier()
    torch.cuda.synchronize()

    timer = Timer(dist.barrier)

    def med(fn):
        """Median us after a barrier and the device-side lead, the slower rank."""
        return timer.median_ms(fn, args.iters, lead=True) * 1e3

    def check(name):
        recv_local.fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier()
        fns[name]()
        torch.cuda.synchronize()
        dist.barrier()
        xs = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(xs, x)
        return bool(torch.equal(recv_local, xs[peer]))

    fns = {}
    res = {
        **run_record.header(dev, world_size=world),
        "tokens": n,
        "hidden": H,
        "bytes_per_rank": n * H * 2,
        "rows": [],
    }
    ce = med(lambda: recv_peer.copy_(x))
    res["ce_us"] = ce
    res["ce_GBps"] = n * H * 2 / ce / 1e3
    if rank == 0:
        print(f"copy engine {ce:.1f} us {res['ce_GBps']:.0f} GB/s", flush=True)
    variants = {
        "reg-c8b1024w16": lambda G: _send_reg[(G,)](x, recv_peer, n, H=H, BH=1024, CH=8, num_warps=16),
        "reg-c8b1024w8": lambda G: _send_reg[(G,)](x, recv_peer, n, H=H, BH=1024, CH=8, num_warps=8),
        "reg-c16b1024w16": lambda G: _send_reg[(G,)](x, recv_peer, n, H=H, BH=1024, CH=16, num_warps=16),
    }
    for ch, nb, w in ((8, 4, 8), (8, 4, 4), (4, 4, 4), (2, 4, 4)):
        d = desc(recv_peer, ch, nb)
        variants[f"tma-c{ch}nb{nb}w{w}"] = lambda G, d=d, ch=ch, nb=nb, w=w: _send_tma[(G,)](
            x, d, n, H=H, NB=nb, CH=ch, num_warps=w
        )
    for ch, nb, st in ((8, 4, 3), (4, 4, 4), (2, 4, 4), (1, 4, 4)):
        dx, dd = desc(x, ch, nb), desc(recv_peer, ch, nb)
        variants[f"tma2-c{ch}nb{nb}s{st}"] = lambda G, dx=dx, dd=dd, ch=ch, nb=nb, st=st: _send_tma2[(G,)](
            dx, dd, n, H=H, NB=nb, CH=ch, STAGES=st, num_warps=4
        )
    for name, launch in variants.items():
        try:
            fns[name] = lambda launch=launch: launch(nsm)
            ok = check(name)
        except Exception as exc:  # a variant that does not compile or launch is reported, not fatal
            if rank == 0:
                print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            res["rows"].append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        for G in args.ctas:
            if nsm < G:
                continue
            t = med(lambda launch=launch, G=G: launch(G))
            row = {
                "variant": name,
                "ctas": G,
                "us": t,
                "GBps": n * H * 2 / t / 1e3,
                "pct_ce": 100 * ce / t,
                "correct": ok,
            }
            res["rows"].append(row)
            if rank == 0:
                print(
                    f"{name:18s} G={G:3d} {t:7.1f} us {row['GBps']:5.0f} GB/s {row['pct_ce']:5.1f}% CE"
                    f" correct={ok}",
                    flush=True,
                )
    run_record.finish(res, args.json, rank=rank)


if __name__ == "__main__":
    main()
