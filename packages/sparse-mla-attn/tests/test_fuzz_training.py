"""Property-based fuzzing of the training ops on CPU (Triton interpreter), bounded in examples: the
backward and the lightning indexer (logits with their backward, top-k, target, KL loss).

Random tiny shapes, any int32 index values (far out of range included), causal settings, NaN in KV rows no
valid index selects, and non-finite or empty indexer inputs. Asserted: no exception besides the
documented ``ValueError``, results equal to the float32 references (the same non-finite entries, the
finite ones within tolerance), and the invariants of top-k selection and of the target distribution.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_mla_attn import (
    indexer_kl_loss,
    indexer_kl_loss_ref,
    indexer_logits,
    indexer_logits_ref,
    indexer_target,
    indexer_topk,
    sparse_mla_bwd,
    sparse_mla_bwd_ref,
)
from sparse_mla_attn._inputs import kernel_test_device
from sparse_mla_attn.reference import sparse_mla_ref

FUZZ = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INDEX_ZOO = [-(2**31), -7, -1, 2**31 - 1, 10**9]


def close_where_finite(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Same non-finite pattern as the reference; finite entries within ``tol`` of its largest magnitude (at
    least 0.01: cancellation leaves rounding noise where the reference is 0)."""
    got, ref = got.float().cpu(), ref.float().cpu()
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref))
    fin = torch.isfinite(ref)
    scale = float(ref[fin].abs().max()) if fin.any() else 1.0
    torch.testing.assert_close(got[fin], ref[fin], rtol=tol, atol=tol * max(scale, 1e-2))


@st.composite
def bwd_problems(draw: st.DrawFn) -> dict:
    s_q = draw(st.integers(0, 3))
    h_q = draw(st.integers(1, 18))
    d_v = draw(st.sampled_from([16, 32]))
    d_qk = d_v + draw(st.sampled_from([0, 16]))
    s_kv = draw(st.integers(1, 24))
    topk = draw(st.integers(1, 20))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    idx = torch.randint(-2, s_kv + 2, (s_q, 1, topk), generator=g, dtype=torch.int32)
    zoo = torch.tensor(INDEX_ZOO, dtype=torch.int32)[torch.randint(0, len(INDEX_ZOO), idx.shape, generator=g)]
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.15, zoo, idx)
    kw: dict = {}
    if draw(st.booleans()):
        kw = {"causal": True, "q_start_index": draw(st.integers(0, 30)), "k_stride": draw(st.integers(1, 3))}
    return {
        "q": torch.randn(s_q, h_q, d_qk, generator=g),
        "kv": torch.randn(s_kv, 1, d_qk, generator=g),
        "dout": torch.randn(s_q, h_q, d_v, generator=g),
        "idx": idx,
        "d_v": d_v,
        "kw": kw,
        "deterministic": draw(st.booleans()),
    }


@FUZZ
@given(p=bwd_problems())
def test_fuzz_backward(p):
    """dq / dkv against the float32 reference; KV rows no valid slot selects hold NaN and get 0."""
    dev = kernel_test_device()
    q, kv, dout, idx = (p[k].to(dev) for k in ("q", "kv", "dout", "idx"))
    out, lse = sparse_mla_ref(q, kv, idx, 0.3, p["d_v"], **p["kw"])
    r_dq, r_dkv = sparse_mla_bwd_ref(q, kv, out, dout, idx, lse, 0.3, p["d_v"], **p["kw"])
    used = r_dkv.abs().sum((1, 2)) > 0
    kv_poisoned = torch.where(used[:, None, None], kv, float("nan"))
    dq, dkv = sparse_mla_bwd(
        q, kv_poisoned, out, dout, idx, lse, 0.3, p["d_v"], deterministic=p["deterministic"], **p["kw"]
    )
    close_where_finite(dq, r_dq, 1e-3)
    close_where_finite(dkv, r_dkv, 1e-3)


