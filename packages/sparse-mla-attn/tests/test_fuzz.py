"""Property-based fuzzing of the public ops on CPU (Triton interpreter), bounded in examples.

Random shapes, index values (any int32, including far out of range), causal settings, optional
arguments, NaN in unselected and selected KV rows, large values, and non-finite or empty indexer inputs.
Asserted: the ops raise nothing, their outputs (and the backward's and the indexer's gradients) match the
float32 references (the same non-finite entries, the finite ones within tolerance), top-k selection and
the target distribution keep their invariants, and malformed arguments raise only the documented
``ValueError`` / ``TypeError``.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_mla_attn import (
    attn_dist,
    attn_dist_ref,
    indexer_kl_loss,
    indexer_kl_loss_ref,
    indexer_logits,
    indexer_logits_ref,
    indexer_target,
    indexer_topk,
    quantize_fp8_kv_cache,
    sparse_mla_bwd,
    sparse_mla_bwd_ref,
    sparse_mla_decode,
    sparse_mla_decode_ref,
    sparse_mla_fwd,
    sparse_mla_fwd_ref,
)
from sparse_mla_attn._inputs import kernel_test_device
from sparse_mla_attn.reference import sparse_mla_ref

FUZZ = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INDEX_ZOO = [-(2**31), -7, -1, 2**31 - 1, 10**9]


def assert_like_reference(got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> None:
    """Same non-finite entries as the reference, finite ones close."""
    got, ref = got.float().cpu(), ref.float().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(got[fin], ref[fin], atol=atol, rtol=rtol)
    assert torch.equal(got[torch.isinf(ref)], ref[torch.isinf(ref)])


@st.composite
def sparse_problems(draw: st.DrawFn) -> dict:
    s_q = draw(st.integers(0, 3))
    h_q = draw(st.integers(1, 20))
    d_qk = draw(st.sampled_from([512, 576]))
    s_kv = draw(st.integers(1, 40))
    topk = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-3, s_kv + 3, (s_q, 1, topk), generator=g, dtype=torch.int32)
    zoo = torch.tensor(INDEX_ZOO, dtype=torch.int32)[torch.randint(0, len(INDEX_ZOO), idx.shape, generator=g)]
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.15, zoo, idx)
    kv = torch.randn(s_kv, 1, d_qk, generator=g)
    used = torch.zeros(s_kv, dtype=torch.bool)
    flat = idx.flatten().long()
    used[flat[(flat >= 0) & (flat < s_kv)]] = True
    kv[~used] = float("nan")  # never read
    if draw(st.booleans()) and s_kv > 1:
        kv[draw(st.integers(0, s_kv - 1)), 0, 0] = draw(st.sampled_from([float("nan"), 1e4, -1e4]))
    kw: dict = {}
    if draw(st.booleans()):
        kw.update(causal=True, q_start_index=draw(st.integers(0, 50)), k_stride=draw(st.integers(1, 4)))
    if draw(st.booleans()):
        kw["attn_sink"] = torch.randn(h_q, generator=g)
    if draw(st.booleans()):
        kw["topk_length"] = torch.randint(-2, topk + 3, (s_q,), generator=g, dtype=torch.int32)
    q = torch.randn(s_q, h_q, d_qk, generator=g)
    return {"q": q.bfloat16(), "kv": kv.bfloat16(), "idx": idx, "kw": kw, "scale": 1 / math.sqrt(d_qk)}


@FUZZ
@given(p=sparse_problems())
def test_fuzz_forward_and_attn_dist(p):
    dev = kernel_test_device()
    q, kv, idx, kw = (
        p["q"].to(dev),
        p["kv"].to(dev),
        p["idx"].to(dev),
        {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in p["kw"].items()},
    )
    out, max_logits, lse = sparse_mla_fwd(q, kv, idx, p["scale"], **kw)
    r_out, r_max, r_lse = sparse_mla_fwd_ref(q.float(), kv.float(), idx, p["scale"], **kw)
    assert_like_reference(out, r_out, 2e-2, 2e-2)
    # Where NaN reached a query's output its lse and max_logits are unspecified (documented).
    ok = torch.isfinite(r_out).all(-1).cpu()
    assert_like_reference(max_logits.cpu()[ok], r_max.cpu()[ok], 1e-3, 1e-4)
    assert_like_reference(lse.cpu()[ok], r_lse.cpu()[ok], 1e-3, 1e-4)
    if not ok.all():
        return
    causal = {k: kw[k] for k in ("causal", "q_start_index", "k_stride") if k in kw}
    if "topk_length" in kw or "attn_sink" in kw:
        return  # attn_dist has neither; its lse must be the forward's without them
    got = attn_dist(
        q, kv, idx, lse, p["scale"], causal=bool(causal), **{k: v for k, v in causal.items() if k != "causal"}
    )
    ref = attn_dist_ref(
        q, kv, idx, lse, p["scale"], causal=bool(causal), **{k: v for k, v in causal.items() if k != "causal"}
    )
    assert_like_reference(got, ref, 1e-3, 1e-3)


@FUZZ
@given(
    b=st.integers(0, 3),
    s_q=st.integers(1, 2),
    h_q=st.integers(1, 20),
    block=st.sampled_from([4, 16]),
    topk=st.integers(1, 24),
    seed=st.integers(0, 2**16),
    fp8=st.booleans(),
    index_kind=st.sampled_from(["positions", "cache_rows"]),
    empty_lse=st.sampled_from([-math.inf, math.inf]),
)
def test_fuzz_decode(b, s_q, h_q, block, topk, seed, fp8, index_kind, empty_lse):
    dev = kernel_test_device()
    g = torch.Generator().manual_seed(seed)
    num_blocks, max_blocks = 6, 4
    cache = torch.randn(num_blocks, block, 1, 576, generator=g).bfloat16()
    if fp8:
        cache = quantize_fp8_kv_cache(cache)
    # Table entries may point outside the cache and sequence lengths past the table: never followed.
    table = torch.randint(-2, num_blocks + 2, (b, max_blocks), generator=g, dtype=torch.int32)
    seqlens = torch.randint(-1, max_blocks * block + 5, (b,), generator=g, dtype=torch.int32)
    # Positions, or cache rows (some past the cache): invalid ones are never read.
    hi = max_blocks * block if index_kind == "positions" else num_blocks * block
    idx = torch.randint(-3, hi + 3, (b, s_q, topk), generator=g, dtype=torch.int32)
    q = torch.randn(b, s_q, h_q, 576, generator=g).bfloat16()
    args = [t.to(dev) for t in (q, cache, table, seqlens, idx)]
    out, lse = sparse_mla_decode(*args, 0.05, index_kind=index_kind, empty_lse=empty_lse)
    assert out.shape == (b, s_q, h_q, 512)
    r_out, r_lse = sparse_mla_decode_ref(
        q.float(), cache if fp8 else cache.float(), table, seqlens, idx, 0.05, index_kind=index_kind,
        empty_lse=empty_lse,
    )  # fmt: skip
    assert_like_reference(out, r_out, 2e-2, 2e-2)
    assert_like_reference(lse, r_lse, 1e-3, 1e-4)


MUTATIONS = {
    "q-float64": lambda a: {**a, "q": a["q"].double()},
    "kv-rank": lambda a: {**a, "kv": a["kv"][:, 0]},
    "kv-dtype": lambda a: {**a, "kv": a["kv"].half()},
    "idx-int64": lambda a: {**a, "idx": a["idx"].long()},
    "idx-rows": lambda a: {**a, "idx": a["idx"][:1]},
    "q-strided": lambda a: {**a, "q": a["q"].transpose(0, 2).contiguous().transpose(0, 2)},
    "d_qk": lambda a: {**a, "q": a["q"][..., :320], "kv": a["kv"][..., :320]},
    "sm_scale-nan": lambda a: {**a, "scale": float("nan")},
    "k_stride-0": lambda a: {**a, "kw": {"causal": True, "k_stride": 0}},
    "q_start-neg": lambda a: {**a, "kw": {"causal": True, "q_start_index": -1}},
    "sink-shape": lambda a: {**a, "kw": {"attn_sink": torch.zeros(3)}},
    "not-a-tensor": lambda a: {**a, "idx": [[0]]},
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_bad_arguments_raise_documented_errors(name):
    dev = kernel_test_device()
    base = {
        "q": torch.randn(2, 4, 576, device=dev).bfloat16(),
        "kv": torch.randn(8, 1, 576, device=dev).bfloat16(),
        "idx": torch.zeros(2, 1, 3, dtype=torch.int32, device=dev),
        "scale": 0.1,
        "kw": {},
    }
    a = MUTATIONS[name](base)
    with pytest.raises((ValueError, TypeError)):
        sparse_mla_fwd(a["q"], a["kv"], a["idx"], a["scale"], **a["kw"])


# ------------------------------------------------------------------ training: backward and indexer


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


# ------------------------------------------------------------------ any argument of any op, corrupted


def _valid_calls(dev: str) -> dict:
    """Small valid positional arguments and options of every public op."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 576, generator=g).bfloat16().to(dev)
    kv = torch.randn(8, 1, 576, generator=g).bfloat16().to(dev)
    idx = torch.randint(0, 8, (2, 1, 3), generator=g, dtype=torch.int32).to(dev)
    lse = torch.randn(2, 4, generator=g).to(dev)
    out = torch.randn(2, 4, 512, generator=g).bfloat16().to(dev)
    cache = torch.randn(2, 8, 1, 576, generator=g).bfloat16().to(dev)
    table = torch.tensor([[1, 0]], dtype=torch.int32, device=dev)
    seqlens = torch.tensor([12], dtype=torch.int32, device=dev)
    q_idx = torch.randn(2, 4, 16, generator=g).to(dev)
    k_idx = torch.randn(8, 16, generator=g).to(dev)
    w = torch.randn(2, 4, generator=g).to(dev)
    logits = torch.randn(2, 3, generator=g).to(dev)
    attn = torch.rand(2, 3, generator=g).to(dev)
    return {
        "sparse_mla_fwd": (sparse_mla_fwd, [q, kv, idx, 0.1], {"causal": True, "q_start_index": 1}),
        "attn_dist": (attn_dist, [q, kv, idx, lse, 0.1], {"k_stride": 1}),
        "sparse_mla_decode": (
            sparse_mla_decode,
            [q[None, :1], cache, table, seqlens, idx[:1, :, :3], 0.1],
            {},
        ),
        "sparse_mla_decode_fp8": (
            sparse_mla_decode,
            [q[None, :1], quantize_fp8_kv_cache(cache), None, None, idx[:1, :, :3], 0.1],
            {"index_kind": "cache_rows", "empty_lse": math.inf},
        ),
        "sparse_mla_bwd": (sparse_mla_bwd, [q, kv, out, out, idx, lse, 0.1], {"deterministic": True}),
        "indexer_logits": (indexer_logits, [q_idx, k_idx, w], {"causal": True}),
        "indexer_topk": (indexer_topk, [logits, 2], {"causal": True}),
        "indexer_target": (indexer_target, [attn], {}),
        "indexer_kl_loss": (indexer_kl_loss, [logits, attn], {"reduction": "sum"}),
    }


