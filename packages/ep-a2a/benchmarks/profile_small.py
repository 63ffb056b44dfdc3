"""Where the time of a small graph-mode dispatch/combine goes: per-kernel timeline (run under torchrun).

    torchrun --standalone --nproc-per-node=2 packages/ep-a2a/benchmarks/profile_small.py --json out.json

At decode-sized batches (``--tokens``, default 128 per rank) the graph replays of the static dispatch
and combine are profiled with ``torch.profiler`` (CUPTI kernel records of the graph's nodes). Each replay
runs after a device barrier and the device-side delay of ``bench_triton.Timer`` (so the host's launch is
hidden); for every kernel of the replay the record gives its start relative to the end of that delay
and its duration, median over ``--iters`` replays, per rank. Each variant of ``--variants`` (the
dispatch kernel's chunk, num_warps and block_h, optionally the combine kernel's chunk, warps, block_h and
maxnreg) is measured in the same run, and also timed with CUDA events as the benchmark does; with
``--tokens 4096`` and ``--num-sm`` it served the tile sweeps of large layers too. ``--layer`` captures
the user's call instead (``EPAll2AllLayer.dispatch_static`` / ``combine_static``, default tiles, whatever
the layer adds to the graph), with the expert ids in ``--id-dtype`` (``torch.topk`` gives int64).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import run_record
import torch
import torch.distributed as dist
from bench_triton import LEAD_CYCLES, SHAPES, Timer, capture_graphs, shape_inputs

#: TritonBackend arguments a variant may set as name=value
VARIANT_ARGS = (
    "chunk", "num_warps", "block_h", "combine_chunk", "combine_warps", "combine_block_h", "combine_maxnreg",
    "send_ctas", "combine_send_ctas", "steal",
)  # fmt: skip


def variant_kwargs(var: str) -> dict[str, int | bool]:
    """TritonBackend arguments of a ``--variants`` entry (see its help)."""
    if var == "default":
        return {}
    if "=" in var:
        kw = {}
        for item in var.split(","):
            name, _, value = item.partition("=")
            if name not in VARIANT_ARGS:
                raise SystemExit(
                    f"--variants: unknown argument {name!r} in {var!r}; expected one of {VARIANT_ARGS}"
                )
            kw[name] = bool(int(value)) if name == "steal" else int(value)
        return kw
    c, nw, bh, *comb = (int(v) for v in var.split(":"))
    kw = dict(chunk=c, num_warps=nw, block_h=bh)
    if comb:
        kw.update(combine_chunk=comb[0], combine_warps=comb[1], combine_block_h=(comb[2:] or [bh])[0])
        if len(comb) > 3:
            kw["combine_maxnreg"] = comb[3]
    return kw


def _kernels(trace_path: str) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel in a Chrome trace, in start order."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ks = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") == "kernel"]
    return sorted(ks, key=lambda k: k[1])


def _short(name: str) -> str:
    for k in ("_layout_kernel", "_dispatch_kernel", "_combine_kernel", "_barrier_kernel", "_counts_kernel"):
        if k in name:
            return k.strip("_").removesuffix("_kernel")
    return "sleep" if ("spin" in name or "sleep" in name) else name[:40]


def timeline(barrier, replays: dict, iters: int) -> dict:
    """Profile ``iters`` rounds of every replay in ``replays`` (name -> function), each after ``barrier``
    and the lead; per replay name the median start (from the end of the lead) and duration of each of
    its kernels."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        order = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                for name, fn in replays.items():
                    barrier()
                    torch.cuda._sleep(LEAD_CYCLES)
                    fn()
                    order.append(name)
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        ks = _kernels(path)
    # split at the lead kernels: what follows one is that replay, up to the next round's barrier
    rounds: list[list[tuple[str, float, float]]] = []
    for name, ts, dur in ks:
        s = _short(name)
        if s == "sleep":
            if rounds and rounds[-1][-1][0] == "barrier":
                rounds[-1].pop()
            rounds.append([("_t0", ts + dur, 0.0)])
        elif rounds:
            rounds[-1].append((s, ts, dur))
    per: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name, rnd in zip(order, rounds, strict=False):
        t0 = rnd[0][1]
        seen: dict[str, int] = {}
        d = per.setdefault(name, {})
        last_end = t0
        for s, ts, dur in rnd[1:]:
            seen[s] = seen.get(s, 0) + 1
            key = s if seen[s] == 1 else f"{s}#{seen[s]}"
            e = d.setdefault(key, {"start_us": [], "dur_us": []})
            e["start_us"].append(ts - t0)
            e["dur_us"].append(dur)
            last_end = max(last_end, ts + dur)
        d.setdefault("_total", {"start_us": [], "dur_us": []})["dur_us"].append(last_end - t0)
    return {
        name: {k: {m: statistics.median(v) for m, v in e.items() if v} for k, e in d.items()}
        for name, d in per.items()
    }


