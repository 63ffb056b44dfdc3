"""Backward benchmark: ``sparse_mla_bwd`` in its default and deterministic modes.

TFLOPS are counted as 2.5x the forward's FLOPs, ``2.5 * 2 * s_q * h_q * topk * (d_qk + d_v)`` (the backward
recomputes QK^T and does four more products: 2.53x by exact count at d_qk 576, d_v 512).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from bench_forward import D_QK, D_V, fwd_flops, make_inputs, time_ms

from sparse_mla_attn import sparse_mla_bwd, sparse_mla_bwd_ref, sparse_mla_fwd
from sparse_mla_attn._runtime import last_launch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bench_bwd(s_q: int, h_q: int, s_kv: int, topk: int) -> dict:
    """Default and deterministic times, the relative error of both against the float32 reference on the
    first 64 queries, and the kernel families that ran (``backend``: the main and dq kernels;
    ``dkv_backend``: the dkv products)."""
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk)
    sm_scale = 1 / math.sqrt(D_QK)
    out, _, lse = sparse_mla_fwd(q, kv, idx, sm_scale, D_V)
    dout = torch.randn(s_q, h_q, D_V, device="cuda").bfloat16()
    flops = 2.5 * fwd_flops(s_q, h_q, topk)
    row: dict[str, Any] = {
        "op": "bwd",
        "s_q": s_q,
        "h_q": h_q,
        "s_kv": s_kv,
        "topk": topk,
    }
    n = 64
    sub = (q[:n], kv, out[:n], dout[:n], idx[:n], lse[:n], sm_scale, D_V)
    dq_ref, dkv_ref = sparse_mla_bwd_ref(*sub)
    for det in (False, True):
        run = lambda d=det: sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, D_V, deterministic=d)
        dq, _ = run()
        ms = time_ms(run, warmup=10, rep=300)
        key = "det_" if det else ""
        row[key + "ms"] = ms
        row[key + "tflops"] = flops / ms / 1e9
        row[key + "dq_rel_err"] = rel_err(dq[:n], dq_ref)
        # dkv of the first n queries alone (the full dkv's float32 reference is too costly)
        row[key + "dkv_rel_err"] = rel_err(sparse_mla_bwd(*sub, deterministic=det)[1], dkv_ref)
        # The kernel families that ran: the main / dq kernels, and the dkv products' kernel.
        main, dkv = last_launch("bwd.main"), last_launch("bwd.dkv")
        row["backend"] = main.backend if main else None
        row["dkv_backend"] = dkv.backend if dkv else None
    return row
