"""Indexer benchmark: the Triton ``indexer_logits`` forward and backward at DeepSeek-V3.2's indexer shape
(h_idx 64, d_idx 128). FLOPs ``2 * pairs * h_idx * d_idx`` (causal: only the unmasked pairs); the backward
counts the minimum three such products."""

from __future__ import annotations

from typing import Any

import torch
from bench_forward import time_ms

from sparse_mla_attn import indexer_logits, indexer_logits_ref
from sparse_mla_attn.indexer import launch_logits_bwd


def bench_indexer(s_q: int, h: int, d: int, s_kv: int, causal: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s_q, h, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(s_kv, d, device="cuda", generator=g).bfloat16()
    w = torch.randn(s_q, h, device="cuda", generator=g)
    q_start = s_kv - s_q if causal else 0  # causal: the last s_q tokens of the sequence, as in prefill
    run = lambda: indexer_logits(q, k, w, causal=causal, q_start_index=q_start)
    got = run()
    ref = indexer_logits_ref(q[:64], k, w[:64], causal=causal, q_start_index=q_start)
    fin = torch.isfinite(ref)
    pairs = s_q * s_kv if not causal else sum(min(s_kv, q_start + t + 1) for t in range(s_q))
    flops = 2.0 * pairs * h * d
    ms = time_ms(run)
    grad = torch.randn(s_q, s_kv, device="cuda", generator=g)
    bwd_ms = time_ms(lambda: launch_logits_bwd(grad, q, k, w, causal, q_start, 1), warmup=5, rep=100)
    row: dict[str, Any] = {
        "op": "indexer_logits", "s_q": s_q, "h_idx": h, "d_idx": d, "s_kv": s_kv, "causal": causal,
        "backend": "triton", "ms": ms, "tflops": flops / ms / 1e9,
        "bwd_ms": bwd_ms, "bwd_tflops": 3 * flops / bwd_ms / 1e9,
        "max_rel_err_first64": float((got[:64][fin] - ref[fin]).abs().max() / ref[fin].abs().max()),
    }  # fmt: skip
    return row
