"""CPU check (sweep 11): how far the Gluon forwards' numerics alone are from the float32 reference.

Both Gluon kernels round P = exp2(S - m) to bf16 before P·V and take the row sum l from the fp32 P. This
emulates exactly that in torch (no kernel) on the GPU tests' inputs and counts the elements of ``out``
outside the "gpu" tolerance (abs 8e-4, rel 2e-2). Run from the repository root:

    PYTHONPATH=packages/sparse-mla-attn/src python packages/sparse-mla-attn/benchmarks/results/bf16_p_rounding.py
"""

import math
import sys

import torch

sys.path.insert(0, "packages/sparse-mla-attn/tests")
from test_forward import make_problem

from sparse_mla_attn import sparse_mla_fwd_ref

LOG2E = 1.4426950408889634


def emulate(q, kv, idx, scale):
    # the Gluon kernels' numerics: S fp32, P = exp2(S*scale*log2e - m) rounded to bf16, l from fp32 P
    qf, kf = q.float(), kv[:, 0].float()
    i = idx[:, 0].long()
    valid = (i >= 0) & (i < kv.shape[0])
    rows = kf[torch.where(valid, i, 0)]  # [s, t, d]
    s = torch.einsum("shd,std->sht", qf, rows) * scale * LOG2E
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp2(s - m)
    row_sum = p.sum(-1, keepdim=True)
    o = torch.einsum("sht,std->shd", p.bfloat16().float(), rows[..., :512]) / row_sum.clamp_min(1e-30)
    return o.bfloat16()


for s_q, h_q, d_qk, topk in [
    (33, 128, 576, 64),
    (97, 48, 576, 129),
    (160, 128, 576, 1000),
    (160, 100, 512, 333),
]:
    worst = []
    for seed in range(3):
        q, kv, idx = make_problem(s_q, h_q, d_qk, 8192, topk, "cpu", seed=seed, invalid_frac=0.05)
        idx[0, 0, :] = -1
        scale = 1 / math.sqrt(d_qk)
        ref = sparse_mla_fwd_ref(q.float(), kv.float(), idx, scale)[0]
        e = emulate(q, kv, idx, scale).float()
        d = (e - ref).abs()
        bad = d > 8e-4 + 2e-2 * ref.abs()
        worst.append((round(float(d.max()), 5), int(bad.sum())))
    print(f"S{s_q} H{h_q} D{d_qk} T{topk}: max abs err, elements over gpu tol (8e-4, 2e-2) per seed: {worst}")
