"""attn_dist benchmark: time against the forward at the same shape (target: <= 0.6x the forward's time).

python packages/sparse-mla-attn/benchmarks/bench_attn_dist.py [--s-q 4096 --h-q 128 --s-kv 8192 --topk 2048]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from bench_forward import D_QK, check_rows, kernel_resources, make_inputs, time_ms

from sparse_mla_attn import attn_dist_ref
from sparse_mla_attn.attn_dist import attn_dist_impl
from sparse_mla_attn.forward import sparse_mla_fwd_impl


def attn_dist_flops(s_q: int, h_q: int, topk: int, d_qk: int = D_QK) -> float:
    return 2.0 * s_q * h_q * topk * d_qk


def bench_attn_dist(
    s_q: int, h_q: int, s_kv: int, topk: int, *, config: dict | None = None, check: bool = True
) -> dict:
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk)
    sm_scale = 1 / math.sqrt(D_QK)
    start = max(0, s_kv - s_q)  # queries at the end of the sequence (causal limit in play)
    _, _, lse = sparse_mla_fwd_impl(q, kv, idx, sm_scale, causal=True, q_start_index=start)
    got = attn_dist_impl(q, kv, idx, lse, sm_scale, q_start_index=start, config=config)
    res: dict[str, Any] = {"s_q": s_q, "h_q": h_q, "s_kv": s_kv, "topk": topk, "config": config}
    if check:
        ref = attn_dist_ref(q[:32], kv, idx[:32], lse[:32], sm_scale, q_start_index=start)
        res["max_abs_err"] = float((got[:32] - ref).abs().max())
        res["row_sum_err"] = float((got.sum(-1) - h_q).abs().max())
    res.update(kernel_resources("attn_dist"))
    ms = time_ms(lambda: attn_dist_impl(q, kv, idx, lse, sm_scale, q_start_index=start, config=config))
    res.update(ms=ms, tflops=attn_dist_flops(s_q, h_q, topk) / ms / 1e9)
    return res


__all__ = ["bench_attn_dist", "check_rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--s-q", type=int, default=4096)
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--s-kv", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=2048)
    a = ap.parse_args()
    r = bench_attn_dist(a.s_q, a.h_q, a.s_kv, a.topk)
    print(f"attn_dist {r['ms']:.3f} ms  {r['tflops']:.0f} TFLOPS  max_abs_err {r['max_abs_err']:.2e}")


if __name__ == "__main__":
    main()
