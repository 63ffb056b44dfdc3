"""Every public op inside ``torch.compile(fullgraph=True)``: no graph break, the eager op's results.

The ``eager`` compile backend keeps the check on CPU (Triton interpreter): Dynamo still traces the whole
function, with each op as one opaque custom-op node (its fake implementation gives the shapes).
"""

from __future__ import annotations

import pytest
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
    # FP8 cache, FlashMLA's cache rows (no tables) and +inf empty lse.
    fp8, rows = sm.quantize_fp8_kv_cache(cache), torch.where(pos < 8, pos + 8, pos - 8)
    kw_fp8 = {"index_kind": "cache_rows", "empty_lse": float("inf")}
    got = compiled(lambda q, c, r: sm.sparse_mla_decode(q, c, None, None, r, 0.05, **kw_fp8))(
        q_dec, fp8, rows
    )
    for a, b in zip(got, sm.sparse_mla_decode(q_dec, fp8, None, None, rows, 0.05, **kw_fp8), strict=True):
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


def test_indexer_ops_compile_without_graph_breaks():
    dev = kernel_test_device()
    g = torch.Generator().manual_seed(2)
    q_idx = torch.randn(4, 16, 16, generator=g).to(dev)
    k_idx = torch.randn(8, 16, generator=g).to(dev)
    w = torch.randn(4, 16, generator=g).to(dev)
    idx = torch.randint(-1, 8, (4, 1, 3), generator=g, dtype=torch.int32).to(dev)
    attn = torch.rand(4, 3, generator=g).to(dev)

    def pipeline(q_idx, k_idx, w, idx, attn):
        logits = sm.indexer_logits(q_idx, k_idx, w, causal=True, q_start_index=2)
        top = sm.indexer_topk(logits, 3, causal=True, q_start_index=2)
        at = sm.indexer_logits_at(q_idx, k_idx, w, idx)
        return logits, top, sm.indexer_kl_loss(at, sm.indexer_target(attn))

    got = compiled(pipeline)(q_idx, k_idx, w, idx, attn)
    for a, b in zip(got, pipeline(q_idx, k_idx, w, idx, attn), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The logits' backward (an op with its autograd formula) inside the compiled region.
    q_g = q_idx.clone().requires_grad_()
    compiled(lambda q: sm.indexer_logits(q, k_idx, w).relu().sum())(q_g).backward()
    q_e = q_idx.clone().requires_grad_()
    sm.indexer_logits(q_e, k_idx, w).relu().sum().backward()
    torch.testing.assert_close(q_g.grad, q_e.grad, rtol=0, atol=0)


GPU_CASES = [pytest.param(b, id=f"B{b}") for b in (1, 8)]


def _gpu_problem(seed: int, h_q: int = 128, s_q: int = 64, s_kv: int = 4096, topk: int = 512) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s_q, h_q, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, 576, device="cuda", generator=g).bfloat16()
    idx = torch.randint(-1, s_kv, (s_q, 1, topk), device="cuda", generator=g, dtype=torch.int32)
    return q, kv, idx


@pytest.mark.gpu
def test_public_ops_inductor_fullgraph_gpu():
    """Every public op under the default compiler (inductor), fullgraph, equal to its eager call."""
    q, kv, idx = _gpu_problem(0)
    fwd = torch.compile(lambda q, kv, idx: sm.sparse_mla_fwd(q, kv, idx, 0.04, causal=True), fullgraph=True)
    got = fwd(q, kv, idx)
    ref = sm.sparse_mla_fwd(q, kv, idx, 0.04, causal=True)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    lse = ref[2]
    ad = torch.compile(lambda q, kv, idx, lse: sm.attn_dist(q, kv, idx, lse, 0.04), fullgraph=True)
    torch.testing.assert_close(ad(q, kv, idx, lse), sm.attn_dist(q, kv, idx, lse, 0.04), rtol=0, atol=0)
    dout = torch.randn_like(ref[0])
    bwd = torch.compile(
        lambda *a: sm.sparse_mla_bwd(*a, 0.04, causal=True, deterministic=True), fullgraph=True
    )
    for a, b in zip(
        bwd(q, kv, ref[0], dout, idx, lse),
        sm.sparse_mla_bwd(q, kv, ref[0], dout, idx, lse, 0.04, causal=True, deterministic=True),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Autograd through the compiled differentiable op.
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    train = torch.compile(lambda q, kv: sm.sparse_mla(q, kv, idx, 0.04, deterministic=True), fullgraph=True)
    train(qg, kvg).float().square().sum().backward()
    qe, kve = q.clone().requires_grad_(), kv.clone().requires_grad_()
    sm.sparse_mla(qe, kve, idx, 0.04, deterministic=True).float().square().sum().backward()
    # (The compiled graph computes dout itself: equal up to its rounding.)
    torch.testing.assert_close(qg.grad, qe.grad)
    torch.testing.assert_close(kvg.grad, kve.grad)
    # Indexer: logits (with backward), top-k, target and loss.
    g = torch.Generator(device="cuda").manual_seed(1)
    q_idx = torch.randn(64, 64, 128, device="cuda", generator=g).bfloat16()
    k_idx = torch.randn(4096, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(64, 64, device="cuda", generator=g)

    def indexer_step(q_idx, attn):
        logits = sm.indexer_logits(q_idx, k_idx, w, causal=True, q_start_index=4032)
        top = sm.indexer_topk(logits, 512, causal=True, q_start_index=4032)
        at = sm.indexer_logits_at(q_idx, k_idx, w, top)
        return sm.indexer_kl_loss(at, sm.indexer_target(attn)), top

    attn = sm.attn_dist(q, kv, idx, lse, 0.04)
    qi_c, qi_e = q_idx.clone().requires_grad_(), q_idx.clone().requires_grad_()
    loss_c, top_c = torch.compile(indexer_step, fullgraph=True)(qi_c, attn)
    loss_e, top_e = indexer_step(qi_e, attn)
    torch.testing.assert_close(top_c, top_e, rtol=0, atol=0)
    torch.testing.assert_close(loss_c, loss_e)
    loss_c.backward()
    loss_e.backward()
    torch.testing.assert_close(qi_c.grad, qi_e.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("b", GPU_CASES)
def test_decode_inductor_fullgraph_and_cuda_graph_gpu(b):
    """Decode compiled (fullgraph), eager, and replayed from a CUDA graph: identical results."""
    g = torch.Generator(device="cuda").manual_seed(b)
    q = torch.randn(b, 1, 128, 576, device="cuda", generator=g).bfloat16()
    cache = torch.randn(64 * b, 64, 1, 576, device="cuda", generator=g).bfloat16()
    table = torch.randperm(64 * b, device="cuda", generator=g).view(b, 64).int()
    seqlens = torch.full((b,), 4000, dtype=torch.int32, device="cuda")
    idx = torch.randint(-1, 4100, (b, 1, 2048), device="cuda", generator=g, dtype=torch.int32)
    args = (q, cache, table, seqlens, idx)
    eager = sm.sparse_mla_decode(*args, 0.04)
    comp = torch.compile(lambda *a: sm.sparse_mla_decode(*a, 0.04), fullgraph=True)(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replay = sm.sparse_mla_decode(*args, 0.04)
    graph.replay()
    torch.cuda.synchronize()
    for outs in (comp, replay):
        for a, e in zip(outs, eager, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
