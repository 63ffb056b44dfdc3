"""Indexer benchmark: the Triton indexer_logits forward and backward against their rooflines and torch.

Forward: FLOPs ``2 * pairs * h_idx * d_idx``; roofline time = max(FLOPs / measured dense bf16 matmul rate,
bytes / measured copy rate), bytes = q + k + weights once + fp32 logits once. Backward: the minimum is three
such products (z = q·k, dq, dk; the kernels do four, recomputing z in each), bytes = the fp32 upstream
gradient + q + k + weights read once + dq + dk + dweights written once; baseline the former chunked float32
torch backward.

    python packages/sparse-mla-attn/benchmarks/bench_indexer.py --out-dir docs/benchmarks [--sweep]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bwd_bench_common import (
    copy_bandwidth_gbs,
    dense_matmul_tflops,
    metadata,
    time_ms,
    update_results,
)

from sparse_mla_attn.indexer import (
    _indexer_logits_bwd,
    _indexer_logits_bwd_torch,
    _indexer_logits_fwd,
    indexer_logits_ref,
)


def torch_bf16_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Baseline: chunked bf16 matmul per token block, ReLU, weighted sum over heads in fp32."""
    s_q, h, d = q.shape
    out = torch.empty(s_q, k.shape[0], dtype=torch.float32, device=q.device)
    for s0 in range(0, s_q, chunk):
        z = (q[s0 : s0 + chunk].reshape(-1, d) @ k.T).view(-1, h, k.shape[0])
        out[s0 : s0 + chunk] = torch.einsum("shn,sh->sn", torch.relu(z).float(), w[s0 : s0 + chunk])
    return out


def bench_indexer(s_q, h, d, s_kv, causal, peak, bw, config=None) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s_q, h, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(s_kv, d, device="cuda", generator=g).bfloat16()
    w = torch.randn(s_q, h, device="cuda", generator=g)
    # Causal: the queries are the last s_q tokens of the sequence, as in prefill of a long prompt.
    q_start = s_kv - s_q if causal else 0
    run = lambda: _indexer_logits_fwd(q, k, w, causal, q_start, 1, config)
    got = run()
    ref = indexer_logits_ref(q[:64], k, w[:64], causal=causal, q_start_index=q_start)
    fin = torch.isfinite(ref)
    err = float((got[:64][fin] - ref[fin]).abs().max() / ref[fin].abs().max())
    ms = time_ms(run)
    pairs = s_q * s_kv if not causal else sum(min(s_kv, q_start + t + 1) for t in range(s_q))
    flops = 2.0 * pairs * h * d  # causal: only the unmasked (query, key) pairs count
    n_bytes = q.numel() * 2 + k.numel() * 2 + w.numel() * 4 + s_q * s_kv * 4
    roof = max(flops / peak / 1e9, n_bytes / bw / 1e6)
    torch_ms = time_ms(lambda: torch_bf16_logits(q, k, w), warmup=3, rep=50) if not causal else float("nan")
    return {
        "s_q": s_q, "h_idx": h, "d_idx": d, "s_kv": s_kv, "causal": causal, "config": config,
        "ms": ms, "tflops": flops / ms / 1e9, "roofline_ms": roof, "bytes": n_bytes,
        "max_rel_err_first64": err, "torch_ms": torch_ms,
    }  # fmt: skip


