"""Backward benchmark: sparse_mla_bwd (default and deterministic) at FlashMLA's shape.

TFLOPS are counted as 2.5x the forward's FLOPs, ``2.5 * 2 * s_q * h_q * topk * (d_qk + d_v)`` (the
backward recomputes QK^T and does four more products: 2.53x by exact count at d_qk 576, d_v 512).

    python packages/sparse-mla-attn/benchmarks/bench_backward.py --out-dir docs/benchmarks [--quick] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bwd_bench_common import (
    dense_matmul_tflops,
    kernel_resources,
    metadata,
    time_ms,
    update_results,
)

from sparse_mla_attn import backward as bwd_mod
from sparse_mla_attn.backward import sparse_mla_bwd, sparse_mla_bwd_ref

D_QK, D_V = 576, 512


def bwd_flops(s_q: int, h_q: int, topk: int) -> float:
    return 2.5 * 2.0 * s_q * h_q * topk * (D_QK + D_V)


def make_inputs(s_q: int, h_q: int, s_kv: int, topk: int, seed: int = 0):
    """Random bf16 q/kv/dout, distinct random indices per query, and out/lse from the package forward."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s_q, h_q, D_QK, device="cuda", generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, D_QK, device="cuda", generator=g).bfloat16()
    idx = torch.empty(s_q, 1, topk, dtype=torch.int32, device="cuda")
    for s0 in range(0, s_q, 256):  # distinct rows per query, as FlashMLA's benchmark draws them
        r = torch.rand(min(256, s_q - s0), s_kv, device="cuda", generator=g)
        idx[s0 : s0 + 256, 0] = r.topk(topk, dim=-1).indices.int()
    sm_scale = 1 / math.sqrt(D_QK)
    from sparse_mla_attn.forward import sparse_mla_fwd

    out, _, lse = sparse_mla_fwd(q, kv, idx, sm_scale, D_V)
    dout = torch.randn(s_q, h_q, D_V, device="cuda", generator=g).bfloat16()
    return q, kv, idx, out, lse, dout, sm_scale


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bench_shape(
    s_q: int,
    h_q: int,
    s_kv: int,
    topk: int,
    *,
    check: bool,
    config=None,
    det: bool = True,
    modes=(False, True),
) -> dict[str, Any]:
    q, kv, idx, out, lse, dout, sm_scale = make_inputs(s_q, h_q, s_kv, topk)
    run = lambda det: sparse_mla_bwd(
        q, kv, out, dout, idx, lse, sm_scale, D_V, deterministic=det, _config=config
    )
    row: dict[str, Any] = {"s_q": s_q, "h_q": h_q, "s_kv": s_kv, "topk": topk}
    res = {}
    row["det_ms"] = row["det_tflops"] = float("nan")
    for mode in modes if det else (False,):
        res[mode] = run(mode)
        ms = time_ms(lambda d=mode: run(d), warmup=10, rep=300)
        key = "det_" if mode else ""
        row[key + "ms"] = ms
        row[key + "tflops"] = bwd_flops(s_q, h_q, topk) / ms / 1e9
        row[key + "resources"] = {k: kernel_resources(v) for k, v in bwd_mod._BWD_LAST_COMPILED.items()}
    if not check:
        return row
    # The indexer target as a by-product of the backward, against the separate attn_dist pass.
    row["attn_sum_ms"] = time_ms(
        lambda: sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, D_V, return_attn_sum=True),
        warmup=10,
        rep=300,
    )
    row["attn_dist_ms"] = row["attn_sum_rel_err_vs_attn_dist"] = float("nan")
    try:  # the forward side's kernel, timed for comparison only
        from sparse_mla_attn.attn_dist import attn_dist

        a_sum = sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, D_V, return_attn_sum=True)[2]
        row["attn_sum_rel_err_vs_attn_dist"] = rel_err(
            a_sum, attn_dist(q, kv, idx, lse, sm_scale, causal=False)
        )
        row["attn_dist_ms"] = time_ms(
            lambda: attn_dist(q, kv, idx, lse, sm_scale, causal=False), warmup=10, rep=300
        )
    except Exception as exc:  # reported, not fatal
        print(f"attn_dist comparison failed: {type(exc).__name__}: {str(exc)[:200]}")
    again = run(True)
    ref_ms = time_ms(lambda: sparse_mla_bwd_ref(q, kv, out, dout, idx, lse, sm_scale, D_V), warmup=1, rep=1)
    dq_ref, dkv_ref = sparse_mla_bwd_ref(q, kv, out, dout, idx, lse, sm_scale, D_V)
    row["check"] = {
        "dq_rel_err": rel_err(res[False][0], dq_ref),
        "dkv_rel_err": rel_err(res[False][1], dkv_ref),
        "det_dq_rel_err": rel_err(res[True][0], dq_ref),
        "det_dkv_rel_err": rel_err(res[True][1], dkv_ref),
        "det_bit_identical": bool(
            torch.equal(again[0], res[True][0]) and torch.equal(again[1], res[True][1])
        ),
    }
    row["baseline"] = {
        "name": "sparse_mla_bwd_ref (float32 torch, chunked)",
        "s_q": s_q, "h_q": h_q, "topk": topk, "s_kv": s_kv,
        "ms": ref_ms, "tflops": bwd_flops(s_q, h_q, topk) / ref_ms / 1e9,
    }  # fmt: skip
    return row


