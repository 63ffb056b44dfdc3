"""Decode benchmark: one new token per sequence over a paged bf16 cache (block 64).

Each row times one call captured in a CUDA graph and replayed (``ms``) and the eager call (``ms_eager``),
both as ``triton.testing.do_bench`` times them: CUDA events around each call, the L2 cache flushed before
it, so the two differ only by what the eager call adds on the GPU (launch gaps; host time beyond the
flush's). ``ms_eager_idle`` is the eager call started from an idle GPU (its whole host cost counts) and
``ms_graph_warm`` back-to-back graph replays with the data left in L2 (``do_bench_cudagraph``). ``merge``
and ``graph_merge`` say who merged the split-K partials in the eager and the captured call.

``bench_decode_fp8`` times, on one paged cache and its FP8 copy (``quantize_fp8_kv_cache``), the bf16
decode, the FP8 decode (FlashMLA's cache-row indices) and, when given, FlashMLA's FP8 sparse decode
(``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``) on the same FP8 cache and indices,
each as one call captured in a CUDA graph and replayed, and compares the FP8 outputs.

``python bench_decode.py`` prints the decode rows at h_q 128 (batch 1 / 8 / 64, with each split-K merge
forced at batch 1 and 8) and every public op's host cost per call, in about a minute.
``python bench_decode.py --sweep [--flashmla PATH]`` prints, at batch 64 / 128, s_q 1 / 2, h_q 64 / 128
and at batch 1 / 8, h_q 128 (topk 2048, 32K-token caches), the replay time of every candidate split-K factor of the bf16 and FP8
decode (each with the Gluon kernel unsplit and split 2, 4, 8 ways and the Triton kernel split 1-4 ways) and of FlashMLA's FP8 decode, and the
factor the default rule (``Config.split_fill``) picks.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from bench_forward import D_QK, D_V, _config_label, capture_graph, fwd_flops, time_ms, time_ms_idle

from sparse_mla_attn import Config, quantize_fp8_kv_cache, sparse_mla_decode, sparse_mla_decode_ref
from sparse_mla_attn._runtime import last_launch
from sparse_mla_attn.reference import paged_rows


def make_decode_inputs(
    b: int, h_q: int, seqlen: int, topk: int, block_size: int = 64, s_q: int = 1
) -> tuple[torch.Tensor, ...]:
    """bf16 ``q [b, s_q, h_q, 576]``, a paged bf16 cache of ``seqlen`` tokens per sequence (blocks in random
    order), its block table and lengths, and ``topk`` distinct random positions per query."""
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = math.ceil(seqlen / block_size)
    num_blocks = b * blocks_per_seq
    q = torch.randn(b, s_q, h_q, D_QK, device="cuda", generator=g).bfloat16()
    cache = torch.randn(num_blocks, block_size, 1, D_QK, device="cuda", generator=g).bfloat16()
    block_table = torch.randperm(num_blocks, device="cuda", generator=g).view(b, blocks_per_seq).int()
    cache_seqlens = torch.full((b,), seqlen, dtype=torch.int32, device="cuda")
    noise = torch.rand(b * s_q, seqlen, device="cuda", generator=g)
    indices = noise.topk(min(topk, seqlen), -1).indices.int().view(b, s_q, -1)
    return q, cache, block_table, cache_seqlens, indices


def cache_rows(
    indices: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """FlashMLA's decode indices: the cache rows ``block * block_size + offset`` of the positions, ``-1``
    where invalid."""
    rows, valid = paged_rows(indices, block_table, seqlens, block_size)
    return torch.where(valid, rows, -1).int()


def graph_ms(call: Any) -> float:
    """The replay time of one ``call`` captured in a CUDA graph (after a first call outside the capture)."""
    call()
    graph = capture_graph(call)
    return time_ms(graph.replay)


def flashmla_fp8_decode(
    flashmla: Any, q: torch.Tensor, fp8: torch.Tensor, rows: torch.Tensor, sm_scale: float
) -> Any:
    """A call of FlashMLA's FP8 sparse decode on ``q``, the FP8 cache and its cache-row indices (its tile
    scheduler metadata made by the first call, outside any capture)."""
    sched, _ = flashmla.get_mla_metadata()

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return flashmla.flash_mla_with_kvcache(
            q, fp8, None, None, D_V, sched, None, sm_scale, False, True, indices=rows
        )

    call()
    return call


def bench_decode_fp8(
    b: int,
    s_q: int,
    h_q: int,
    *,
    flashmla: Any = None,
    seqlen: int = 32768,
    topk: int = 2048,
    block_size: int = 64,
) -> dict:
    """One ``decode_fp8`` row: the bf16 decode on a paged cache, the FP8 decode on its FP8 copy with cache-row
    indices, FlashMLA's FP8 sparse decode on that FP8 cache and those indices (when given); replay times,
    TFLOPS, FlashMLA's time over each of ours (> 1: ours faster), and the FP8 outputs against the float32
    reference (the first 4 sequences) and against FlashMLA's."""
    q, cache, table, seqlens, idx = make_decode_inputs(b, h_q, seqlen, topk, block_size, s_q)
    sm_scale = 1 / math.sqrt(D_QK)
    fp8 = quantize_fp8_kv_cache(cache)
    rows = cache_rows(idx, table, seqlens, block_size)
    flops = fwd_flops(b * s_q, h_q, topk)
    row: dict[str, Any] = {"op": "decode_fp8", "batch": b, "s_q": s_q, "h_q": h_q, "seqlen": seqlen, "topk": topk,
                           "block_size": block_size}  # fmt: skip
    bf16_call = lambda: sparse_mla_decode(q, cache, table, seqlens, idx, sm_scale)
    row["ms_bf16"] = graph_ms(bf16_call)
    launch = last_launch("fwd")
    row["bf16_backend"], row["bf16_splits"] = (launch.backend, launch.splits) if launch else (None, None)
    fp8_call = lambda: sparse_mla_decode(q, fp8, None, None, rows, sm_scale, index_kind="cache_rows")
    row["ms_fp8"] = graph_ms(fp8_call)
    launch = last_launch("fwd")
    row["fp8_backend"], row["fp8_splits"] = (launch.backend, launch.splits) if launch else (None, None)
    row["tflops_bf16"], row["tflops_fp8"] = flops / row["ms_bf16"] / 1e9, flops / row["ms_fp8"] / 1e9
    out, lse = fp8_call()
    # The reference on the first 4 sequences, their blocks gathered into a small cache.
    sub = fp8.view(torch.uint8)[table[:4].flatten().long()].view(torch.float8_e4m3fn)
    sub_table = torch.arange(sub.shape[0], device="cuda", dtype=torch.int32).view(4, -1)
    r_out, r_lse = sparse_mla_decode_ref(q[:4], sub, sub_table, seqlens[:4], idx[:4], sm_scale)
    row["fp8_out_max_abs_err"] = float((out[:4].float() - r_out.float()).abs().max())
    row["fp8_lse_max_abs_err"] = float((lse[:4] - r_lse).abs().max())
    if flashmla is not None:
        try:
            fm = flashmla_fp8_decode(flashmla, q, fp8, rows, sm_scale)
            fm_out, fm_lse = fm()
            row["flashmla_ms"] = graph_ms(fm)
        except Exception as exc:  # a FlashMLA build that cannot run this shape: recorded, not fatal
            row["flashmla_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        else:
            row["flashmla_tflops"] = flops / row["flashmla_ms"] / 1e9
            row["fp8_speed_vs_flashmla"] = row["flashmla_ms"] / row["ms_fp8"]
            row["bf16_speed_vs_flashmla"] = row["flashmla_ms"] / row["ms_bf16"]
            row["fp8_vs_flashmla_out_max_abs_diff"] = float((out.float() - fm_out.float()).abs().max())
            row["fp8_vs_flashmla_lse_max_abs_diff"] = float((lse - fm_lse.transpose(1, 2)).abs().max())
            row["flashmla_out_max_abs_err"] = float((fm_out[:4].float() - r_out.float()).abs().max())
    return row


#: The decode shapes compared with FlashMLA's FP8 sparse decode (batch, s_q, h_q), topk 2048, 32K caches.
FP8_SHAPES = [(b, s_q, h_q) for h_q in (128, 64) for b in (64, 128) for s_q in (1, 2)]


def sweep_splits(flashmla: Any = None, *, seqlen: int = 32768, topk: int = 2048) -> None:
    """Print the replay time of each candidate split-K factor of the bf16 and FP8 decode at ``FP8_SHAPES``
    and batch 1 / 8 (and FlashMLA's FP8 decode), with the kernel and factor the defaults pick."""
    from sparse_mla_attn._runtime import num_sms

    n_sm = num_sms(torch.device("cuda"))
    candidates = [("gluon/auto s1", Config(num_splits=1))] + [
        (f"triton s{s}", Config(backend="triton", num_splits=s)) for s in (1, 2, 3, 4)
    ]
    gluon_splits = [(f"gluon s{s}", Config(backend="gluon", num_splits=s)) for s in (2, 4, 8)]
    for b, s_q, h_q in [(1, 1, 128), (8, 1, 128), *FP8_SHAPES]:  # and the small batches that split
        q, cache, table, seqlens, idx = make_decode_inputs(b, h_q, seqlen, topk, 64, s_q)
        fp8 = quantize_fp8_kv_cache(cache)
        rows = cache_rows(idx, table, seqlens, 64)
        scale = 1 / math.sqrt(D_QK)
        n_programs = b * s_q * math.ceil(h_q / 64)
        sparse_mla_decode(q, cache, table, seqlens, idx, scale)
        bf16 = last_launch("fwd")
        sparse_mla_decode(q, fp8, None, None, rows, scale, index_kind="cache_rows")
        fp8_launch = last_launch("fwd")
        picks = [Config(split_fill=f).splits_for(n_programs, topk, n_sm) for f in (0.5, 1.0, 2.0, 4.0)]
        head = (
            f"b{b} s_q{s_q} h_q{h_q} ({n_programs} programs; default bf16 {bf16.backend if bf16 else '?'} "
            f"s{bf16.splits if bf16 else '?'}, fp8 s{fp8_launch.splits if fp8_launch else '?'}; Triton-only "
            f"split_fill 0.5/1/2/4 -> {picks})"
        )
        times = []
        for name, cfg in candidates + gluon_splits:
            call = functools.partial(sparse_mla_decode, q, cache, table, seqlens, idx, scale, config=cfg)
            try:
                times.append(f"bf16 {name} {graph_ms(call) * 1e3:.1f}")
            except ValueError:  # the Gluon kernels need an sm_90 GPU and Triton 3.6
                times.append(f"bf16 {name} n/a")
        for name, cfg in [
            *candidates[1:],
            ("gluon s1", Config(backend="gluon", num_splits=1)),
            *gluon_splits,
        ]:
            call = functools.partial(
                sparse_mla_decode, q, fp8, None, None, rows, scale, index_kind="cache_rows", config=cfg
            )
            try:
                times.append(f"fp8 {name} {graph_ms(call) * 1e3:.1f}")
            except ValueError:  # the Gluon kernels need an sm_90 GPU and Triton 3.6
                times.append(f"fp8 {name} n/a")
        if flashmla is not None:
            try:
                fm = flashmla_fp8_decode(flashmla, q, fp8, rows, scale)
                times.append(f"FlashMLA fp8 {graph_ms(fm) * 1e3:.1f}")
                fm_out, fm_lse = fm()
                out, lse = sparse_mla_decode(
                    q, fp8, None, None, rows, scale, index_kind="cache_rows", empty_lse=math.inf
                )
                diff = (out.float() - fm_out.float()).abs().max().item()
                lse_diff = (lse - fm_lse.transpose(1, 2)).abs().max().item()
                times.append(f"(ours fp8 vs FlashMLA: out max abs diff {diff:.2e}, lse {lse_diff:.2e})")
            except Exception as exc:
                times.append(f"FlashMLA error {type(exc).__name__}: {str(exc)[:100]}")
        print(head + ": " + ", ".join(times) + " us", flush=True)
        del q, cache, fp8, table, seqlens, idx, rows
        torch.cuda.empty_cache()


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


def bench_host_cost(n_batches: int = 40, per_batch: int = 25) -> list[dict]:
    """Host cost per call of each public op: a tiny problem (one token, 64 slots) called with default
    arguments. ``us_per_call`` is host time: the median over ``n_batches`` batches of ``per_batch``
    back-to-back calls of the batch's wall time per call, the GPU drained between batches (not timed) so
    that no launch waits for room in the queue. ``us_per_call_back_to_back`` is the wall time per call of
    all those calls with the GPU's work included (one synchronisation at the end): the larger of the host
    cost and the GPU time of one call. ``sparse_mla`` is one forward and backward through autograd."""
    import statistics
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
        host = []
        for _ in range(n_batches):
            t0 = time.perf_counter()
            for _ in range(per_batch):
                call()
            host.append((time.perf_counter() - t0) / per_batch * 1e6)
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_batches * per_batch):
            call()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / (n_batches * per_batch) * 1e6
        shape = "b 1, h_q 128, topk 2048, 32K cache" if "split" in name else "s_q 1, h_q 128, topk 64"
        rows.append({"op": "host_cost", "function": name, "us_per_call": statistics.median(host),
                     "us_per_call_back_to_back": wall, "shape": shape})  # fmt: skip
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
    import argparse
    import importlib
    import sys

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="time the candidate split-K factors (see above)")
    ap.add_argument("--flashmla", default=None, help="folder holding FlashMLA's built flash_mla package")
    a = ap.parse_args()
    if a.sweep:
        flashmla = None
        if a.flashmla:
            sys.path.insert(0, a.flashmla)
            flashmla = importlib.import_module("flash_mla")
        sweep_splits(flashmla)
        return
    host_rows = bench_host_cost()  # first: in a process that has run nothing else yet, as a user's
    for row in decode_rows():
        print(
            f"decode b{row['batch']:<4d} h_q {row['h_q']} {row['config'] or 'defaults':24s} {row['backend']} "
            f"splits {row['splits']} merge {row['merge']}/{row['graph_merge']}: graph {row['ms'] * 1e3:.1f} us, "
            f"eager {row['ms_eager'] * 1e3:.1f} us ({row['eager_over_graph']:.2f}x), "
            f"eager from idle GPU {row['ms_eager_idle'] * 1e3:.1f} us, graph warm L2 {row['ms_graph_warm'] * 1e3:.1f} us, "
            f"max err {row['out_max_abs_err']:.2g}",
            flush=True,
        )  # fmt: skip
    for row in host_rows:
        print(
            f"host cost {row['function']:26s} {row['us_per_call']:.1f} us per call ({row['shape']}; back to back "
            f"with the GPU's time {row['us_per_call_back_to_back']:.1f} us)",
            flush=True,
        )


if __name__ == "__main__":
    main()
