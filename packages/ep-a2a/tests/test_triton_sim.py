"""The Triton fast path's kernels in a single-process simulation of 2-4 ranks, against ep_a2a.reference.

Runs under ``TRITON_INTERPRET=1`` (CPU buffers as the symmetric heaps, one shared pointer table;
producers launched before consumers). Dispatch must be bit-identical to the reference (rows, weights,
local experts, counts, token_dst_scatter_idx); combine within bf16 rounding of the float32 reference
(the expert side rounds each per-(token, rank) partial sum to the row dtype once).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ep_a2a.backends.triton import kernels as K
from ep_a2a.backends.triton.engine import (
    COMBINE_TILE_PER_THREAD,
    WHOLE_ROW_MAX_CHUNK,
    EPTimeoutFromDevice,
    HeapLayout,
    TritonEPEngine,
    fp8_row_bytes,
    interpreting,
    pack_fp8_rows,
)
from ep_a2a.backends.triton.simulate import SimWorld
from ep_a2a.reference import combine_per_slot_ref, combine_ref, dispatch_ref

# The simulation shares plain CPU buffers between "ranks": only Triton's interpreter can run it, and the
# variable must be set before Triton compiles anything (so not here: `nox -s tests` sets it).
pytestmark = pytest.mark.skipif(
    not interpreting(),
    reason="needs TRITON_INTERPRET=1 (set by `nox -s tests`; the CPU simulation runs in Triton's interpreter)",
)

# combine tolerance per row dtype, relative to sum_k |row_k| of each token: each partial sum is rounded
# once and the total once, so two roundings. The interpreter's float32 -> bf16 cast truncates (one ulp,
# 2**-7, instead of half an ulp), hence 2 * 2**-7 for bf16 here; the GPU tests use 2 * 2**-8.
COMBINE_RTOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-10, torch.float32: 1e-6}


def _routing(
    n: int, topk: int, num_experts: int, gen: torch.Generator, *, skew: bool, drop: float
) -> torch.Tensor:
    if n == 0:
        return torch.empty(0, topk, dtype=torch.int32)
    if skew:  # most slots on the first few experts (and so on rank 0)
        logits = -torch.arange(num_experts, dtype=torch.float32) * 0.7
        probs = torch.softmax(logits, 0).expand(n, -1)
        ids = torch.multinomial(probs, topk, replacement=False, generator=gen)
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(n)])
    ids = ids.to(torch.int32)
    if drop:
        ids[torch.rand(ids.shape, generator=gen) < drop] = -1
    return ids


def _check_dispatch(res, ref, scat, weights_given: bool) -> None:
    for r, (got, want) in enumerate(zip(res, ref, strict=True)):
        assert got.output.shape == want.output.shape, (
            f"rank {r}: rows {got.output.shape} != {want.output.shape}"
        )
        assert torch.equal(
            got.output.view(torch.uint8 if got.output.dtype.itemsize == 1 else got.output.dtype), want.output
        ), f"rank {r}: rows differ"
        assert torch.equal(got.local_expert.long(), want.local_expert), f"rank {r}: local experts differ"
        assert torch.equal(got.num_recv_tokens_per_expert, want.num_recv_tokens_per_expert)
        assert torch.equal(got.num_recv_tokens_per_rank, want.num_recv_tokens_per_rank)
        assert torch.equal(got.token_dst_scatter_idx.long(), scat[r]), (
            f"rank {r}: token_dst_scatter_idx differs"
        )
        if weights_given:
            assert torch.equal(got.weights, want.weights), f"rank {r}: weights differ"


def _check_skip_mapping(res, ids_all, e_local: int) -> None:
    for r, ids in enumerate(ids_all):
        got = res[r].skipped_token_topk_mapping_indices
        dest = torch.where(ids >= 0, ids.long() // e_local, -1)
        for t in range(ids.shape[0]):
            for k in range(ids.shape[1]):
                want = -1 if ids[t, k] < 0 else next(k2 for k2 in range(k + 1) if dest[t, k2] == dest[t, k])
                assert int(got[t, k]) == want, f"rank {r} slot ({t},{k}): {int(got[t, k])} != {want}"


def _check_combine(outs, ys, ids_all, scat, num_experts: int, dtype: torch.dtype) -> None:
    want = combine_ref([y.float() for y in ys], ids_all, scat, num_tot_experts=num_experts)
    scale = combine_ref([y.float().abs() for y in ys], ids_all, scat, num_tot_experts=num_experts)
    for r, (got, ref, mag) in enumerate(zip(outs, want, scale, strict=True)):
        assert got.dtype == dtype
        assert not torch.isnan(got).any(), f"rank {r}: unwritten combine output"
        err = (got.float() - ref).abs()
        bound = COMBINE_RTOL[dtype] * mag + 1e-30
        assert bool((err <= bound).all()), (
            f"rank {r}: combine error {float((err - bound).max())} over the bound"
        )


CASES = [
    # world, tokens per rank, hidden, topk, experts, dtype, weights, skew, drop
    pytest.param(2, [6, 5], 32, 4, 8, torch.bfloat16, True, False, 0.0, id="W2-n6,5-H32-k4-E8-bf16"),
    pytest.param(2, [7, 0], 32, 2, 4, torch.bfloat16, False, False, 0.2, id="W2-n7,0-k2-E4-noW-drop"),
    pytest.param(3, [4, 6, 1], 16, 3, 6, torch.float32, True, True, 0.1, id="W3-n4,6,1-H16-k3-E6-f32-skew"),
    pytest.param(4, [5, 3, 6, 2], 32, 1, 8, torch.bfloat16, True, False, 0.0, id="W4-k1-E8"),
    pytest.param(
        4, [6, 6, 0, 4], 48, 8, 16, torch.float16, True, True, 0.15, id="W4-H48-k8-E16-f16-skew-drop"
    ),
    # 8 ranks, the size of one HGX node
    pytest.param(
        8, [3, 0, 4, 2, 5, 1, 3, 2], 16, 4, 16, torch.bfloat16, True, True, 0.1, id="W8-H16-k4-E16-skew-drop"
    ),
]


@pytest.mark.parametrize(
    ("world", "ns", "hidden", "topk", "experts", "dtype", "with_w", "skew", "drop"), CASES
)
def test_dispatch_combine_matches_reference(world, ns, hidden, topk, experts, dtype, with_w, skew, drop):
    gen = torch.Generator().manual_seed(1234 + world * 100 + hidden + topk)
    max_tokens = max(ns)
    sim = SimWorld(
        world_size=world, max_tokens=max_tokens, hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=dtype, num_sm=2, chunk=4,
    )  # fmt: skip
    # three calls with fresh inputs: monotone epochs, count parity and buffer reuse across calls, both
    # dispatch flows (receive layout in its own launch, or merged into the row kernel) one after another,
    # the last with the row kernel's CTAs split into senders and writers
    _round_trips(sim, ns, ((False, 0), (True, 0), (True, 1)), gen, with_w=with_w, skew=skew, drop=drop)


@pytest.mark.parametrize("chunk", [1, 2])
@pytest.mark.parametrize(
    ("world", "ns", "hidden", "topk", "experts", "dtype", "with_w", "skew", "drop"),
    [CASES[0], CASES[2], CASES[4]],
)
def test_decode_chunks_match_reference(world, ns, hidden, topk, experts, dtype, with_w, skew, drop, chunk):
    """Chunks of at most ``WHOLE_ROW_MAX_CHUNK`` tokens hold whole rows in registers: the same three
    flows as above, down to one token per work item. The merged flow sends each program's first chunk
    before the receive layout (``early_send``), and writes its own rows after."""
    assert chunk <= WHOLE_ROW_MAX_CHUNK
    gen = torch.Generator().manual_seed(99 + world * 10 + chunk)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=dtype, num_sm=2, chunk=chunk,
    )  # fmt: skip
    assert sim.engines[0].whole_row
    assert sim.engines[0].early_send
    _round_trips(sim, ns, ((False, 0), (True, 0), (True, 1)), gen, with_w=with_w, skew=skew, drop=drop)


def test_decode_chunks_without_early_send():
    """``TritonTuning(early_send=False)``: the merged flow's programs wait for the receive layout before
    they send, with the same results."""
    world, ns, hidden, topk, experts, dtype, with_w, skew, drop = CASES[2].values
    gen = torch.Generator().manual_seed(4242)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=dtype, num_sm=2, chunk=1, early_send=False,
    )  # fmt: skip
    assert not sim.engines[0].early_send
    _round_trips(sim, ns, ((True, 0),), gen, with_w=with_w, skew=skew, drop=drop)


@pytest.mark.parametrize("node", [None, 2], ids=["intra", "remote"])
@pytest.mark.parametrize("combine_chunk", [1, 4, 8])
def test_combine_chunk_differs_from_dispatch_chunk(combine_chunk, node):
    """The combine kernel's own chunk (its work items and flags) against the reference: smaller than,
    larger than and equal to the dispatch chunk's token count, on one node and with remote peers."""
    world, ns, hidden, topk, experts = 4, [6, 6, 0, 4], 48, 4, 16
    gen = torch.Generator().manual_seed(31 + combine_chunk)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=torch.bfloat16, num_sm=2, chunk=2, combine_chunk=combine_chunk, node_size=node,
    )  # fmt: skip
    assert sim.engines[0].combine_chunk == combine_chunk
    assert sim.layout.cnchunks == -(-max(ns) // combine_chunk)
    flows = ((False, 0), (True, 0), (True, 1)) if node is None else ((False, 0), (False, 1))
    _round_trips(sim, ns, flows, gen, with_w=True, skew=True, drop=0.1)
    if node is not None:
        sim.check_decoy()


@pytest.mark.parametrize("node", [None, 2], ids=["intra", "remote"])
@pytest.mark.parametrize(
    ("hidden", "block_h", "combine_block_h"),
    [
        pytest.param(48, 16, 16, id="H48-three-even-tiles"),
        pytest.param(40, 16, 32, id="H40-partial-last-tile"),
    ],
)
def test_rows_in_several_tiles(hidden, block_h, combine_block_h, node):
    """Rows wider than one tile: the dispatch's tile-ahead loads and the combine's next-tile gathers
    (the other tests fit a row in one tile), on one node and with remote peers."""
    world, ns, topk, experts = 4, [6, 6, 0, 4], 4, 16
    gen = torch.Generator().manual_seed(hidden + block_h)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=torch.bfloat16, num_sm=2, chunk=4, block_h=block_h, combine_block_h=combine_block_h,
        node_size=node,
    )  # fmt: skip
    assert (sim.engines[0].block_h, sim.engines[0].combine_block_h) == (block_h, combine_block_h)
    flows = ((False, 0), (True, 0), (True, 1)) if node is None else ((False, 0), (False, 1))
    _round_trips(sim, ns, flows, gen, with_w=True, skew=True, drop=0.1)
    if node is not None:
        sim.check_decoy()


