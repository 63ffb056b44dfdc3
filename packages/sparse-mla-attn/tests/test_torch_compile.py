"""Every public op inside ``torch.compile(fullgraph=True)``: no graph break, the eager op's results.

The ``eager`` compile backend keeps the check on CPU (Triton interpreter): Dynamo still traces the whole
function, with each op as one opaque custom-op node (its fake implementation gives the shapes).
"""

from __future__ import annotations

import torch

import sparse_mla_attn as sm
from sparse_mla_attn._inputs import kernel_test_device


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")


def test_forward_attn_dist_decode_compile_without_graph_breaks():
    dev = kernel_test_device()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 576, generator=g).bfloat16().to(dev)
    kv = torch.randn(16, 1, 576, generator=g).bfloat16().to(dev)
    idx = torch.randint(-1, 17, (2, 1, 5), generator=g, dtype=torch.int32).to(dev)
    kw = {"causal": True, "q_start_index": 3}
    out, max_logits, lse = compiled(lambda q, kv, idx: sm.sparse_mla_fwd(q, kv, idx, 0.05, **kw))(q, kv, idx)
    for a, b in zip((out, max_logits, lse), sm.sparse_mla_fwd(q, kv, idx, 0.05, **kw), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    attn = compiled(lambda q, kv, idx, lse: sm.attn_dist(q, kv, idx, lse, 0.05, q_start_index=3))(
        q, kv, idx, lse
    )
    torch.testing.assert_close(attn, sm.attn_dist(q, kv, idx, lse, 0.05, q_start_index=3), rtol=0, atol=0)
    cache = torch.randn(2, 8, 1, 576, generator=g).bfloat16().to(dev)
    table = torch.tensor([[1, 0]], dtype=torch.int32, device=dev)
    seqlens = torch.tensor([12], dtype=torch.int32, device=dev)
    pos = torch.randint(0, 12, (1, 1, 5), generator=g, dtype=torch.int32).to(dev)
    q_dec = torch.randn(1, 1, 4, 576, generator=g).bfloat16().to(dev)
    args = (q_dec, cache, table, seqlens, pos)
    got = compiled(lambda *a: sm.sparse_mla_decode(*a, 0.05))(*args)
    for a, b in zip(got, sm.sparse_mla_decode(*args, 0.05), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backward_and_autograd_compile_without_graph_breaks():
    dev = kernel_test_device()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 96, generator=g).to(dev)
    kv = torch.randn(16, 1, 96, generator=g).to(dev)
    out = torch.randn(2, 4, 64, generator=g).to(dev)
    idx = torch.randint(0, 16, (2, 1, 5), generator=g, dtype=torch.int32).to(dev)
    lse = torch.randn(2, 4, generator=g).to(dev)
    dq, dkv = compiled(lambda *a: sm.sparse_mla_bwd(*a, 0.05, 64))(q, kv, out, out, idx, lse)
    ref_dq, ref_dkv = sm.sparse_mla_bwd(q, kv, out, out, idx, lse, 0.05, 64)
    torch.testing.assert_close(dq, ref_dq, rtol=0, atol=0)
    torch.testing.assert_close(dkv, ref_dkv, rtol=0, atol=0)
    q16 = torch.randn(2, 4, 576, generator=g).half().to(dev).requires_grad_()
    kv16 = torch.randn(16, 1, 576, generator=g).half().to(dev).requires_grad_()
    compiled(lambda q, kv, idx: sm.sparse_mla(q, kv, idx, 0.05))(q16, kv16, idx).float().sum().backward()
    assert q16.grad is not None
    assert kv16.grad is not None
    assert torch.isfinite(q16.grad).all()
