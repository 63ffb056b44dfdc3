"""Benchmark of the Triton fast path against the copy-engine ceiling and NCCL pipelines (run under torchrun).

    torchrun --standalone --nproc-per-node=2 packages/ep-a2a/benchmarks/bench_triton.py --json out.json

Per shape (DeepSeek-V3: hidden 7168, top-8 of 256; Qwen3-30B-A3B: hidden 2048, top-8 of 128) and
routing (uniform, skewed), each rank dispatches ``--tokens`` tokens and combines them back. Measured in
the same run:

* ``ce``: the copy engine copying the same bytes into the peer's symmetric buffer (``copy_`` of a
  peer-mapped tensor, both ranks at once): the ceiling.
* ``ours``: the Triton backend (exact-shape mode: includes its one device-to-host copy), ``num_sm`` in
  ``--num-sm``; ``ours-graph``: the same captured in a CUDA graph (static shapes, no host sync).
* ``nccl-dest``: ``all_to_all_single`` pipeline with one row per (token, destination rank), the receiver
  expanding to expert rows; ``nccl-expert``: one row per (token, expert), as users usually write it.

Bytes counted: only those that cross NVLink, i.e. token rows (hidden x dtype) sent to another rank, one
per (token, destination rank); dispatch and combine move the same number. The figure is that of the
busiest rank: the maximum over ranks of the larger of what it sends and what it receives (on 2 GPUs the
two are equal; with skewed routing on more GPUs the hot rank receives more than any rank sends). Times:
median over ``--iters`` runs, each started right after a device-side barrier of all ranks, measured with
CUDA events on each rank; the slowest rank's median is reported. The ``ours-sm*`` and ``ours-graph-sm*``
rows are timed in ``--rounds`` rounds, each timing every ``num_sm`` of the case in turn (the order
rotating) as the median over ``--round-iters`` runs; their times are the medians of the rounds, and
``dispatch_ms_rounds``, ``combine_ms_rounds`` (and the eager rows' ``*_launches_ms_rounds``) hold each
round's, which the summary (run.py) pairs round by round. Graph replays are timed from the end
of a short device-side delay after the barrier (``Timer.median_ms(lead=True)``), so their time is the
GPU's and excludes the host's launch of the replay (a model's own graph hides it); ``ours-graph`` rows
also record the time without that delay (``*_no_lead``), and the eager static calls (timed without it,
host work included) also record the time with it (``*_lead``), so graph and eager compare both ways.
The copy-engine ceiling is timed the same way (with the lead; also without). ``*_host_ms`` is the wall
time the calling thread spends inside the call (the exact-shape mode waits for its counts), median,
slowest rank.

FP8 dispatch (DeepSeek-V3 shape, at the default ``num_sm``): ``ours-fp8`` / ``ours-fp8-graph`` run the
layer built for FP8 rows (``EPLayer(dtype=torch.float8_e4m3fn)``), dispatching ``(x_fp8, scales)`` in
DeepEP's format (the packing into one row per token included) and combining bf16 rows; their
``quantize_dispatch_ms`` is the dispatch of the bf16 rows with ``fp8=True``, quantized inside the row
kernel as it sends them (``quantize_in_kernel``; the graph row also records whether those bytes equal
the tuple's, ``quantize_matches_tuple``).
Their bytes (``nvlink_bytes_fp8``) are the FP8 row and its float32 scales (``hidden + 4 * hidden / 128``
per crossing token row), and their copy-engine ceiling (``ce-fp8``) copies that many bytes.

``host`` (per case): each rank's host speed as the case starts (``run_record.host_speed``: a fixed
Python loop, ``python_us``, and a one-kernel CUDA graph replay's host time, ``graph_replay_us``; lists in
rank order) and the share of the machine's CPU time its hypervisor stole during the case
(``steal_pct``): the eager rows are bound by host work and move with these.

``ours-layer-default``: the layer built as the README shows (default tuning) called with int64 ids, as
``torch.topk`` returns them; beside it, on the same layer, its backend called directly (``backend_*``),
int32 ids (``int32_ids_*``) and the layer's calls again (``repeat_*``), and how the calls ran (CUDA
graphs captured and replayed, workspaces and combine outputs allocated; the ``ours-sm*`` rows too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import run_record
import torch
import torch.distributed as dist

from ep_a2a import TritonTuning
from ep_a2a.backends import BackendOptions
from ep_a2a.config import EPConfig

SHAPES = {
    "deepseek-v3": {"hidden": 7168, "experts": 256, "topk": 8},
    "qwen3-30b-a3b": {"hidden": 2048, "experts": 128, "topk": 8},
}


def routing(
    n: int, experts: int, topk: int, kind: str, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    if kind == "uniform":
        scores = torch.rand(n, experts, generator=gen, device=device)
    else:  # skewed: expert e's score shrinks with e, so the first rank's experts get most slots
        bias = -torch.arange(experts, device=device, dtype=torch.float32) * (4.0 / experts)
        scores = torch.rand(n, experts, generator=gen, device=device).log() + bias * 2
    ids = scores.topk(topk, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.rand(n, topk, generator=gen, device=device), dim=1)
    return ids, w


def triton_backend(cfg: EPConfig, group, *, use_aot: bool = False, timeout_s: float = 60.0, **tuning):
    """The Triton backend of ``cfg`` with ``TritonTuning(**tuning)`` (``None`` fields left at defaults)."""
    from ep_a2a.backends.triton import TritonBackend

    tuning = {k: v for k, v in tuning.items() if v is not None}
    options = BackendOptions(
        tuning=TritonTuning(**tuning), enable_local_combine=True, use_aot=use_aot, timeout_s=timeout_s
    )
    return TritonBackend(cfg, group, options)


def shape_inputs(
    shape_name: str,
    n: int,
    rank: int,
    world: int,
    dev: torch.device,
    *,
    route: str = "uniform",
    seed: int = 1000,
) -> tuple[EPConfig, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer of ``SHAPES[shape_name]`` with ``n`` tokens per rank, and this rank's inputs:
    ``(config, x [n, hidden] bf16, expert ids [n, topk] int32, weights [n, topk] float32)``, routed by
    ``route`` with seed ``seed + rank``."""
    shp = SHAPES[shape_name]
    cfg = EPConfig(
        max_tokens=n,
        hidden=shp["hidden"],
        topk=shp["topk"],
        num_tot_experts=shp["experts"],
        rank=rank,
        world_size=world,
        local_world_size=world,
        token_dtype=torch.bfloat16,
    )
    x = torch.randn(n, shp["hidden"], device=dev).to(torch.bfloat16)
    ids, w = routing(n, shp["experts"], shp["topk"], route, seed + rank, dev)
    return cfg, x, ids, w


