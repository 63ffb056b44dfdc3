"""Forward benchmark: sparse_mla_fwd TFLOPS at FlashMLA's shape, against a torch gather + einsum baseline.

FLOPs are counted as FlashMLA counts them: ``2 * s_q * h_q * topk * (d_qk + d_v)``.

    python packages/sparse-mla-attn/benchmarks/bench_forward.py [--s-q 4096 --h-q 128 --s-kv 8192 --topk 2048]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import triton

from sparse_mla_attn import sparse_mla_fwd_ref
from sparse_mla_attn._inputs import random_indices
from sparse_mla_attn.forward import LAST_BACKEND, LAST_COMPILED, sparse_mla_fwd_impl

D_QK, D_V = 576, 512


def time_ms(fn, *, warmup: int = 25, rep: int = 200, graph: bool = False) -> float:
    """Median time of ``fn`` in ms: CUDA events through triton.testing.do_bench, or with ``graph`` the
    replay of ``fn`` captured in a CUDA graph (triton.testing.do_bench_cudagraph: no host launch cost,
    as a serving engine runs decode)."""
    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def dense_matmul_tflops(n: int = 8192) -> float:
    """Measured bf16 dense matmul rate (random data), the compute roofline of this run."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def fwd_flops(s_q: int, h_q: int, topk: int, d_qk: int = D_QK, d_v: int = D_V) -> float:
    return 2.0 * s_q * h_q * topk * (d_qk + d_v)


def make_inputs(s_q: int, h_q: int, s_kv: int, topk: int, *, seed: int = 0, d_qk: int = D_QK):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, device="cuda", generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, d_qk, device="cuda", generator=g).bfloat16()
    idx = random_indices(s_q, s_kv, topk, device="cuda", generator=g)
    return q, kv, idx


def kernel_resources(name: str) -> dict[str, Any]:
    """Registers, spills, shared memory and whether wgmma is used by the latest compile of ``name``."""
    k = LAST_COMPILED.get(name)
    if k is None:
        return {}
    ptx = k.asm.get("ptx", "") if hasattr(k, "asm") else ""
    return {
        "n_regs": getattr(k, "n_regs", None),
        "n_spills": getattr(k, "n_spills", None),
        "shared_bytes": getattr(getattr(k, "metadata", None), "shared", None),
        "wgmma": "wgmma" in ptx,
        "backend": LAST_BACKEND.get(name),
    }


def check_rows(got, q, kv, idx, sm_scale, rows: int = 32, **kw) -> dict[str, float]:
    """Max abs error of out / lse on the first ``rows`` queries against the float32 reference."""
    r_out, _, r_lse = sparse_mla_fwd_ref(q[:rows].float(), kv.float(), idx[:rows], sm_scale, **kw)
    return {
        "out_max_abs_err": float((got[0][:rows].float() - r_out).abs().max()),
        "lse_max_abs_err": float((got[2][:rows] - r_lse).abs().max()),
    }


def bench_fwd(
    s_q: int, h_q: int, s_kv: int, topk: int, *, config: dict | None = None, check: bool = True
) -> dict:
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk)
    sm_scale = 1 / math.sqrt(D_QK)
    got = sparse_mla_fwd_impl(q, kv, idx, sm_scale, config=config)
    res: dict[str, Any] = {"s_q": s_q, "h_q": h_q, "s_kv": s_kv, "topk": topk, "config": config}
    if check:
        res.update(check_rows(got, q, kv, idx, sm_scale))
    res.update(kernel_resources("fwd"))
    ms = time_ms(lambda: sparse_mla_fwd_impl(q, kv, idx, sm_scale, config=config))
    res.update(ms=ms, tflops=fwd_flops(s_q, h_q, topk) / ms / 1e9)
    return res


def torch_gather_einsum(q, kv, idx, sm_scale, chunk: int = 256):
    """Baseline: chunked torch gather + bf16 einsum + fp32 softmax (what one writes without a kernel)."""
    s_q = q.shape[0]
    out = torch.empty(s_q, q.shape[1], D_V, dtype=q.dtype, device=q.device)
    rows_all = kv[:, 0]
    for s0 in range(0, s_q, chunk):
        i = idx[s0 : s0 + chunk, 0].long()
        valid = (i >= 0) & (i < kv.shape[0])
        rows = rows_all[torch.where(valid, i, 0)]
        scores = torch.einsum("shd,std->sht", q[s0 : s0 + chunk], rows).float() * sm_scale
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
        p = torch.softmax(scores, -1).to(q.dtype)
        out[s0 : s0 + chunk] = torch.einsum("sht,std->shd", p, rows[..., :D_V])
    return out


def bench_baseline(s_q: int, h_q: int, s_kv: int, topk: int) -> dict:
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk)
    ms = time_ms(lambda: torch_gather_einsum(q, kv, idx, 0.04), warmup=5, rep=100)
    return {
        "s_q": s_q,
        "h_q": h_q,
        "s_kv": s_kv,
        "topk": topk,
        "ms": ms,
        "tflops": fwd_flops(s_q, h_q, topk) / ms / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--s-q", type=int, default=4096)
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--s-kv", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=2048)
    a = ap.parse_args()
    peak = dense_matmul_tflops()
    r = bench_fwd(a.s_q, a.h_q, a.s_kv, a.topk)
    b = bench_baseline(a.s_q, a.h_q, a.s_kv, a.topk)
    print(f"dense bf16 matmul {peak:.0f} TFLOPS")
    print(
        f"sparse_mla_fwd  {r['ms']:.3f} ms  {r['tflops']:.0f} TFLOPS ({100 * r['tflops'] / peak:.0f}% of matmul)"
    )
    print(f"torch baseline  {b['ms']:.3f} ms  {b['tflops']:.0f} TFLOPS")


if __name__ == "__main__":
    main()
