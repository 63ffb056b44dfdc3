"""Benchmark of the torch backend and the two NCCL ``all_to_all_single`` pipelines (run under torchrun).

    torchrun --standalone --nproc-per-node=2 packages/ep-a2a/benchmarks/bench_torch_backend.py --json out.json

Per shape (DeepSeek-V3: hidden 7168 bf16, top-8 of 256 experts; Qwen3-30B-A3B: hidden 2048, top-8 of 128)
and routing (uniform, skewed), each rank dispatches ``--tokens`` tokens and combines them back; plus 128
tokens per rank for latency. Measured in the same run, same inputs:

* ``ce``: copy-engine ``copy_`` of the same bytes into the peer GPU's buffer (symmetric memory), the
  hardware ceiling for moving those bytes;
* ``nccl-a2a``: one ``all_to_all_single`` of exactly the per-destination rows, nothing else (what NCCL
  itself reaches on these bytes);
* ``torch``: ``EPAll2AllLayer(backend="torch")`` (input checks, counts exchange, packed payload, expansion;
  combine in float32), ``torch-lc``: the same with ``enable_local_combine=True``; ``torch-fp8``: FP8
  dispatch of the same rows in DeepEP's format (quantized before the timing), combine of bf16 rows;
* ``nccl-dest``: user-style pipeline, one row per (token, destination rank), receiver expands;
* ``nccl-expert``: user-style pipeline, one row per (token, expert).

For uniform routing each torch and NCCL row also carries the work of one call (``count_work.py``):
``dispatch_collectives``, ``dispatch_host_syncs``, ``dispatch_device_ops``,
``dispatch_cuda_sync_warnings`` and the same for combine.

Bytes counted: only token rows that cross to another GPU, one per (token, destination rank)
(``hidden x 2`` bytes each), the same for every method. Times: CUDA events around each call, started
after a barrier of both ranks; the torch and NCCL pipeline rows run in ``--rounds`` rounds, each round
measuring every one of them (the order rotating) as the median over ``--iters`` calls after warm-up,
the slower rank's; their times are the medians of the rounds (``*_rounds``: each round's), and the torch
rows' ``dispatch_vs_nccl_dest`` / ``combine_vs_nccl_dest`` the medians of the rounds' time ratios
against ``nccl-dest``; ``*_host_ms``: the host's time until the call returned (same calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import run_record
import torch
import torch.distributed as dist

from ep_a2a import EPAll2AllLayer

SHAPES = {
    "deepseek-v3": {"hidden": 7168, "experts": 256, "topk": 8},
    "qwen3-30b-a3b": {"hidden": 2048, "experts": 128, "topk": 8},
}


def make_routing(
    n: int, experts: int, topk: int, kind: str, seed: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    u = torch.rand(n, experts, generator=gen, device=device).clamp_min(1e-20)
    scores = -torch.log(-torch.log(u))  # Gumbel top-k = sampling experts without replacement
    if kind == "skewed":  # Zipf popularity: low-numbered experts (rank 0's) get most slots
        scores = scores - torch.log(torch.arange(1, experts + 1, device=device, dtype=torch.float32))
    ids = scores.topk(topk, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.rand(n, topk, generator=gen, device=device), dim=1)
    return ids, w


class NcclPerExpert:
    """All-to-all with one row per (token, expert), sorted by expert, as MoE code often writes it."""

    def __init__(self, rank: int, world: int, e_local: int) -> None:
        self.rank, self.world, self.e_local = rank, world, e_local

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
        flat = ids.flatten().long()
        kept = flat >= 0
        order = torch.sort(torch.where(kept, flat, 1 << 30), stable=True).indices[: int(kept.sum())]
        expert = flat[order]
        send_counts = torch.bincount(expert // self.e_local, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        rows = x[order // ids.shape[1]]
        recv_x = x.new_empty(sum(rc), x.shape[1])
        dist.all_to_all_single(recv_x, rows, rc, sc)
        meta = torch.stack([expert.to(torch.int32), w.flatten()[order].view(torch.int32)], 1)
        recv_meta = meta.new_empty(sum(rc), 2)
        dist.all_to_all_single(recv_meta, meta, rc, sc)
        local = recv_meta[:, 0].long() % self.e_local
        perm = torch.sort(local, stable=True).indices
        return (
            recv_x[perm],
            recv_meta[perm, 1].view(torch.float32),
            (order, sc, rc, perm, x.shape[0], ids.shape[1]),
        )

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        order, sc, rc, perm, n, topk = state
        arrival = torch.empty_like(y)
        arrival[perm] = y
        back = y.new_empty(sum(sc), y.shape[1])
        dist.all_to_all_single(back, arrival, sc, rc)
        out = torch.zeros(n, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, order // topk, back.float())
        return out.to(y.dtype)


class NcclPerDest:
    """All-to-all with one row per (token, destination rank); the receiver expands to expert rows."""

    def __init__(self, rank: int, world: int, e_local: int) -> None:
        self.rank, self.world, self.e_local = rank, world, e_local

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
        dest = torch.where(ids >= 0, ids.long() // self.e_local, self.world)
        present = torch.zeros(x.shape[0], self.world + 1, dtype=torch.bool, device=x.device)
        present.scatter_(1, dest, True)
        present = present[:, : self.world]
        send_counts = present.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        tok = torch.nonzero(present.t())[:, 1]
        recv_x = x.new_empty(sum(rc), x.shape[1])
        dist.all_to_all_single(recv_x, x[tok], rc, sc)
        meta = torch.cat([ids[tok], w[tok].view(torch.int32)], 1)
        recv_meta = meta.new_empty(sum(rc), meta.shape[1])
        dist.all_to_all_single(recv_meta, meta, rc, sc)
        k = ids.shape[1]
        r_ids, r_w = recv_meta[:, :k].long(), recv_meta[:, k:].view(torch.float32)
        row, slot = torch.nonzero((r_ids >= 0) & (r_ids // self.e_local == self.rank), as_tuple=True)
        perm = torch.sort(r_ids[row, slot] % self.e_local, stable=True).indices
        row, slot = row[perm], slot[perm]
        return recv_x[row], r_w[row, slot], (tok, sc, rc, row, x.shape[0])

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        tok, sc, rc, row, n = state
        partial = torch.zeros(sum(rc), y.shape[1], dtype=torch.float32, device=y.device)
        partial.index_add_(0, row, y.float())
        back = y.new_empty(sum(sc), y.shape[1])
        dist.all_to_all_single(back, partial.to(y.dtype), sc, rc)
        out = torch.zeros(n, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, tok, back.float())
        return out.to(y.dtype)


def median_ms(
    fn: Callable[[], object],
    iters: int,
    setup: Callable[[], object] | None = None,
    host: list[float] | None = None,
) -> float:
    """Median of CUDA-event times; each call starts after both ranks are idle; max over ranks. ``host``:
    gets the median host time of the call (until it returns), max over ranks."""
    fn() if setup is None else (setup(), fn())
    times, hosts = [], []
    for _ in range(iters):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        hosts.append(1e3 * (time.perf_counter() - t0))
        end.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor([statistics.median(times), statistics.median(hosts)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if host is not None:
        host.append(float(t[1]))
    return float(t[0])


def copy_engine_ms(nbytes: int, rank: int, world: int, iters: int) -> float | None:
    """Copy ``nbytes`` into the next rank's GPU buffer with the copy engine (symmetric memory)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(max(nbytes, 16), dtype=torch.uint8, device="cuda")
        handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        peer = handle.get_buffer((rank + 1) % world, (max(nbytes, 16),), torch.uint8)
        src = torch.randint(0, 255, (max(nbytes, 16),), dtype=torch.uint8, device="cuda")
        return median_ms(lambda: peer.copy_(src), iters)
    except Exception as exc:  # symmetric memory not usable here: say so in the JSON
        print(f"[rank {rank}] copy-engine ceiling skipped: {type(exc).__name__}: {exc}", flush=True)
        return None


