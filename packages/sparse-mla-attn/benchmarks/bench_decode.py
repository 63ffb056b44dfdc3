"""Decode benchmark: one new token per sequence over a paged bf16 cache, h_q 128, topk 2048.

Timed as a CUDA-graph replay (``ms``) and with plain CUDA events (``ms_eager``, includes launch cost).

python packages/sparse-mla-attn/benchmarks/bench_decode.py [--batch 64 --seqlen 32768]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from bench_forward import D_QK, fwd_flops, kernel_resources, time_ms

from sparse_mla_attn import sparse_mla_decode_ref
from sparse_mla_attn.decode import sparse_mla_decode_impl
from sparse_mla_attn.forward import LAST_SPLITS


def make_decode_inputs(b: int, h_q: int, seqlen: int, topk: int, block_size: int = 64, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = math.ceil(seqlen / block_size)
    num_blocks = b * blocks_per_seq
    q = torch.randn(b, 1, h_q, D_QK, device="cuda", generator=g).bfloat16()
    cache = torch.randn(num_blocks, block_size, 1, D_QK, device="cuda", generator=g).bfloat16()
    block_table = torch.randperm(num_blocks, device="cuda", generator=g).view(b, blocks_per_seq).int()
    cache_seqlens = torch.full((b,), seqlen, dtype=torch.int32, device="cuda")
    noise = torch.rand(b, seqlen, device="cuda", generator=g)
    indices = noise.topk(min(topk, seqlen), -1).indices.int().view(b, 1, -1)
    return q, cache, block_table, cache_seqlens, indices


def bench_decode(
    b: int, h_q: int, seqlen: int, topk: int, *, config: dict | None = None, check: bool = True
) -> dict:
    args = make_decode_inputs(b, h_q, seqlen, topk)
    sm_scale = 1 / math.sqrt(D_QK)
    out, lse = sparse_mla_decode_impl(*args, sm_scale, config=config)
    res: dict[str, Any] = {"batch": b, "h_q": h_q, "seqlen": seqlen, "topk": topk, "config": config}
    res["n_splits"] = LAST_SPLITS["fwd"]
    if check:
        q, cache, bt, sl, idx = args
        # bf16 in: the reference upcasts only the rows it gathers (a float32 copy of a 128K x 128 cache
        # would not fit); its out is rounded to bf16 like the kernel's.
        r_out, r_lse = sparse_mla_decode_ref(q[:4], cache, bt[:4], sl[:4], idx[:4], sm_scale)
        res["out_max_abs_err"] = float((out[:4].float() - r_out.float()).abs().max())
        res["lse_max_abs_err"] = float((lse[:4] - r_lse).abs().max())
    res.update(kernel_resources("fwd"))
    call = lambda: sparse_mla_decode_impl(*args, sm_scale, config=config)
    # Timed as a CUDA-graph replay (how serving engines run decode): the kernels' time without the host's
    # launch cost, which at these sizes is comparable to the GPU time. The plain event timing is kept too.
    ms = time_ms(call, graph=True)
    ms_eager = time_ms(call)
    res.update(ms=ms, ms_eager=ms_eager, tflops=fwd_flops(b, h_q, topk) / ms / 1e9)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    a = ap.parse_args()
    r = bench_decode(a.batch, a.h_q, a.seqlen, a.topk)
    print(f"decode b={a.batch}: {r['ms'] * 1e3:.1f} us  {r['tflops']:.0f} TFLOPS")


if __name__ == "__main__":
    main()