def test_combine_tile_arguments():
    """The combine kernel's tile: checked against the layout, defaults from the dispatch kernel's, and a
    default width that keeps a [chunk, KP, width] gather within COMBINE_TILE_PER_THREAD per thread."""
    sim = SimWorld(world_size=2, max_tokens=8, hidden=16, topk=8, num_tot_experts=4, num_sm=2, chunk=2)
    e = sim.engines[0]
    kw = dict(
        rank=0, world_size=2, max_tokens=8, hidden=16, topk=8, num_tot_experts=4, token_dtype=torch.bfloat16,
        weight_dtype=torch.float32, heap_local=sim.heaps[0], ptr_table=sim.table, num_sm=2, timeout_s=1.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="combine_chunk must be a power of 2"):
        TritonEPEngine(layout=sim.layout, chunk=2, combine_chunk=3, **kw)
    with pytest.raises(ValueError, match="combine_block_h must be a power of 2"):
        TritonEPEngine(layout=sim.layout, chunk=2, combine_block_h=48, **kw)
    with pytest.raises(ValueError, match="combine_chunk=1 needs 8"):
        TritonEPEngine(layout=sim.layout, chunk=2, combine_chunk=1, **kw)
    assert e.combine_chunk == 2
    assert e.combine_warps == e.num_warps
    for cc, warps, want in ((8, 16, 512), (1, 4, 1024), (16, 8, 128), (2, 8, 1024)):
        lay = HeapLayout.build(
            world_size=2, max_tokens=8, hidden=16, topk=8, experts_per_rank=2, token_bytes=2, chunk=2,
            combine_chunk=cc,
        )  # fmt: skip
        eng = TritonEPEngine(
            layout=lay, chunk=2, block_h=1024, combine_chunk=cc, combine_warps=warps, **kw
        )  # fmt: skip
        assert eng.combine_block_h == want, (cc, warps)
        assert cc * eng.kp * eng.combine_block_h <= COMBINE_TILE_PER_THREAD * 32 * warps