def measure_calls(disp: Callable[[], object], comb: Callable[[], object], iters: int) -> dict[str, float]:
    """Dispatch, combine (each after a dispatch) and round-trip times of one method (:func:`median_ms`)."""
    d_host: list[float] = []
    c_host: list[float] = []
    t_d = median_ms(disp, iters, host=d_host)
    t_c = median_ms(comb, iters, setup=disp, host=c_host)

    def rt() -> None:
        disp()
        comb()

    return {"dispatch_ms": t_d, "combine_ms": t_c, "round_trip_ms": median_ms(rt, iters),
            "dispatch_host_ms": d_host[0], "combine_host_ms": c_host[0]}  # fmt: skip


def run_case(shape: str, route: str, tokens: int, args, rank: int, world: int, dev) -> dict:
    hidden, experts, topk = (SHAPES[shape][k] for k in ("hidden", "experts", "topk"))
    e_local = experts // world
    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    ids, w = make_routing(tokens, experts, topk, route, 1000 + rank, dev)
    dest = ids.long() // e_local
    crossing = sum(int((dest == r).any(1).sum()) for r in range(world) if r != rank)
    cross_t = torch.tensor([crossing], device=dev)
    dist.all_reduce(cross_t, op=dist.ReduceOp.MAX)
    nbytes = int(cross_t) * hidden * 2
    res: dict[str, dict[str, Any]] = {}

    ce = copy_engine_ms(nbytes, rank, world, args.iters)
    if ce is not None:
        res["ce"] = {"copy_ms": ce}
    # NCCL alone on the per-destination rows (no pre/post-processing)
    present = torch.zeros(tokens, world, dtype=torch.bool, device=dev)
    present.scatter_(1, dest, True)
    sc = present.sum(0).tolist()
    rc_t = torch.empty(world, dtype=torch.int64, device=dev)
    dist.all_to_all_single(rc_t, present.sum(0))
    rc = rc_t.tolist()
    rows = x[torch.nonzero(present.t())[:, 1]]
    recv = x.new_empty(sum(rc), hidden)
    res["nccl-a2a"] = {"copy_ms": median_ms(lambda: dist.all_to_all_single(recv, rows, rc, sc), args.iters)}

    from ep_a2a.reference import quantize_fp8

    x_fp8 = quantize_fp8(x)  # DeepEP's format: FP8 rows and per-128-channel scales

    def measure_layer(name: str) -> dict[str, float]:
        layer = EPAll2AllLayer(
            None,
            tokens,
            hidden,
            topk,
            rank,
            experts,
            world,
            world,
            enable_local_combine=name == "torch-lc",
            backend="torch",
        )
        holder: dict = {}

        def disp(rows=x_fp8 if name == "torch-fp8" else x):
            holder["d"] = layer.dispatch(rows, ids, w)

        def comb():
            rows, desc = holder["d"][0], holder["d"][2]
            if not isinstance(rows, torch.Tensor):  # FP8 dispatch: the experts' bf16 rows (allocated once)
                if holder.get("y") is None or holder["y"].shape[0] != desc.num_recv_rows:
                    holder["y"] = torch.zeros(desc.num_recv_rows, hidden, dtype=x.dtype, device=dev)
                rows = holder["y"]
            layer.combine(rows, desc)

        try:
            return measure_calls(disp, comb, args.iters)
        finally:
            layer.finalize()

    def measure_pipeline(name: str) -> dict[str, float]:
        pipe = (NcclPerDest if name == "nccl-dest" else NcclPerExpert)(rank, world, e_local)
        st: dict = {}

        def disp():
            st["d"] = pipe.dispatch(x, ids, w)

        return measure_calls(disp, lambda: pipe.combine(st["d"][0], st["d"][2]), args.iters)

    # Rounds, each measuring every method (the order rotating), so that drift of the host's speed during
    # the run reaches all methods alike; the ``*_vs_nccl_dest`` ratios pair the methods round by round.
    methods = ["torch", "torch-lc", "torch-fp8", "nccl-dest", "nccl-expert"]
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    for r in range(args.rounds):
        for name in methods[r % len(methods) :] + methods[: r % len(methods)]:
            measure = measure_pipeline if name.startswith("nccl") else measure_layer
            rounds[name].append(measure(name))
    for name in methods:
        res[name] = {k: statistics.median(t[k] for t in rounds[name]) for k in rounds[name][0]}
        res[name].update({f"{k}_rounds": [t[k] for t in rounds[name]] for k in ("dispatch_ms", "combine_ms")})
        if name.startswith("torch"):
            for op in ("dispatch", "combine"):
                res[name][f"{op}_vs_nccl_dest"] = statistics.median(
                    t[f"{op}_ms"] / n[f"{op}_ms"]
                    for t, n in zip(rounds[name], rounds["nccl-dest"], strict=True)
                )
    if route == "uniform":  # work per call (count_work.py: the same routing), for the torch and NCCL rows
        import count_work

        counts = count_work.count_methods(rank, world, tokens, hidden, experts, topk, device=dev)
        for name, ops in counts.items():
            for op, c in ops.items():
                res[name].update({f"{op}_{k}": c[k] for k in count_work.SUMMARY_KEYS})
    case = {
        "shape": shape,
        "routing": route,
        "tokens": tokens,
        "hidden": hidden,
        "experts": experts,
        "topk": topk,
        "nvlink_bytes": nbytes,
        "results": res,
    }
    if rank == 0:
        print(json.dumps(case), flush=True)
    return case


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where rank 0 writes the raw results")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20, help="calls per method and round (median)")
    p.add_argument("--rounds", type=int, default=5, help="rounds over all methods (median of the rounds)")
    p.add_argument("--quick", action="store_true", help="DeepSeek-V3 uniform and the 128-token case only")
    args = p.parse_args()
    rank, world, dev = run_record.start_ranks()
    out = {"bench": "torch_backend", **run_record.header(dev, world_size=world)}
    cases = []
    shapes = ["deepseek-v3"] if args.quick else list(SHAPES)
    routes = ["uniform"] if args.quick else ["uniform", "skewed"]
    for shape in shapes:
        for route in routes:
            cases.append(run_case(shape, route, args.tokens, args, rank, world, dev))
    cases.append(run_case("deepseek-v3", "uniform", 128, args, rank, world, dev))
    out["cases"] = cases
    run_record.finish(out, args.json, rank=rank)


if __name__ == "__main__":
    main()