#: what each ``%globaltimer`` stamp of the row kernel marks (``engine.probe[1][pid, i]``)
DISPATCH_STAMPS = {
    0: "start",
    1: "counts ready",
    2: "send 0",
    3: "recv 0",
    4: "send 1",
    5: "recv 1",
    12: "last flag seen",
    10: "scatter idx",
    11: "end",
    16: "p0 counts poll starts",
    17: "p0 counts seen",
    18: "p0 layout written",
    19: "p0 base rows sent",
}
LAYOUT_STAMPS = {0: "start", 1: "hist out", 2: "lower hists in", 3: "pos written", 4: "end"}


def probe_slots() -> int:
    """Stamps per program of the package on the path (16 before ``PROBE_SLOTS``: an older tree's)."""
    from ep_a2a.triton_backend import kernels

    return int(getattr(getattr(kernels, "PROBE_SLOTS", 16), "value", 16))


def stamps(eng, replay, iters: int) -> dict:
    """Median over ``iters`` replays of every stamp (us after this rank's first layout start): the
    earliest, median and latest program of each kernel."""
    L, D = [], []
    nl, nd = eng._layout_grid[0], eng.num_sm
    for _ in range(iters):
        eng.probe.zero_()
        eng.launch_barrier()
        torch.cuda._sleep(LEAD_CYCLES)
        replay()
        torch.cuda.synchronize()
        pr = eng.probe.cpu()
        t0 = int(pr[0, :nl, 0].min())
        L.append((pr[0, :nl].double() - t0) / 1e3)
        D.append((pr[1, :nd].double() - t0) / 1e3)
    out = {}
    for name, arr, names in (("layout", L, LAYOUT_STAMPS), ("dispatch", D, DISPATCH_STAMPS)):
        a = torch.stack(arr)  # [iters, programs, slots]
        for i, label in names.items():
            if i >= a.shape[2]:
                continue
            per_iter = []
            for it in a[:, :, i]:
                v = it[it > -1e5]  # programs that wrote this stamp (unwritten ones lie far before t0)
                if len(v):
                    per_iter.append([float(v.min()), float(v.median()), float(v.max())])
            if per_iter:
                out[f"{name}/{label}"] = [statistics.median(c) for c in zip(*per_iter, strict=True)]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--shape", default="deepseek-v3", choices=list(SHAPES))
    p.add_argument("--route", default="uniform", choices=["uniform", "skewed"], help="routing of the tokens")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--num-sm", type=int, default=132)
    p.add_argument("--probe", action="store_true", help="also %%globaltimer stamps inside the kernels")
    p.add_argument("--layer", action="store_true", help="through EPAll2AllLayer (variant 'default' only)")
    p.add_argument("--id-dtype", default="int32", choices=["int32", "int64"], help="dtype of the expert ids")
    p.add_argument(
        "--variants",
        nargs="+",
        default=["default"],
        help="'default' (the backend's choice), chunk:num_warps:block_h[:combine_chunk:combine_warps"
        "[:combine_block_h[:combine_maxnreg]]], e.g. 1:4:1024 or 32:16:512:8:16:512:128, or TritonBackend "
        f"arguments as name=value pairs joined by ',' ({', '.join(VARIANT_ARGS)}), e.g. send_ctas=55",
    )
    args = p.parse_args()
    if args.layer and args.variants != ["default"]:
        p.error("--layer takes the layer's default tiles: --variants default only")
    from ep_a2a import EPAll2AllLayer
    from ep_a2a.triton_backend import TritonBackend

    rank, world, dev = run_record.start_ranks()
    n = args.tokens
    cfg, x, ids, w = shape_inputs(args.shape, n, rank, world, dev, route=args.route)
    ids = ids.to(getattr(torch, args.id_dtype))
    out = {
        **run_record.header(dev, world_size=world),
        "shape": args.shape,
        "route": args.route,
        "tokens": n,
        "num_sm": args.num_sm,
        "through_layer": args.layer,
        "id_dtype": args.id_dtype,
        "variants": [],
    }
    for var in args.variants:
        kw = variant_kwargs(var)
        if args.layer:
            be = EPAll2AllLayer(
                dist.group.WORLD, max_tokens=cfg.max_tokens, hidden=cfg.hidden, topk=cfg.topk, rank=rank,
                num_tot_experts=cfg.num_tot_experts, local_world_size=world, world_size=world,
                dtype=cfg.token_dtype, weight_dtype=cfg.weight_dtype, num_sm=args.num_sm,
                enable_local_combine=True, backend="triton", timeout_s=60.0,
            )  # fmt: skip
            eng = be.ctx.backend.engine
        else:
            be = TritonBackend(
                cfg, dist.group.WORLD, num_sm=args.num_sm, enable_local_combine=True, use_aot=False,
                timeout_s=60.0, **kw,
            )  # fmt: skip
            eng = be.engine
        if args.probe:
            eng.probe = torch.zeros(
                2, max(eng.num_sm, eng._layout_grid[0]), probe_slots(), dtype=torch.int64, device=dev
            )
        g_d, g_c = capture_graphs(be, x, ids, w)
        timer = Timer(eng.launch_barrier)
        row = {
            "variant": var,
            "chunk": eng.chunk,
            "num_warps": eng.num_warps,
            "block_h": eng.block_h,
            "combine_chunk": eng.combine_chunk,
            "combine_warps": eng.combine_warps,
            "combine_block_h": eng.combine_block_h,
            "combine_maxnreg": eng.combine_maxnreg,
            "send_ctas": eng.send_ctas,
            "combine_send_ctas": eng.combine_send_ctas,
            "graph_dispatch_us": 1e3 * timer.median_ms(g_d.replay, args.iters, lead=True),
            "graph_combine_us": 1e3 * timer.median_ms(g_c.replay, args.iters, setup=g_d.replay, lead=True),
        }
        tl_ = timeline(eng.launch_barrier, {"dispatch": g_d.replay, "combine": g_c.replay}, args.iters)
        allr: list = [None] * world
        dist.all_gather_object(allr, tl_)
        row["timeline"] = {f"rank{r}": t for r, t in enumerate(allr)}
        if args.probe:
            st = stamps(eng, g_d.replay, args.iters)
            alls: list = [None] * world
            dist.all_gather_object(alls, st)
            row["stamps_us"] = {f"rank{r}": t for r, t in enumerate(alls)}
            if rank == 0:
                for r, t in enumerate(alls):
                    print(f"  rank{r} stamps (first / median / last program, us):")
                    for k, (lo, me, hi) in t.items():
                        print(f"    {k:28s} {lo:7.1f} {me:7.1f} {hi:7.1f}")
        out["variants"].append(row)
        if rank == 0:
            print(f"== {var}: chunk {eng.chunk} warps {eng.num_warps} block_h {eng.block_h} combine chunk "
                  f"{eng.combine_chunk} warps {eng.combine_warps} block_h {eng.combine_block_h} send_ctas "
                  f"{eng.send_ctas} / {eng.combine_send_ctas}: graph dispatch "
                  f"{row['graph_dispatch_us']:.1f} us, combine {row['graph_combine_us']:.1f} us")  # fmt: skip
            for r, t in enumerate(allr):
                for op, ks in t.items():
                    parts = [
                        f"{k} +{e.get('start_us', 0):.1f} ({e['dur_us']:.1f})"
                        for k, e in ks.items()
                        if k != "_total"
                    ]
                    print(f"  rank{r} {op}: total {ks['_total']['dur_us']:.1f} us | " + " | ".join(parts))
        torch.cuda.synchronize()
        be.finalize()
        del g_d, g_c
    run_record.finish(out, args.json, rank=rank)


if __name__ == "__main__":
    main()
