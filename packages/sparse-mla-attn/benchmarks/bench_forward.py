"""Forward benchmark: ``sparse_mla_fwd`` at FlashMLA's shape, with a torch gather + einsum baseline and,
when given, FlashMLA's ``flash_mla_sparse_fwd`` on the same inputs.

FLOPs are counted as FlashMLA counts them: ``2 * s_q * h_q * topk * (d_qk + d_v)``.

``python bench_forward.py [--flashmla PATH] [--quick]`` prints, without writing a file, the forward at
FlashMLA's shape (s_q 4096, topk 2048, h_q 128 / 64, s_kv 8K / 32K / 128K) with the default sm_90 Gluon
kernel and with ``Config.fwd_persistent`` forced on and off, beside FlashMLA's ``flash_mla_sparse_fwd`` on the
same inputs, and ``attn_dist`` with each ``Config.attn_dist_split`` and ``Config.attn_dist_order`` as a
fraction of the fastest forward's time; about two minutes on an H200.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
import triton

from sparse_mla_attn import Config, sparse_mla_fwd, sparse_mla_fwd_ref
from sparse_mla_attn._inputs import random_indices
from sparse_mla_attn._runtime import last_launch

D_QK, D_V = 576, 512


def time_ms(fn: Any, *, warmup: int = 25, rep: int = 200, graph: bool = False) -> float:
    """Median time of ``fn`` in ms: CUDA events around each call with the L2 cache flushed before it
    (``triton.testing.do_bench``), or with ``graph`` back-to-back replays of ``fn`` captured in a CUDA graph
    (``triton.testing.do_bench_cudagraph``: no flush, so the data stays in L2 between replays)."""
    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_interleaved_ms(fns: list[Any], *, reps: int = 40, warmup: int = 3) -> list[list[float]]:
    """Per-call times in ms of each function of ``fns``, timed in turns call by call: each call with CUDA
    events around it and the L2 cache flushed before it (as ``triton.testing.do_bench``), the turns'
    order reversed every other turn (``A B``, ``B A``, ...), so that every function runs as often first as
    last and all of them under the same clocks and temperature. Returns ``reps`` times per function."""
    driver = triton.runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    events: list[list[tuple[Any, Any]]] = [[] for _ in fns]
    for r in range(reps):
        for i in range(len(fns)) if r % 2 == 0 else reversed(range(len(fns))):
            driver.clear_cache(cache)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[i]()
            end.record()
            events[i].append((start, end))
    torch.cuda.synchronize()
    return [[s.elapsed_time(e) for s, e in ev] for ev in events]


def time_ms_idle(fn: Any, *, rep: int = 100) -> float:
    """Median time of ``fn`` in ms started from an idle GPU: the L2 flushed, then the host waits for the GPU
    before each call, so the call's whole host cost counts (an eager call's latency)."""
    driver = triton.runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    fn()
    times = []
    for _ in range(rep):
        driver.clear_cache(cache)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in times)
    return float(ms[len(ms) // 2])


def capture_graph(fn: Any) -> torch.cuda.CUDAGraph:
    """``fn`` called once on a side stream (as before any capture), then captured once in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def dense_matmul_tflops(n: int = 8192) -> float:
    """Measured bf16 dense matmul rate (random data): the compute roofline of this run."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / time_ms(lambda: a @ b) / 1e9


def fwd_flops(s_q: int, h_q: int, topk: int) -> float:
    return 2.0 * s_q * h_q * topk * (D_QK + D_V)


def make_inputs(s_q: int, h_q: int, s_kv: int, topk: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 ``q``, ``kv`` and distinct random indices per query (as FlashMLA's benchmark draws them)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s_q, h_q, D_QK, device="cuda", generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, D_QK, device="cuda", generator=g).bfloat16()
    return q, kv, random_indices(s_q, s_kv, topk, device="cuda", generator=g)


def _config_label(config: Config | None) -> str | None:
    """``None`` for the defaults, else the options that differ from them (e.g. ``"backend=triton"``)."""
    if config is None or config == Config():
        return None
    return ", ".join(f"{k}={v}" for k, v in vars(config).items() if getattr(Config(), k) != v)


#: Calls of each kernel timed in a forward row (:func:`time_interleaved_ms`: this package's forward and FlashMLA's,
#: when given, in turns call by call).
FWD_REPS = 60


def bench_fwd(
    s_q: int, h_q: int, s_kv: int, topk: int, *, config: Config | None = None, flashmla: Any = None
) -> dict:
    """One forward row: time, TFLOPS, kernel family, max error of the first 32 queries against the float32
    reference, and FlashMLA's time on the same inputs when its module is given. The two are timed in turns
    call by call (:func:`time_interleaved_ms`, ``FWD_REPS`` calls each); each time is the median of its calls,
    all of them recorded (``ms_calls``, ``flashmla_ms_calls``), and ``time_vs_flashmla`` the median of the
    ratios of the calls made side by side."""
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk)
    sm_scale = 1 / math.sqrt(D_QK)
    run = lambda: sparse_mla_fwd(q, kv, idx, sm_scale, config=config)
    out, _, lse = run()
    launch = last_launch("fwd")
    r_out, _, r_lse = sparse_mla_fwd_ref(q[:32].float(), kv.float(), idx[:32], sm_scale)
    fm = None
    if flashmla is not None:
        fm = lambda: flashmla.flash_mla_sparse_fwd(q, kv, idx, sm_scale, D_V)
        try:
            fm_out = fm()[0]
        except Exception as exc:  # a shape FlashMLA does not support: recorded, not fatal
            fm_error = f"{type(exc).__name__}: {str(exc)[:200]}"
            fm = None
    calls = time_interleaved_ms([run] if fm is None else [run, fm], reps=FWD_REPS)
    ours_calls = calls[0]
    ms = statistics.median(ours_calls)
    row: dict[str, Any] = {
        "op": "fwd", "s_q": s_q, "h_q": h_q, "s_kv": s_kv, "topk": topk, "config": _config_label(config),
        "backend": launch.backend if launch else None, "ms": ms, "tflops": fwd_flops(s_q, h_q, topk) / ms / 1e9,
        "out_max_abs_err": float((out[:32].float() - r_out).abs().max()),
        "lse_max_abs_err": float((lse[:32] - r_lse).abs().max()), "ms_calls": ours_calls,
    }  # fmt: skip
    if flashmla is not None and fm is None:
        row["flashmla_error"] = fm_error
    elif fm is not None:
        row["flashmla_out_max_abs_err"] = float((fm_out[:32].float() - r_out).abs().max())
        fm_calls = calls[1]
        row["flashmla_ms"] = statistics.median(fm_calls)
        row["flashmla_ms_calls"] = fm_calls
        row["flashmla_tflops"] = fwd_flops(s_q, h_q, topk) / row["flashmla_ms"] / 1e9
        row["time_vs_flashmla"] = statistics.median(
            ours / theirs for ours, theirs in zip(ours_calls, fm_calls, strict=True)
        )
    return row


def torch_gather_einsum(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Baseline: chunked torch gather + bf16 einsum + fp32 softmax (what one writes without a kernel)."""
    out = torch.empty(q.shape[0], q.shape[1], D_V, dtype=q.dtype, device=q.device)
    for s0 in range(0, q.shape[0], 256):
        i = idx[s0 : s0 + 256, 0].long()
        valid = (i >= 0) & (i < kv.shape[0])
        rows = kv[:, 0][torch.where(valid, i, 0)]
        scores = torch.einsum("shd,std->sht", q[s0 : s0 + 256], rows).float() * sm_scale
        p = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), -1).to(q.dtype)
        out[s0 : s0 + 256] = torch.einsum("sht,std->shd", p, rows[..., :D_V])
    return out


