"""Invariants of the single-process reference (the ground truth of every other test)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_a2a.reference import combine_per_slot_ref, combine_ref, dispatch_ref, scatter_indices_ref


@st.composite
def routing(draw, *, allow_drop: bool = True, allow_repeat: bool = True):
    world_size = draw(st.integers(1, 4))
    e_local = draw(st.integers(1, 4))
    num_experts = world_size * e_local
    topk = draw(st.integers(1, min(6, num_experts) if not allow_repeat else 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    hidden = draw(st.sampled_from([1, 3, 8]))
    xs, idxs, ws = [], [], []
    for _ in range(world_size):
        n = draw(st.integers(0, 6))
        if allow_repeat:
            idx = torch.randint(0, num_experts, (n, topk), generator=gen)
        else:
            idx = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(n)]).reshape(
                n, topk
            )
        if allow_drop:
            idx[torch.rand(n, topk, generator=gen) < 0.25] = -1
        xs.append(torch.randn(n, hidden, generator=gen))
        idxs.append(idx.to(torch.int32))
        ws.append(torch.rand(n, topk, generator=gen))
    return num_experts, xs, idxs, ws


@settings(max_examples=60, deadline=None)
@given(routing())
def test_every_kept_slot_delivered_exactly_once(case) -> None:
    num_experts, xs, idxs, ws = case
    world_size = len(xs)
    e_local = num_experts // world_size
    received, scatter = dispatch_ref(xs, idxs, ws, num_tot_experts=num_experts)
    delivered = []
    for d, rec in enumerate(received):
        for r in range(rec.output.shape[0]):
            s, t, k = int(rec.src_rank[r]), int(rec.src_token[r]), int(rec.src_slot[r])
            e = int(idxs[s][t, k])
            assert e // e_local == d, "row delivered to a rank that does not host its expert"
            assert int(rec.local_expert[r]) == e % e_local
            assert torch.equal(rec.output[r], xs[s][t])
            assert rec.weights is not None
            assert rec.weights[r] == ws[s][t, k]
            assert int(scatter[s][t, k]) == r
            delivered.append((s, t, k))
        # rows ordered by (local expert, source rank, token, slot), counts consistent
        keys = list(
            zip(
                rec.local_expert.tolist(),
                rec.src_rank.tolist(),
                rec.src_token.tolist(),
                rec.src_slot.tolist(),
                strict=True,
            )
        )
        assert keys == sorted(keys)
        assert int(rec.num_recv_tokens_per_expert.sum()) == rec.output.shape[0]
        assert rec.num_recv_tokens_per_rank.tolist() == [
            int((rec.src_rank == s).sum()) for s in range(world_size)
        ]
    kept = [(s, t, k) for s, idx in enumerate(idxs) for t, k in torch.nonzero(idx >= 0).tolist()]
    assert sorted(delivered) == sorted(kept)
    for s, idx in enumerate(idxs):
        assert torch.equal(scatter[s] < 0, idx < 0)


@settings(max_examples=40, deadline=None)
@given(routing(allow_drop=False))
def test_identity_expert_combine_is_topk_times_input(case) -> None:
    num_experts, xs, idxs, _ = case
    received, scatter = dispatch_ref(xs, idxs, None, num_tot_experts=num_experts)
    assert all(rec.weights is None for rec in received)
    out = combine_ref([rec.output for rec in received], idxs, scatter, num_tot_experts=num_experts)
    for x, idx, o in zip(xs, idxs, out, strict=True):
        torch.testing.assert_close(o, x * idx.shape[1], rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(routing())
def test_combine_is_sum_of_kept_slots(case) -> None:
    num_experts, xs, idxs, ws = case
    received, scatter = dispatch_ref(xs, idxs, ws, num_tot_experts=num_experts)
    # expert "computation": scale each row by its weight and its local expert id + 1
    ys = [rec.output * rec.weights[:, None] * (rec.local_expert[:, None] + 1) for rec in received]  # type: ignore[index]
    out = combine_ref(ys, idxs, scatter, num_tot_experts=num_experts)
    per_slot = combine_per_slot_ref(ys, idxs, scatter, num_tot_experts=num_experts)
    e_local = num_experts // len(xs)
    for x, idx, w, o, p in zip(xs, idxs, ws, out, per_slot, strict=True):
        kept = (idx >= 0).float()
        factor = (w * kept * (idx.clamp(min=0) % e_local + 1)).sum(1, keepdim=True)
        torch.testing.assert_close(o, x * factor, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p.sum(1), o, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(routing(), st.integers(0, 2**31 - 1))
def test_full_scatter_indices_place_rows(case, seed) -> None:
    num_experts, xs, idxs, ws = case
    world_size = len(xs)
    default = scatter_indices_ref(idxs, num_tot_experts=num_experts)
    # a random permutation of each receiver's rows, expressed as caller-given positions
    gen = torch.Generator().manual_seed(seed)
    e_local = num_experts // world_size
    counts = [sum(int(((i >= 0) & (i // e_local == d)).sum()) for i in idxs) for d in range(world_size)]
    perms = [torch.randperm(c, generator=gen) for c in counts]
    custom = []
    for idx, sc in zip(idxs, default, strict=True):
        dest = torch.where(idx >= 0, idx.long() // e_local, 0)
        mapped = torch.full_like(sc, -1)
        for t, k in torch.nonzero(idx >= 0).tolist():
            mapped[t, k] = perms[int(dest[t, k])][int(sc[t, k])]
        custom.append(mapped)
    base, _ = dispatch_ref(xs, idxs, ws, num_tot_experts=num_experts)
    moved, scatter = dispatch_ref(xs, idxs, ws, num_tot_experts=num_experts, full_scatter_indices=custom)
    for d in range(world_size):
        new_out = torch.empty_like(base[d].output)
        new_out[perms[d]] = base[d].output
        assert torch.equal(moved[d].output, new_out)
    for s in range(world_size):
        assert torch.equal(scatter[s], custom[s])


def test_full_scatter_indices_must_cover_rows() -> None:
    idx = [torch.tensor([[0, 1]]), torch.tensor([[1, 0]])]
    xs = [torch.ones(1, 2), torch.ones(1, 2)]
    bad = [torch.tensor([[0, 0]]), torch.tensor([[0, 0]])]  # two rows claim row 0 of each receiver
    with pytest.raises(ValueError, match="full_scatter_indices"):
        dispatch_ref(xs, idx, None, num_tot_experts=2, full_scatter_indices=bad)


def test_reference_rejects_bad_indices() -> None:
    with pytest.raises(ValueError, match="exp_indices"):
        dispatch_ref([torch.ones(1, 2)], [torch.tensor([[3]])], None, num_tot_experts=2)
    with pytest.raises(ValueError, match="divisible"):
        dispatch_ref([torch.ones(1, 2)] * 2, [torch.tensor([[0]])] * 2, None, num_tot_experts=3)


def test_bf16_combine_accumulates_in_fp32() -> None:
    # 1 + 8 * 2^-8 is exact in fp32 but every partial sum would round away in bf16
    x = torch.tensor([[1.0]], dtype=torch.bfloat16)
    idx = torch.zeros(1, 9, dtype=torch.int32)
    received, scatter = dispatch_ref([x], [idx], None, num_tot_experts=1)
    rows = received[0].output.clone()
    rows[1:] = 2.0**-8
    (out,) = combine_ref([rows], [idx], scatter, num_tot_experts=1)
    assert out.dtype == torch.bfloat16
    assert float(out) == pytest.approx(1.03125)