@st.composite
def indexer_problems(draw: st.DrawFn) -> dict:
    s_q = draw(st.integers(0, 5))
    h = draw(st.integers(1, 20))
    d = draw(st.sampled_from([16, 32]))
    s_kv = draw(st.integers(1, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kw: dict = {}
    if draw(st.booleans()):
        kw = {"causal": True, "q_start_index": draw(st.integers(0, 40)), "k_stride": draw(st.integers(1, 3))}
    return {
        "q": torch.randn(s_q, h, d, generator=g),
        "k": torch.randn(s_kv, d, generator=g),
        "w": torch.randn(s_q, h, generator=g),
        "grad": torch.randn(s_q, s_kv, generator=g),
        "topk": draw(st.integers(1, 48)),
        "kw": kw,
    }


@FUZZ
@given(p=indexer_problems())
def test_fuzz_indexer(p):
    """Logits and their gradients against the reference; top-k picks the largest selectable logits."""
    dev = kernel_test_device()
    q, k, w = (p[n].to(dev).requires_grad_() for n in ("q", "k", "w"))
    logits = indexer_logits(q, k, w, **p["kw"])
    qr, kr, wr = (t.detach().clone().requires_grad_() for t in (q, k, w))
    ref = indexer_logits_ref(qr, kr, wr, **p["kw"])
    close_where_finite(logits.detach(), ref.detach(), 1e-4)
    grad = p["grad"].to(dev)
    (torch.where(torch.isfinite(logits), logits, 0.0) * grad).sum().backward()
    (torch.where(torch.isfinite(ref), ref, 0.0) * grad).sum().backward()
    for a, b in ((q, qr), (k, kr), (w, wr)):
        close_where_finite(a.grad, b.grad, 1e-3)

    top = indexer_topk(logits.detach(), p["topk"], **p["kw"])
    s_q = logits.shape[0]
    assert top.shape == (s_q, 1, p["topk"])
    assert top.dtype == torch.int32
    sel = top[:, 0].long().cpu()
    lg = ref.detach().cpu()
    n_finite = torch.isfinite(lg).sum(-1)
    for t in range(s_q):
        picked = sel[t][sel[t] >= 0]
        # Every selectable key up to topk is picked, each once, in descending order, then -1.
        assert len(picked) == min(p["topk"], int(n_finite[t]))
        assert bool((sel[t][len(picked) :] == -1).all())
        assert len(set(picked.tolist())) == len(picked)
        vals = lg[t, picked]
        assert bool(torch.isfinite(vals).all())
        assert bool((vals[:-1] >= vals[1:]).all())
        if len(picked) < int(n_finite[t]):
            rest = lg[t].clone()
            rest[picked] = float("-inf")
            assert float(rest.max()) <= float(vals.min())


@FUZZ
@given(
    s_q=st.integers(0, 4),
    topk=st.integers(1, 12),
    special=st.sampled_from(["none", "neginf", "zeros", "huge"]),
    seed=st.integers(0, 2**16),
    reduction=st.sampled_from(["mean", "sum", "none"]),
)
def test_fuzz_target_and_kl_loss(s_q, topk, special, seed, reduction):
    """The target is a distribution per row (or all 0); the loss and its gradient match the float64
    reference for -inf logits (invalid slots), all-zero targets and huge logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(s_q, topk, generator=g) * 3
    attn = torch.rand(s_q, topk, generator=g)
    if special == "neginf":
        logits = logits.masked_fill(torch.rand(s_q, topk, generator=g) < 0.4, float("-inf"))
    elif special == "zeros":
        attn = attn.masked_fill(torch.rand(s_q, 1, generator=g) < 0.5, 0.0)
    elif special == "huge":
        logits = logits * 1e4
    target = indexer_target(attn)
    sums = target.sum(-1)
    assert bool(((sums - 1).abs() < 1e-5).logical_or(sums == 0).all())
    assert bool((target >= 0).all())
    lg = logits.clone().requires_grad_()
    loss = indexer_kl_loss(lg, target, reduction=reduction)
    lr = logits.double().clone().requires_grad_()
    ref = indexer_kl_loss_ref(lr, target.double(), reduction=reduction)
    assert bool(torch.isfinite(loss).all())
    torch.testing.assert_close(loss.double(), ref, rtol=1e-4, atol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(lg.grad.double(), lr.grad, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="attn_sum"):
        indexer_target(attn - 2.0 if attn.numel() else torch.full((1, 1), -1.0))
