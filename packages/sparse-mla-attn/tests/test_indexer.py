"""Lightning indexer: logits kernel, top-k selection and KL loss against torch references."""

from __future__ import annotations

import pytest
import torch

from sparse_mla_attn._inputs import kernel_test_device
from sparse_mla_attn.indexer import (
    indexer_kl_loss,
    indexer_logits,
    indexer_logits_at,
    indexer_topk,
    launch_logits_bwd,
)
from sparse_mla_attn.reference import indexer_kl_loss_ref, indexer_logits_ref

# Max abs error of the logits relative to the largest |logit|, per input dtype.
LOGIT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_inputs(s_q, h, d, s_kv, *, device, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(s_q, h, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(s_kv, d, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(s_q, h, generator=g).to(device)
    return q, k, w


def assert_logits_close(got, ref, dtype):
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin), "the -inf (masked) pattern differs"
    scale = ref[fin].abs().max().clamp_min(1.0)
    err = (got[fin].double() - ref[fin].double()).abs().max() / scale
    assert err < LOGIT_TOL[dtype], float(err)


LOGIT_CASES = [
    pytest.param(20, 4, 32, 37, {}, id="S20-H4-D32-K37"),
    pytest.param(33, 3, 16, 50, {"causal": True, "q_start_index": 5, "k_stride": 2}, id="causal-st2"),
    pytest.param(17, 2, 64, 23, {"causal": True, "q_start_index": 0, "k_stride": 1}, id="causal-q0"),
]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize(("s_q", "h", "d", "s_kv", "kw"), LOGIT_CASES)
def test_indexer_logits_forward_and_backward(s_q, h, d, s_kv, kw, dtype):
    dev = kernel_test_device()
    q, k, w = make_inputs(s_q, h, d, s_kv, device=dev, dtype=dtype, seed=s_q)
    got = indexer_logits(q, k, w, **kw)
    ref = indexer_logits_ref(q, k, w, **kw)
    assert got.dtype == torch.float32
    assert got.shape == (s_q, s_kv)
    assert_logits_close(got, ref, dtype)
    # Backward: a loss on the finite logits, compared with autograd through the float32 reference.
    grad = torch.randn(s_q, s_kv, generator=torch.Generator().manual_seed(s_q + s_kv)).to(dev)
    qa, ka, wa = (t.clone().requires_grad_() for t in (q, k, w))
    lg = indexer_logits(qa, ka, wa, **kw)
    (torch.where(torch.isfinite(lg), lg, 0.0) * grad).sum().backward()
    qr, kr, wr = (t.float().clone().requires_grad_() for t in (q, k, w))
    lr = indexer_logits_ref(qr, kr, wr, **kw)
    (torch.where(torch.isfinite(lr), lr, 0.0) * grad).sum().backward()
    # bf16 rounds the gradient products' inputs to 8 bits of mantissa (fp16: 11).
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]
    for a, b in ((qa, qr), (ka, kr), (wa, wr)):
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=tol, atol=tol * float(b.grad.abs().max()))


# Relative Frobenius error of the Triton backward's dq_idx / dk_idx / dweights against float64 autograd.
BWD_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

BWD_CASES = [
    pytest.param(5, 3, 16, 37, {}, id="S5-H3-D16-K37"),
    pytest.param(7, 4, 32, 50, {"causal": True, "q_start_index": 5, "k_stride": 2}, id="causal-q5-st2"),
    pytest.param(9, 2, 16, 23, {"causal": True, "q_start_index": 20, "k_stride": 3}, id="causal-q20-st3"),
    pytest.param(6, 20, 16, 19, {"causal": True}, id="causal-H20"),
    pytest.param(3, 72, 16, 9, {}, id="H72-two-head-blocks"),
]