JUNK = [
    None, [[0]], "x", 1.5, -1, 0, 2**40, float("nan"), float("inf"), True,
    "dtype-int64", "dtype-float64", "dtype-bool", "rank-down", "rank-up", "empty", "strided",
]  # fmt: skip


def _corrupt(value: object, junk: object) -> object:
    if not isinstance(junk, str) or junk == "x" or not isinstance(value, torch.Tensor):
        return junk
    if junk.startswith("dtype-"):
        return value.to(getattr(torch, junk.removeprefix("dtype-")))
    if junk == "rank-down":
        return value[0]
    if junk == "rank-up":
        return value[None]
    if junk == "empty":
        return value[:0]
    return value.transpose(0, -1) if value.dim() > 1 else value[::2]  # strided


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(sorted(_valid_calls("cpu"))), data=st.data())
def test_fuzz_any_argument_raises_only_documented_errors(op, data):
    """Any one argument (or option) of any public op replaced by junk: the op either runs or raises
    ``ValueError`` / ``TypeError``; never an error from deep inside (IndexError, RuntimeError, a crash)."""
    fn, args, kw = _valid_calls(kernel_test_device())[op]
    names = [*range(len(args)), *kw]
    where = data.draw(st.sampled_from(names))
    junk = data.draw(st.sampled_from(JUNK))
    if isinstance(where, int):
        args[where] = _corrupt(args[where], junk)
    else:
        kw[where] = _corrupt(kw[where], junk)
    with contextlib.suppress(ValueError, TypeError):
        fn(*args, **kw)
