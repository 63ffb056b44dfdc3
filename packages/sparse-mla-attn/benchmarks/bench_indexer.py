"""Indexer benchmark: the Triton indexer_logits forward against its roofline and a torch bf16 baseline.

FLOPs ``2 * s_q * s_kv * h_idx * d_idx``; roofline time = max(FLOPs / measured dense bf16 matmul rate,
bytes / measured copy rate), bytes = q + k + weights once + fp32 logits once.

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

from sparse_mla_attn.indexer import _indexer_logits_fwd, indexer_logits_ref


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
    ap.add_argument("--sweep", action="store_true")
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
    rows = []
    for causal in (False, True):
        r = bench_indexer(4096, 64, 128, 32768, causal, peak, bw)
        rows.append(r)
        print(
            f"indexer s_q 4096 h 64 d 128 s_kv 32768 causal={causal}: {r['ms']:.3f} ms {r['tflops']:.0f} TFLOPS, "
            f"{100 * r['roofline_ms'] / r['ms']:.0f}% of roofline; torch bf16 {r['torch_ms']:.3f} ms; "
            f"err {r['max_rel_err_first64']:.1e}"
        )
    update_results(
        a.out_dir, "indexer", {"meta": meta, "dense_matmul_tflops": peak, "copy_gbs": bw, "rows": rows}
    )


if __name__ == "__main__":
    main()
