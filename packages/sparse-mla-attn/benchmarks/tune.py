"""Tile-variant sweep for the forward, attn_dist and decode kernels (correctness + time per variant).

Writes every measurement to ``--out`` (JSON) and prints one line per variant. NOTES.md records what each
sweep measured and which variant became the default.

    python packages/sparse-mla-attn/benchmarks/tune.py --out /tmp/tune.json [--only fwd,attn_dist,decode,fwd_ab,ad_ab]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback

import torch
from bench_attn_dist import bench_attn_dist
from bench_decode import bench_decode
from bench_forward import (
    bench_fwd,
    check_rows,
    dense_matmul_tflops,
    fwd_flops,
    kernel_resources,
    make_inputs,
    time_ms,
)

# Forward: the Gluon kernel (warp-specialised ping-pong, the default on sm_90 since sweep 12) against the
# Triton kernel. The variants of sweeps 7-11 (G_S_FIRST, G_WG_STATS, G_QROPE_REG, G_PINGPONG) belonged to
# the earlier Gluon forward, removed at sweep 12: tune.py up to 202dd67 runs them.
FWD_VARIANTS = [{"GLUON": True}, {"GLUON": False}]
FWD_SHAPES = [(128, 8192), (128, 131072), (64, 32768)]
ATTN_DIST_VARIANTS = [{"GLUON": True, "G_WS": 2}, {"GLUON": True, "G_WS": 1}, {"GLUON": False}]
ATTN_DIST_SHAPES = [(128, 8192), (128, 131072)]
DECODE_VARIANTS = [{"GLUON": False}, {"GLUON": True}]

# Interleaved A/B of two forward configurations on one set of inputs per shape (the same kernel varies
# 5-15% between timings: sweep 10 follow-up). Sweep 11 compared G_PINGPONG with the earlier Gluon forward;
# sweep 12 the producer's L2 prefetch of the next block's rows (G_PREFETCH_L2 at 80ac143: 11-15% slower,
# removed). Sweep 15 (8814d12: G_BLOCK_XOR 0/2/4/8, the odd head tile reading its blocks in the order
# b ^ xor; no gain, removed) ran the variants of tune.py at that commit.
AB_VARIANTS = {"gluon": {"GLUON": True}, "triton": {"GLUON": False}}
AB_SHAPES = [(128, 8192), (128, 32768), (128, 131072), (64, 131072)]


# Sweeps 13-14: the warp-specialised attn_dist, timed alternately with the default forward at the same
# shape (the target is attn_dist <= 0.6x the forward). Sweep 13 (913a686) compared it (without turns, then
# the default) with the earlier Gluon kernel (G_WS 0) and the alternate-block split at h_q 64
# (results/tune13.log); sweep 14: consumers issuing S by turns (G_WS 2) against no turns (G_WS 1).
AD_AB_VARIANTS = {
    "ad_ws": {"GLUON": True, "G_WS": 2},
    "ad_ws_noturns": {"GLUON": True, "G_WS": 1},
}  # (G_WS 0, the earlier kernel, was removed after sweep 14: tune.py at 913a686 runs it)
AD_AB_SHAPES = [(128, 8192), (128, 32768), (128, 131072)]  # sweep 13 also ran (64, 32768)


def _alternate(row: dict, calls: dict, reps: int) -> None:
    """Time ``calls`` (name -> fn) alternately ``reps`` times (do_bench median each); keep every timing
    and the median per name in ``row["variants"]``."""
    for name in calls:
        row["variants"][name]["ms_all"] = []
    for _ in range(reps):
        for name, fn in calls.items():
            row["variants"][name]["ms_all"].append(round(time_ms(fn), 4))
    for v in row["variants"].values():
        v["ms"] = statistics.median(v["ms_all"])


def _ab_shape(row: dict, s_q: int, h_q: int, s_kv: int, reps: int) -> None:
    from sparse_mla_attn.forward import sparse_mla_fwd_impl

    q, kv, idx = make_inputs(s_q, h_q, s_kv, 2048)
    sm_scale = 1 / math.sqrt(576)
    calls = {}
    for name, cfg in AB_VARIANTS.items():
        got = sparse_mla_fwd_impl(q, kv, idx, sm_scale, config=cfg)
        torch.cuda.synchronize()
        row["variants"][name] = {"config": cfg, **check_rows(got, q, kv, idx, sm_scale)}
        row["variants"][name].update(kernel_resources("fwd"))
        calls[name] = lambda cfg=cfg: sparse_mla_fwd_impl(q, kv, idx, sm_scale, config=cfg)
    _alternate(row, calls, reps)
    for v in row["variants"].values():
        v["tflops"] = fwd_flops(s_q, h_q, 2048) / v["ms"] / 1e9


def _ad_ab_shape(row: dict, s_q: int, h_q: int, s_kv: int, reps: int) -> None:
    from sparse_mla_attn import attn_dist_ref
    from sparse_mla_attn.attn_dist import attn_dist_impl
    from sparse_mla_attn.forward import sparse_mla_fwd_impl

    q, kv, idx = make_inputs(s_q, h_q, s_kv, 2048)
    sm_scale = 1 / math.sqrt(576)
    start = max(0, s_kv - s_q)  # as bench_attn_dist: causal limit in play
    _, _, lse = sparse_mla_fwd_impl(q, kv, idx, sm_scale, causal=True, q_start_index=start)
    ref = attn_dist_ref(q[:32], kv, idx[:32], lse[:32], sm_scale, q_start_index=start)
    calls = {"fwd": lambda: sparse_mla_fwd_impl(q, kv, idx, sm_scale)}  # as bench_fwd (run.py's ratio)
    row["variants"]["fwd"] = {}
    variants = {n: c for n, c in AD_AB_VARIANTS.items() if h_q <= 64 or "G_SPLIT64" not in c}
    for name, cfg in variants.items():
        calls[name] = lambda cfg=cfg: attn_dist_impl(
            q, kv, idx, lse, sm_scale, q_start_index=start, config=cfg
        )
        got, again = calls[name](), calls[name]()
        row["variants"][name] = {
            "config": cfg,
            "max_abs_err": float((got[:32] - ref).abs().max()),
            "row_sum_err": float((got.sum(-1) - h_q).abs().max()),
            "deterministic": bool(torch.equal(got, again)),
            **kernel_resources("attn_dist"),
        }
    _alternate(row, calls, reps)
    for name in variants:
        row["variants"][name]["ratio_to_fwd"] = row["variants"][name]["ms"] / row["variants"]["fwd"]["ms"]


def ab_fwd(results: list, s_q: int, reps: int, label: str = "fwd_ab") -> None:
    """Per shape: check each variant on 32 rows against the reference, then time them alternately
    ``reps`` times (do_bench median each); record every timing and the median per variant. ``label``
    "ad_ab": the attn_dist variants of ``AD_AB_VARIANTS`` with the forward."""
    shapes, one_shape = (AB_SHAPES, _ab_shape) if label == "fwd_ab" else (AD_AB_SHAPES, _ad_ab_shape)
    for h_q, s_kv in shapes:
        row: dict = {"label": label, "s_q": s_q, "h_q": h_q, "s_kv": s_kv, "topk": 2048, "variants": {}}
        try:
            one_shape(row, s_q, h_q, s_kv, reps)
            print(
                f"{label} h{h_q} kv{s_kv}: "
                + "; ".join(
                    f"{n} {v['ms']:.3f} ms {v['ms_all']} "
                    + " ".join(f"{k}={v[k]}" for k in v if k not in ("ms", "ms_all", "config", "wgmma"))
                    for n, v in row["variants"].items()
                ),
                flush=True,
            )
        except Exception as e:  # recorded, not fatal (e.g. a variant that fails to compile on the device)
            row["error"] = repr(e)[:500]
            print(f"{label} h{h_q} kv{s_kv} FAILED {repr(e)[:300]}", flush=True)
            traceback.print_exc(limit=2)
        results.append(row)
        torch.cuda.empty_cache()


def profile_kernels(fn, label: str, iters: int = 20) -> None:
    """Per-kernel CUDA time of ``fn`` (torch.profiler), to see where a multi-kernel call spends it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.device_time_total > 0:
            print(
                f"  profile {label}: {e.key[:60]:60s} {e.device_time_total / iters:9.1f} us/call", flush=True
            )