def bench_torch_baseline(s_q: int, h_q: int, s_kv: int, topk: int) -> dict:
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk)
    ms = time_ms(lambda: torch_gather_einsum(q, kv, idx, 0.04), warmup=5, rep=100)
    return {"op": "fwd_torch_baseline", "s_q": s_q, "h_q": h_q, "s_kv": s_kv, "topk": topk, "backend": "torch",
            "ms": ms, "tflops": fwd_flops(s_q, h_q, topk) / ms / 1e9}  # fmt: skip


#: The forward variants of ``python bench_forward.py``: the default and the Gluon kernel forced persistent
#: (``on``) or not (``off``).
FWD_VARIANTS = {
    "default": Config(),
    "persistent on": Config(fwd_persistent="on"),
    "persistent off": Config(fwd_persistent="off"),
}
#: The attn_dist variants of ``python bench_forward.py`` (name, config, up to which h_q it applies).
ATTN_DIST_VARIANTS = [
    ("default", Config(), 128),
    ("cols", Config(attn_dist_split="cols"), 64),
    ("slot order", Config(attn_dist_order="slot"), 64),
    ("index order", Config(attn_dist_order="index"), 64),
]


def bench_fwd_variants(
    s_q: int, h_q: int, s_kv: int, topk: int, variants: dict[str, Config], *, flashmla: Any = None
) -> dict:
    """The forward with each config of ``variants`` (and FlashMLA's, if given) on the same inputs:
    ``{name: {"ms", "tflops", "out_max_abs_err"}}`` (the error on the first 32 queries against the float32
    reference), or ``{name: {"error": ...}}`` where a run failed."""
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk)
    sm_scale = 1 / math.sqrt(D_QK)
    r_out = sparse_mla_fwd_ref(q[:32].float(), kv.float(), idx[:32], sm_scale)[0]
    runs = {
        name: (lambda c=cfg: sparse_mla_fwd(q, kv, idx, sm_scale, config=c)) for name, cfg in variants.items()
    }
    if flashmla is not None:
        runs["FlashMLA"] = lambda: flashmla.flash_mla_sparse_fwd(q, kv, idx, sm_scale, D_V)
    row: dict[str, Any] = {"s_q": s_q, "h_q": h_q, "s_kv": s_kv, "topk": topk}
    for name, run in list(runs.items()):
        try:
            row[name] = {"out_max_abs_err": float((run()[0][:32].float() - r_out).abs().max())}
        except Exception as exc:  # a variant or shape that fails: printed, the others still run
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            del runs[name]
    # (all of them timed in turns, call by call: the same clocks for every variant)
    for name, calls in zip(runs, time_interleaved_ms(list(runs.values()), reps=FWD_REPS), strict=True):
        ms = statistics.median(calls)
        row[name].update(ms=ms, tflops=fwd_flops(s_q, h_q, topk) / ms / 1e9)
    return row