def _round_trips(
    sim, ns, flows, gen, *, with_w, skew, drop, after_dispatch=None, steal=False, id_dtype=torch.int32
) -> None:
    """One dispatch + combine per ``(merged, send_ctas)`` of ``flows``, each with fresh inputs (the
    token counts ``ns``, then shifted and reversed, expert ids in ``id_dtype``), checked against the
    reference."""
    eng = sim.engines[0]
    hidden, topk, experts, dtype = eng.hidden, eng.topk, eng.num_tot_experts, eng.token_dtype
    for call, (merged, send_ctas) in enumerate(flows):
        ns_call = ns if call == 0 else [max(0, n - call) for n in reversed(ns)]
        xs = [torch.randn(n, hidden, generator=gen).to(dtype) for n in ns_call]
        ids = [_routing(n, topk, experts, gen, skew=skew, drop=drop).to(id_dtype) for n in ns_call]
        ws = [torch.rand(n, topk, generator=gen) for n in ns_call] if with_w else None
        res = sim.dispatch(xs, ids, ws, merged=merged, send_ctas=send_ctas, steal=steal)
        ref, scat = dispatch_ref(xs, ids, ws, num_tot_experts=experts)
        _check_dispatch(res, ref, scat, with_w)
        assert all(torch.equal(r.num_input_tokens_per_rank, torch.tensor(ns_call)) for r in res)
        _check_skip_mapping(res, ids, experts // sim.world_size)
        if after_dispatch is not None:
            after_dispatch(res, ids)
        ys = [torch.randn(r.output.shape[0], hidden, generator=gen).to(dtype) for r in res]
        outs = sim.combine(ys, res, ids)
        _check_combine(outs, ys, ids, scat, experts, dtype)


@pytest.mark.parametrize("steal", [False, True], ids=["fixed", "steal"])
@pytest.mark.parametrize(
    ("world", "ns", "num_sm", "send_ctas"),
    [pytest.param(2, [9, 7], 4, 2, id="W2-G4-S2"), pytest.param(3, [6, 11, 3], 5, 3, id="W3-G5-S3")],
)
def test_split_with_several_senders(world, ns, num_sm, send_ctas, steal):
    """Sending CTAs other than program 0 start once the peers have started the dispatch (their
    token-count words) instead of waiting for the receive layout: the merged flow with several senders,
    twice in a row (count-word parity), then the counts-launch flow with the same split; with
    ``steal``, chunks claimed from the shared counters (reset by each launch's last CTA), and the
    scatter indices in claimed blocks of other sizes than the chunks (4 tokens; chunks of 2)."""
    gen = torch.Generator().manual_seed(77 + world)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=24, topk=4, num_tot_experts=4 * world, num_sm=num_sm,
        chunk=2,
    )  # fmt: skip
    assert sim.engines[0].scatter_tokens == 4  # (3 blocks: one program claims several)
    flows = ((True, send_ctas), (True, send_ctas), (False, send_ctas))
    _round_trips(sim, ns, flows, gen, with_w=True, skew=False, drop=0.1, steal=steal)
    if steal:  # every launch's last CTA put the counters back to zero
        for eng in sim.engines:
            assert eng.state[K.STATE_STEAL_SEND : K.STATE_STEAL_SCATTER + 1].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("send_ctas", "steal"), [(0, False), (1, False), (1, True)], ids=["no-split", "split", "split-steal"]
)
def test_speculative_rows_match_reference(send_ctas, steal):
    """The speculative exact-shape flow: the merged row kernel writes into outputs sized before the
    counts are known (dropping rows past their end) and copies ``info`` to the host mirror; a rank that
    receives more rows gets exact outputs and a second writing pass (``rewrite=True``), which must
    rewrite every row, this rank's own included, the slot table and the scatter indices (the simulation
    poisons them first). Capacities: 0 rows (every rank overflows), between the ranks' row counts (some
    do), the worst case (none does: the small layers' flow)."""
    world, ns, hidden, topk, experts = 3, [6, 5, 7], 24, 3, 6
    gen = torch.Generator().manual_seed(31 + send_ctas + steal)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=topk, num_tot_experts=experts, num_sm=3,
        chunk=2,
    )  # fmt: skip
    for call, which in enumerate(("none", "middle", "worst")):
        ns_call = ns if call == 0 else [n - call for n in reversed(ns)]
        xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in ns_call]
        ids = [_routing(n, topk, experts, gen, skew=True, drop=0.1) for n in ns_call]
        ws = [torch.rand(n, topk, generator=gen) for n in ns_call]
        ref, scat = dispatch_ref(xs, ids, ws, num_tot_experts=experts)
        rows = sorted(r.output.shape[0] for r in ref)
        cap = {"none": 0, "middle": rows[1], "worst": sim.engines[0].worst_case_rows()}[which]
        if which == "middle":
            assert rows[0] <= cap < rows[-1], rows  # (the routing is skewed: some rank overflows)
        res = sim.dispatch(
            xs, ids, ws, merged=True, send_ctas=send_ctas, steal=steal, speculative_rows=cap, mirror=True
        )
        _check_dispatch(res, ref, scat, True)
        for r in res:  # the host copy: info, then the epoch
            assert r.mirror is not None
            assert r.mirror[-1] > 0
            assert torch.equal(r.mirror[:-1], r.info)
        _check_skip_mapping(res, ids, experts // world)
        ys = [torch.randn(r.output.shape[0], hidden, generator=gen).to(torch.bfloat16) for r in res]
        _check_combine(sim.combine(ys, res, ids), ys, ids, scat, experts, torch.bfloat16)
    with pytest.raises(ValueError, match="speculative_rows"):
        sim.dispatch(xs, ids, ws, merged=False, speculative_rows=0)


def test_rewrite_pass_needs_a_writing_pass():
    """``launch_dispatch(rewrite=True)`` is only a writing pass of its own."""
    sim = SimWorld(world_size=1, max_tokens=4, hidden=16, topk=2, num_tot_experts=2, num_sm=2, chunk=2)
    eng = sim.engines[0]
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    b = eng.alloc_dispatch_outputs(4, 8, with_weights=False)
    for kw in ({"send": True}, {"send": False, "counts": True}, {"send": False, "recv": False}):
        with pytest.raises(ValueError, match="rewrite=True"):
            eng.launch_dispatch(x, ids, None, eng.pos, b, caller_scatter=False, rewrite=True, **kw)


@pytest.mark.parametrize("merged", [False, True], ids=["counts-launch", "merged"])
def test_steal_switches_roles_in_one_launch(merged):
    """Work stealing in one launch that sends and writes (one rank: nothing to wait for), so every role
    switch runs: the first sender takes every send chunk and then every write chunk (the interpreter
    runs one program at a time), the other senders find the send queue empty and go to the write
    queue (an early sender waiting for the receive layout first), the writers find theirs empty and
    go to the send queue. The balance between concurrent CTAs is for the GPU test."""
    gen = torch.Generator().manual_seed(5)
    ns, hidden, topk, experts = [13], 24, 3, 4
    sim = SimWorld(
        world_size=1, max_tokens=13, hidden=hidden, topk=topk, num_tot_experts=experts, num_sm=5, chunk=2,
    )  # fmt: skip
    for _ in range(2):
        xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in ns]
        ids = [_routing(n, topk, experts, gen, skew=False, drop=0.1) for n in ns]
        ws = [torch.rand(n, topk, generator=gen) for n in ns]
        res = sim.dispatch(xs, ids, ws, merged=merged, send_ctas=2, steal=True, whole=True)
        ref, scat = dispatch_ref(xs, ids, ws, num_tot_experts=experts)
        _check_dispatch(res, ref, scat, True)
        assert sim.engines[0].state[K.STATE_STEAL_SEND : K.STATE_STEAL_SCATTER + 1].tolist() == [0, 0, 0, 0]
        ys = [torch.randn(r.output.shape[0], hidden, generator=gen).to(torch.bfloat16) for r in res]
        _check_combine(sim.combine(ys, res, ids), ys, ids, scat, experts, torch.bfloat16)
    with pytest.raises(ValueError, match="whole=True"):
        SimWorld(world_size=2, max_tokens=4, hidden=16, topk=2, num_tot_experts=4).dispatch(
            xs * 2, ids * 2, whole=True
        )