def float64_grads(q, k, w, grad, kw):
    """dq/dk/dw through autograd on the float64 reference, for the loss Σ grad * logits over finite logits."""
    qr, kr, wr = (t.double().clone().requires_grad_() for t in (q, k, w))
    lr = indexer_logits_ref(qr, kr, wr, **kw)
    (torch.where(torch.isfinite(lr), lr, 0.0) * grad.double()).sum().backward()
    return torch.isfinite(lr.detach()), (qr.grad, kr.grad, wr.grad)


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize(("s_q", "h", "d", "s_kv", "kw"), BWD_CASES)
def test_indexer_logits_bwd_kernel(s_q, h, d, s_kv, kw, dtype):
    """Triton backward against float64 autograd; the gradient at masked entries and the outputs are NaN
    beforehand, so a read of a masked entry or an unwritten output shows."""
    dev = kernel_test_device()
    q, k, w = make_inputs(s_q, h, d, s_kv, device=dev, dtype=dtype, seed=s_q + h)
    grad = torch.randn(s_q, s_kv, generator=torch.Generator().manual_seed(h)).to(dev)
    finite, ref = float64_grads(q, k, w, grad, kw)
    grad = torch.where(finite, grad, float("nan"))
    outs = tuple(torch.full_like(t, float("nan")) for t in (q, k, w))
    got = launch_logits_bwd(
        grad, q, k, w, kw.get("causal", False), kw.get("q_start_index", 0), kw.get("k_stride", 1), out=outs
    )
    for name, a, b, x in zip(("dq_idx", "dk_idx", "dweights"), got, ref, (q, k, w), strict=True):
        assert a.dtype == x.dtype, name
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < BWD_TOL[dtype], (name, rel_err(a, b))
    # Keys that no query may see get exactly 0.
    if kw.get("causal"):
        seen = finite.any(0)
        assert torch.all(got[1][~seen.to(dev)] == 0)


def test_indexer_logits_ref_gradcheck_float64():
    q, k, w = make_inputs(4, 2, 6, 5, device="cpu", dtype=torch.float64, seed=3)
    w = w.double()
    for t in (q, k, w):
        t.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: indexer_logits_ref(a, b, c), (q, k, w))


def test_indexer_rejects_bad_inputs():
    q, k, w = make_inputs(4, 2, 16, 5, device="cpu", dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="k_idx must be"):
        indexer_logits(q, k[:, :8], w)
    with pytest.raises(ValueError, match="weights must be"):
        indexer_logits(q, k, w[:, :1])
    with pytest.raises(ValueError, match="d_idx must be a power of two"):
        indexer_logits(q[..., :12], k[:, :12], w)
    with pytest.raises(ValueError, match="k_idx dtype"):
        indexer_logits(q, k.half(), w)
    with pytest.raises(ValueError, match="topk must be"):
        indexer_topk(torch.randn(3, 4), 0)
    with pytest.raises(ValueError, match="attn_sum must have"):
        indexer_kl_loss(torch.randn(3, 4), torch.rand(3, 5))
    with pytest.raises(ValueError, match="reduction"):
        indexer_kl_loss(torch.randn(3, 4), torch.rand(3, 4), reduction="avg")


