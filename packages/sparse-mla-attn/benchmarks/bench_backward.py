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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bench_bwd(s_q: int, h_q: int, s_kv: int, topk: int) -> dict:
    """Default and deterministic times, and the relative error of both against the float32 reference on
    the first 64 queries."""
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
        "backend": "triton",
    }
    n = 64
    dq_ref, _ = sparse_mla_bwd_ref(q[:n], kv, out[:n], dout[:n], idx[:n], lse[:n], sm_scale, D_V)
    for det in (False, True):
        run = lambda d=det: sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, D_V, deterministic=d)
        dq, _ = run()
        ms = time_ms(run, warmup=10, rep=300)
        key = "det_" if det else ""
        row[key + "ms"] = ms
        row[key + "tflops"] = flops / ms / 1e9
        row[key + "dq_rel_err"] = rel_err(dq[:n], dq_ref)
    return row