def test_caller_scatter_indices():
    """``full_scatter_indices``: the caller's rows, taken verbatim on the receiver."""
    world, hidden, topk, experts = 2, 32, 2, 4
    gen = torch.Generator().manual_seed(7)
    ns = [5, 4]
    sim = SimWorld(
        world_size=world, max_tokens=5, hidden=hidden, topk=topk, num_tot_experts=experts, num_sm=2, chunk=4,
    )  # fmt: skip
    xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in ns]
    ids = [_routing(n, topk, experts, gen, skew=False, drop=0.2) for n in ns]
    _, default = dispatch_ref(xs, ids, num_tot_experts=experts)
    # a permutation of each receiver's rows: reverse them
    totals = [0] * world
    for s in range(world):
        for d in range(world):
            mask = (ids[s] >= 0) & (ids[s].long() // (experts // world) == d)
            totals[d] += int(mask.sum())
    fsi = []
    for s in range(world):
        f = torch.full_like(ids[s], -1)
        for d in range(world):
            mask = (ids[s] >= 0) & (ids[s].long() // (experts // world) == d)
            f[mask] = (totals[d] - 1 - default[s][mask]).to(torch.int32)
        fsi.append(f)
    ref, scat = dispatch_ref(xs, ids, num_tot_experts=experts, full_scatter_indices=fsi)
    for merged in (False, True):
        res = sim.dispatch(xs, ids, None, fsi, merged=merged)
        _check_dispatch(res, ref, scat, False)
        ys = [torch.randn(r.output.shape[0], hidden, generator=gen).to(torch.bfloat16) for r in res]
        _check_combine(sim.combine(ys, res, ids), ys, ids, scat, experts, torch.bfloat16)


def _short_timeout_sim(world: int, hidden: int, topk: int, experts: int) -> SimWorld:
    """Four tokens per rank, device waits bounded at 10 ms."""
    return SimWorld(
        world_size=world, max_tokens=4, hidden=hidden, topk=topk, num_tot_experts=experts, timeout_s=0.01
    )


@pytest.mark.parametrize("merged", [False, True], ids=["counts-launch", "merged"])
def test_missing_rank_times_out_naming_it(merged):
    """A rank that never dispatches: the others' count wait runs out and names it; later calls refuse."""
    world, hidden, topk, experts = 3, 16, 2, 6
    gen = torch.Generator().manual_seed(3)
    sim = _short_timeout_sim(world, hidden, topk, experts)
    xs = [torch.randn(4, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    ids = [_routing(4, topk, experts, gen, skew=False, drop=0.0) for _ in range(world)]
    with pytest.raises(EPTimeoutFromDevice, match="waiting for rank 2") as info:
        sim.dispatch(xs, ids, skip_ranks=[2], merged=merged)
    assert info.value.peer == 2
    assert info.value.step == "dispatch/counts"
    # the error is sticky: the engine refuses to go on (its buffers may hold a half-finished call)
    with pytest.raises(EPTimeoutFromDevice):
        sim.engines[0].check_error()


def test_missing_combine_peer_times_out():
    world, hidden, topk, experts = 2, 16, 2, 4
    gen = torch.Generator().manual_seed(5)
    sim = _short_timeout_sim(world, hidden, topk, experts)
    xs = [torch.randn(4, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    ids = [torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]], dtype=torch.int32) for _ in range(world)]
    res = sim.dispatch(xs, ids)
    ys = [r.output.clone() for r in res]
    with pytest.raises(EPTimeoutFromDevice, match="rank 1") as info:
        sim.combine(ys[:1], res[:1], ids, skip_ranks=[1])
    assert info.value.step == "combine"


def test_combine_per_slot_matches_reference():
    """Per-slot combine (routing-weight gradients): topk combines with a barrier before each."""
    world, hidden, topk, experts = 3, 16, 3, 6
    gen = torch.Generator().manual_seed(9)
    ns = [5, 3, 4]
    sim = SimWorld(
        world_size=world, max_tokens=5, hidden=hidden, topk=topk, num_tot_experts=experts, num_sm=2, chunk=4,
    )  # fmt: skip
    xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in ns]
    ids = [_routing(n, topk, experts, gen, skew=False, drop=0.2) for n in ns]
    res = sim.dispatch(xs, ids)
    _, scat = dispatch_ref(xs, ids, num_tot_experts=experts)
    # width 1 in float32, as the layer uses it for weight gradients
    ys = [torch.randn(r.output.shape[0], 1, generator=gen) for r in res]
    got = sim.combine_per_slot(ys, res, ids)
    want = combine_per_slot_ref(ys, ids, scat, num_tot_experts=experts)
    for r in range(world):
        assert got[r].shape == (ns[r], topk, 1)
        assert torch.equal(got[r], want[r]), f"rank {r}: per-slot rows differ"


@pytest.mark.parametrize("chunk", [1, 4], ids=["whole-row", "tiles"])
def test_int64_expert_ids(chunk):
    """int64 ids (as ``torch.topk`` returns them) are read in place, with no conversion: the same
    results as int32 ids in every flow, decode-sized (early sends) and tiled."""
    world, ns, hidden, topk, experts, dtype, with_w, skew, drop = CASES[2].values
    gen = torch.Generator().manual_seed(640 + chunk)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=dtype, num_sm=2, chunk=chunk,
    )  # fmt: skip
    flows = ((False, 0), (True, 0), (True, 1))
    _round_trips(sim, ns, flows, gen, with_w=with_w, skew=skew, drop=drop, id_dtype=torch.int64)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("merged", [False, True], ids=["counts-launch", "merged"])
def test_invalid_expert_ids_are_counted_and_dropped(merged, id_dtype):
    """Ids outside [-1, E) never reach an address: counted for the host's error, the slots dropped.
    int64 ids beyond the int32 range among them, which would wrap onto valid experts as int32."""
    world, hidden, topk, experts = 2, 16, 3, 4
    gen = torch.Generator().manual_seed(21)
    sim = SimWorld(
        world_size=world, max_tokens=5, hidden=hidden, topk=topk, num_tot_experts=experts, num_sm=2, chunk=4,
    )  # fmt: skip
    xs = [torch.randn(5, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    ids = [_routing(5, topk, experts, gen, skew=False, drop=0.0) for _ in range(world)]
    bad = [i.clone().to(id_dtype) for i in ids]
    bad[1][0, 0], bad[1][2, 1], bad[1][4, 2] = experts, -3, 1 << 20
    if id_dtype == torch.int64:  # as int32: experts 1 and 0, and -2**31
        bad[0][1, 1], bad[0][3, 0], bad[1][1, 2] = (1 << 32) + 1, -(1 << 33), 1 << 31
    res = sim.dispatch(xs, bad, merged=merged)
    assert [r.num_invalid_ids for r in res] == ([0, 3] if id_dtype == torch.int32 else [2, 4])
    dropped = [torch.where((b < -1) | (b >= experts), -1, b) for b in bad]
    ref, scat = dispatch_ref(xs, dropped, num_tot_experts=experts)
    _check_dispatch(res, ref, scat, False)
    ys = [torch.randn(r.output.shape[0], hidden, generator=gen).to(torch.bfloat16) for r in res]
    _check_combine(sim.combine(ys, res, dropped), ys, dropped, scat, experts, torch.bfloat16)


@pytest.mark.parametrize(
    ("ns", "num_sm", "experts"),
    [
        pytest.param([100, 37], 16, 12, id="n100,37-13progs-E12"),
        pytest.param([64, 64], 5, 10, id="n64-4progs-E10"),
    ],
)
def test_layout_across_many_programs(ns, num_sm, experts):
    """The layout kernel's programs each own a block of tokens and add up the histograms of the ones
    before them: many programs, a last block only partly filled, expert counts that are not powers of 2,
    invalid ids in several blocks."""
    world, hidden, topk = 2, 8, 4
    gen = torch.Generator().manual_seed(99 + num_sm)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=topk, num_tot_experts=experts,
        num_sm=num_sm, chunk=8,
    )  # fmt: skip
    eng = sim.engines[0]
    assert eng._layout_grid[0] > 1
    xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in ns]
    ids = [_routing(n, topk, experts, gen, skew=True, drop=0.1) for n in ns]
    ids[0][3, 0], ids[0][50, 2], ids[1][30, 1] = experts, -4, experts + 7
    res = sim.dispatch(xs, ids)
    assert [r.num_invalid_ids for r in res] == [2, 1]
    dropped = [torch.where((b < -1) | (b >= experts), -1, b) for b in ids]
    ref, scat = dispatch_ref(xs, dropped, num_tot_experts=experts)
    _check_dispatch(res, ref, scat, False)


# ------------------------------------------------------------------------------------------------------
# copy-engine dispatch (ce_pieces): the sender's metadata and token rows reach every peer by copies (here
# plain CPU copies into the peer's heap), in pieces each followed by the epoch in the peer's piece flag;
# the row kernel only writes rows, its own and then each piece's once the flag arrived
# ------------------------------------------------------------------------------------------------------
CE_CASES = [
    # world, tokens per rank, hidden, topk, experts, dtype, weights, skew, drop, pieces
    pytest.param(2, [9, 5], 32, 4, 8, torch.bfloat16, True, False, 0.0, 3, id="W2-n9,5-k4-E8-bf16-p3"),
    pytest.param(2, [7, 0], 32, 2, 4, torch.bfloat16, False, False, 0.2, 1, id="W2-n7,0-k2-noW-drop-p1"),
    pytest.param(3, [4, 10, 1], 16, 3, 6, torch.float32, True, True, 0.1, 2, id="W3-f32-skew-drop-p2"),
    pytest.param(4, [6, 9, 0, 4], 48, 8, 16, torch.float16, True, True, 0.15, 4, id="W4-H48-k8-f16-p4"),
]


@pytest.mark.parametrize(
    ("world", "ns", "hidden", "topk", "experts", "dtype", "with_w", "skew", "drop", "pieces"), CE_CASES
)
def test_copy_engine_dispatch_matches_reference(
    world, ns, hidden, topk, experts, dtype, with_w, skew, drop, pieces
):
    gen = torch.Generator().manual_seed(4321 + world * 10 + pieces)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=dtype, num_sm=2, chunk=2, ce_pieces=pieces,
    )  # fmt: skip
    assert sim.engines[0].ce_tokens % 2 == 0
    # three calls: epochs, the flags of every piece, buffer reuse, token counts that shrink and grow
    _round_trips(sim, ns, ((False, 0),) * 3, gen, with_w=with_w, skew=skew, drop=drop)