@pytest.mark.parametrize(
    "kw", [{}, {"causal": True, "q_start_index": 3, "k_stride": 2}], ids=["full", "causal"]
)
def test_indexer_topk_selects_largest(kw):
    g = torch.Generator().manual_seed(4)
    s_q, s_kv, topk = 9, 14, 5
    logits = torch.randn(s_q, s_kv, generator=g)
    idx = indexer_topk(logits, topk, **kw)
    assert idx.shape == (s_q, 1, topk)
    assert idx.dtype == torch.int32
    for t in range(s_q):
        limit = s_kv - 1
        if kw:
            limit = min(limit, max(kw["q_start_index"] + t + 1 - kw["k_stride"], 0) // kw["k_stride"])
        allowed = logits[t, : limit + 1]
        n_valid = min(topk, limit + 1)
        sel = idx[t, 0, :n_valid].long()
        assert torch.all(idx[t, 0, n_valid:] == -1)
        assert torch.all(sel <= limit)
        assert len(set(sel.tolist())) == n_valid
        torch.testing.assert_close(logits[t, sel], allowed.topk(n_valid).values)


def test_indexer_topk_pads_when_short():
    logits = torch.tensor([[0.5, float("-inf"), 2.0]])
    idx = indexer_topk(logits, 5)
    assert idx[0, 0].tolist() == [2, 0, -1, -1, -1]


def test_indexer_kl_loss_matches_ref_and_gradient():
    g = torch.Generator().manual_seed(6)
    s_q, topk = 7, 9
    logits = torch.randn(s_q, topk, generator=g, dtype=torch.float64) * 3
    attn = torch.rand(s_q, topk, generator=g, dtype=torch.float64) * 5
    logits[1, 2] = float("-inf")  # invalid slot
    attn[1, 2] = 0.0
    logits[2] = float("-inf")  # a query with no valid slot
    attn[3] = 0.0  # a query whose target is all zero
    attn[4, :3] = 0.0  # zero target on some valid slots
    for reduction in ("mean", "sum", "none"):
        a = logits.clone().requires_grad_()
        b = logits.clone().requires_grad_()
        la = indexer_kl_loss(a, attn, reduction=reduction)
        lb = indexer_kl_loss_ref(b, attn, reduction=reduction)
        torch.testing.assert_close(la, lb)
        gout = torch.randn_like(la)
        la.backward(gout)
        lb.backward(gout)
        torch.testing.assert_close(a.grad, torch.nan_to_num(b.grad, nan=0.0, neginf=0.0, posinf=0.0))
    # Target on the simplex equal to softmax(I): KL = 0, gradient 0.
    lg = torch.randn(3, 4, dtype=torch.float64)
    z = lg.clone().requires_grad_()
    loss = indexer_kl_loss(z, torch.softmax(lg, -1) * 7.0, reduction="sum")
    loss.backward()
    assert abs(float(loss.detach())) < 1e-12
    assert z.grad.abs().max() < 1e-12


def test_indexer_kl_loss_gradcheck_float64():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 6, generator=g, dtype=torch.float64).requires_grad_()
    attn = torch.rand(4, 6, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: indexer_kl_loss(x, attn), (logits,))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("s_q", "h", "d", "s_kv", "kw"),
    [
        pytest.param(512, 64, 128, 4096, {}, id="S512-H64-D128-K4096"),
        pytest.param(300, 64, 128, 2000, {"causal": True, "q_start_index": 1700, "k_stride": 1}, id="causal"),
    ],
)
def test_indexer_logits_gpu(s_q, h, d, s_kv, kw):
    q, k, w = make_inputs(s_q, h, d, s_kv, device="cuda", dtype=torch.bfloat16, seed=1)
    got = indexer_logits(q, k, w, **kw)
    ref = indexer_logits_ref(q, k, w, **kw)
    assert_logits_close(got, ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_indexer_logits_at_matches_dense_gather(dtype):
    q, k, w = make_inputs(9, 3, 16, 20, device="cpu", dtype=dtype, seed=9)
    g = torch.Generator().manual_seed(10)
    idx = torch.randint(0, 20, (9, 1, 7), generator=g, dtype=torch.int32)
    idx[0, 0, :3] = idx[0, 0, 3]  # duplicates
    idx[1, 0, 2] = -1
    idx[2, 0, 4] = 20  # out of range
    idx[3, 0, :] = -1
    grad = torch.randn(9, 7, generator=g)
    qa, ka, wa = (t.clone().requires_grad_() for t in (q, k, w))
    got = indexer_logits_at(qa, ka, wa, idx)
    valid = (idx[:, 0] >= 0) & (idx[:, 0] < 20)
    assert torch.equal(torch.isfinite(got), valid)
    (torch.where(valid, got, 0.0) * grad).sum().backward()
    qr, kr, wr = (t.float().clone().requires_grad_() for t in (q, k, w))
    dense = indexer_logits_ref(qr, kr, wr)
    ref = dense.gather(1, idx[:, 0].long().clamp(0, 19))
    (torch.where(valid, ref, 0.0) * grad).sum().backward()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)
    for a, b in ((qa, qr), (ka, kr), (wa, wr)):
        torch.testing.assert_close(a.grad.float(), b.grad.to(a.dtype).float(), rtol=2e-2, atol=2e-2)


