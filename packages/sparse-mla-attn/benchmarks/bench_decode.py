"""Decode benchmark: one new token per sequence over a paged bf16 cache (block 64), timed as a CUDA-graph
replay (``ms``) and as plain calls (``ms_eager``, host launch cost included)."""

from __future__ import annotations

import math
from typing import Any

import torch
from bench_forward import D_QK, _config_label, fwd_flops, time_ms

from sparse_mla_attn import Config, sparse_mla_decode, sparse_mla_decode_ref
from sparse_mla_attn._runtime import last_launch


def make_decode_inputs(
    b: int, h_q: int, seqlen: int, topk: int, block_size: int = 64
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = math.ceil(seqlen / block_size)
    num_blocks = b * blocks_per_seq
    q = torch.randn(b, 1, h_q, D_QK, device="cuda", generator=g).bfloat16()
    cache = torch.randn(num_blocks, block_size, 1, D_QK, device="cuda", generator=g).bfloat16()
    block_table = torch.randperm(num_blocks, device="cuda", generator=g).view(b, blocks_per_seq).int()
    cache_seqlens = torch.full((b,), seqlen, dtype=torch.int32, device="cuda")
    noise = torch.rand(b, seqlen, device="cuda", generator=g)
    indices = noise.topk(min(topk, seqlen), -1).indices.int().view(b, 1, -1)
    return q, cache, block_table, cache_seqlens, indices


def bench_decode(b: int, h_q: int, seqlen: int, topk: int, *, config: Config | None = None) -> dict:
    args = make_decode_inputs(b, h_q, seqlen, topk)
    sm_scale = 1 / math.sqrt(D_QK)
    call = lambda: sparse_mla_decode(*args, sm_scale, config=config)
    out, lse = call()
    launch = last_launch("fwd")
    q, cache, table, seqlens, idx = args
    r_out, r_lse = sparse_mla_decode_ref(q[:4], cache, table[:4], seqlens[:4], idx[:4], sm_scale)
    ms = time_ms(call, graph=True)
    row: dict[str, Any] = {
        "op": "decode", "batch": b, "h_q": h_q, "seqlen": seqlen, "topk": topk, "config": _config_label(config),
        "backend": launch.backend if launch else None, "splits": launch.splits if launch else None,
        "ms": ms, "ms_eager": (eager := time_ms(call)), "eager_over_graph": eager / ms,
        "tflops": fwd_flops(b, h_q, topk) / ms / 1e9,
        "out_max_abs_err": float((out[:4].float() - r_out.float()).abs().max()),
        "lse_max_abs_err": float((lse[:4] - r_lse).abs().max()),
    }  # fmt: skip
    return row


def bench_host_cost(n_calls: int = 300) -> list[dict]:
    """Host cost per call of each public op: a tiny problem (one token, 64 slots) whose GPU time is a few
    microseconds, called back to back with default arguments; wall time per call with one synchronisation
    at the end. ``sparse_mla`` is one forward and backward through autograd."""
    import time

    from bench_forward import make_inputs

    import sparse_mla_attn as sm

    q, kv, idx = make_inputs(1, 128, 4096, 64)
    out, _, lse = sm.sparse_mla_fwd(q, kv, idx, 0.04)
    dec = make_decode_inputs(1, 128, 4096, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    q_idx = torch.randn(1, 64, 128, device="cuda", generator=g).bfloat16()
    k_idx = torch.randn(4096, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(1, 64, device="cuda", generator=g)
    logits = sm.indexer_logits(q_idx, k_idx, w)
    attn = sm.attn_dist(q, kv, idx, lse, 0.04)
    at = sm.indexer_logits_at(q_idx, k_idx, w, idx)
    q_g, kv_g = q.clone().requires_grad_(), kv.clone().requires_grad_()

    def train_step() -> None:
        sm.sparse_mla(q_g, kv_g, idx, 0.04).sum().backward()

    calls = {
        "sparse_mla_fwd": lambda: sm.sparse_mla_fwd(q, kv, idx, 0.04),
        "attn_dist": lambda: sm.attn_dist(q, kv, idx, lse, 0.04),
        "sparse_mla_decode": lambda: sm.sparse_mla_decode(*dec, 0.04),
        "sparse_mla_bwd": lambda: sm.sparse_mla_bwd(q, kv, out, out, idx, lse, 0.04),
        "sparse_mla": train_step,
        "indexer_logits": lambda: sm.indexer_logits(q_idx, k_idx, w),
        "indexer_topk": lambda: sm.indexer_topk(logits, 64),
        "indexer_logits_at": lambda: sm.indexer_logits_at(q_idx, k_idx, w, idx),
        "indexer_target": lambda: sm.indexer_target(attn),
        "indexer_kl_loss": lambda: sm.indexer_kl_loss(at, attn),
    }
    rows = []
    for name, call in calls.items():
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_calls):
            call()
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / n_calls * 1e6
        rows.append(
            {"op": "host_cost", "function": name, "us_per_call": us, "shape": "s_q 1, h_q 128, topk 64"}
        )
    return rows