def main() -> None:
    import argparse
    import importlib
    import sys

    from bench_attn_dist import bench_attn_dist

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flashmla", default=None, help="folder holding FlashMLA's built flash_mla package")
    ap.add_argument("--quick", action="store_true", help="s_kv 8K and 128K only")
    a = ap.parse_args()
    flashmla = None
    if a.flashmla:
        sys.path.insert(0, a.flashmla)
        flashmla = importlib.import_module("flash_mla")
    s_q, topk = 4096, 2048
    for h_q in (128, 64):
        for s_kv in (8192, 131072) if a.quick else (8192, 32768, 131072):
            row = bench_fwd_variants(s_q, h_q, s_kv, topk, FWD_VARIANTS, flashmla=flashmla)
            fm = row.get("FlashMLA", {}).get("tflops")
            cells = []
            for name in (*FWD_VARIANTS, "FlashMLA"):
                r = row.get(name)
                if r is None:
                    continue
                if "error" in r:
                    cells.append(f"{name} ERROR {r['error']}")
                    continue
                ratio = f" ({r['tflops'] / fm:.3f}x)" if fm and name != "FlashMLA" else ""
                cells.append(f"{name} {r['tflops']:.0f}{ratio} err {r['out_max_abs_err']:.1e}")
            print(f"fwd h_q {h_q} s_kv {s_kv // 1024}K TFLOPS: " + " | ".join(cells), flush=True)
            best = min(
                (r["ms"] for n, r in row.items() if n in FWD_VARIANTS and "ms" in r), default=float("nan")
            )
            cells = []
            for name, cfg, max_h in ATTN_DIST_VARIANTS:
                if h_q > max_h:
                    continue
                ad = bench_attn_dist(s_q, h_q, s_kv, topk, fwd_ms=best, config=cfg)
                cells.append(
                    f"{name} {ad['ms']:.3f} ms = {ad['time_vs_fwd']:.3f}x err {ad['max_abs_err']:.1e}"
                )
            print(
                f"attn_dist h_q {h_q} s_kv {s_kv // 1024}K vs fastest fwd {best:.3f} ms: "
                + " | ".join(cells),
                flush=True,
            )


if __name__ == "__main__":
    main()
