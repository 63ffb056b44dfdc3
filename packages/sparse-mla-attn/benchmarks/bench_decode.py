"""Decode benchmark: one new token per sequence over a paged bf16 cache (block 64).

Each row times one call captured in a CUDA graph and replayed (``ms``) and the eager call (``ms_eager``),
both as ``triton.testing.do_bench`` times them: CUDA events around each call, the L2 cache flushed before
it, so the two differ only by what the eager call adds on the GPU (launch gaps; host time beyond the
flush's). ``ms_eager_idle`` is the eager call started from an idle GPU (its whole host cost counts) and
``ms_graph_warm`` back-to-back graph replays with the data left in L2 (``do_bench_cudagraph``). ``merge``
and ``graph_merge`` say who merged the split-K partials in the eager and the captured call.

``python bench_decode.py`` prints the decode rows at h_q 128 (batch 1 / 8 / 64, with each split-K merge
forced at batch 1 and 8) and every public op's host cost per call, in about a minute.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from bench_forward import D_QK, _config_label, capture_graph, fwd_flops, time_ms, time_ms_idle

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
    call()  # a signature's first call
    graph = capture_graph(call)
    graph_launch = last_launch("fwd")
    out, lse = call()  # eager
    launch = last_launch("fwd")
    q, cache, table, seqlens, idx = args
    r_out, r_lse = sparse_mla_decode_ref(q[:4], cache, table[:4], seqlens[:4], idx[:4], sm_scale)
    ms = time_ms(graph.replay)
    eager = time_ms(call)
    row: dict[str, Any] = {
        "op": "decode", "batch": b, "h_q": h_q, "seqlen": seqlen, "topk": topk, "config": _config_label(config),
        "backend": launch.backend if launch else None, "splits": launch.splits if launch else None,
        "merge": launch.merge if launch else None, "graph_merge": graph_launch.merge if graph_launch else None,
        "ms": ms, "ms_eager": eager, "eager_over_graph": eager / ms, "ms_eager_idle": time_ms_idle(call),
        "ms_graph_warm": time_ms(call, graph=True, rep=50), "tflops": fwd_flops(b, h_q, topk) / ms / 1e9,
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

    dec_split = make_decode_inputs(1, 128, 32768, 2048)  # the split-K decode of batch 1
    calls = {
        "sparse_mla_fwd": lambda: sm.sparse_mla_fwd(q, kv, idx, 0.04),
        "attn_dist": lambda: sm.attn_dist(q, kv, idx, lse, 0.04),
        "sparse_mla_decode": lambda: sm.sparse_mla_decode(*dec, 0.04),
        "sparse_mla_decode split-K": lambda: sm.sparse_mla_decode(*dec_split, 0.04),
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
        shape = "b 1, h_q 128, topk 2048, 32K cache" if "split" in name else "s_q 1, h_q 128, topk 64"
        rows.append({"op": "host_cost", "function": name, "us_per_call": us, "shape": shape})
    return rows


def decode_rows() -> list[dict]:
    """The decode rows of the published run at h_q 128 (``run.py`` adds h_q 64 and split-K variants)."""
    from sparse_mla_attn import Config

    rows = [bench_decode(b, 128, 32768, 2048) for b in (1, 8, 64, 128)]
    for b in (1, 8):  # each split-K merge forced, eager and captured
        for merge in ("last_program", "kernel"):
            rows.append(bench_decode(b, 128, 32768, 2048, config=Config(split_merge=merge)))
    return rows


def main() -> None:
    for row in decode_rows():
        print(
            f"decode b{row['batch']:<4d} h_q {row['h_q']} {row['config'] or 'defaults':24s} {row['backend']} "
            f"splits {row['splits']} merge {row['merge']}/{row['graph_merge']}: graph {row['ms'] * 1e3:.1f} us, "
            f"eager {row['ms_eager'] * 1e3:.1f} us ({row['eager_over_graph']:.2f}x), "
            f"eager from idle GPU {row['ms_eager_idle'] * 1e3:.1f} us, graph warm L2 {row['ms_graph_warm'] * 1e3:.1f} us, "
            f"max err {row['out_max_abs_err']:.2g}",
            flush=True,
        )  # fmt: skip
    for row in bench_host_cost():
        print(
            f"host cost {row['function']:26s} {row['us_per_call']:.1f} us per call ({row['shape']})",
            flush=True,
        )


if __name__ == "__main__":
    main()