def test_indexer_logits_at_gradcheck_float64():
    q, k, w = make_inputs(3, 2, 16, 6, device="cpu", dtype=torch.float64, seed=12)
    w = w.double()
    idx = torch.tensor([[[0, 5, 5, -1]], [[2, 3, 6, 1]], [[4, 4, 0, 2]]], dtype=torch.int32)
    for t in (q, k, w):
        t.requires_grad_()
    valid = (idx[:, 0] >= 0) & (idx[:, 0] < 6)
    f = lambda a, b, c: torch.where(valid, indexer_logits_at(a, b, c, idx), 0.0)
    assert torch.autograd.gradcheck(f, (q, k, w))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("s_q", "h", "d", "s_kv", "kw"),
    [
        pytest.param(512, 64, 128, 4096, {}, id="S512-H64-D128-K4096"),
        pytest.param(300, 64, 128, 2000, {"causal": True, "q_start_index": 1700}, id="causal"),
        pytest.param(200, 24, 64, 999, {"causal": True, "q_start_index": 500, "k_stride": 2}, id="H24-st2"),
    ],
)
def test_indexer_logits_bwd_gpu(s_q, h, d, s_kv, kw):
    q, k, w = make_inputs(s_q, h, d, s_kv, device="cuda", dtype=torch.bfloat16, seed=2)
    grad = torch.randn(s_q, s_kv, device="cuda")
    finite, ref = float64_grads(q, k, w, grad, kw)
    grad = torch.where(finite, grad, float("nan"))
    args = (grad, q, k, w, kw.get("causal", False), kw.get("q_start_index", 0), kw.get("k_stride", 1))
    got = launch_logits_bwd(*args)
    again = launch_logits_bwd(*args)
    for name, a, b, c in zip(("dq_idx", "dk_idx", "dweights"), got, ref, again, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < BWD_TOL[torch.bfloat16], (name, rel_err(a, b))
        assert torch.equal(a, c), f"{name} changed between runs"


def test_kl_loss_of_no_query_is_zero():
    lg = torch.zeros(0, 8, requires_grad=True)
    for reduction in ("mean", "sum"):
        loss = indexer_kl_loss(lg, torch.zeros(0, 8), reduction=reduction)
        assert loss.item() == 0.0
        ref = indexer_kl_loss_ref(lg, torch.zeros(0, 8), reduction=reduction)
        assert ref.item() == 0.0
    loss.backward()
    assert lg.grad is not None
    assert lg.grad.shape == (0, 8)


def test_indexer_custom_ops_opcheck():
    """indexer_logits (with its registered backward), its backward op and indexer_target pass
    torch.library.opcheck: schema, fake implementation, autograd registration."""
    dev = kernel_test_device()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 16, 16, generator=g).to(dev)
    k = torch.randn(8, 16, generator=g).to(dev)
    w = torch.randn(4, 16, generator=g).to(dev)
    ops = torch.ops.sparse_mla_attn
    torch.library.opcheck(ops.indexer_logits.default, (q.requires_grad_(), k, w, True, 2, 1))
    grad = torch.randn(4, 8, generator=g).to(dev)
    torch.library.opcheck(ops.indexer_logits_bwd.default, (grad, q.detach(), k, w, True, 2, 1))
    torch.library.opcheck(ops.indexer_target.default, (torch.rand(4, 3, generator=g).to(dev), 0.0))