# Alternatives timed for the record after the main benchmark, at the first row's shape: (changes from the
# default configuration, mode). SPLIT_DKV 0 is the fused kernel (dkv products per 64-head block inside the
# main kernel; the default before the separate dkv kernel, and still the path of h_q > 128). DKV_WRITE 1/2 are
# diagnostics with a wrong dkv (plain stores instead of atomics / no dkv update): they bound what the dkv
# accumulation costs.
SWEEP: list[tuple[dict[str, int], bool]] = [
    ({"SPLIT_DKV": 0}, False),
    ({"SPLIT_DKV": 0, "N_SUB": 2}, True),
    ({"N_CSPLIT": 1}, False),
    ({"BLOCK_T_DKV": 128, "num_warps_dkv": 8, "chunk_stages_dkv": 3, "N_CSPLIT": 1}, False),
    ({"BLOCK_T_DKV": 64, "num_warps_dkv": 4, "chunk_stages_dkv": 2, "N_CSPLIT": 2}, True),
    ({"DKV_WRITE": 1}, False),
    ({"DKV_WRITE": 2}, False),
]


def kernel_breakdown(
    s_q: int, h_q: int, s_kv: int, topk: int, det: bool, n_calls: int = 5
) -> dict[str, float]:
    """Device time per kernel (ms per backward call) from the torch profiler, default configuration."""
    q, kv, idx, out, lse, dout, sm_scale = make_inputs(s_q, h_q, s_kv, topk)
    run = lambda: sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, D_V, deterministic=det)
    run()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n_calls):
            run()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if t > 0:
            times[ev.key] = times.get(ev.key, 0.0) + t / 1e3 / n_calls
    return dict(sorted(times.items(), key=lambda kv_: -kv_[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=None, help="write sparse-mla-attn-training.json/.md here")
    ap.add_argument("--quick", action="store_true", help="only the main shape")
    ap.add_argument("--sweep", action="store_true", help="also time alternative kernel configurations")
    ap.add_argument(
        "--configs",
        default=None,
        help="tuning: JSON list of [config, deterministic] pairs timed after the main rows (with --quick), "
        "printed only",
    )
    a = ap.parse_args()
    meta = metadata()
    peak = dense_matmul_tflops()
    print(f"{meta['device']}: dense bf16 matmul {peak:.0f} TFLOPS")
    shapes = [(4096, 128, 32768, 2048)]
    if not a.quick:
        shapes += [(4096, 64, 32768, 2048), (4096, 128, 8192, 2048), (4096, 128, 131072, 2048)]
    rows = []
    for i, (s_q, h_q, s_kv, topk) in enumerate(shapes):
        r = bench_shape(s_q, h_q, s_kv, topk, check=(i == 0))
        rows.append(r)
        print(
            f"s_q {s_q} h_q {h_q} s_kv {s_kv} topk {topk}: default {r['ms']:.2f} ms {r['tflops']:.0f} TFLOPS "
            f"({100 * r['tflops'] / peak:.0f}% of matmul); deterministic {r['det_ms']:.2f} ms "
            f"{r['det_tflops']:.0f} TFLOPS ({r['det_ms'] / r['ms']:.2f}x)"
        )
    if a.configs:
        for cfg, det in json.loads(a.configs):
            r = bench_shape(4096, 128, 32768, 2048, check=False, config=cfg, det=det, modes=(det,))
            key = "det_" if det else ""
            print(f"config {cfg} deterministic={det}: {r[key + 'ms']:.2f} ms {r[key + 'tflops']:.0f} TFLOPS "
                  f"{r[key + 'resources']}")  # fmt: skip
        return
    first = rows[0]
    if "check" in first:
        print(f"check: {first['check']}")
        print(
            f"attn_sum by-product: backward {first['attn_sum_ms']:.2f} ms with it vs {first['ms']:.2f} without; "
            f"separate attn_dist {first['attn_dist_ms']:.2f} ms; rel. err. {first['attn_sum_rel_err_vs_attn_dist']:.1e}"
        )
        print(f"baseline: {first['baseline']['name']} {first['baseline']['ms']:.1f} ms")
    data = {
        "meta": meta,
        "d_qk": D_QK,
        "d_v": D_V,
        "flops_formula": "2.5 * 2 * s_q * h_q * topk * (d_qk + d_v)",
        "dense_matmul_tflops": peak,
        "rows": rows,
        "check": first.get("check"),
        "baseline": first.get("baseline"),
    }
    if a.sweep:
        data["sweep"] = []
        for det in (False, True):
            try:
                bd = kernel_breakdown(4096, 128, 32768, 2048, det)
            except Exception as exc:  # the profiler is a diagnostic: report, do not fail the benchmark
                print(f"breakdown (deterministic={det}) failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            data["breakdown" + ("_det" if det else "")] = bd
            print(f"breakdown (deterministic={det}), ms per call: {bd}")
        for cfg, det in SWEEP:
            try:
                r = bench_shape(4096, 128, 32768, 2048, check=False, config=cfg, det=det, modes=(det,))
            except Exception as exc:  # a config that does not compile or fit is reported, not fatal
                print(f"sweep {cfg}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            key = "det_" if det else ""
            data["sweep"].append(
                {"config": cfg, "deterministic": det, "ms": r[key + "ms"], "tflops": r[key + "tflops"],
                 "resources": r[key + "resources"]}
            )  # fmt: skip
            print(
                f"sweep {cfg} deterministic={det}: {r[key + 'ms']:.2f} ms {r[key + 'tflops']:.0f} TFLOPS; "
                f"{r[key + 'resources']}"
            )
    update_results(a.out_dir, "backward", data)


if __name__ == "__main__":
    main()