def run(label: str, fn, results: list, **kw) -> None:
    t0 = time.time()
    try:
        r = fn(**kw)
        r["label"] = label
        r["wall_s"] = round(time.time() - t0, 1)
        results.append(r)
        errs = {k: f"{v:.1e}" for k, v in r.items() if "err" in k}
        print(
            f"{label:10s} {kw!s:90s} {r['ms']:8.3f} ms (eager {r.get('ms_eager', r['ms']):.3f}) "
            f"{r['tflops']:6.0f} TF regs={r.get('n_regs')} "
            f"spills={r.get('n_spills')} smem={r.get('shared_bytes')} wgmma={r.get('wgmma')} {errs}",
            flush=True,
        )
    except (
        Exception
    ) as e:  # a variant that does not compile (e.g. out of shared memory) is recorded, not fatal
        results.append({"label": label, "args": repr(kw), "error": repr(e)[:500]})
        print(f"{label:10s} {kw!s:90s} FAILED {repr(e)[:300]}", flush=True)
        traceback.print_exc(limit=1)
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="fwd,attn_dist,decode")
    ap.add_argument("--s-q", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3, help="fwd_ab: alternations per shape")
    a = ap.parse_args()
    only = set(a.only.split(","))
    results: list = [{"device": torch.cuda.get_device_name(), "dense_bf16_tflops": dense_matmul_tflops()}]
    print(results[0], flush=True)
    for label in ("fwd_ab", "ad_ab"):
        if label in only:
            ab_fwd(results, a.s_q, a.reps, label)
    if "fwd" in only:
        for cfg in FWD_VARIANTS:
            for h_q, s_kv in FWD_SHAPES:
                run("fwd", bench_fwd, results, s_q=a.s_q, h_q=h_q, s_kv=s_kv, topk=2048, config=cfg)
    if "attn_dist" in only:
        for cfg in ATTN_DIST_VARIANTS:
            for h_q, s_kv in ATTN_DIST_SHAPES:
                run(
                    "attn_dist",
                    bench_attn_dist,
                    results,
                    s_q=a.s_q,
                    h_q=h_q,
                    s_kv=s_kv,
                    topk=2048,
                    config=cfg,
                )
    if "decode" in only:
        for b, seqlen in ((64, 32768), (128, 32768)):
            for cfg in DECODE_VARIANTS:
                run("decode", bench_decode, results, b=b, h_q=128, seqlen=seqlen, topk=2048, config=cfg)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