def bench_indexer_bwd(s_q, h, d, s_kv, causal, peak, bw, config=None, baseline=True) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(s_q, h, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(s_kv, d, device="cuda", generator=g).bfloat16()
    w = torch.randn(s_q, h, device="cuda", generator=g)
    q_start = s_kv - s_q if causal else 0
    grad = torch.randn(s_q, s_kv, device="cuda", generator=g)
    if causal:  # the torch baseline needs 0 at masked entries; the kernels ignore them
        max_k = q_start + torch.arange(s_q, device="cuda")
        grad = grad.masked_fill(torch.arange(s_kv, device="cuda")[None, :] > max_k[:, None], 0.0)
    run = lambda: _indexer_logits_bwd(grad, q, k, w, causal, q_start, 1, config=config)
    got = run()
    ms = time_ms(run, warmup=5, rep=100)
    pairs = s_q * s_kv if not causal else sum(min(s_kv, q_start + t + 1) for t in range(s_q))
    flops_min = 3 * 2.0 * pairs * h * d
    n_bytes = grad.numel() * 4 + 2 * (q.numel() * 2 + k.numel() * 2 + w.numel() * 4)
    roof = max(flops_min / peak / 1e9, n_bytes / bw / 1e6)
    row = {
        "s_q": s_q, "h_idx": h, "d_idx": d, "s_kv": s_kv, "causal": causal, "config": config,
        "ms": ms, "tflops_min": flops_min / ms / 1e9, "tflops_executed": 4 / 3 * flops_min / ms / 1e9,
        "roofline_ms": roof, "bytes": n_bytes, "torch_ms": float("nan"),
    }  # fmt: skip
    if baseline:
        ref = _indexer_logits_bwd_torch(grad, q, k, w)
        row["rel_err_vs_torch_fp32"] = {
            n: float((a.double() - b.double()).norm() / b.double().norm())
            for n, a, b in zip(("dq_idx", "dk_idx", "dweights"), got, ref, strict=True)
        }
        again = run()
        row["bit_identical_rerun"] = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
        if not causal:
            row["torch_ms"] = time_ms(lambda: _indexer_logits_bwd_torch(grad, q, k, w), warmup=1, rep=3)
    return row


BWD_SWEEP = [
    {"TOK_DQ": 2, "BLOCK_N_DQ": 64, "num_warps_dq": 8},
    {"BLOCK_N_DQ": 64, "num_stages_dq": 4},
    {"BLOCK_N_DQ": 128, "num_stages_dq": 2},
    {"BLOCK_N_DK": 128, "num_warps_dk": 8},
    {"BLOCK_N_DK": 64, "num_stages_dk": 4},
    {"BLOCK_N_DK": 32, "num_stages_dk": 4},
    {"TOK_DK": 2, "BLOCK_N_DK": 64, "num_warps_dk": 8},
]


SWEEP = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3},
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--sweep", action="store_true", help="time forward tile configurations, write nothing")
    ap.add_argument(
        "--bwd-sweep", action="store_true", help="time backward tile configurations, write nothing"
    )
    a = ap.parse_args()
    meta = metadata()
    peak, bw = dense_matmul_tflops(), copy_bandwidth_gbs()
    print(f"{meta['device']}: dense bf16 matmul {peak:.0f} TFLOPS, copy {bw:.0f} GB/s")
    if a.sweep:
        for cfg in SWEEP:
            try:
                r = bench_indexer(4096, 64, 128, 32768, False, peak, bw, cfg)
            except Exception as exc:
                print(f"indexer sweep {cfg}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            print(
                f"indexer sweep {cfg}: {r['ms']:.3f} ms {r['tflops']:.0f} TFLOPS err {r['max_rel_err_first64']:.1e}"
            )
        return
    if a.bwd_sweep:
        base = bench_indexer_bwd(4096, 64, 128, 32768, False, peak, bw, baseline=False)
        print(f"indexer bwd default: {base['ms']:.3f} ms")
        for cfg in BWD_SWEEP:
            try:
                r = bench_indexer_bwd(4096, 64, 128, 32768, False, peak, bw, cfg, baseline=False)
            except Exception as exc:
                print(f"indexer bwd sweep {cfg}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            print(f"indexer bwd sweep {cfg}: {r['ms']:.3f} ms ({base['ms'] / r['ms']:.2f}x the default)")
        return
    rows = []
    for causal in (False, True):
        r = bench_indexer(4096, 64, 128, 32768, causal, peak, bw)
        rows.append(r)
        print(
            f"indexer s_q 4096 h 64 d 128 s_kv 32768 causal={causal}: {r['ms']:.3f} ms {r['tflops']:.0f} TFLOPS, "
            f"{100 * r['roofline_ms'] / r['ms']:.0f}% of roofline; torch bf16 {r['torch_ms']:.3f} ms; "
            f"err {r['max_rel_err_first64']:.1e}"
        )
    bwd_rows = []
    for causal in (False, True):
        r = bench_indexer_bwd(4096, 64, 128, 32768, causal, peak, bw)
        bwd_rows.append(r)
        print(
            f"indexer bwd causal={causal}: {r['ms']:.3f} ms, {r['tflops_min']:.0f} TFLOPS (3 products), "
            f"{100 * r['roofline_ms'] / r['ms']:.0f}% of roofline; torch fp32 {r['torch_ms']:.1f} ms; "
            f"err {r['rel_err_vs_torch_fp32']}; bit-identical rerun {r['bit_identical_rerun']}"
        )
    update_results(
        a.out_dir,
        "indexer",
        {"meta": meta, "dense_matmul_tflops": peak, "copy_gbs": bw, "rows": rows, "bwd_rows": bwd_rows},
    )


if __name__ == "__main__":
    main()
