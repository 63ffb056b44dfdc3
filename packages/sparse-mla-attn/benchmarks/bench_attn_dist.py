"""attn_dist benchmark: time against the forward's at the same shape (queries at the end of the sequence,
causal limit in play)."""

from __future__ import annotations

import math
from typing import Any

from bench_forward import D_QK, _config_label, make_inputs, time_ms

from sparse_mla_attn import Config, attn_dist, attn_dist_ref, sparse_mla_fwd
from sparse_mla_attn._runtime import last_launch


def bench_attn_dist(
    s_q: int, h_q: int, s_kv: int, topk: int, *, fwd_ms: float, config: Config | None = None
) -> dict:
    q, kv, idx = make_inputs(s_q, h_q, s_kv, topk)
    sm_scale = 1 / math.sqrt(D_QK)
    start = max(0, s_kv - s_q)
    _, _, lse = sparse_mla_fwd(q, kv, idx, sm_scale, causal=True, q_start_index=start)
    run = lambda: attn_dist(q, kv, idx, lse, sm_scale, q_start_index=start, config=config)
    got = run()
    launch = last_launch("attn_dist")
    ref = attn_dist_ref(q[:32], kv, idx[:32], lse[:32], sm_scale, q_start_index=start)
    ms = time_ms(run)
    row: dict[str, Any] = {
        "op": "attn_dist", "s_q": s_q, "h_q": h_q, "s_kv": s_kv, "topk": topk, "config": _config_label(config),
        "backend": launch.backend if launch else None, "ms": ms,
        "tflops": 2.0 * s_q * h_q * topk * D_QK / ms / 1e9, "time_vs_fwd": ms / fwd_ms,
        "max_abs_err": float((got[:32] - ref).abs().max()),
    }  # fmt: skip
    return row