def test_copy_engine_caller_scatter_and_invalid_ids():
    """The copies carry the raw ids and the caller's rows: invalid ids are dropped on the receiver too."""
    world, hidden, topk, experts = 2, 16, 3, 4
    gen = torch.Generator().manual_seed(22)
    sim = SimWorld(
        world_size=world, max_tokens=6, hidden=hidden, topk=topk, num_tot_experts=experts, num_sm=2, chunk=2,
        ce_pieces=2,
    )  # fmt: skip
    xs = [torch.randn(6, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    ids = [_routing(6, topk, experts, gen, skew=False, drop=0.0) for _ in range(world)]
    bad = [i.clone() for i in ids]
    bad[0][1, 0], bad[0][5, 2], bad[1][3, 1] = experts + 1, -2, 1 << 20
    bad = [bad[0].long(), bad[1]]  # int64 ids too (as topk returns them), one beyond int32 on rank 0
    bad[0][2, 1] = (1 << 32) + 1
    res = sim.dispatch(xs, bad)
    assert [r.num_invalid_ids for r in res] == [3, 1]
    dropped = [torch.where((b < -1) | (b >= experts), -1, b) for b in bad]
    ref, scat = dispatch_ref(xs, dropped, num_tot_experts=experts)
    _check_dispatch(res, ref, scat, False)
    ys = [torch.randn(r.output.shape[0], hidden, generator=gen).to(torch.bfloat16) for r in res]
    _check_combine(sim.combine(ys, res, dropped), ys, dropped, scat, experts, torch.bfloat16)
    # the caller's scatter indices: reverse every receiver's rows
    _, default = dispatch_ref(xs, ids, num_tot_experts=experts)
    e_local = experts // world
    totals = [sum(int(((i >= 0) & (i.long() // e_local == d)).sum()) for i in ids) for d in range(world)]
    fsi = []
    for s in range(world):
        f = torch.full_like(ids[s], -1)
        for d in range(world):
            mask = (ids[s] >= 0) & (ids[s].long() // e_local == d)
            f[mask] = (totals[d] - 1 - default[s][mask]).to(torch.int32)
        fsi.append(f)
    ref, scat = dispatch_ref(xs, ids, num_tot_experts=experts, full_scatter_indices=fsi)
    res = sim.dispatch(xs, ids, None, fsi)
    _check_dispatch(res, ref, scat, False)


def test_copy_engine_missing_rank_times_out_naming_it():
    world, hidden, topk, experts = 2, 16, 2, 4
    gen = torch.Generator().manual_seed(5)
    sim = SimWorld(
        world_size=world, max_tokens=4, hidden=hidden, topk=topk, num_tot_experts=experts, num_sm=2, chunk=2,
        timeout_s=0.01, ce_pieces=2,
    )  # fmt: skip
    xs = [torch.randn(4, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    ids = [_routing(4, topk, experts, gen, skew=False, drop=0.0) for _ in range(world)]
    with pytest.raises(EPTimeoutFromDevice, match="waiting for rank 1"):
        sim.dispatch(xs, ids, skip_ranks=[1])


def test_copy_engine_refuses_what_it_cannot_run():
    kw = dict(
        world_size=2, max_tokens=4, hidden=16, topk=2, num_tot_experts=4, num_sm=2, chunk=2, ce_pieces=2
    )
    sim = SimWorld(**kw)
    xs = [torch.randn(4, 16).to(torch.bfloat16) for _ in range(2)]
    ids = [torch.zeros(4, 2, dtype=torch.int32) for _ in range(2)]
    with pytest.raises(ValueError, match="receive layout in its own launch"):
        sim.dispatch(xs, ids, merged=True)
    with pytest.raises(ValueError, match="remote peers"):
        SimWorld(**kw, node_size=1)
    eng = sim.engines[0]
    with pytest.raises(ValueError, match="send_ctas=0"):
        type(eng)(
            rank=0, world_size=2, max_tokens=4, hidden=16, topk=2, num_tot_experts=4,
            token_dtype=torch.bfloat16, weight_dtype=torch.float32, heap_local=sim.heaps[0],
            ptr_table=sim.table, layout=sim.layout, num_sm=2, timeout_s=1.0, chunk=2, send_ctas=1,
            ce_pieces=2, peer_heaps=sim.heaps,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs peer_heaps"):
        type(eng)(
            rank=0, world_size=2, max_tokens=4, hidden=16, topk=2, num_tot_experts=4,
            token_dtype=torch.bfloat16, weight_dtype=torch.float32, heap_local=sim.heaps[0],
            ptr_table=sim.table, layout=sim.layout, num_sm=2, timeout_s=1.0, chunk=2, ce_pieces=2,
        )  # fmt: skip


# ------------------------------------------------------------------------------------------------------
# remote peers (the inter-node path, forced on simulated nodes of `node` ranks): every transfer to a rank
# of another node is staged in the sender's heap and moved by a simulated put-with-signal (a copy into the
# peer's heap, then its signal word); the table entries of remote ranks point at a decoy heap that must
# stay untouched (SimWorld.check_decoy, run after every call)
# ------------------------------------------------------------------------------------------------------
REMOTE_CASES = [
    # world, node size, tokens per rank, hidden, topk, experts, dtype, weights, skew, drop
    pytest.param(2, 1, [6, 5], 32, 4, 8, torch.bfloat16, True, False, 0.0, id="W2-node1-k4-E8-bf16"),
    pytest.param(3, 1, [4, 6, 1], 16, 3, 6, torch.float32, True, True, 0.1, id="W3-node1-f32-skew-drop"),
    pytest.param(
        4, 2, [6, 6, 0, 4], 48, 8, 16, torch.float16, True, True, 0.15, id="W4-node2-H48-k8-f16-skew-drop"
    ),
    pytest.param(4, 2, [5, 3, 6, 2], 32, 2, 8, torch.bfloat16, False, False, 0.2, id="W4-node2-k2-noW-drop"),
    # two nodes of 4: three local and four remote peers per rank
    pytest.param(
        8, 4, [3, 0, 4, 2, 5, 1, 3, 2], 16, 4, 16, torch.bfloat16, True, True, 0.1, id="W8-node4-k4-E16-skew"
    ),
]


def _remote_world(
    world, node, max_tokens, hidden, topk, experts, dtype=torch.bfloat16, chunk=4, **kw
) -> SimWorld:
    return SimWorld(
        world_size=world,
        max_tokens=max_tokens,
        hidden=hidden,
        topk=topk,
        num_tot_experts=experts,
        token_dtype=dtype,
        num_sm=2,
        chunk=chunk,
        node_size=node,
        **kw,
    )


@pytest.mark.parametrize(
    ("world", "node", "ns", "hidden", "topk", "experts", "dtype", "with_w", "skew", "drop"), REMOTE_CASES
)
def test_remote_path_matches_reference(world, node, ns, hidden, topk, experts, dtype, with_w, skew, drop):
    _check_remote_path(world, node, ns, hidden, topk, experts, dtype, with_w, skew, drop, chunk=4)


@pytest.mark.parametrize(
    ("world", "node", "ns", "hidden", "topk", "experts", "dtype", "with_w", "skew", "drop", "chunk"),
    [
        pytest.param(*REMOTE_CASES[0].values, 2, id="W2-node1-c2"),
        pytest.param(*REMOTE_CASES[2].values, 1, id="W4-node2-H48-c1"),
    ],
)
def test_remote_path_whole_row_chunks(
    world, node, ns, hidden, topk, experts, dtype, with_w, skew, drop, chunk
):
    """Decode-sized chunks (whole rows in registers) staged for remote peers, and mixed with local ones;
    int64 expert ids (the pack kernel reads them too)."""
    _check_remote_path(
        world, node, ns, hidden, topk, experts, dtype, with_w, skew, drop, chunk=chunk, id_dtype=torch.int64
    )


def _check_remote_path(
    world, node, ns, hidden, topk, experts, dtype, with_w, skew, drop, *, chunk, id_dtype=torch.int32
) -> None:
    gen = torch.Generator().manual_seed(4321 + world * 10 + node + hidden)
    sim = _remote_world(world, node, max(ns), hidden, topk, experts, dtype, chunk=chunk)
    assert sim.engines[0].whole_row == (chunk <= WHOLE_ROW_MAX_CHUNK)
    assert all(
        sim.engines[r].remote_ranks == tuple(p for p in range(world) if p // node != r // node)
        for r in range(world)
    )
    L = experts // world
    calls = [0]

    def packed_and_put(res, ids) -> None:
        for r in range(world):
            for p in sim.engines[r].remote_ranks:  # packed: one record per (token, remote rank), no more
                goes = ((ids[r] >= 0) & (ids[r].long() // L == p)).any(dim=1)
                assert res[p].npk_recv[r] == int(goes.sum()), f"records {r} -> {p}"
            # per remote peer and dispatch: counts, base rows and records, one put-with-signal each (and
            # the previous combine's rows)
            puts = [e for e in sim.transports[r].log if e[0] == "put"]
            assert len(puts) == (3 + (calls[0] > 0)) * len(sim.engines[r].remote_ranks)
            sim.transports[r].log.clear()
        calls[0] += 1

    # three calls: epochs, count parity, staging and signal reuse; the last with the CTA split
    flows = ((False, 0), (False, 0), (False, 1))
    _round_trips(
        sim,
        ns,
        flows,
        gen,
        with_w=with_w,
        skew=skew,
        drop=drop,
        after_dispatch=packed_and_put,
        id_dtype=id_dtype,
    )


def test_remote_caller_scatter_and_per_slot_combine():
    """full_scatter_indices and the per-slot combine (device barriers with host signals) over remote peers."""
    world, hidden, topk, experts = 3, 16, 3, 6
    gen = torch.Generator().manual_seed(77)
    ns = [5, 3, 4]
    sim = _remote_world(world, 1, 5, hidden, topk, experts)
    xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in ns]
    ids = [_routing(n, topk, experts, gen, skew=False, drop=0.2) for n in ns]
    ref, scat = dispatch_ref(xs, ids, num_tot_experts=experts)
    fsi = [s.to(torch.int32) for s in scat]  # the default rows, given by the caller
    res = sim.dispatch(xs, ids, None, fsi)
    _check_dispatch(res, ref, scat, False)
    ys = [torch.randn(r.output.shape[0], 1, generator=gen) for r in res]
    got = sim.combine_per_slot(ys, res, ids)
    want = combine_per_slot_ref(ys, ids, scat, num_tot_experts=experts)
    for r in range(world):
        assert torch.equal(got[r], want[r]), f"rank {r}: per-slot rows differ"


def test_remote_rank_missing_times_out_naming_it():
    """A remote rank that never dispatches: its counts signal never comes, the wait names it."""
    world, hidden, topk, experts = 4, 16, 2, 8
    gen = torch.Generator().manual_seed(11)
    sim = _remote_world(world, 2, 4, hidden, topk, experts, timeout_s=0.01)
    xs = [torch.randn(4, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    ids = [_routing(4, topk, experts, gen, skew=False, drop=0.0) for _ in range(world)]
    with pytest.raises(EPTimeoutFromDevice, match="waiting for rank 3") as info:
        sim.dispatch(xs, ids, skip_ranks=[3])
    assert info.value.step == "dispatch/counts"


def test_remote_combine_peer_missing_times_out():
    world, hidden, topk, experts = 2, 16, 2, 4
    gen = torch.Generator().manual_seed(13)
    sim = _remote_world(world, 1, 4, hidden, topk, experts, timeout_s=0.01)
    xs = [torch.randn(4, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    ids = [torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]], dtype=torch.int32) for _ in range(world)]
    res = sim.dispatch(xs, ids)
    with pytest.raises(EPTimeoutFromDevice, match="rank 1") as info:
        sim.combine([r.output.clone() for r in res[:1]], res[:1], ids, skip_ranks=[1])
    assert info.value.step == "combine"


def test_remote_path_refuses_merged_flow():
    sim = _remote_world(2, 1, 4, 16, 2, 4)
    x = [torch.zeros(1, 16, dtype=torch.bfloat16)] * 2
    ids = [torch.zeros(1, 2, dtype=torch.int32)] * 2
    with pytest.raises(ValueError, match="merged"):
        sim.dispatch(x, ids, merged=True)


# ------------------------------------------------------------------------------------------------------
# FP8 rows in DeepEP's format: (x_fp8 [n, H] float8_e4m3fn, scales [n, H / 128] float32) travel as one
# packed row each (FP8 bytes, scale bytes, padding to 16 bytes) through the same kernels; the rows and
# scales received must be the sender's bytes (random bit patterns, NaN and infinity included)
# ------------------------------------------------------------------------------------------------------
def _fp8_rows(n: int, hidden: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 256, (n, hidden), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.randint(-(2**31), 2**31 - 1, (n, hidden // 128), generator=gen, dtype=torch.int32)
    return q, s.view(torch.float32)


def _fp8_bytes(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8)], 1)


def _check_fp8_dispatch(res, xs, ids, ws, experts: int) -> list[torch.Tensor]:
    """Each rank's ``(rows, scales)``: the reference's bytes, as views of one buffer of packed rows;
    weights, experts, counts and scatter indices as for any row. Returns the reference scatter indices."""
    hidden = xs[0][0].shape[1]
    ref, scat = dispatch_ref([_fp8_bytes(*x) for x in xs], ids, ws, num_tot_experts=experts)
    for got, want in zip(res, ref, strict=True):
        q, s = got.output
        rows = want.output.shape[0]
        assert (q.dtype, tuple(q.shape)) == (torch.float8_e4m3fn, (rows, hidden))
        assert (s.dtype, tuple(s.shape)) == (torch.float32, (rows, hidden // 128))
        assert q.untyped_storage().data_ptr() == s.untyped_storage().data_ptr(), "not views of one buffer"
        assert q.stride() == (fp8_row_bytes(hidden), 1)
        assert s.stride() == (fp8_row_bytes(hidden) // 4, 1)
    as_bytes = [dataclasses.replace(g, output=_fp8_bytes(*g.output)) for g in res]
    _check_dispatch(as_bytes, ref, scat, ws is not None)
    _check_skip_mapping(res, ids, experts // len(res))
    return scat


def _fp8_round_trips(sim, ns, flows, gen, *, with_w=True, drop=0.1, **dispatch_kw) -> None:
    """One FP8 dispatch and one bf16 combine of its rows per ``(merged, send_ctas)`` of ``flows``."""
    eng = sim.engines[0]
    hidden, topk, experts = eng.hidden, eng.topk, eng.num_tot_experts
    for call, (merged, send_ctas) in enumerate(flows):
        ns_call = ns if call == 0 else [max(0, n - call) for n in reversed(ns)]
        xs = [_fp8_rows(n, hidden, gen) for n in ns_call]
        ids = [_routing(n, topk, experts, gen, skew=True, drop=drop) for n in ns_call]
        ws = [torch.rand(n, topk, generator=gen) for n in ns_call] if with_w else None
        res = sim.dispatch(xs, ids, ws, merged=merged, send_ctas=send_ctas, **dispatch_kw)
        scat = _check_fp8_dispatch(res, xs, ids, ws, experts)
        ys = [torch.randn(r.output[0].shape[0], hidden, generator=gen).to(torch.bfloat16) for r in res]
        _check_combine(sim.combine(ys, res, ids), ys, ids, scat, experts, torch.bfloat16)


@pytest.mark.parametrize(
    "layer_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8-layer", "bf16-layer"]
)
@pytest.mark.parametrize(
    ("world", "ns", "hidden", "chunk"),
    [
        pytest.param(2, [6, 5], 128, 4, id="W2-H128-tiles"),  # 144-byte rows: two tiles, the last partial
        pytest.param(3, [4, 6, 1], 256, 1, id="W3-H256-whole-row"),
        pytest.param(2, [3, 4], 512, 2, id="W2-H512-whole-row"),  # 528-byte rows: no padding
    ],
)
def test_fp8_rows_arrive_bit_for_bit(world, ns, hidden, chunk, layer_dtype):
    """Counts-launch, merged and split flows, on a layer of FP8 rows (heap rows sized for them) and on a
    bf16 layer (whose rows hold them)."""
    gen = torch.Generator().manual_seed(hidden + world + chunk)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=3, num_tot_experts=2 * world,
        token_dtype=layer_dtype, num_sm=2, chunk=chunk,
    )  # fmt: skip
    assert sim.layout.row_bytes == (fp8_row_bytes(hidden) if layer_dtype.itemsize == 1 else 2 * hidden)
    _fp8_round_trips(sim, ns, ((False, 0), (True, 0), (True, 1)), gen)


def test_fp8_speculative_rows_rewrite():
    """The speculative flow of FP8 rows: outputs of 0 rows (every rank rewrites into exact ones) and the
    host mirror of the counts."""
    gen = torch.Generator().manual_seed(8)
    sim = SimWorld(
        world_size=2, max_tokens=5, hidden=128, topk=2, num_tot_experts=4, token_dtype=torch.float8_e4m3fn,
        num_sm=2, chunk=2,
    )  # fmt: skip
    _fp8_round_trips(sim, [5, 4], ((True, 0),), gen, speculative_rows=0, mirror=True)


@pytest.mark.parametrize(
    ("world", "node", "ns"),
    [pytest.param(2, 1, [5, 4], id="W2-node1"), pytest.param(4, 2, [3, 4, 0, 2], id="W4-node2")],
)
def test_fp8_remote_path(world, node, ns):
    """Packed FP8 rows in the remote path's token records (puts), expanded on the receiver."""
    gen = torch.Generator().manual_seed(40 + world)
    sim = _remote_world(world, node, max(ns), 128, 2, 2 * world, torch.float8_e4m3fn, chunk=2)
    _fp8_round_trips(sim, ns, ((False, 0),), gen)
    sim.check_decoy()


def test_fp8_copy_engine():
    """Copy-engine dispatch of packed FP8 rows (the copies' row width is the packed row's)."""
    gen = torch.Generator().manual_seed(9)
    sim = SimWorld(
        world_size=2, max_tokens=6, hidden=128, topk=3, num_tot_experts=4, token_dtype=torch.float8_e4m3fn,
        num_sm=2, chunk=2, ce_pieces=2,
    )  # fmt: skip
    _fp8_round_trips(sim, [6, 3], ((False, 0), (False, 0)), gen)


def test_rows_wider_than_the_heap_rows_are_refused():
    """A layer's heap holds rows of ``layout.row_bytes``: packed FP8 rows on a layer of another 1-byte
    dtype, or bf16 rows on a layer of FP8 rows, raise before any launch, and no heap byte changes."""
    gen = torch.Generator().manual_seed(3)
    ids = [torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)] * 2
    narrow = SimWorld(world_size=2, max_tokens=2, hidden=128, topk=2, num_tot_experts=2,
                      token_dtype=torch.float8_e5m2, num_sm=2, chunk=2)  # fmt: skip
    assert narrow.layout.row_bytes == 128
    fp8 = SimWorld(world_size=2, max_tokens=2, hidden=128, topk=2, num_tot_experts=2,
                   token_dtype=torch.float8_e4m3fn, num_sm=2, chunk=2)  # fmt: skip
    assert fp8.layout.row_bytes == fp8_row_bytes(128) == 144
    for sim, xs, match in (
        (
            narrow,
            [pack_fp8_rows(*_fp8_rows(2, 128, gen)) for _ in range(2)],
            "take 144 bytes, more than the 128",
        ),
        (fp8, [torch.zeros(2, 128, dtype=torch.bfloat16)] * 2, "take 256 bytes, more than the 144"),
    ):
        eng, before = sim.engines[0], [h.clone() for h in sim.heaps]
        b = eng.alloc_dispatch_outputs(2, 4, with_weights=False, dtype=xs[0].dtype)
        with pytest.raises(ValueError, match=match):
            eng.launch_dispatch(xs[0], ids[0], None, eng.pos, b, caller_scatter=False, counts=True)
        assert all(torch.equal(h, h0) for h, h0 in zip(sim.heaps, before, strict=True))
    # outputs of another width than the input rows
    eng = fp8.engines[0]
    x = pack_fp8_rows(*_fp8_rows(2, 128, gen))
    b = eng.alloc_dispatch_outputs(2, 4, with_weights=False)  # (float8 rows of 128: not the packed width)
    with pytest.raises(ValueError, match=r"bufs\.out must be"):
        eng.launch_dispatch(x, ids[0], None, eng.pos, b, caller_scatter=False, counts=True)


def test_fp8_caller_scatter_and_int64_ids():
    """FP8 rows placed at the caller's rows (``full_scatter_indices``: every receiver's rows reversed),
    with int64 expert ids as ``torch.topk`` gives them, both flows."""
    world, hidden, topk, experts = 2, 128, 2, 4
    gen = torch.Generator().manual_seed(17)
    ns = [5, 4]
    sim = SimWorld(
        world_size=world, max_tokens=5, hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=torch.float8_e4m3fn, num_sm=2, chunk=2,
    )  # fmt: skip
    xs = [_fp8_rows(n, hidden, gen) for n in ns]
    ids = [_routing(n, topk, experts, gen, skew=False, drop=0.2).long() for n in ns]
    rows = [_fp8_bytes(*x) for x in xs]
    _, default = dispatch_ref(rows, ids, num_tot_experts=experts)
    e_local = experts // world
    totals = [sum(int(((i >= 0) & (i // e_local == d)).sum()) for i in ids) for d in range(world)]
    fsi = []
    for s in range(world):
        f = torch.full(ids[s].shape, -1, dtype=torch.int32)
        for d in range(world):
            mask = (ids[s] >= 0) & (ids[s] // e_local == d)
            f[mask] = (totals[d] - 1 - default[s][mask]).to(torch.int32)
        fsi.append(f)
    ref, scat = dispatch_ref(rows, ids, num_tot_experts=experts, full_scatter_indices=fsi)
    for merged in (False, True):
        res = sim.dispatch(xs, ids, None, fsi, merged=merged)
        _check_dispatch([dataclasses.replace(r, output=_fp8_bytes(*r.output)) for r in res], ref, scat, False)
        ys = [torch.randn(r.output[0].shape[0], hidden, generator=gen).to(torch.bfloat16) for r in res]
        _check_combine(sim.combine(ys, res, ids), ys, ids, scat, experts, torch.bfloat16)


# ------------------------------------------------------------------------------------------------------
# FP8 quantization on send: bf16 / fp16 / fp32 rows quantized inside the row kernel (QuantizeOnSend);
# the received bytes and scales must be the reference quantizer's, bit for bit
# ------------------------------------------------------------------------------------------------------
def _rows_to_quantize(n: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows over many magnitudes, with an all-zero block, one of tiny (FP8-subnormal and float32-
    subnormal) values, one holding an infinity and one a NaN (where the row count allows)."""
    x = torch.randn(n, hidden, generator=gen) * torch.logspace(-3, 4, n)[:, None]
    if n > 1:
        x[1, :128] = 0
    if n > 2:
        x[2, -128:] = torch.randn(128, generator=gen) * 1e-30
        x[2, -1] = 1e-42 if dtype == torch.float32 else 0  # (a float32 subnormal)
    if n > 3:
        x[3, 5] = float("-inf")
    if n > 4:
        x[4, -7] = float("nan")
    return x.to(dtype)


def _quantized_round_trips(sim, ns, flows, gen, dtype, *, with_w=True, **dispatch_kw) -> None:
    """One dispatch of ``dtype`` rows quantized on send and one bf16 combine per ``(merged, send_ctas)``
    of ``flows``, against the reference quantizer's bytes."""
    from ep_a2a.reference import quantize_fp8

    eng = sim.engines[0]
    hidden, topk, experts = eng.hidden, eng.topk, eng.num_tot_experts
    for call, (merged, send_ctas) in enumerate(flows):
        ns_call = ns if call == 0 else [max(0, n - call) for n in reversed(ns)]
        xs = [_rows_to_quantize(n, hidden, dtype, gen) for n in ns_call]
        ids = [_routing(n, topk, experts, gen, skew=True, drop=0.1) for n in ns_call]
        ws = [torch.rand(n, topk, generator=gen) for n in ns_call] if with_w else None
        res = sim.dispatch(xs, ids, ws, merged=merged, send_ctas=send_ctas, quantize=True, **dispatch_kw)
        scat = _check_fp8_dispatch(res, [quantize_fp8(x) for x in xs], ids, ws, experts)
        ys = [torch.randn(r.output[0].shape[0], hidden, generator=gen).to(torch.bfloat16) for r in res]
        _check_combine(sim.combine(ys, res, ids), ys, ids, scat, experts, torch.bfloat16)


@pytest.mark.parametrize(
    ("world", "ns", "hidden", "chunk", "block_h", "layer_dtype", "dtype"),
    [
        # tiles of 128 pairs (256 channels) over 192 pairs: the last tile half masked
        pytest.param(
            2, [6, 5], 384, 4, 256, torch.float8_e4m3fn, torch.bfloat16, id="W2-H384-tiles-uneven-bf16"
        ),
        pytest.param(
            2, [6, 5], 384, 4, 256, torch.float8_e4m3fn, torch.float16, id="W2-H384-tiles-uneven-fp16"
        ),
        pytest.param(
            2, [6, 5], 384, 4, 256, torch.float8_e4m3fn, torch.float32, id="W2-H384-tiles-uneven-fp32"
        ),
        pytest.param(2, [5, 3], 256, 4, None, torch.bfloat16, torch.bfloat16, id="W2-H256-tiles-bf16-layer"),
        pytest.param(3, [4, 6, 1], 384, 1, None, torch.float8_e4m3fn, torch.bfloat16, id="W3-H384-whole-row"),
        pytest.param(
            2, [3, 5], 512, 2, None, torch.float8_e4m3fn, torch.float32, id="W2-H512-whole-row-fp32"
        ),
    ],
)
def test_quantize_on_send_bit_for_bit(world, ns, hidden, chunk, block_h, layer_dtype, dtype):
    """Counts-launch, merged and CTA-split flows quantizing bf16 / fp16 / fp32 rows in the row kernel:
    tiled rows (a tile's pairs of channels, its scales after the row's FP8 bytes) and whole rows, every
    store path (peers, this rank's own rows); zero, tiny, infinite and NaN blocks."""
    gen = torch.Generator().manual_seed(hidden + world + chunk)
    sim = SimWorld(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=3, num_tot_experts=2 * world,
        token_dtype=layer_dtype, num_sm=2, chunk=chunk, block_h=block_h,
    )  # fmt: skip
    _quantized_round_trips(sim, ns, ((False, 0), (True, 0), (True, 1)), gen, dtype)


def test_quantize_on_send_speculative_rewrite_and_steal():
    """Rows quantized on send in the speculative flow (outputs of 0 rows: the second writing pass
    quantizes this rank's own rows again) and with chunks claimed from shared counters."""
    gen = torch.Generator().manual_seed(81)
    sim = SimWorld(
        world_size=2, max_tokens=5, hidden=256, topk=2, num_tot_experts=4, token_dtype=torch.float8_e4m3fn,
        num_sm=2, chunk=2,
    )  # fmt: skip
    _quantized_round_trips(sim, [5, 4], ((True, 0),), gen, torch.bfloat16, speculative_rows=0, mirror=True)
    _quantized_round_trips(sim, [5, 4], ((True, 1),), gen, torch.bfloat16, steal=True)


@pytest.mark.parametrize(
    ("world", "node", "ns"),
    [pytest.param(2, 1, [5, 4], id="W2-node1"), pytest.param(4, 2, [3, 4, 0, 2], id="W4-node2")],
)
def test_quantize_on_send_remote_path(world, node, ns):
    """Rows quantized on send into the remote path's token records (FP8 bytes, then scales), put and
    expanded on the receiver; the decoy heap stays untouched."""
    gen = torch.Generator().manual_seed(90 + world)
    sim = _remote_world(world, node, max(ns), 256, 2, 2 * world, torch.float8_e4m3fn, chunk=2)
    _quantized_round_trips(sim, ns, ((False, 0),), gen, torch.bfloat16)
    sim.check_decoy()


def test_quantize_on_send_one_rank_one_launch():
    """One rank, one launch that sends and writes (as on a GPU): the quantized rows of its own experts."""
    gen = torch.Generator().manual_seed(5)
    sim = SimWorld(world_size=1, max_tokens=6, hidden=256, topk=2, num_tot_experts=2,
                   token_dtype=torch.float8_e4m3fn, num_sm=2, chunk=4)  # fmt: skip
    _quantized_round_trips(sim, [6], ((True, 0),), gen, torch.bfloat16, whole=True)


def test_quantize_on_send_refusals():
    """Rows of a width that is not a multiple of 128 or of another dtype are refused when wrapped; a
    copy-engine engine refuses rows to quantize (its copies move rows as they are)."""
    from ep_a2a.backends.triton.engine import QuantizeOnSend

    with pytest.raises(ValueError, match="multiple of 128"):
        QuantizeOnSend(torch.zeros(2, 192, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype in"):
        QuantizeOnSend(torch.zeros(2, 128, dtype=torch.float8_e4m3fn))
    q = QuantizeOnSend(torch.zeros(3, 256, dtype=torch.bfloat16))
    assert (q.dtype, tuple(q.shape)) == (torch.int16, (3, fp8_row_bytes(256) // 2))
    odd = torch.zeros(2 * 256 + 1, dtype=torch.bfloat16)[1:].view(2, 256)  # (2-byte aligned only)
    assert QuantizeOnSend(odd).x.data_ptr() % 4 == 0
    sim = SimWorld(world_size=2, max_tokens=2, hidden=128, topk=2, num_tot_experts=2,
                   token_dtype=torch.float8_e4m3fn, num_sm=2, chunk=2, ce_pieces=2)  # fmt: skip
    eng = sim.engines[0]
    b = eng.alloc_dispatch_outputs(2, 4, with_weights=False, dtype=torch.int16)
    ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="copy-engine dispatch"):
        eng.launch_dispatch(QuantizeOnSend(torch.zeros(2, 128, dtype=torch.bfloat16)), ids, None, eng.pos, b,
                            caller_scatter=False)  # fmt: skip


def test_e4m3_rounding_matches_torch():
    """The row kernel's float32 -> float8_e4m3fn conversion (its interpreter path: torch's rule in integer
    operations) against torch's, on every value it can meet: +-[0, 448] in float32 patterns, ties to
    even at every binade (normal and subnormal FP8), float32 subnormals; NaN in one encoding."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + i, mask=i < n)
        tl.store(out_ptr + i, K._to_e4m3(v).to(tl.uint8), mask=i < n)

    bits = torch.arange(0, 0x43E00001, 4099, dtype=torch.int64)  # (0x43E00000: 448.0)
    ties = torch.tensor([(e << 23) | (m << 20) | 0x80000 for e in range(110, 135) for m in range(8)])
    x = torch.cat([bits, ties, torch.arange(0, 64)]).to(torch.int32).view(torch.float32)
    x = torch.cat([x, -x, torch.tensor([float("nan"), -float("nan")])])
    got = torch.empty(x.shape, dtype=torch.uint8)
    block = 1 << 16
    convert[(triton.cdiv(x.numel(), block),)](x, got, x.numel(), BLOCK=block)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    want = torch.where(x.isnan(), 0x7F, want)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), int(got[i]), int(want[i])) for i in bad[:5]]