def crossing_tokens(ids: torch.Tensor, rank: int, e_local: int) -> int:
    """Tokens of this rank with at least one slot on another rank (each crosses NVLink once per rank)."""
    dest = torch.where(ids >= 0, ids.long() // e_local, -1)
    world = int(dest.max()) + 1 if dest.numel() else 1
    count = 0
    for r in range(max(world, rank + 1)):
        if r != rank:
            count += int((dest == r).any(dim=1).sum())
    return count


def busiest_tokens(matrix: torch.Tensor) -> tuple[int, list[int], list[int]]:
    """``matrix[s, d]``: tokens of rank ``s`` crossing to rank ``d`` (zero diagonal).

    Returns the busiest rank's count, ``max_r max(sent_r, received_r)``, and the per-rank sent and
    received counts.
    """
    sent = matrix.sum(1).tolist()
    recv = matrix.sum(0).tolist()
    return int(max(max(sent), max(recv))), [int(v) for v in sent], [int(v) for v in recv]


def crossing_matrix(ids: torch.Tensor, rank: int, world: int, e_local: int, device) -> torch.Tensor:
    """All ranks' crossing token counts ``[world, world]`` (collective): row ``s`` from rank ``s``."""
    dest = torch.where(ids >= 0, ids.long() // e_local, -1)
    m = torch.zeros(world, world, dtype=torch.int64)
    for d in range(world):
        if d != rank:
            m[rank, d] = int((dest == d).any(dim=1).sum())
    m = m.to(device)
    dist.all_reduce(m)
    return m.cpu()


#: GPU cycles of the device-side delay before a timed graph replay (about 100 us at the H200's 1.98 GHz):
#: long enough for every rank's host to have enqueued the replay before its GPU reaches it
LEAD_CYCLES = 200_000


def rotated(items: list, r: int) -> list:
    """``items`` rotated left by ``r`` places: round ``r``'s order of the interleaved configurations."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


#: fields whose value in every round a row of :func:`over_rounds` keeps (``<field>_rounds``): the times
#: the summary pairs round by round (run.py)
ROUND_FIELDS = ("dispatch_ms", "combine_ms", "dispatch_launches_ms", "combine_launches_ms")


def over_rounds(rounds: list[dict]) -> dict:
    """One configuration's row from its rows of the rounds (same keys in each): every time (float) the
    median over the rounds, other fields (flags, counters) the last round's; ``<field>_rounds``: each
    round's value of the ``ROUND_FIELDS`` present, in round order; ``rounds``: how many."""
    if not rounds:
        raise ValueError("over_rounds: rounds is empty (--rounds must be at least 1)")
    last = rounds[-1]
    row = {k: statistics.median(r[k] for r in rounds) if isinstance(v, float) else v for k, v in last.items()}
    row.update({f"{k}_rounds": [r[k] for r in rounds] for k in ROUND_FIELDS if k in last})
    row["rounds"] = len(rounds)
    return row


class Timer:
    def __init__(self, barrier):
        self.barrier = barrier
        self.host_ms = 0.0  # median wall time of the calls in the last median_ms (slowest rank)

    def median_ms(self, fn, iters: int, setup=None, lead: bool = False) -> float:
        """Median CUDA-event time of ``fn`` (slowest rank), each call right after a device barrier.

        ``lead``: a device-side delay (``LEAD_CYCLES``) runs between the barrier and the start event, so
        the time starts when the GPU reaches already-enqueued work on every rank and excludes the host's
        launch time and the ranks' host skew (for graph replays, whose launch a model's graph hides;
        eager calls are timed without it, host work included).
        """
        times, host = [], []
        for _ in range(iters):
            if setup is not None:
                setup()
            self.barrier()
            if lead:
                torch.cuda._sleep(LEAD_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        t = torch.tensor([statistics.median(times), statistics.median(host)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.host_ms = float(t[1])
        return float(t[0])


def warm_up(fn) -> None:
    """``fn()`` twice on a side stream, then a device sync: nothing compiles or allocates inside a
    capture that follows."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def capture_graphs(be, x, ids, w):
    """CUDA graphs of one static dispatch and of the combine of its output, after two eager rounds on a
    side stream so nothing compiles or allocates inside the capture."""

    def both() -> None:
        d = be.dispatch_static(x, ids, w)
        be.combine_static(d.output, d)

    warm_up(both)
    g_d, g_c = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_d):
        dd = be.dispatch_static(x, ids, w)
    with torch.cuda.graph(g_c):
        be.combine_static(dd.output, dd)
    return g_d, g_c


# ---------------------------------------------------------------------------------------- NCCL pipelines
class NcclPerDest:
    """One row per (token, destination rank); the receiver expands to expert rows (reference order)."""

    def __init__(self, rank, world, e_local):
        self.rank, self.world, self.e_local = rank, world, e_local

    def dispatch(self, x, ids, w):
        dest = torch.where(ids >= 0, ids.long() // self.e_local, -1)
        mask = torch.stack([(dest == r).any(1) for r in range(self.world)], 1)  # [n, W]
        send_counts = mask.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        tok = mask.t().nonzero()[:, 1]
        meta = torch.cat([ids[tok], w[tok].view(torch.int32)], 1)
        recv_x = x.new_empty(sum(rc), x.shape[1])
        recv_meta = meta.new_empty(sum(rc), meta.shape[1])
        dist.all_to_all_single(recv_x, x[tok], rc, sc)
        dist.all_to_all_single(recv_meta, meta, rc, sc)
        k = ids.shape[1]
        r_ids, r_w = recv_meta[:, :k], recv_meta[:, k:].view(torch.float32)
        local = (r_ids >= 0) & (r_ids.long() // self.e_local == self.rank)
        row, slot = local.nonzero(as_tuple=True)
        order = torch.sort(r_ids[row, slot].long() % self.e_local, stable=True).indices
        row, slot = row[order], slot[order]
        out = recv_x[row]
        state = (tok, sc, rc, row, x.shape[0])
        return out, r_w[row, slot], state

    def combine(self, y, state):
        tok, sc, rc, row, n = state
        acc = torch.zeros(sum(rc), y.shape[1], dtype=torch.float32, device=y.device)
        acc.index_add_(0, row, y.float())
        back = torch.empty(sum(sc), y.shape[1], dtype=y.dtype, device=y.device)
        dist.all_to_all_single(back, acc.to(y.dtype), sc, rc)
        out = torch.zeros(n, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, tok, back.float())
        return out.to(y.dtype)


class NcclPerExpert:
    """One row per (token, expert) pair both ways; the source sums in float32."""

    def __init__(self, rank, world, e_local):
        self.rank, self.world, self.e_local = rank, world, e_local

    def dispatch(self, x, ids, w):
        n, k = ids.shape
        flat = ids.reshape(-1).long()
        keep = (flat >= 0).nonzero().flatten()
        dest = flat[keep] // self.e_local
        order = torch.sort(dest, stable=True).indices
        slots = keep[order]
        send_counts = torch.bincount(dest, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        recv_x = x.new_empty(sum(rc), x.shape[1])
        dist.all_to_all_single(recv_x, x[slots // k], rc, sc)
        meta = torch.stack([flat[slots].to(torch.int32), w.reshape(-1)[slots].view(torch.int32)], 1)
        recv_meta = meta.new_empty(sum(rc), 2)
        dist.all_to_all_single(recv_meta, meta, rc, sc)
        order2 = torch.sort(recv_meta[:, 0].long() % self.e_local, stable=True).indices
        return recv_x[order2], recv_meta[order2, 1].view(torch.float32), (slots, sc, rc, order2, n, k)

    def combine(self, y, state):
        slots, sc, rc, order2, n, k = state
        unsorted = torch.empty_like(y)
        unsorted[order2] = y
        back = torch.empty(sum(sc), y.shape[1], dtype=y.dtype, device=y.device)
        dist.all_to_all_single(back, unsorted, sc, rc)
        out = torch.zeros(n, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, slots // k, back.float())
        return out.to(y.dtype)


# ---------------------------------------------------------------------------------------- main
def eager_case(be, x, ids, w, timer, holder: dict, iters: int) -> dict:
    """The exact-shape calls of ``be``, ``iters`` each: dispatch (also after the device-side lead),
    combine, round trip; leaves the last dispatch in ``holder["d"]``."""

    def disp(be=be, holder=holder):
        holder["d"] = be.dispatch(x, ids, w, None)

    disp()
    torch.cuda.synchronize()
    t_disp = timer.median_ms(disp, iters)
    h_disp = timer.host_ms
    # the same calls with the host ahead of the GPU (device-side lead), as in a pipeline
    t_disp_lead = timer.median_ms(disp, iters, lead=True)
    # the same calls launching their kernels one by one (no graph of the repeated tensors: a loop whose
    # buffers move from call to call)
    graphs, be.eager_graphs = be.eager_graphs, False
    t_disp_launches = timer.median_ms(disp, iters)
    h_disp_launches = timer.host_ms
    be.eager_graphs = graphs
    y = holder["d"][0]
    t_comb = timer.median_ms(lambda: be.combine(y, holder["d"][2]), iters, setup=disp)
    h_comb = timer.host_ms
    # the same combines launching their kernel without a graph
    be.eager_graphs = False
    t_comb_launches = timer.median_ms(lambda: be.combine(y, holder["d"][2]), iters, setup=disp)
    h_comb_launches = timer.host_ms
    be.eager_graphs = graphs

    def rt():
        d = be.dispatch(x, ids, w, None)
        be.combine(d[0], d[2])

    return {
        "dispatch_ms": t_disp,
        "combine_ms": t_comb,
        "round_trip_ms": timer.median_ms(rt, iters),
        "dispatch_host_ms": h_disp,
        "combine_host_ms": h_comb,
        "dispatch_ms_lead": t_disp_lead,
        "dispatch_launches_ms": t_disp_launches,
        "dispatch_launches_host_ms": h_disp_launches,
        "combine_launches_ms": t_comb_launches,
        "combine_launches_host_ms": h_comb_launches,
        "overlap_exact": be.overlap_exact,
        "speculative_rows": be.speculative_rows,
        **_path_counters(be),
    }


def fp8_case(args, cfg, group, x, ids, w, num_sm) -> tuple[dict, dict]:
    """FP8 dispatch through the layer of FP8 rows (``num_sm`` CTAs): eager (exact-shape) and CUDA-graph
    dispatch of ``(x_fp8, scales)``, the combine of bf16 rows after it, and the dispatch of the bf16
    rows ``x`` with ``fp8=True`` (quantized in the row kernel). Returns the eager and the graph row."""
    from ep_a2a import EPLayer
    from ep_a2a.backends.triton.engine import QuantizeOnSend
    from ep_a2a.reference import quantize_fp8

    layer = EPLayer(
        group, max_tokens=cfg.max_tokens, hidden=cfg.hidden, topk=cfg.topk, num_experts=cfg.num_tot_experts,
        dtype=torch.float8_e4m3fn, backend="triton", tuning=TritonTuning(num_sm=num_sm), timeout_s=60.0,
    )  # fmt: skip
    timer = Timer(lambda: layer.ctx.backend.engine.launch_barrier())
    xq = quantize_fp8(x)
    holder: dict = {}

    def disp():
        holder["d"] = layer.dispatch(xq, ids, w)

    def disp_q():
        holder["d"] = layer.dispatch(x, ids, w, fp8=True)

    disp_q()
    disp()
    torch.cuda.synchronize()
    eager = {"dispatch_ms": timer.median_ms(disp, args.iters), "dispatch_host_ms": timer.host_ms}
    eager["dispatch_ms_lead"] = timer.median_ms(disp, args.iters, lead=True)
    y = torch.randn(holder["d"][0][0].shape[0], cfg.hidden, device=x.device).to(torch.bfloat16)
    eager["combine_ms"] = timer.median_ms(lambda: layer.combine(y, holder["d"][2]), args.iters, setup=disp)
    eager["quantize_dispatch_ms"] = timer.median_ms(disp_q, args.iters)
    eager["quantize_in_kernel"] = isinstance(layer.ctx.backend.quantize_fp8(x), QuantizeOnSend)
    holder.clear()
    # CUDA-graph mode: static FP8 dispatch (the tuple, or bf16 rows quantized in the graph) and combine
    rows = cfg.world_size * cfg.max_tokens * cfg.topk
    ys = torch.randn(rows, cfg.hidden, device=x.device).to(torch.bfloat16)

    def both() -> None:
        layer.combine_static(ys, layer.dispatch_static(xq, ids, w))
        layer.combine_static(ys, layer.dispatch_static(x, ids, w, fp8=True))

    warm_up(both)
    g_d, g_c, g_q = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_d):
        dd = layer.dispatch_static(xq, ids, w)
    with torch.cuda.graph(g_c):
        layer.combine_static(ys, dd)
    with torch.cuda.graph(g_q):
        dq = layer.dispatch_static(x, ids, w, fp8=True)
    graph = {
        "dispatch_ms": timer.median_ms(g_d.replay, args.iters, lead=True),
        "combine_ms": timer.median_ms(g_c.replay, args.iters, setup=g_d.replay, lead=True),
        "quantize_dispatch_ms": timer.median_ms(g_q.replay, args.iters, lead=True),
        "dispatch_ms_no_lead": timer.median_ms(g_d.replay, args.iters),
    }
    # the tuple and quantize-on-send move the same bytes (quantize_fp8 of x on both paths; both graphs
    # write the layer's one set of static FP8 buffers, so the first result is copied)
    g_d.replay()
    r = int(dd.num_recv_rows)
    first = [t[:r].clone() for t in dd.output]
    g_q.replay()
    torch.cuda.synchronize()
    same = int(dq.num_recv_rows) == r and all(
        torch.equal(a, b[:r]) for a, b in zip(first, dq.output, strict=True)
    )
    flag = torch.tensor([0 if same else 1], device=x.device)
    dist.all_reduce(flag)
    graph["quantize_matches_tuple"] = int(flag) == 0
    del g_d, g_c, g_q, dd, dq
    torch.cuda.synchronize()
    layer.check_errors()
    layer.finalize()
    return eager, graph


def low_latency_case(args, cfg, group, x, ids, w, num_sm, ref) -> tuple[dict, dict]:
    """The low-latency mode (``TritonTuning(low_latency=True)``, ``num_sm`` CTAs): CUDA-graph replays of
    one dispatch of bf16 rows, of FP8 rows in DeepEP's format (packed ``(x_fp8, scales)``) and of bf16 rows
    quantized on send, and of one bf16 combine; the same bf16 calls eager (no graph). Its received rows
    must equal the normal mode's (``ref``: rows and combine of the same inputs) and its combine be within
    bf16 rounding of it. Returns the eager and the graph row."""
    from ep_a2a.reference import quantize_fp8

    be = triton_backend(cfg, group, num_sm=num_sm, low_latency=True, timeout_s=60.0)
    timer = Timer(lambda: be.engine.launch_barrier())
    inputs = {"bf16": x, "fp8": be.pack_fp8(*quantize_fp8(x)), "quantize": be.quantize_fp8(x)}
    rows = cfg.world_size * cfg.max_tokens * cfg.topk
    ys = torch.randn(rows, cfg.hidden, device=x.device).to(torch.bfloat16)
    warm_up(lambda: [be.combine_static(ys, be.dispatch_static(inp, ids, w)) for inp in inputs.values()])
    # a combine takes the latest dispatch only, so its graph is captured right after the bf16 dispatch's
    graphs, g_c = {}, torch.cuda.CUDAGraph()
    for name, inp in inputs.items():
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            d = be.dispatch_static(inp, ids, w)
        if name == "bf16":
            with torch.cuda.graph(g_c):
                be.combine_static(ys, d)
    g_d = graphs["bf16"]
    graph = {
        "dispatch_ms": timer.median_ms(g_d.replay, args.iters, lead=True),
        "combine_ms": timer.median_ms(g_c.replay, args.iters, setup=g_d.replay, lead=True),
        "fp8_dispatch_ms": timer.median_ms(graphs["fp8"].replay, args.iters, lead=True),
        "quantize_dispatch_ms": timer.median_ms(graphs["quantize"].replay, args.iters, lead=True),
        "dispatch_ms_no_lead": timer.median_ms(g_d.replay, args.iters),
        "combine_ms_no_lead": timer.median_ms(g_c.replay, args.iters, setup=g_d.replay),
    }
    holder: dict = {}

    def sdisp():
        holder["d"] = be.dispatch_static(x, ids, w)

    def scomb():
        holder["y"] = be.combine_static(holder["d"].output, holder["d"])

    eager = {"dispatch_ms": timer.median_ms(sdisp, args.iters), "dispatch_host_ms": timer.host_ms}
    eager["combine_ms"] = timer.median_ms(scomb, args.iters, setup=sdisp)
    eager["combine_host_ms"] = timer.host_ms
    # the same rows as the normal mode, and its sums within bf16 rounding (another summation order)
    sdisp()
    scomb()
    torch.cuda.synchronize()
    r = int(holder["d"].num_recv_rows)
    same = r == ref[0].shape[0] and torch.equal(holder["d"].output[:r], ref[0])
    err = (
        (holder["y"].float() - ref[1].float()).abs().max()
        if ref[1].numel()
        else torch.zeros((), device=x.device)
    )
    close = bool(err <= 2.0**-6 * ref[1].float().abs().max().clamp(min=1.0))
    flags = torch.tensor([0 if same else 1, 0 if close else 1], device=x.device)
    dist.all_reduce(flags)
    eager["rows_match_normal_mode"], eager["combine_close_to_normal_mode"] = (
        int(flags[0]) == 0,
        int(flags[1]) == 0,
    )
    del graphs, g_c, g_d, d
    torch.cuda.synchronize()
    be.check_errors()
    be.finalize()
    return eager, graph


def split_experiments(args, cfg, group, x, ids, w, num_sm_list, ref, route, res) -> None:
    """Other sender / writer splits, steal off, int64 ids, the smaller SM counts, copy-engine dispatch
    and worst-case buffers beside the default, each checked to give exactly its rows and sums (``ref``)."""
    n, topk, hidden, world = x.shape[0], cfg.topk, cfg.hidden, cfg.world_size
    # experiment: other sender / writer splits of the CTAs than the default (large layers on many
    # SMs: num_sm // 3 dispatch and num_sm // 2 combine CTAs sending; 0 = every CTA both), graph
    # mode and eager static mode, each checked to give exactly the default's rows and sums; and the
    # graph mode at the smaller num_sm (its default: no split)
    nsm = num_sm_list[-1]
    # the split's fixed shares without work stealing (steal=False), under both routings
    res[f"ours-graph-nosteal-sm{nsm}"] = split_case(
        args, cfg, group, x, ids, w, nsm, None, None, ref, steal=False
    )
    # the default with the ids as torch.topk gives them (int64, read in place by the kernels)
    res[f"ours-graph-int64-sm{nsm}"] = split_case(args, cfg, group, x, ids.long(), w, nsm, None, None, ref)
    if route == "uniform":
        for gd, gc in ((0, 0), (nsm // 4, 2 * nsm // 3)):
            res[f"ours-graph-split{gd}-{gc}-sm{nsm}"] = split_case(
                args, cfg, group, x, ids, w, nsm, gd, gc, ref, copy_engine=False
            )
        for small in num_sm_list[:-1]:
            res[f"ours-graph-sm{small}"] = split_case(args, cfg, group, x, ids, w, small, None, None, ref)
            res[f"ours-graph-split{small // 4}-{small // 2}-sm{small}"] = split_case(
                args, cfg, group, x, ids, w, small, small // 4, small // 2, ref
            )
        # copy-engine dispatch (copy_engine=True, off by default) beside the default, same run
        for nsm_ab in num_sm_list:
            res[f"ours-graph-ce-sm{nsm_ab}"] = split_case(
                args, cfg, group, x, ids, w, nsm_ab, None, None, ref, copy_engine=True
            )
        # the exact-shape mode without the host wait before the row kernel (worst-case buffers),
        # which the default keeps for layers whose worst case is at most 256 MiB
        if world * n * topk * hidden * 2 > TritonTuning().overlap_bytes:
            res[f"ours-overlap-sm{num_sm_list[-1]}"] = exact_variant_case(
                args, cfg, group, x, ids, w, num_sm_list[-1], overlap_bytes=1 << 62
            )


def nccl_cases(args, rank, world, e_local, x, ids, w) -> dict:
    """The NCCL ``all_to_all_single`` pipelines: one row per (token, destination rank) and per expert."""
    res = {}
    for name, cls in (("nccl-dest", NcclPerDest), ("nccl-expert", NcclPerExpert)):
        pipe = cls(rank, world, e_local)
        st = {}

        def nd(pipe=pipe, st=st):
            st["d"] = pipe.dispatch(x, ids, w)

        nd()
        t_d = Timer(lambda: None).median_ms(nd, args.iters)
        t_c = Timer(lambda: None).median_ms(
            lambda pipe=pipe, st=st: pipe.combine(st["d"][0], st["d"][2]), args.iters
        )
        res[name] = {"dispatch_ms": t_d, "combine_ms": t_c}
    return res


def run_case(
    args,
    shape_name,
    route,
    num_sm_list,
    rank,
    world,
    group,
    dev,
    results,
    heap="torch",
    tokens=None,
    extra=True,
):
    shp = SHAPES[shape_name]
    hidden, experts, topk = shp["hidden"], shp["experts"], shp["topk"]
    n = tokens or args.tokens
    e_local = experts // world
    cfg, x, ids, w = shape_inputs(shape_name, n, rank, world, dev, route=route)
    busiest, sent, recv = busiest_tokens(crossing_matrix(ids.cpu(), rank, world, e_local, dev))
    nbytes = busiest * hidden * 2  # the busiest rank's bytes (max of sent and received)
    nbytes_fp8 = busiest * (hidden + 4 * (hidden // 128))  # FP8 rows and their float32 scales
    case = {
        "shape": shape_name,
        "routing": route,
        "tokens": n,
        "hidden": hidden,
        "experts": experts,
        "topk": topk,
        "heap": heap,
        "nvlink_bytes": nbytes,
        "nvlink_bytes_rule": "max over ranks of max(sent, received) crossing token rows",
        "nvlink_bytes_fp8": nbytes_fp8,
        "crossing_tokens_sent": sent,
        "crossing_tokens_received": recv,
        "results": {},
    }
    res = case["results"]
    # the host the eager rows run on: every rank's speed as the case starts, the machine's CPU steal
    # over the case (filled in at its end)
    speeds: list = [None] * world
    dist.all_gather_object(speeds, run_record.host_speed(dev))
    case["host"] = {k: [s[k] for s in speeds] for k in speeds[0]}
    ticks = run_record.cpu_times()
    device_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    #: the layer's default (TritonTuning().num_sm None: every SM); the rows at it are the default's
    case["default_num_sm"] = TritonTuning().for_device(device_sms).num_sm
    # every num_sm's backend (and, with ``extra``, the CUDA graphs of its static calls: worst-case shapes,
    # counts on device) at once, so that the rounds below interleave them
    backends = {
        k: triton_backend(cfg, group, num_sm=k, use_aot=False, timeout_s=60.0, heap=heap) for k in num_sm_list
    }
    graphs = {k: capture_graphs(be, x, ids, w) for k, be in backends.items()} if extra else {}
    holders: dict[int, dict] = {k: {} for k in num_sm_list}
    eager_rounds: dict[int, list[dict]] = {k: [] for k in num_sm_list}
    graph_rounds: dict[int, list[dict]] = {k: [] for k in num_sm_list}
    # The eager calls are bound by host work, whose speed changes for seconds at a time: rounds, each
    # timing every num_sm's eager calls and graph replays (the order rotating), reach every
    # configuration alike, and the summary pairs them round by round.
    for r in range(args.rounds):
        for num_sm in rotated(num_sm_list, r):
            be = backends[num_sm]
            timer = Timer(lambda be=be: be.engine.launch_barrier())
            eager_rounds[num_sm].append(eager_case(be, x, ids, w, timer, holders[num_sm], args.round_iters))
            if extra:
                g_d, g_c, it = *graphs[num_sm], args.round_iters
                graph = {
                    "dispatch_ms": timer.median_ms(g_d.replay, it, lead=True),
                    "combine_ms": timer.median_ms(g_c.replay, it, setup=g_d.replay, lead=True),
                    # the same replays timed without the device-side lead (host launch and skew included)
                    "dispatch_ms_no_lead": timer.median_ms(g_d.replay, it),
                    "combine_ms_no_lead": timer.median_ms(g_c.replay, it, setup=g_d.replay),
                }
                graph_rounds[num_sm].append(graph)
    for num_sm in num_sm_list:
        res[f"ours-sm{num_sm}"] = over_rounds(eager_rounds[num_sm])
        res[f"ours-sm{num_sm}"]["default_num_sm"] = num_sm == device_sms
        if extra:
            res[f"ours-graph-sm{num_sm}"] = over_rounds(graph_rounds[num_sm])
    graphs.clear()
    for num_sm in num_sm_list:
        be, holder = backends.pop(num_sm), holders.pop(num_sm)
        timer = Timer(lambda be=be: be.engine.launch_barrier())
        if extra and num_sm == num_sm_list[-1]:
            # eager static mode (same kernels, no graph) for the graph-vs-eager comparison
            def sdisp(be=be, holder=holder):
                holder["s"] = be.dispatch_static(x, ids, w)

            t_sd = timer.median_ms(sdisp, args.iters)
            h_sd = timer.host_ms

            def scomb(be=be, holder=holder):
                be.combine_static(holder["s"].output, holder["s"])

            t_sc = timer.median_ms(scomb, args.iters, setup=sdisp)
            h_sc = timer.host_ms
            res[f"ours-static-eager-sm{num_sm}"] = {
                "dispatch_ms": t_sd,
                "combine_ms": t_sc,
                "dispatch_host_ms": h_sd,
                "combine_host_ms": h_sc,
                # the same eager calls timed like the graph replays (after the device-side lead: the
                # host's launches are ahead of the GPU, as in a pipeline that keeps it busy)
                "dispatch_ms_lead": timer.median_ms(sdisp, args.iters, lead=True),
                "combine_ms_lead": timer.median_ms(scomb, args.iters, setup=sdisp, lead=True),
            }
            # copy-engine ceiling into the peer's symmetric heap
            if heap == "torch":
                peer = 1 - rank if world == 2 else (rank + 1) % world
                import torch.distributed._symmetric_memory as symm_mem  # noqa: F401

                hdl = be.heap._handle
                elems = nbytes // 2
                dst = hdl.get_buffer(peer, (elems,), torch.bfloat16)
                src = torch.randn(elems, device=dev).to(torch.bfloat16)
                # timed like the graph replays (after the device-side lead: the copy's GPU time), and
                # without the lead as well
                t_ce = timer.median_ms(lambda dst=dst, src=src: dst.copy_(src), args.iters, lead=True)
                t_ce_nl = timer.median_ms(lambda dst=dst, src=src: dst.copy_(src), args.iters)
                res["ce"] = {"copy_ms": t_ce, "copy_ms_no_lead": t_ce_nl}
                del dst, src
                if shape_name == "deepseek-v3":  # the ceiling of FP8 dispatch: its own bytes
                    dst = hdl.get_buffer(peer, (nbytes_fp8,), torch.uint8)
                    src = torch.randint(0, 256, (nbytes_fp8,), dtype=torch.uint8, device=dev)
                    t_ce = timer.median_ms(lambda dst=dst, src=src: dst.copy_(src), args.iters, lead=True)
                    res["ce-fp8"] = {"copy_ms": t_ce, "bytes": nbytes_fp8}
                    del dst, src
            # the other floor of dispatch: the busiest rank writes its expert rows to HBM once each
            # (memset of that many bytes, every rank at once); under skewed routing it binds first
            rows = torch.tensor([holder["d"][0].shape[0]], device=dev)
            dist.all_reduce(rows, op=dist.ReduceOp.MAX)
            wbytes = int(rows) * hidden * x.element_size()
            buf = torch.empty(max(wbytes, 1), dtype=torch.uint8, device=dev)
            t_w = timer.median_ms(lambda buf=buf: buf.zero_(), args.iters, lead=True)
            res["hbm-write"] = {"write_ms": t_w, "rows": int(rows), "bytes": wbytes}
            del buf
        if num_sm == num_sm_list[-1]:
            # the default's exact result, for the experiments' equivalence check below
            d = be.dispatch(x, ids, w, None)
            ref = (d[0].clone(), be.combine(d[0], d[2]).clone())
        torch.cuda.synchronize()
        be.check_errors()  # a device-side wait that ran out makes every time above meaningless
        res[f"ours-sm{num_sm}"]["send_ctas"] = [be.engine.send_ctas, be.engine.combine_send_ctas]
        res[f"ours-sm{num_sm}"]["copy_engine"] = be.copy_engine
        res[f"ours-sm{num_sm}"]["speculative_overflows"] = be.speculative_overflows
        be.finalize()
        if extra and num_sm == num_sm_list[-1] and shape_name == "deepseek-v3" and heap == "torch":
            # FP8 dispatch (DeepEP's format) beside bf16, at the same num_sm
            res[f"ours-fp8-sm{num_sm}"], res[f"ours-fp8-graph-sm{num_sm}"] = fp8_case(
                args, cfg, group, x, ids, w, num_sm
            )
        if (
            extra
            and args.low_latency
            and num_sm == num_sm_list[-1]
            and shape_name == "deepseek-v3"
            and heap == "torch"
        ):
            res[f"ours-ll-sm{num_sm}"], res[f"ours-ll-graph-sm{num_sm}"] = low_latency_case(
                args, cfg, group, x, ids, w, num_sm, ref
            )
        if extra and not args.quick and be.speculative_rows and num_sm == num_sm_list[-1]:
            # the exact-shape flow that waits for the counts before the row kernel, beside the default
            res[f"ours-nospec-sm{num_sm}"] = exact_variant_case(
                args, cfg, group, x, ids, w, num_sm, speculative_rows=False
            )
            # both over batch sizes that vary from call to call (kept apart: other bytes per call)
            case["varying"] = varying_case(args, shape_name, route, n, rank, world, group, dev, num_sm)
    if extra and n > 1024 and getattr(args, "split", False) and not args.quick:
        split_experiments(args, cfg, group, x, ids, w, args.num_sm, ref, route, res)
    if extra and (n <= 1024 or len(num_sm_list) > 2):
        # the user's call: the layer built as the README shows (default tuning, int64 ids as topk returns
        # them, no host-side id check: the triton backend counts bad ids on the device), exact-shape mode
        res["ours-layer-default"] = layer_case(args, cfg, group, x, ids.long(), w, None)
    if extra:
        res.update(nccl_cases(args, rank, world, e_local, x, ids, w))
    case["host"]["steal_pct"] = run_record.steal_pct(ticks)
    results.append(case)
    if rank == 0:
        print(json.dumps(case), flush=True)


def split_case(
    args,
    cfg,
    group,
    x,
    ids,
    w,
    num_sm,
    send_ctas: int | None,
    combine_send_ctas: int | None,
    ref,
    copy_engine: bool | None = None,
    steal: bool = True,
) -> dict:
    """Graph-mode (and eager) times of one configuration of the CTA split / copy-engine dispatch /
    work stealing, checked to give exactly the default configuration's rows and sums (``ref``)."""
    be = triton_backend(
        cfg, group, num_sm=num_sm, timeout_s=30.0, send_ctas=send_ctas, combine_send_ctas=combine_send_ctas,
        copy_engine=copy_engine, steal=steal,
    )  # fmt: skip
    timer = Timer(lambda: be.engine.launch_barrier())
    g_d, g_c = capture_graphs(be, x, ids, w)
    out = {
        "dispatch_ms": timer.median_ms(g_d.replay, args.iters, lead=True),
        "send_ctas": [be.engine.send_ctas, be.engine.combine_send_ctas],
        "copy_engine": be.copy_engine,
        "steal": be.engine.steal,
    }
    out["combine_ms"] = timer.median_ms(g_c.replay, args.iters, setup=g_d.replay, lead=True)
    out["static_eager_dispatch_ms"] = timer.median_ms(lambda: be.dispatch_static(x, ids, w), args.iters)
    out["exact_eager_dispatch_ms"] = timer.median_ms(lambda: be.dispatch(x, ids, w, None), args.iters)
    d = be.dispatch_static(x, ids, w)
    comb = be.combine_static(d.output, d)
    rows = int(d.num_recv_rows)
    same = rows == ref[0].shape[0] and torch.equal(d.output[:rows], ref[0]) and torch.equal(comb, ref[1])
    flag = torch.tensor([0 if same else 1], device=x.device)
    dist.all_reduce(flag)
    out["matches_default"] = int(flag) == 0  # on every rank: rows bit-identical, sums bit-identical
    torch.cuda.synchronize()
    try:  # a device-side wait that ran out would make the times above meaningless
        be.check_errors()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    del g_d, g_c
    be.finalize()
    return out


#: inputs of the varying-batch case (token counts drawn per rank in [n / 4, n]), cycled call by call
VARYING_INPUTS = 8


def varying_case(args, shape_name, route, n, rank, world, group, dev, num_sm) -> dict:
    """The exact-shape dispatch over batch sizes that change from call to call, as a serving engine's
    do: ``VARYING_INPUTS`` inputs of ``n / 4`` to ``n`` tokens (drawn per rank, seeded), cycled in lockstep
    on every rank; with and without ``speculative_rows``. Median per call (slowest rank), also after the
    device-side lead; the speculative flow's overflows (second writing passes) summed over ranks."""
    cfg, x, ids, w = shape_inputs(shape_name, n, rank, world, dev, route=route)
    gen = torch.Generator().manual_seed(4321 + rank)
    sizes = torch.randint(n // 4, n + 1, (VARYING_INPUTS,), generator=gen).tolist()
    out: dict = {"token_counts_this_rank": sizes, "low": n // 4, "high": n}
    for spec in (True, False):
        be = triton_backend(
            cfg, group, num_sm=num_sm, use_aot=False, timeout_s=60.0,
            speculative_rows=spec,
        )  # fmt: skip
        timer = Timer(lambda be=be: be.engine.launch_barrier())
        state: dict = {"i": 0}

        def disp(be=be, state=state):
            m = sizes[state["i"] % len(sizes)]
            state["i"] += 1
            state["d"] = be.dispatch(x[:m], ids[:m], w[:m], None)

        for _ in range(2 * len(sizes)):  # every size compiled and seen (the speculative window filled)
            disp()
        torch.cuda.synchronize()
        calls0, over0 = be.speculative_calls, be.speculative_overflows
        row = {"dispatch_ms": timer.median_ms(disp, args.iters), "dispatch_host_ms": timer.host_ms}
        row["dispatch_ms_lead"] = timer.median_ms(disp, args.iters, lead=True)
        counts = torch.tensor([be.speculative_overflows - over0, be.speculative_calls - calls0], device=dev)
        dist.all_reduce(counts)
        row["overflows"], row["speculative_calls"] = int(counts[0]), int(counts[1])
        out["speculative" if spec else "no_speculation"] = row
        state.clear()
        torch.cuda.synchronize()
        be.check_errors()
        be.finalize()
    return out


def exact_variant_case(args, cfg, group, x, ids, w, num_sm, **backend_kw) -> dict:
    """The exact-shape calls of a backend built with ``backend_kw`` (an experiment beside the default):
    dispatch timed as the default's row is, and also after the device-side lead (the host ahead of the
    GPU, as in a pipeline), then combine."""
    be = triton_backend(cfg, group, num_sm=num_sm, use_aot=False, timeout_s=30.0, **backend_kw)
    timer = Timer(lambda: be.engine.launch_barrier())
    holder = {}

    def disp():
        holder["d"] = be.dispatch(x, ids, w, None)

    disp()
    torch.cuda.synchronize()
    out = {"dispatch_ms": timer.median_ms(disp, args.iters), "dispatch_host_ms": timer.host_ms}
    out["dispatch_ms_lead"] = timer.median_ms(disp, args.iters, lead=True)
    out["combine_ms"] = timer.median_ms(
        lambda: be.combine(holder["d"][0], holder["d"][2]), args.iters, setup=disp
    )
    out["combine_host_ms"] = timer.host_ms
    out["overlap_exact"] = be.overlap_exact
    out["speculative_rows"] = be.speculative_rows
    out["speculative_overflows"] = be.speculative_overflows
    holder.clear()
    torch.cuda.synchronize()
    be.check_errors()
    be.finalize()
    return out


def _path_counters(be) -> dict:
    """How an eager backend's calls ran: CUDA graphs captured and replayed, workspaces and combine
    outputs allocated (a replay per call and a few allocations in all is the common case's path)."""
    return {
        "graph_captures": be.graph_captures,
        "graph_replays": be.graph_replays,
        "workspaces_allocated": be.workspaces.allocated,
        "combine_outputs_allocated": be.combine_outputs.allocated,
    }


def layer_case(args, cfg, group, x, ids, w, num_sm) -> dict:
    """The layer built as the README shows, called with ``ids`` (int64, as ``torch.topk`` returns them):
    dispatch and combine as a user calls them (``dispatch_ms``, ``combine_ms``), then, on the same layer
    in the same process state, what tells a gap to the backend's own rows apart: the layer's backend
    called directly with the same tensors (``backend_*``), the layer with int32 ids (``int32_ids_*``),
    and the layer's calls again (``*_repeat``: a drift over the case shows there); and how its calls ran
    (:func:`_path_counters`)."""
    import gc

    from ep_a2a import EPAll2AllLayer

    gc.collect()  # (earlier cases' finalized layers: nothing of theirs is left when this one is built)
    layer = EPAll2AllLayer(
        group,
        max_tokens=cfg.max_tokens,
        hidden=cfg.hidden,
        topk=cfg.topk,
        rank=cfg.rank,
        num_tot_experts=cfg.num_tot_experts,
        local_world_size=cfg.local_world_size,
        world_size=cfg.world_size,
        dtype=cfg.token_dtype,
        num_sm=num_sm,
        backend="triton",
        timeout_s=60.0,
    )
    be = layer.ctx.backend
    timer = Timer(lambda: be.engine.launch_barrier())
    holder: dict = {}
    out: dict = {}

    def measure(prefix: str, dispatch, combine) -> None:
        def disp():
            holder["d"] = dispatch()

        disp()
        torch.cuda.synchronize()
        out[f"{prefix}dispatch_ms"] = timer.median_ms(disp, args.iters)
        out[f"{prefix}dispatch_host_ms"] = timer.host_ms
        out[f"{prefix}combine_ms"] = timer.median_ms(
            lambda: combine(holder["d"][0], holder["d"][2]), args.iters, setup=disp
        )
        out[f"{prefix}combine_host_ms"] = timer.host_ms

    ids32 = ids.to(torch.int32)
    measure("", lambda: layer.dispatch(x, ids, w), layer.combine)
    out.update(_path_counters(be))
    measure("backend_", lambda: be.dispatch(x, ids, w, None), be.combine)
    measure("int32_ids_", lambda: layer.dispatch(x, ids32, w), layer.combine)
    measure("repeat_", lambda: layer.dispatch(x, ids, w), layer.combine)
    holder.clear()
    torch.cuda.synchronize()
    layer.check_errors()  # (a device-side wait that ran out makes every time above meaningless)
    layer.finalize()
    return out


def first_call(args, rank, world, group, dev) -> dict:
    """First dispatch+combine latency of a fresh backend, with and without use_aot (fresh Triton cache)."""
    cfg, x, ids, w = shape_inputs("deepseek-v3", 128, rank, world, dev, seed=5)
    t0 = time.perf_counter()
    be = triton_backend(cfg, group, num_sm=args.num_sm[-1], use_aot=args.use_aot, timeout_s=120.0)
    torch.cuda.synchronize()
    t_construct = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    d = be.dispatch(x, ids, w, None)
    be.combine(d[0], d[2])
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    be.finalize()
    return {"use_aot": args.use_aot, "construct_s": t_construct, "first_dispatch_combine_s": t_first}


def breakdown(args, be, x, ids, w) -> dict:
    """Per-kernel GPU time of one static dispatch + combine (events between the launches), median."""
    eng = be.engine
    d = be.dispatch_static(x, ids, w)
    be.combine_static(d.output, d)
    torch.cuda.synchronize()
    b = be._static
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    names = ("layout", "dispatch", "combine")
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(args.iters):
        eng.launch_barrier()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        evs[0].record()
        eng.launch_layout(ids, caller_scatter=False, info=b["info"])
        evs[1].record()
        eng.launch_dispatch(
            x, ids, w, eng.pos, b["out"], b["out_w"], b["out_e"], b["tab"], b["skip"], b["scat"],
            caller_scatter=False, info=b["info"], counts=True,
        )  # fmt: skip
        evs[2].record()
        eng.launch_combine(d.output, b["tab"], ids, b["info"][2 : 2 + eng.world_size], out)
        evs[3].record()
        evs[3].synchronize()
        for i, k in enumerate(names):
            times[k].append(evs[i].elapsed_time(evs[i + 1]))
    return {k: statistics.median(v) for k, v in times.items()}


def sweep(args, rank, world, group, dev) -> list:
    """Tile/chunk/warp variants at one shape, graph-mode times plus a per-kernel breakdown."""
    rows = []
    for tokens in (args.tokens, 128):
        cfg, x, ids, w = shape_inputs("deepseek-v3", tokens, rank, world, dev, seed=77)
        # (chunk, block_h, num_warps, num_sm, send_ctas, combine_send_ctas); None: the backend's default
        variants = [
            (8, 1024, 8, 132, None, None),
            (8, 1024, 16, 132, None, None),
            (8, 2048, 8, 132, None, None),
            (16, 1024, 8, 132, None, None),
            (8, 1024, 16, 32, None, None),
            (4, 1024, 8, 32, None, None),
        ]
        if tokens == 128:
            variants = [
                (2, 1024, 8, 132, None, None),
                (2, 1024, 8, 132, 132 // 3, 132 // 2),
                (1, 1024, 4, 132, None, None),
            ]
        for chunk, bh, nw, nsm, send, comb in variants:
            be = triton_backend(
                cfg, group, num_sm=nsm, chunk=chunk, block_h=bh, num_warps=nw, send_ctas=send, combine_send_ctas=comb
            )  # fmt: skip
            row = {"tokens": tokens, "chunk": chunk, "block_h": bh, "num_warps": nw, "num_sm": nsm}
            row["send_ctas"] = [be.engine.send_ctas, be.engine.combine_send_ctas]
            bd = breakdown(args, be, x, ids, w)
            t = torch.tensor([bd[k] for k in sorted(bd)], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            row["breakdown_ms"] = dict(zip(sorted(bd), t.tolist(), strict=True))
            timer = Timer(lambda be=be: be.engine.launch_barrier())
            g_d, g_c = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_d):
                dd = be.dispatch_static(x, ids, w)
            with torch.cuda.graph(g_c):
                be.combine_static(dd.output, dd)
            row["graph_dispatch_ms"] = timer.median_ms(g_d.replay, args.iters, lead=True)
            row["graph_combine_ms"] = timer.median_ms(g_c.replay, args.iters, setup=g_d.replay, lead=True)
            holder = {}

            def disp(be=be, holder=holder, x=x, ids=ids, w=w):
                holder["d"] = be.dispatch(x, ids, w, None)

            disp()
            row["eager_dispatch_ms"] = timer.median_ms(disp, args.iters)
            row["eager_combine_ms"] = timer.median_ms(
                lambda be=be, holder=holder: be.combine(holder["d"][0], holder["d"][2]),
                args.iters,
                setup=disp,
            )
            torch.cuda.synchronize()
            be.finalize()
            del g_d, g_c
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20, help="calls per timed block (median)")
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds over the num_sm variants' eager calls and graph replays (median of the rounds)",
    )
    p.add_argument("--round-iters", type=int, default=10, help="calls per timed block in each round (median)")
    p.add_argument(
        "--num-sm",
        type=int,
        nargs="+",
        default=None,
        help="SM counts of the Triton rows (default: 32 and every SM; the last one gets the extra rows)",
    )
    p.add_argument(
        "--num-sm-sweep",
        type=int,
        nargs="+",
        default=[20, 32, 66, 0],
        help="SM counts of the DeepSeek-V3 uniform cases at --tokens and 128 tokens, eager and graph (0: every SM)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="DeepSeek-V3 uniform only (the num_sm sweep, the layer's default, NCCL), no other experiments",
    )
    p.add_argument("--first-call", action="store_true", help="only measure first-call latency")
    p.add_argument("--use-aot", action="store_true")
    p.add_argument("--sweep", action="store_true", help="tile/chunk/warp variants and a per-kernel breakdown")
    p.add_argument("--heaps", nargs="+", default=["torch", "nvshmem"])
    p.add_argument(
        "--no-split",
        dest="split",
        action="store_false",
        help="skip the sender/writer CTA split experiment at 4096 tokens",
    )
    p.add_argument(
        "--low-latency",
        action="store_true",
        help="also time the low-latency mode (TritonTuning(low_latency=True)) in the DeepSeek-V3 cases at every SM",
    )
    p.add_argument("--topo", default=None, help="file holding `nvidia-smi topo -m`")
    args = p.parse_args()
    if args.rounds < 1 or args.round_iters < 1 or args.iters < 1:
        p.error("--iters, --rounds and --round-iters must be at least 1")
    rank, world, dev = run_record.start_ranks()
    group = dist.group.WORLD
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    args.num_sm = args.num_sm or [32, sms]
    sweep_sms = sorted({min(k, sms) if k > 0 else sms for k in args.num_sm_sweep})
    out = run_record.header(dev, world_size=world)
    if args.topo and os.path.exists(args.topo):
        with open(args.topo) as f:
            out["topology"] = f.read()
    if args.first_call:
        out["first_call"] = first_call(args, rank, world, group, dev)
    elif args.sweep:
        out["sweep"] = sweep(args, rank, world, group, dev)
    else:
        results: list = []
        shapes = ["deepseek-v3"] if args.quick else list(SHAPES)
        routes = ["uniform"] if args.quick else ["uniform", "skewed"]
        out["cases"] = results

        def save() -> None:  # after every case: a run stopped part-way keeps what it measured
            run_record.write(out, args.json, rank=rank)

        for shape in shapes:
            for route in routes:
                # the DeepSeek-V3 uniform case sweeps num_sm (the default, every SM, last)
                sms_list = sweep_sms if (shape, route) == ("deepseek-v3", "uniform") else args.num_sm
                run_case(args, shape, route, sms_list, rank, world, group, dev, results)
                save()
        # latency at 128 tokens per rank
        for shape in shapes:
            sms_list = sweep_sms if shape == "deepseek-v3" else args.num_sm[-1:]
            run_case(args, shape, "uniform", sms_list, rank, world, group, dev, results, tokens=128)
            save()
        if "nvshmem" in args.heaps and not args.quick:
            try:
                import nvshmem.core  # noqa: F401

                run_case(
                    args,
                    "deepseek-v3",
                    "uniform",
                    args.num_sm[-1:],
                    rank,
                    world,
                    group,
                    dev,
                    results,
                    heap="nvshmem",
                    extra=False,
                )
            except ImportError as exc:
                out["nvshmem_skipped"] = f"nvshmem4py not importable: {exc}"
        out["cases"] = results
    run_record.finish(out, args.json, rank=rank)


if __name__ == "__main__":
    main()
