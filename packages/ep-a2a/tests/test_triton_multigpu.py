"""The Triton backend on real GPUs (``nox -s multigpu``: every rank runs pytest under torchrun).

Both heaps (torch symmetric memory, nvshmem4py) against :mod:`ep_a2a.reference`: dispatch bit-identical,
combine within bf16 rounding of float32; CUDA-graph capture and replay; a missing rank times out with an
error naming it. Every rank builds every rank's inputs from one seed, so each can compute the reference.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ep_a2a import TritonTuning
from ep_a2a.backends import BackendOptions
from ep_a2a.config import EPConfig
from ep_a2a.reference import combine_per_slot_ref, combine_ref, dispatch_ref
from ep_a2a.testing import load_target

CASES = str(Path(__file__).with_name("_cases.py"))

pytestmark = pytest.mark.multigpu

# per row dtype, relative to sum_k |row_k| of each token: each partial sum (expert side) and the total are
# rounded once to the row dtype; one round-to-nearest costs at most 2**-8 |x| in bf16 (8 significant bits)
# and 2**-11 |x| in fp16, so two roundings give 2**-7 and 2**-10.
COMBINE_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-6}


@pytest.fixture(scope="module")
def group():
    if "RANK" not in os.environ:
        pytest.fail(
            "multigpu tests run under torchrun: torchrun --nproc-per-node=2 -m pytest -m multigpu ..."
        )
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=torch.device("cuda", local))
    # the CPU references of the large layers take minutes on the one thread torchrun leaves each rank
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world, 1)))
    return dist.group.WORLD


@pytest.fixture(autouse=True)
def _settled(group):
    """After each test: this rank's kernels finished (a test that leaves kernels waiting for a peer ends
    with them), and the test's backends and layers collected on every rank at this point, so what they
    held (the symmetric heaps among it) is released before the next test builds its own, not whenever
    garbage collection happens to run on each rank."""
    yield
    torch.cuda.synchronize()
    gc.collect()


def _heaps() -> list:
    heaps = ["torch"]
    heaps.append(
        pytest.param(
            "nvshmem", marks=pytest.mark.skipif(not _has_nvshmem(), reason="nvshmem4py not installed")
        )
    )
    return heaps


def _has_nvshmem() -> bool:
    try:
        import nvshmem.core  # noqa: F401
    except Exception:
        return False
    return True


def _routing(n, topk, experts, gen, *, skew, drop):
    if n == 0:
        return torch.empty(0, topk, dtype=torch.int32)
    if skew:
        probs = torch.softmax(-torch.arange(experts, dtype=torch.float32) * 0.05, 0).expand(n, -1)
        ids = torch.multinomial(probs, topk, replacement=False, generator=gen)
    else:
        ids = torch.rand(n, experts, generator=gen).argsort(dim=1)[:, :topk]
    ids = ids.to(torch.int32)
    if drop:
        ids[torch.rand(ids.shape, generator=gen) < drop] = -1
    return ids


def _warm_up_and_capture(step):
    """``step()`` once on a side stream (it compiles there, as graph capture requires), then captured:
    ``(graph, what the captured call returned)``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = step()
    return graph, res


def _make_backend(
    group,
    *,
    max_tokens,
    hidden,
    topk,
    experts,
    dtype,
    heap,
    num_sm=16,
    use_aot=False,
    timeout_s=30.0,
    overlap_bytes=None,
    **more,
):
    from ep_a2a.backends.triton import TritonBackend

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = EPConfig(
        max_tokens=max_tokens, hidden=hidden, topk=topk, num_tot_experts=experts, rank=rank, world_size=world,
        local_world_size=world, token_dtype=dtype,
    )  # fmt: skip
    extra = {} if overlap_bytes is None else {"overlap_bytes": overlap_bytes}
    extra.update(more)
    tuning = TritonTuning(num_sm=num_sm, heap=heap, **extra)
    options = BackendOptions(tuning=tuning, enable_local_combine=True, use_aot=use_aot, timeout_s=timeout_s)
    return TritonBackend(cfg, group, options)


def _inputs(seed, world, ns, hidden, topk, experts, dtype, *, skew, drop, with_w):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, hidden, generator=gen).to(dtype) for n in ns]
    ids = [_routing(n, topk, experts, gen, skew=skew, drop=drop) for n in ns]
    ws = [torch.rand(n, topk, generator=gen) for n in ns] if with_w else None
    return xs, ids, ws, gen


def _check_round_trip(be, group, xs, ids, ws, gen, experts, dtype):
    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    out, out_w, desc = be.dispatch(
        xs[rank].to(dev), ids[rank].to(dev), ws[rank].to(dev) if ws else None, None
    )
    ref, scat = dispatch_ref(xs, ids, ws, num_tot_experts=experts)
    mine = ref[rank]
    assert out.shape == mine.output.shape
    assert torch.equal(out.cpu(), mine.output), "dispatch rows differ from the reference"
    if ws:
        assert torch.equal(out_w.cpu(), mine.weights)
    assert torch.equal(desc.recv_expert_indices.cpu().long(), mine.local_expert)
    assert torch.equal(desc.num_recv_tokens_per_expert.cpu(), mine.num_recv_tokens_per_expert)
    assert torch.equal(desc.num_recv_tokens_per_rank.cpu(), mine.num_recv_tokens_per_rank)
    assert torch.equal(desc.token_dst_scatter_idx.cpu().long(), scat[rank])
    # expert outputs: fresh rows per rank, known to every rank (same generator on all ranks)
    ys = [torch.randn(r.output.shape[0], xs[0].shape[1], generator=gen).to(dtype) for r in ref]
    got = be.combine(ys[rank].to(dev), desc).cpu()
    # a dispatch may be combined again (as DeepEP reuses a handle): the same sums
    assert torch.equal(be.combine(ys[rank].to(dev), desc).cpu(), got), "a second combine differs"
    want = combine_ref([y.float() for y in ys], ids, scat, num_tot_experts=experts)[rank]
    mag = combine_ref([y.float().abs() for y in ys], ids, scat, num_tot_experts=experts)[rank]
    assert not torch.isnan(got).any()
    err = (got.float() - want).abs()
    assert bool((err <= COMBINE_RTOL[dtype] * mag + 1e-30).all()), f"combine error {float(err.max())}"


MATRIX = [
    # hidden, topk, experts, dtype, with weights, skew, drop, tokens per rank (per call, rank-indexed)
    pytest.param(
        7168, 8, 256, torch.bfloat16, True, False, 0.0, [[64, 48], [0, 33], [64, 64]], id="H7168-k8-E256-bf16"
    ),
    pytest.param(
        2048, 8, 128, torch.bfloat16, True, True, 0.05, [[40, 64], [64, 1]], id="H2048-k8-E128-skew-drop"
    ),
    pytest.param(256, 1, 4, torch.float32, False, False, 0.0, [[17, 9]], id="H256-k1-E4-f32-noW"),
    pytest.param(128, 16, 32, torch.float16, True, True, 0.2, [[30, 31], [5, 0]], id="H128-k16-E32-f16"),
]


@pytest.mark.parametrize("heap", _heaps())
@pytest.mark.parametrize(("hidden", "topk", "experts", "dtype", "with_w", "skew", "drop", "calls"), MATRIX)
def test_against_reference(group, heap, hidden, topk, experts, dtype, with_w, skew, drop, calls):
    world = dist.get_world_size(group)
    # experts must split evenly over ranks: round up (E4 on 8 ranks runs as one expert per rank)
    experts = -(-experts // world) * world
    max_tokens = max(max(c) for c in calls)
    be = _make_backend(
        group, max_tokens=max_tokens, hidden=hidden, topk=topk, experts=experts, dtype=dtype, heap=heap
    )
    try:
        for i, ns in enumerate(calls):
            ns = (ns * world)[:world]
            xs, ids, ws, gen = _inputs(
                100 + i, world, ns, hidden, topk, experts, dtype, skew=skew, drop=drop, with_w=with_w
            )
            if i % 2:  # int64 ids (as torch.topk gives them), read in place by the same kernels
                ids = [t.long() for t in ids]
            _check_round_trip(be, group, xs, ids, ws, gen, experts, dtype)
    finally:
        be.finalize()


def _check_static_call(be, rank, xs, ids, ws, experts):
    """One CUDA-graph-mode dispatch (run eagerly) against the reference, then its combine."""
    dev = torch.device("cuda", torch.cuda.current_device())
    d = be.dispatch_static(xs[rank].to(dev), ids[rank].to(dev), ws[rank].to(dev))
    ref, _ = dispatch_ref(xs, ids, ws, num_tot_experts=experts)
    assert torch.equal(d.output[: int(d.num_recv_rows)].cpu(), ref[rank].output)
    be.combine_static(d.output, d)


def test_exact_flow_with_counts_launch(group):
    """Large layers' exact-shape flow (counts, host sync, exact buffers, rows; forced by overlap_bytes=0),
    then the small layers' flow (rows into worst-case buffers) and CUDA-graph-mode calls on one backend."""
    for overlap_bytes in (0, 1 << 40):
        be = _make_backend(
            group, max_tokens=64, hidden=2048, topk=8, experts=32, dtype=torch.bfloat16, heap="torch",
            overlap_bytes=overlap_bytes,
        )  # fmt: skip

        def check(be, overlap_bytes=overlap_bytes) -> None:
            assert be.overlap_exact == (overlap_bytes > 0)

        # a static (merged) call after each exact one: the epochs of both flows stay in step
        rounds = (([64, 40], False), ([0, 64], True), ([64, 64], False))
        _check_round_trips(
            be,
            group,
            hidden=2048,
            seed=300,
            rounds=rounds,
            check=check,
            experts=32,
            drop=0.1,
            static_each_round=True,
        )
        # every cached variant went through Triton's C launcher directly, its arguments verified
        # against the compiled kernel's handle (Triton 3.6; another Triton may keep the handle)
        assert be.engine.direct_launches == len(be.engine._plans) > 0


def test_exact_calls_on_side_streams(group):
    """Exact-shape calls on other streams than the default, alternating (every flow): the large
    layers' flow without speculation waits for its counts on the stream it runs on (the backend caches
    one stream object per stream), the others poll the host mirror their row kernel writes on that
    stream; either way every call's token counts, which change from call to call, must be its own."""
    world = dist.get_world_size(group)
    streams = [torch.cuda.Stream(), torch.cuda.current_stream(), torch.cuda.Stream()]
    for overlap_bytes, speculative in ((0, False), (0, True), (1 << 40, True)):
        be = _make_backend(
            group, max_tokens=64, hidden=512, topk=4, experts=16, dtype=torch.bfloat16, heap="torch",
            overlap_bytes=overlap_bytes, speculative_rows=speculative,
        )  # fmt: skip
        try:
            for i, stream in enumerate(streams * 2):
                ns = [(17 * (i + r) + 5) % 65 for r in range(world)]
                xs, ids, ws, gen = _inputs(
                    400 + i, world, ns, 512, 4, 16, torch.bfloat16, skew=False, drop=0.1, with_w=True
                )
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    _check_round_trip(be, group, xs, ids, ws, gen, 16, torch.bfloat16)
                torch.cuda.current_stream().wait_stream(stream)
            # (the speculative flow's first call waits on its stream; the small layers' never do)
            want = 0 if be.overlap_exact else (1 if be.speculative_rows else 3)
            assert len(be._streams) == want
        finally:
            be.finalize()


@pytest.mark.parametrize("steal", [False, True], ids=["fixed", "steal"])
def test_cta_split_against_reference(group, steal):
    """Kernels with their CTAs split into senders and writers (``send_ctas`` / ``combine_send_ctas``),
    both exact-shape flows and a CUDA-graph-mode call, against the reference; with ``steal`` the
    dispatch CTAs claim chunks from shared counters and take the other role's once theirs run out."""

    def check(be) -> None:
        assert (be.engine.send_ctas, be.engine.combine_send_ctas) == (5, 8)
        assert be.engine.steal == steal

    for overlap_bytes in (0, 1 << 40):
        be = _make_backend(
            group, max_tokens=64, hidden=1024, topk=8, experts=32, dtype=torch.bfloat16, heap="torch",
            send_ctas=5, combine_send_ctas=8, overlap_bytes=overlap_bytes, steal=steal,
        )  # fmt: skip
        rounds = (([64, 50], False), ([0, 64], True))
        _check_round_trips(be, group, hidden=1024, seed=500, rounds=rounds, check=check, experts=32, drop=0.1)


def _check_round_trips(
    be, group, *, hidden, seed, rounds, check=None, experts=None, drop=0.05, static_each_round=False
) -> None:
    """``check(be)`` first, then one round trip per ``(token counts, skewed)`` of ``rounds`` (the counts
    repeated over the ranks; top-8 of ``experts`` (default 8 per rank), bf16 with weights, ``drop`` of
    the slots dropped) and a static call (after every round with ``static_each_round``, else after the
    last), each against the reference. Finalizes ``be``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    experts = experts or 8 * world
    try:
        if check is not None:
            check(be)
        for i, (ns, skew) in enumerate(rounds):
            ns = (list(ns) * world)[:world]
            xs, ids, ws, gen = _inputs(
                seed + i, world, ns, hidden, 8, experts, torch.bfloat16, skew=skew, drop=drop, with_w=True
            )
            _check_round_trip(be, group, xs, ids, ws, gen, experts, torch.bfloat16)
            if static_each_round:
                _check_static_call(be, rank, xs, ids, ws, experts)
        if not static_each_round:
            _check_static_call(be, rank, xs, ids, ws, experts)
        torch.cuda.synchronize()
        be.check_errors()
    finally:
        torch.cuda.synchronize()
        be.finalize()


def _default_backend(group, max_tokens: int, num_sm: int):
    """A backend of 512-wide bf16 rows, top-8 of 8 experts per rank, default tuning but ``num_sm``."""
    experts = 8 * dist.get_world_size(group)
    return _make_backend(
        group, max_tokens=max_tokens, hidden=512, topk=8, experts=experts, dtype=torch.bfloat16, heap="torch",
        num_sm=num_sm,
    )  # fmt: skip


def test_default_split_large_layer(group):
    """A large layer on all SMs gets the sender / writer split by default (``num_sm // 3`` dispatch,
    ``num_sm // 2`` combine CTAs sending) and matches the reference, exact-shape and static calls."""
    from ep_a2a.backends.triton.resolve import SPLIT_MIN_TOKENS

    world = dist.get_world_size(group)
    n_sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    max_tokens = 2 * SPLIT_MIN_TOKENS
    be = _make_backend(
        group, max_tokens=max_tokens, hidden=512, topk=8, experts=8 * world, dtype=torch.bfloat16,
        heap="torch", num_sm=n_sm,
    )  # fmt: skip

    def check(be) -> None:
        assert (be.engine.send_ctas, be.engine.combine_send_ctas) == (n_sm // 3, n_sm // 2)

    rounds = (([max_tokens, 1500], False), ([7, max_tokens], True))
    _check_round_trips(be, group, hidden=512, seed=700, rounds=rounds, check=check)
    small = _default_backend(group, SPLIT_MIN_TOKENS, n_sm)
    try:
        assert (small.engine.send_ctas, small.engine.combine_send_ctas) == (0, 0)
    finally:
        small.finalize()


@pytest.mark.parametrize("num_sm", [32, 64, 0], ids=["sm32", "sm64", "all-sms"])
def test_default_tiles_large_layer(group, num_sm):
    """A large layer of wide rows gets the tiles tuned for its SM count (``_default_tiles``: larger chunks
    and more warps on fewer SMs, a combine chunk of its own) and matches the reference, exact-shape and
    static calls."""
    from ep_a2a.backends.triton.resolve import SPLIT_MIN_TOKENS, _default_tiles

    world = dist.get_world_size(group)
    num_sm = num_sm or torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    max_tokens, hidden = 2 * SPLIT_MIN_TOKENS, 1024
    be = _make_backend(
        group, max_tokens=max_tokens, hidden=hidden, topk=8, experts=8 * world, dtype=torch.bfloat16,
        heap="torch", num_sm=num_sm,
    )  # fmt: skip

    def check(be) -> None:
        d, c = _default_tiles(hidden, max_tokens, num_sm)
        e = be.engine
        assert (e.chunk, e.num_warps, e.block_h) == (d["chunk"], d["num_warps"], d["block_h"])
        assert (e.combine_chunk, e.combine_warps) == (c["chunk"], c["num_warps"])
        assert c["block_h"] in (None, e.combine_block_h)

    rounds = (([max_tokens, 1500], False), ([7, max_tokens], True))
    _check_round_trips(be, group, hidden=hidden, seed=720, rounds=rounds, check=check)


def test_copy_engine_large_layer(group):
    """``TritonTuning(copy_engine=True)`` on a large layer: copy-engine dispatch, no sending CTAs (the
    split that such a layer gets by default), against the reference; off by default."""
    from ep_a2a.backends.triton.resolve import SPLIT_MIN_TOKENS

    world = dist.get_world_size(group)
    n_sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    max_tokens = 2 * SPLIT_MIN_TOKENS
    be = _make_backend(
        group, max_tokens=max_tokens, hidden=512, topk=8, experts=8 * world, dtype=torch.bfloat16,
        heap="torch", num_sm=n_sm, copy_engine=True,
    )  # fmt: skip

    def check(be) -> None:
        assert be.copy_engine
        assert (be.engine.send_ctas, be.engine.ce_pieces) == (0, 4)

    rounds = (([max_tokens, 1500], True),)
    _check_round_trips(be, group, hidden=512, seed=710, rounds=rounds, check=check)
    off = _default_backend(group, max_tokens, n_sm)
    try:
        assert not off.copy_engine
        assert off.engine.ce_pieces == 0
    finally:
        off.finalize()


@pytest.mark.parametrize("heap", _heaps())
@pytest.mark.parametrize("overlap", [None, 0], ids=["worst-case-buffers", "counts-launch"])
def test_copy_engine_against_reference(group, heap, overlap):
    """``copy_engine=True`` on any number of ranks: both exact-shape flows, then a static call."""
    world = dist.get_world_size(group)
    experts = 16 * world
    be = _make_backend(
        group, max_tokens=64, hidden=2048, topk=8, experts=experts, dtype=torch.bfloat16, heap=heap,
        copy_engine=True, ce_pieces=3, overlap_bytes=overlap,
    )  # fmt: skip

    def check(be) -> None:
        assert be.copy_engine
        assert (be.engine.ce_pieces, be.engine.send_ctas) == (3, 0)

    rounds = (([64, 40], False), ([0, 33], True), ([64, 64], False))
    _check_round_trips(be, group, hidden=2048, seed=900, rounds=rounds, check=check, experts=experts)


def test_invalid_expert_ids_raise_on_their_rank(group):
    """Ids outside [-1, E) on one rank: that rank raises ValueError, the others get the dispatch with
    those slots dropped (no host sync for the check, no out-of-bounds access)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    hidden, topk, experts = 256, 4, 16
    be = _make_backend(
        group, max_tokens=24, hidden=hidden, topk=topk, experts=experts, dtype=torch.bfloat16, heap="torch"
    )
    try:
        xs, ids, ws, _gen = _inputs(
            41, world, [24] * world, hidden, topk, experts, torch.bfloat16, skew=False, drop=0.0, with_w=True
        )
        bad = [i.clone() for i in ids]
        bad[world - 1][3, 1], bad[world - 1][7, 0] = experts + 5, -4
        dropped = [torch.where((b < -1) | (b >= experts), -1, b) for b in bad]
        ref, scat = dispatch_ref(xs, dropped, ws, num_tot_experts=experts)
        if rank == world - 1:
            with pytest.raises(ValueError, match=f"exp_indices on rank {rank}: 2 slot"):
                be.dispatch(xs[rank].to(dev), bad[rank].to(dev), ws[rank].to(dev), None)
        else:
            out, _w, desc = be.dispatch(xs[rank].to(dev), bad[rank].to(dev), ws[rank].to(dev), None)
            assert torch.equal(out.cpu(), ref[rank].output)
            assert torch.equal(desc.token_dst_scatter_idx.cpu().long(), scat[rank])
    finally:
        torch.cuda.synchronize()
        be.finalize()


def test_num_sm_and_aot(group):
    """Few CTAs and ahead-of-time compiled variants give the same results."""
    world = dist.get_world_size(group)
    be = _make_backend(
        group,
        max_tokens=96,
        hidden=1024,
        topk=4,
        experts=16,
        dtype=torch.bfloat16,
        heap="torch",
        num_sm=2,
        use_aot=True,
    )
    try:
        assert be.aot_variants >= 6
        xs, ids, ws, gen = _inputs(
            7, world, [96] * world, 1024, 4, 16, torch.bfloat16, skew=False, drop=0.1, with_w=True
        )
        _check_round_trip(be, group, xs, ids, ws, gen, 16, torch.bfloat16)
    finally:
        be.finalize()


def test_combine_per_slot(group):
    """Per-slot rows back (routing-weight gradients), float32 width 1, against the reference."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    be = _make_backend(
        group, max_tokens=40, hidden=512, topk=4, experts=16, dtype=torch.bfloat16, heap="torch"
    )
    try:
        xs, ids, ws, gen = _inputs(
            31,
            world,
            ([40, 23] * world)[:world],
            512,
            4,
            16,
            torch.bfloat16,
            skew=False,
            drop=0.1,
            with_w=True,
        )
        _, _, desc = be.dispatch(xs[rank].to(dev), ids[rank].to(dev), ws[rank].to(dev), None)
        _, scat = dispatch_ref(xs, ids, ws, num_tot_experts=16)
        grads = [
            torch.randn(n_rows, 1, generator=gen)
            for n_rows in [int(r) for r in _rows_per_rank(ids, world, 16)]
        ]
        got = be.combine_per_slot(grads[rank].to(dev), desc).cpu()
        want = combine_per_slot_ref(grads, ids, scat, num_tot_experts=16)[rank]
        assert torch.equal(got, want)
    finally:
        torch.cuda.synchronize()
        be.finalize()


def test_layer_autograd(group):
    """Gradients through ``EPAll2AllLayer(backend="triton")`` (dispatch backward = combine, combine
    backward = dispatch, routing-weight gradients by ``combine_per_slot``) equal the dense per-rank
    formula: float32 rows, with and without caller-given rows (the torch backend's autograd case)."""
    run_autograd = load_target(f"{CASES}:run_autograd")
    dev = torch.device("cuda", torch.cuda.current_device())
    run_autograd(dist.get_rank(group), dist.get_world_size(group), dev, group, backend="triton")
    torch.cuda.synchronize()
    dist.barrier(group)


def _rows_per_rank(ids, world, experts):
    e_local = experts // world
    counts = [0] * world
    for idx in ids:
        for d in range(world):
            counts[d] += int(((idx >= 0) & (idx.long() // e_local == d)).sum())
    return counts


@pytest.mark.parametrize(
    ("api", "copy_engine"),
    [("backend", False), ("backend", True), ("layer", False)],
    ids=["sm-stores", "copy-engine", "layer"],
)
def test_cuda_graph_capture_replay(group, api, copy_engine):
    """CUDA-graph capture of a static dispatch, an elementwise expert and a static combine, replayed with
    fresh inputs against the reference: on the backend, and through ``EPAll2AllLayer``'s graph mode
    (which then also drops and counts an invalid expert id on the device), there with int64 ids as
    ``torch.topk`` gives them."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    hidden, topk, experts, n = 512, 4, 16, 48
    dev = torch.device("cuda", torch.cuda.current_device())
    if api == "layer":
        from ep_a2a import EPAll2AllLayer

        be = EPAll2AllLayer(
            group, n, hidden, topk, rank, experts, world, world, dtype=torch.bfloat16, backend="triton",
            timeout_s=30.0,
        )  # fmt: skip
    else:
        be = _make_backend(
            group, max_tokens=n, hidden=hidden, topk=topk, experts=experts, dtype=torch.bfloat16, heap="torch",
            copy_engine=copy_engine,
        )  # fmt: skip
    try:
        x = torch.zeros(n, hidden, dtype=torch.bfloat16, device=dev)
        ids = torch.zeros(n, topk, dtype=torch.int64 if api == "layer" else torch.int32, device=dev)
        w = torch.zeros(n, topk, dtype=torch.float32, device=dev)
        scale = torch.full((), 0.5, dtype=torch.float32, device=dev)
        # warm up (compiles) on a side stream, as graph capture requires
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        xs, idl, ws, _gen = _inputs(
            11, world, [n] * world, hidden, topk, experts, torch.bfloat16, skew=False, drop=0.0, with_w=True
        )
        with torch.cuda.stream(s):
            x.copy_(xs[rank])
            ids.copy_(idl[rank])
            w.copy_(ws[rank])
            d = be.dispatch_static(x, ids, w)
            be.combine_static((d.output.float() * scale).to(torch.bfloat16), d)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            d = be.dispatch_static(x, ids, w)
            y = (d.output.float() * scale).to(torch.bfloat16)
            out = be.combine_static(y, d)
        for call in range(3):
            xs, idl, ws, _gen = _inputs(
                20 + call,
                world,
                [n] * world,
                hidden,
                topk,
                experts,
                torch.bfloat16,
                skew=call == 1,
                drop=0.1,
                with_w=True,
            )
            x.copy_(xs[rank])
            ids.copy_(idl[rank])
            w.copy_(ws[rank])
            graph.replay()
            torch.cuda.synchronize()
            ref, scat = dispatch_ref(xs, idl, ws, num_tot_experts=experts)
            rows = int(d.num_recv_rows)
            assert rows == ref[rank].output.shape[0]
            assert torch.equal(d.output[:rows].cpu(), ref[rank].output)
            assert torch.equal(d.weights[:rows].cpu(), ref[rank].weights)
            assert torch.equal(d.num_recv_tokens_per_expert.cpu(), ref[rank].num_recv_tokens_per_expert)
            ys = [(r.output.float() * 0.5).to(torch.bfloat16) for r in ref]
            want = combine_ref([t.float() for t in ys], idl, scat, num_tot_experts=experts)[rank]
            mag = combine_ref([t.float().abs() for t in ys], idl, scat, num_tot_experts=experts)[rank]
            err = (out.cpu().float() - want).abs()
            assert bool((err <= COMBINE_RTOL[torch.bfloat16] * mag + 1e-30).all())
            assert int(d.num_invalid_ids) == 0
        be.check_errors()
        if api == "layer":
            # ids past num_tot_experts, eagerly: dropped like -1, counted on the device, no host sync
            # (2**32 + 1 would be expert 1 as int32)
            bad = idl[rank].clone().long()
            bad[0, 0], bad[1, 1] = experts, (1 << 32) + 1
            d = be.dispatch_static(x, bad.to(dev), w)
            dropped = [t.clone() for t in idl]
            for t in dropped:
                t[0, 0], t[1, 1] = -1, -1
            ref, _ = dispatch_ref(xs, dropped, ws, num_tot_experts=experts)
            assert int(d.num_invalid_ids) == 2
            assert torch.equal(d.output[: int(d.num_recv_rows)].cpu(), ref[rank].output)
            be.combine_static(d.output, d)
            be.check_errors()
    finally:
        torch.cuda.synchronize()
        be.finalize()


def _small_backend(group, *, timeout_s: float):
    """A small layer's backend with a short timeout, and this rank's 16 tokens and expert ids."""
    dev = torch.device("cuda", torch.cuda.current_device())
    be = _make_backend(
        group, max_tokens=16, hidden=256, topk=2, experts=8, dtype=torch.bfloat16, heap="torch",
        timeout_s=timeout_s,
    )  # fmt: skip
    x = torch.randn(16, 256, device=dev).to(torch.bfloat16)
    ids = torch.randint(0, 8, (16, 2), dtype=torch.int32, device=dev)
    return be, x, ids


def test_missing_rank_times_out(group):
    """The last rank skips a dispatch: the others raise EPTimeoutError naming it, within the timeout."""
    import time

    from ep_a2a._dist import EPTimeoutError

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    be, x, ids = _small_backend(group, timeout_s=2.0)
    try:
        if rank != world - 1:
            t0 = time.perf_counter()
            with pytest.raises(EPTimeoutError, match=f"rank {world - 1}") as info:
                be.dispatch(x, ids, None, None)
            assert info.value.missing_ranks == [world - 1]
            assert time.perf_counter() - t0 < 30
            with pytest.raises(EPTimeoutError):  # poisoned from now on
                be.dispatch(x, ids, None, None)
    finally:
        torch.cuda.synchronize()
        be.finalize()


@pytest.mark.parametrize("second", ["combine", "barrier"])
def test_misordered_calls_raise_protocol_error(group, second):
    """After one dispatch, rank 0 dispatches again while the others call ``second``: every rank raises
    EPProtocolError naming both operations (no rank returns data, nobody waits for the timeout), and the
    backend refuses further calls."""
    import time

    from ep_a2a import EPProtocolError

    if dist.get_world_size(group) < 2:
        pytest.skip("misordered calls need a second rank")
    rank = dist.get_rank(group)
    be, x, ids = _small_backend(group, timeout_s=5.0)
    try:
        out, _, desc = be.dispatch(x, ids, None, None)
        calls = {
            "dispatch": lambda: be.dispatch(x, ids, None, None),
            "combine": lambda: be.combine(out, desc),
            "barrier": lambda: be.barrier(),
        }
        t0 = time.perf_counter()
        with pytest.raises(EPProtocolError) as info:
            calls["dispatch" if rank == 0 else second]()
        assert time.perf_counter() - t0 < 4.0  # detected on the host, before the device wait runs out
        msg = str(info.value)
        assert "rank 0 is in dispatch (call #1)" in msg, msg
        assert f"is in {second} (call #1)" in msg, msg
        with pytest.raises(RuntimeError, match="unusable"):
            be.dispatch(x, ids, None, None)
    finally:
        torch.cuda.synchronize()  # (kernels already launched stop at their own timeout)
        be.finalize()


@pytest.mark.skipif(not _has_nvshmem(), reason="nvshmem4py not installed")
@pytest.mark.parametrize("node", [1, 2], ids=["all-remote", "node2"])
def test_forced_remote_against_reference(group, node):
    """The inter-node path on one host: peers outside this rank's block of ``node`` ranks are reached
    only by NVSHMEM host-side put-with-signal (their table entries are 0, so a stray store would fault),
    then the per-slot combine (barriers by host signal). Bit-identical dispatch, combine within rounding."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if node >= world:
        pytest.skip(f"node size {node} leaves no remote peer on {world} ranks")
    dev = torch.device("cuda", torch.cuda.current_device())
    experts = -(-64 // world) * world
    be = _make_backend(
        group, max_tokens=64, hidden=2048, topk=8, experts=experts, dtype=torch.bfloat16, heap="nvshmem",
        force_remote=node,
    )  # fmt: skip
    try:
        assert be.remote_ranks == tuple(p for p in range(world) if p // node != rank // node)
        assert int(be.heap.ptr_table[be.remote_ranks[0]]) == 0
        for i, ns in enumerate([[64, 48], [0, 33], [64, 64]]):
            ns = (ns * world)[:world]
            xs, ids, ws, gen = _inputs(
                700 + i, world, ns, 2048, 8, experts, torch.bfloat16, skew=i == 1, drop=0.1, with_w=True
            )
            _check_round_trip(be, group, xs, ids, ws, gen, experts, torch.bfloat16)
        _, _, desc = be.dispatch(xs[rank].to(dev), ids[rank].to(dev), ws[rank].to(dev), None)
        _, scat = dispatch_ref(xs, ids, ws, num_tot_experts=experts)
        grads = [torch.randn(n, 1, generator=gen) for n in _rows_per_rank(ids, world, experts)]
        got = be.combine_per_slot(grads[rank].to(dev), desc).cpu()
        assert torch.equal(got, combine_per_slot_ref(grads, ids, scat, num_tot_experts=experts)[rank])
        with pytest.raises(NotImplementedError, match="remote peers"):
            be.dispatch_static(xs[rank].to(dev), ids[rank].to(dev), ws[rank].to(dev))
        be.barrier()
    finally:
        torch.cuda.synchronize()
        be.finalize()


def test_forced_remote_needs_nvshmem_heap(group):
    if dist.get_world_size(group) < 2:
        pytest.skip("force_remote=1 leaves no remote peer on one rank")
    with pytest.raises(ValueError, match="heap='nvshmem'"):
        _make_backend(
            group, max_tokens=8, hidden=256, topk=2, experts=8, dtype=torch.bfloat16, heap="torch",
            force_remote=1,
        )  # fmt: skip


def test_exact_dispatch_refused_while_capturing(group):
    """The exact-shape dispatch reads its counts on the host, so capturing it in a CUDA graph raises at
    once (no kernel runs under capture: a poll for the counts could only time out)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    be = _make_backend(group, max_tokens=8, hidden=256, topk=2, experts=8, dtype=torch.bfloat16, heap="torch")
    try:
        x = torch.zeros(8, 256, dtype=torch.bfloat16, device=dev)
        ids = torch.zeros(8, 2, dtype=torch.int32, device=dev)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="cannot be captured"), torch.cuda.graph(graph):
            be.dispatch(x, ids, None, None)
        w = torch.ones(8, 2, device=dev)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="cannot be captured"), torch.cuda.graph(graph):
            be.dispatch_plain(x, ids, w)  # (the layer's common case)
    finally:
        torch.cuda.synchronize()
        be.finalize()


@pytest.mark.parametrize(
    ("send_ctas", "steal"), [(0, False), (5, False), (5, True)], ids=["no-split", "split", "split-steal"]
)
def test_speculative_rows(group, send_ctas, steal):
    """Large layers' exact-shape flow with ``speculative_rows`` (the default): after a first call (host
    wait before the row kernel) the row kernel goes before the counts, into outputs sized from the most
    rows of the last calls. Every call against the reference: a first call, the same size again, a
    quarter of the tokens, the full size again (the quarter did not shrink the outputs: no overflow),
    then every slot to rank 0's experts (rank 0 outgrows its outputs: exact outputs and a second
    writing pass; the others receive no rows) and uniform again. A CUDA-graph-mode dispatch after each of
    the first calls keeps the flows' epochs in step."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    experts = 8 * world
    be = _make_backend(
        group, max_tokens=64, hidden=512, topk=8, experts=experts, dtype=torch.bfloat16, heap="torch",
        overlap_bytes=0, send_ctas=send_ctas, steal=steal,
    )  # fmt: skip
    try:
        assert be.speculative_rows
        assert not be.overlap_exact
        for i, tokens in enumerate((64, 64, 16, 64, 64)):
            xs, ids, ws, gen = _inputs(
                910 + i, world, [tokens] * world, 512, 8, experts, torch.bfloat16, skew=False, drop=0.05,
                with_w=True,
            )  # fmt: skip
            _check_round_trip(be, group, xs, ids, ws, gen, experts, torch.bfloat16)
            _check_static_call(be, rank, xs, ids, ws, experts)
        assert be.speculative_calls == 4, be.speculative_calls
        assert be.speculative_overflows == 0, "the full size after the quarter fits the window's outputs"
        for i, to_rank0 in enumerate((True, False)):
            xs, ids, ws, gen = _inputs(
                920 + i, world, [64] * world, 512, 8, experts, torch.bfloat16, skew=False, drop=0.05,
                with_w=True,
            )  # fmt: skip
            if to_rank0:
                ids = [torch.where(t >= 0, t % (experts // world), t) for t in ids]
            _check_round_trip(be, group, xs, ids, ws, gen, experts, torch.bfloat16)
        assert be.speculative_calls == 6, be.speculative_calls
        # (in a world of one every expert is rank 0's already: its rows, at most 64 x 8, fit the outputs
        # sized from the last calls, 64 x 8 x 0.95 plus an eighth; with peers rank 0 gets theirs too)
        overflows = 1 if rank == 0 and world > 1 else 0
        assert be.speculative_overflows == overflows, be.speculative_overflows
        torch.cuda.synchronize()
        be.check_errors()
    finally:
        torch.cuda.synchronize()
        be.finalize()


def test_exact_rows_allocated_ahead(group):
    """Large layers' exact-shape flow allocates the row-sized outputs before the host waits for the
    counts, sized from the last calls (an eighth of headroom), and returns views of their first rows
    when the counts fit (at least three quarters of them); otherwise it allocates exactly after the wait.
    Every call against the reference: a first call, the same inputs again (fits), a quarter of the
    tokens (too few rows: exact), then the full size (too many: exact). (Without ``speculative_rows``,
    whose flow is ``test_speculative_rows``.)"""
    world = dist.get_world_size(group)
    experts = 8 * world
    be = _make_backend(
        group, max_tokens=64, hidden=512, topk=8, experts=experts, dtype=torch.bfloat16, heap="torch",
        overlap_bytes=0, speculative_rows=False,
    )  # fmt: skip
    sizes: list[int] = []
    alloc = be.engine.alloc_dispatch_rows

    def recording(rows, **kw):
        sizes.append(rows)
        return alloc(rows, **kw)

    be.engine.alloc_dispatch_rows = recording
    try:
        assert not be.overlap_exact
        for tokens, seed in ((64, 900), (64, 900), (16, 901), (64, 902)):
            xs, ids, ws, gen = _inputs(
                seed, world, [tokens] * world, 512, 8, experts, torch.bfloat16, skew=False, drop=0.05,
                with_w=True,
            )  # fmt: skip
            _check_round_trip(be, group, xs, ids, ws, gen, experts, torch.bfloat16)
        first = sizes[0]
        ahead = min(first + first // 8, be.engine.worst_case_rows())  # (at most the worst case)
        assert sizes[1] == ahead, "the repeat is allocated ahead, and fits"
        assert len(sizes) == 6, f"the quarter-size and full calls allocate ahead, then exactly: {sizes}"
        be.check_errors()
    finally:
        torch.cuda.synchronize()
        be.finalize()


@pytest.mark.parametrize("overlap", [None, 0], ids=["worst-case-buffers", "speculative-rows"])
def test_eager_graphs_against_reference(group, overlap):
    """Eager dispatches whose input tensors stay where they are (new values written into them in place)
    replay a CUDA graph of their launches from the third call on, and so do the combines of their rows
    (the layer's common-case path, ``combine_plain``): every dispatch against the reference (the graph
    reads the tensors' current values), other tensors and token counts in between, dispatch and combine
    bit for bit those of the same calls without graphs; a combine of other rows (at another address)
    right after a replayed one sums those rows, not the graph's; every combine output is NaN-poisoned
    once read (the ring hands it out again: the next combine must write every row)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    experts = 8 * world
    dev = torch.device("cuda", torch.cuda.current_device())
    kw = dict(max_tokens=64, hidden=256, topk=4, experts=experts, dtype=torch.bfloat16, heap="torch")
    be = _make_backend(group, **kw, overlap_bytes=overlap)
    plain = _make_backend(group, **kw, overlap_bytes=overlap, eager_graphs=False)
    try:
        assert be.eager_graphs
        x, ids, w = None, None, None
        calls = (48, 48, 48, 17, 48, 48)
        for i, tokens in enumerate(calls):
            xs, idss, wss, _ = _inputs(
                500 + i, world, [tokens] * world, 256, 4, experts, torch.bfloat16, skew=False, drop=0.1,
                with_w=True,
            )  # fmt: skip
            if tokens == 48 and x is not None:  # (the same tensors, new values)
                x.copy_(xs[rank])
                ids.copy_(idss[rank])
                w.copy_(wss[rank])
                args = (x, ids, w)
            else:
                args = (xs[rank].to(dev), idss[rank].to(dev), wss[rank].to(dev))
                if tokens == 48:
                    x, ids, w = args
            results = []
            for b in (be, plain):
                out, out_w, desc = b.dispatch(*args, None)
                summed = b.combine_plain(out, desc)  # (the rows sent back as they came: repeated addresses)
                got = [out.clone(), out_w.clone(), desc.recv_expert_indices.clone(), summed.clone()]
                summed.fill_(float("nan"))
                del summed
                if i == len(calls) - 1:  # (other rows at another address, then the same rows again)
                    other = out * 2
                    for rows in (other, None):
                        del out, out_w, desc  # (released: the next dispatch takes the same workspace)
                        out, out_w, desc = b.dispatch(*args, None)
                        got.append(b.combine_plain(out if rows is None else rows, desc).clone())
                    del other
                del out, out_w, desc
                results.append(got)
            torch.cuda.synchronize()
            mine = dispatch_ref(xs, idss, wss, num_tot_experts=experts)[0][rank]
            assert torch.equal(results[0][0].cpu(), mine.output), f"call {i}: rows differ from the reference"
            assert torch.equal(results[0][1].cpu(), mine.weights), f"call {i}: weights differ"
            for a, b_ in zip(results[0], results[1], strict=True):
                assert torch.equal(a, b_), f"call {i}: with graphs != without"
            if i == len(calls) - 1:  # (doubling is exact in bf16: so are the doubled sums)
                assert torch.equal(results[0][4], results[0][3] * 2), "other rows served another's graph"
                assert torch.equal(results[0][5], results[0][3]), "the same rows again"
        if overlap is None:  # (rows allocated per call repeat their address only as the allocator wills)
            assert be.graph_captures >= 1, "the repeated tensors were captured"
            assert be.graph_replays >= 2, be.graph_replays
        assert plain.graph_captures == plain.graph_replays == 0
        be.check_errors()
        plain.check_errors()
    finally:
        torch.cuda.synchronize()
        be.finalize()
        plain.finalize()


def _returned_tensors(out, out_w, desc) -> dict:
    """Every tensor a dispatch returns, by name."""
    return {
        "output": out, "weights": out_w, "recv_expert_indices": desc.recv_expert_indices,
        "num_recv_tokens_per_expert": desc.num_recv_tokens_per_expert,
        "num_recv_tokens_per_rank": desc.num_recv_tokens_per_rank,
        "num_input_tokens_per_rank": desc.num_input_tokens_per_rank,
        "token_dst_scatter_idx": desc.token_dst_scatter_idx,
        "skipped_token_topk_mapping_indices": desc.skipped_token_topk_mapping_indices,
        "tab": desc.backend_state.tab, "n_src": desc.backend_state.n_src,
    }  # fmt: skip


@pytest.mark.parametrize("overlap", [None, 0], ids=["worst-case-buffers", "speculative-rows"])
def test_held_outputs_survive_later_dispatches(group, overlap):
    """Whatever later dispatches run, every tensor a dispatch returned (rows, weights, every descriptor
    field) keeps its values while the caller holds it; once released, the outputs' workspaces are reused
    (no new one per call). Both exact-shape flows that take workspaces ahead of the counts."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    experts = 8 * world
    dev = torch.device("cuda", torch.cuda.current_device())
    be = _make_backend(
        group, max_tokens=64, hidden=256, topk=4, experts=experts, dtype=torch.bfloat16, heap="torch",
        overlap_bytes=overlap,
    )  # fmt: skip
    try:
        held = []
        for seed, tokens in ((301, 64), (302, 40), (303, 64), (304, 17)):
            xs, ids, ws, _ = _inputs(
                seed, world, [tokens] * world, 256, 4, experts, torch.bfloat16, skew=False, drop=0.1, with_w=True
            )  # fmt: skip
            out, out_w, desc = be.dispatch(xs[rank].to(dev), ids[rank].to(dev), ws[rank].to(dev), None)
            torch.cuda.synchronize()
            returned = _returned_tensors(out, out_w, desc)
            snapshot = {k: v.clone() for k, v in returned.items()}
            held.append((xs, ids, ws, returned, snapshot))
        for xs, ids, ws, returned, snapshot in held:
            mine = dispatch_ref(xs, ids, ws, num_tot_experts=experts)[0][rank]
            assert torch.equal(returned["output"].cpu(), mine.output), "held rows overwritten"
            assert torch.equal(returned["weights"].cpu(), mine.weights), "held weights overwritten"
            for name, t in returned.items():
                assert torch.equal(t, snapshot[name]), f"held {name} overwritten by a later dispatch"
        allocated = be.workspaces.allocated
        del held, returned, snapshot, out, out_w, desc, t
        for seed in (305, 306, 307):  # released: round trips reuse the workspaces
            xs, ids, ws, gen = _inputs(
                seed, world, [48] * world, 256, 4, experts, torch.bfloat16, skew=False, drop=0.1, with_w=True
            )  # fmt: skip
            _check_round_trip(be, group, xs, ids, ws, gen, experts, torch.bfloat16)
        assert be.workspaces.allocated == allocated, "released workspaces are taken again"
        be.check_errors()
    finally:
        torch.cuda.synchronize()
        be.finalize()


def test_large_layer_rows_kept_between_calls(group):
    """A large layer's common-case dispatch (rows sized from the last calls) writes the rows its
    workspace kept from the last call once the caller dropped them: the same inputs again land in the
    same rows (and replay their CUDA graph), every call against the reference; rows the caller still
    holds keep their values while the next call writes new ones."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    experts = 8 * world
    dev = torch.device("cuda", torch.cuda.current_device())
    be = _make_backend(
        group, max_tokens=64, hidden=256, topk=4, experts=experts, dtype=torch.bfloat16, heap="torch",
        overlap_bytes=0,
    )  # fmt: skip
    try:
        assert be._plain_large
        xs, ids, ws, _ = _inputs(
            931, world, [48] * world, 256, 4, experts, torch.bfloat16, skew=False, drop=0.1, with_w=True
        )  # fmt: skip
        args = (xs[rank].to(dev), ids[rank].to(dev), ws[rank].to(dev))
        mine = dispatch_ref(xs, ids, ws, num_tot_experts=experts)[0][rank]
        addresses = []
        for i in range(5):
            out, out_w, desc = be.dispatch_plain(*args)
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), mine.output), f"call {i}: rows differ from the reference"
            assert torch.equal(out_w.cpu(), mine.weights), f"call {i}: weights differ from the reference"
            addresses.append(out.data_ptr())
            del out, out_w, desc
        # (the first call waits for the counts and allocates exact rows; the second allocates and keeps)
        assert len(set(addresses[1:])) == 1, f"the kept rows are written again: {addresses}"
        assert be.graph_replays >= 2, be.graph_replays
        held, _, _ = be.dispatch_plain(*args)
        snapshot = held.clone()
        xs2, ids2, ws2, _ = _inputs(
            932, world, [48] * world, 256, 4, experts, torch.bfloat16, skew=False, drop=0.1, with_w=True
        )  # fmt: skip
        out, _, _ = be.dispatch_plain(xs2[rank].to(dev), ids2[rank].to(dev), ws2[rank].to(dev))
        torch.cuda.synchronize()
        assert held.data_ptr() == addresses[-1]
        assert out.data_ptr() != held.data_ptr(), "held rows: new ones"
        assert torch.equal(held, snapshot), "held rows overwritten by a later dispatch"
        assert torch.equal(out.cpu(), dispatch_ref(xs2, ids2, ws2, num_tot_experts=experts)[0][rank].output)
        be.check_errors()
    finally:
        torch.cuda.synchronize()
        be.finalize()


# ------------------------------------------------------------------------------------------------------
# FP8 dispatch in DeepEP's format through EPLayer(backend="triton"): rows and scales bit for bit (random
# bytes, NaN and infinity patterns included), combine of bf16 expert outputs; exact and CUDA-graph modes
# ------------------------------------------------------------------------------------------------------
def _fp8_bytes(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8)], 1).cpu()


def _fp8_inputs(seed, ns, hidden, topk, experts, *, skew=False, drop=0.05):
    """Every rank's ``(x_fp8, scales)`` as random bytes, expert ids and weights (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [
        (
            torch.randint(0, 256, (n, hidden), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn),
            torch.randint(-(2**31), 2**31 - 1, (n, hidden // 128), generator=gen, dtype=torch.int32).view(
                torch.float32
            ),
        )
        for n in ns
    ]
    ids = [_routing(n, topk, experts, gen, skew=skew, drop=drop) for n in ns]
    ws = [torch.rand(n, topk, generator=gen) for n in ns]
    return xs, ids, ws, gen


def _rows_to_quantize(n: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 rows over many magnitudes with an all-zero block, a tiny one, an infinity and a NaN (CPU)."""
    x = torch.randn(n, hidden, generator=gen) * torch.logspace(-3, 4, n)[:, None]
    x[1, :128] = 0
    x[2, -128:] *= 1e-35
    x[3, 5], x[4, -7] = float("-inf"), float("nan")
    return x.to(torch.bfloat16)


def _check_quantize_on_send(layer, group, seed, ns, *, skew=False, drop=0.05) -> None:
    """:func:`_check_fp8_round_trip` of bf16 rows (:func:`_rows_to_quantize`) dispatched with ``fp8=True``,
    against the reference quantizer run on the sender's device; ``skew``: every slot to rank 0's experts."""
    from ep_a2a.reference import quantize_fp8

    cfg, world = layer.config, dist.get_world_size(group)
    hidden, topk, experts = cfg.hidden, cfg.topk, cfg.num_tot_experts
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(seed)
    bf = [_rows_to_quantize(n, hidden, gen) for n in ns]
    sent = [tuple(t.cpu() for t in quantize_fp8(x.to(dev))) for x in bf]
    ids = [_routing(n, topk, experts, gen, skew=False, drop=drop) for n in ns]
    if skew:
        ids = [torch.where(t >= 0, t % (experts // world), t) for t in ids]
    ws = [torch.rand(n, topk, generator=gen) for n in ns]
    _check_fp8_round_trip(layer, group, sent, ids, ws, gen, experts, sent=sent, quantize_from=bf)


def _fp8_layer(
    group, *, max_tokens, hidden, topk, experts, dtype=torch.float8_e4m3fn, tuning=None, use_aot=False
):
    from ep_a2a import EPLayer

    layer = EPLayer(
        group, max_tokens=max_tokens, hidden=hidden, topk=topk, num_experts=experts, dtype=dtype,
        backend="triton", tuning=tuning, timeout_s=60.0, use_aot=use_aot,
    )  # fmt: skip
    assert layer.backend_name == "triton"
    return layer


def _check_fp8_round_trip(
    layer, group, xs, ids, ws, gen, experts, *, sent=None, quantize_from=None, on_device=None
):
    """One FP8 ``layer.dispatch`` of this rank's ``xs`` (or, with ``quantize_from``, of its bf16 rows with
    ``fp8=True``, whose bytes the caller gives as ``sent``) against the reference, then a bf16 combine;
    ``on_device``: this rank's input, ids and weights already on the GPU, dispatched as they are.
    Returns the received ``(rows, scales)``."""
    rank, hidden = dist.get_rank(group), xs[0][0].shape[1]
    dev = torch.device("cuda", torch.cuda.current_device())
    kw = {"fp8": True} if quantize_from is not None else {}
    if on_device is not None:
        arg, ids_d, w_d = on_device
    else:
        arg = quantize_from[rank].to(dev) if quantize_from is not None else tuple(t.to(dev) for t in xs[rank])
        ids_d, w_d = ids[rank].to(dev), ws[rank].to(dev)
    (q, s), w, desc = layer.dispatch(arg, ids_d, w_d, **kw)
    ref, scat = dispatch_ref([_fp8_bytes(*x) for x in (sent or xs)], ids, ws, num_tot_experts=experts)
    mine = ref[rank]
    assert (q.dtype, s.dtype) == (torch.float8_e4m3fn, torch.float32)
    assert tuple(q.shape) == (mine.output.shape[0], hidden)
    assert tuple(s.shape) == (mine.output.shape[0], hidden // 128)
    assert torch.equal(_fp8_bytes(q, s), mine.output), "FP8 rows or scales differ from the sender's bytes"
    assert torch.equal(w.cpu(), mine.weights)
    assert torch.equal(desc.recv_expert_indices.cpu().long(), mine.local_expert)
    assert torch.equal(desc.num_recv_tokens_per_expert.cpu(), mine.num_recv_tokens_per_expert)
    assert torch.equal(desc.token_dst_scatter_idx.cpu().long(), scat[rank])
    ys = [torch.randn(r.output.shape[0], hidden, generator=gen).to(torch.bfloat16) for r in ref]
    got = layer.combine(ys[rank].to(dev), desc).cpu()
    want = combine_ref([y.float() for y in ys], ids, scat, num_tot_experts=experts)[rank]
    mag = combine_ref([y.float().abs() for y in ys], ids, scat, num_tot_experts=experts)[rank]
    assert got.dtype == torch.bfloat16
    err = (got.float() - want).abs()
    assert bool((err <= COMBINE_RTOL[torch.bfloat16] * mag + 1e-30).all()), (
        f"combine error {float(err.max())}"
    )
    return q, s


@pytest.mark.parametrize(
    ("layer_dtype", "overlap_bytes", "copy_engine"),
    [
        pytest.param(torch.float8_e4m3fn, None, False, id="fp8-layer-worst-case-buffers"),
        pytest.param(torch.float8_e4m3fn, 0, False, id="fp8-layer-counts-then-speculative"),
        pytest.param(torch.bfloat16, 0, False, id="bf16-layer-counts-then-speculative"),
        pytest.param(torch.float8_e4m3fn, None, True, id="fp8-layer-copy-engine"),
    ],
)
def test_fp8_dispatch_against_reference(group, layer_dtype, overlap_bytes, copy_engine):
    """FP8 rows of the DeepSeek-V3 width (7168 channels, 56 scales) on small batches, every exact-shape
    flow: worst-case buffers, counts first then speculative (a call that outgrows its outputs gets a
    second writing pass), copy-engine dispatch; on a layer of FP8 rows and on a bf16 layer. Then
    quantize-on-send (``fp8=True``) against the sender's quantizer."""
    from ep_a2a.backends.triton.engine import QuantizeOnSend

    world = dist.get_world_size(group)
    hidden, topk, experts = 7168, 8, -(-256 // world) * world
    extra = {} if overlap_bytes is None else {"overlap_bytes": overlap_bytes}
    tuning = TritonTuning(num_sm=32, copy_engine=copy_engine, **extra)
    layer = _fp8_layer(group, max_tokens=64, hidden=hidden, topk=topk, experts=experts, dtype=layer_dtype,
                       tuning=tuning)  # fmt: skip
    be = layer.ctx.backend
    try:
        assert be.overlap_exact == (overlap_bytes is None)
        for i, (ns, skew) in enumerate(
            (([64, 48], False), ([0, 33], False), ([64, 64], True), ([64, 64], False))
        ):
            ns = (ns * world)[:world]
            xs, ids, ws, gen = _fp8_inputs(1100 + i, ns, hidden, topk, experts, skew=skew)
            if skew:  # every slot to rank 0's experts: rank 0 outgrows the speculative outputs
                ids = [torch.where(t >= 0, t % (experts // world), t) for t in ids]
            _check_fp8_round_trip(layer, group, xs, ids, ws, gen, experts)
        if overlap_bytes == 0:
            assert be.speculative_calls == 3, be.speculative_calls
            # rank 0 outgrows its outputs on the skewed call (with peers: their rows come on top of its
            # own; in a world of one every call sends it everything); a rank whose guess followed a
            # small call (rank 1 received nothing there) may outgrow them on the next one
            assert be.speculative_overflows >= (1 if dist.get_rank(group) == 0 and world > 1 else 0)
            assert be.speculative_overflows <= be.speculative_calls
        # quantize-on-send: the bytes are those of the reference quantizer run on the sender's device;
        # inside the row kernel (the copy engine's copies move rows as they are: torch operations first)
        dev = torch.device("cuda", torch.cuda.current_device())
        probe = be.quantize_fp8(torch.zeros(2, hidden, dtype=torch.bfloat16, device=dev))
        assert isinstance(probe, QuantizeOnSend) == (not copy_engine)
        for j, skew in enumerate((False, True)):
            # (skewed: every slot to rank 0's experts, a speculative call outgrows its outputs: rewrite)
            _check_quantize_on_send(layer, group, 1200 + j, [40 + r for r in range(world)], skew=skew)
        torch.cuda.synchronize()
        layer.check_errors()
    finally:
        torch.cuda.synchronize()
        layer.finalize()


@pytest.mark.parametrize("quantize", [False, True], ids=["tuple", "quantize-on-send"])
def test_fp8_eager_calls_from_the_same_tensors(group, quantize):
    """FP8 dispatches of the DeepSeek-V3 width called eagerly on the same tensors, refilled between
    calls, on a layer whose workspaces hold the rows: tuples ``(x_fp8, scales)``, or bf16 rows with
    ``fp8=True``. Later calls replay CUDA graphs (of the packing and the launches); every call's rows
    and scales equal the sender's bytes, and a result held across the later calls keeps its values."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    hidden, topk, experts = 7168, 8, -(-256 // world) * world
    layer = _fp8_layer(group, max_tokens=64, hidden=hidden, topk=topk, experts=experts)
    be = layer.ctx.backend
    dev = torch.device("cuda", torch.cuda.current_device())
    assert be._fp8_plain
    tensors, held = None, None
    from ep_a2a.reference import quantize_fp8

    try:
        for i in range(6):
            xs, ids, ws, gen = _fp8_inputs(1500 + i, [48] * world, hidden, topk, experts)
            kw: dict = {}
            if quantize:
                bf = [_rows_to_quantize(48, hidden, gen) for _ in range(world)]
                xs = [tuple(t.cpu() for t in quantize_fp8(x.to(dev))) for x in bf]
                kw = {"sent": xs, "quantize_from": bf}
            mine = ((bf[rank],) if quantize else xs[rank]) + (ids[rank], ws[rank])
            if tensors is None:
                tensors = tuple(t.to(dev) for t in mine)
            else:
                for t, new in zip(tensors, mine, strict=True):
                    t.copy_(new)
            arg = tensors[0] if quantize else tensors[:2]
            q, s = _check_fp8_round_trip(
                layer, group, xs, ids, ws, gen, experts, on_device=(arg, *tensors[-2:]), **kw
            )
            if i == 2:
                held = (q, s, _fp8_bytes(q, s))
            del q, s
        assert be.graph_captures >= 1
        assert be.graph_replays >= 2
        assert held is not None
        assert torch.equal(_fp8_bytes(held[0], held[1]), held[2]), "a held result was overwritten"
        torch.cuda.synchronize()
        layer.check_errors()
    finally:
        torch.cuda.synchronize()
        layer.finalize()


def test_fp8_dispatch_large_layer(group):
    """The DeepSeek-V3 shape at full size on every SM (default tuning: tiled rows, the CTA split, the
    speculative flow): 4096 tokens per rank, then 1000; then bf16 rows quantized on send at 4096 and
    1000 tokens."""
    world = dist.get_world_size(group)
    hidden, topk, experts = 7168, 8, -(-256 // world) * world
    layer = _fp8_layer(group, max_tokens=4096, hidden=hidden, topk=topk, experts=experts)
    try:
        for i, n in enumerate((4096, 1000)):
            xs, ids, ws, gen = _fp8_inputs(1300 + i, [n] * world, hidden, topk, experts, drop=0.02)
            _check_fp8_round_trip(layer, group, xs, ids, ws, gen, experts)
        for i, n in enumerate((4096, 1000)):
            _check_quantize_on_send(layer, group, 1400 + i, [n] * world, drop=0.02)
        torch.cuda.synchronize()
        layer.check_errors()
    finally:
        torch.cuda.synchronize()
        layer.finalize()


@pytest.mark.parametrize(
    ("layer_dtype", "quantize"),
    [
        pytest.param(torch.float8_e4m3fn, False, id="fp8-layer-tuple"),
        pytest.param(torch.float8_e4m3fn, True, id="fp8-layer-quantize-in-graph"),
        pytest.param(torch.bfloat16, False, id="bf16-layer-tuple"),
    ],
)
def test_fp8_cuda_graph_capture_replay(group, layer_dtype, quantize):
    """``dispatch_static`` of FP8 rows (the tuple, or bf16 rows quantized inside the graph), an expert that
    dequantizes them to bf16, and ``combine_static``, captured once and replayed with fresh inputs: the
    valid rows are the sender's bytes, the rows past them keep the poison written before the replay
    (nothing is written past the received rows), the combine matches the reference. The layer of FP8 rows
    is built with ``use_aot=True`` (its packed-row variants compiled at construction, on the GPU)."""
    from ep_a2a.reference import dequantize_fp8, quantize_fp8

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    hidden, topk, experts, n = 1024, 4, 16, 48
    dev = torch.device("cuda", torch.cuda.current_device())
    aot = layer_dtype == torch.float8_e4m3fn
    layer = _fp8_layer(
        group, max_tokens=n, hidden=hidden, topk=topk, experts=experts, dtype=layer_dtype, use_aot=aot
    )
    try:
        if aot:
            assert layer.ctx.backend.aot_variants > 0
        xb = torch.zeros(n, hidden, dtype=torch.bfloat16, device=dev)
        xq = torch.zeros(n, hidden, dtype=torch.float8_e4m3fn, device=dev)
        xsc = torch.ones(n, hidden // 128, dtype=torch.float32, device=dev)
        ids = torch.zeros(n, topk, dtype=torch.int64, device=dev)
        w = torch.zeros(n, topk, dtype=torch.float32, device=dev)

        def step():
            d = (
                layer.dispatch_static(xb, ids, w, fp8=True)
                if quantize
                else layer.dispatch_static((xq, xsc), ids, w)
            )
            y = dequantize_fp8(*d.output).to(torch.bfloat16)
            return d, layer.combine_static(y, d)

        graph, (d, out) = _warm_up_and_capture(step)
        q_out, s_out = d.output
        assert tuple(q_out.shape) == (world * n * topk, hidden)
        for call in range(3):
            gen = torch.Generator().manual_seed(1400 + call)
            bf = [(torch.randn(n, hidden, generator=gen) * 4).to(torch.bfloat16) for _ in range(world)]
            sent = [tuple(t.cpu() for t in quantize_fp8(x.to(dev))) for x in bf]
            idl = [_routing(n, topk, experts, gen, skew=call == 1, drop=0.1).long() for _ in range(world)]
            ws = [torch.rand(n, topk, generator=gen) for _ in range(world)]
            xb.copy_(bf[rank])
            xq.copy_(sent[rank][0])
            xsc.copy_(sent[rank][1])
            ids.copy_(idl[rank])
            w.copy_(ws[rank])
            q_out.view(torch.uint8).fill_(0xFF)  # poison
            s_out.view(torch.int32).fill_(-1)
            graph.replay()
            torch.cuda.synchronize()
            ref, scat = dispatch_ref([_fp8_bytes(*x) for x in sent], idl, ws, num_tot_experts=experts)
            rows = int(d.num_recv_rows)
            assert rows == ref[rank].output.shape[0]
            assert torch.equal(_fp8_bytes(q_out[:rows], s_out[:rows]), ref[rank].output)
            assert bool((q_out[rows:].view(torch.uint8) == 0xFF).all()), (
                "a row past the received ones written"
            )
            assert bool((s_out[rows:].view(torch.int32) == -1).all()), (
                "a scale past the received ones written"
            )
            assert torch.equal(d.weights[:rows].cpu(), ref[rank].weights)
            ys = [
                dequantize_fp8(r.output[:, :hidden].view(torch.float8_e4m3fn),
                               r.output[:, hidden:].contiguous().view(torch.float32)).to(torch.bfloat16)
                for r in ref
            ]  # fmt: skip
            want = combine_ref([t.float() for t in ys], idl, scat, num_tot_experts=experts)[rank]
            mag = combine_ref([t.float().abs() for t in ys], idl, scat, num_tot_experts=experts)[rank]
            err = (out.cpu().float() - want).abs()
            assert bool((err <= COMBINE_RTOL[torch.bfloat16] * mag + 1e-30).all())
        layer.check_errors()
    finally:
        torch.cuda.synchronize()
        layer.finalize()


def test_fp8_refused_where_the_buffers_are_too_narrow(group):
    """A layer of another 1-byte dtype holds rows of ``hidden`` bytes: an FP8 dispatch (exact or static)
    raises on every rank, naming ``dtype``, before any communication; the layer stays usable."""
    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = _fp8_layer(group, max_tokens=8, hidden=256, topk=2, experts=8, dtype=torch.float8_e5m2)
    try:
        q = torch.zeros(8, 256, dtype=torch.float8_e4m3fn, device=dev)
        sc = torch.ones(8, 2, dtype=torch.float32, device=dev)
        ids = torch.full((8, 2), rank, dtype=torch.int32, device=dev)
        for fn in (layer.dispatch, layer.dispatch_static):
            with pytest.raises(ValueError, match=r"dtype=torch\.float8_e5m2"):
                fn((q, sc), ids)
        layer.ep_barrier_all()  # (no rank started a collective: every rank reaches the barrier)
        layer.check_errors()
    finally:
        torch.cuda.synchronize()
        layer.finalize()


# --------------------------------------------------------------------------------------------------
# the low-latency mode (TritonTuning(low_latency=True)) through the layer; these run on any number of
# GPUs, one included (torchrun --nproc-per-node 1 ... -k low_latency)
# --------------------------------------------------------------------------------------------------
def _ll_layer(group, *, n, hidden, topk, experts, dtype=torch.bfloat16, timeout_s=30.0, use_aot=False):
    from ep_a2a import EPLayer

    return EPLayer(
        group, max_tokens=n, hidden=hidden, topk=topk, num_experts=experts, dtype=dtype, backend="triton",
        tuning=TritonTuning(num_sm=32, low_latency=True), timeout_s=timeout_s, use_aot=use_aot,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8-quantize"])
def test_low_latency_layer_against_reference(group, mode):
    """The layer in the low-latency mode: exact-shape dispatch / combine, static (eager) and captured in a
    CUDA graph replayed with fresh inputs, each against the reference (FP8: DeepEP's tuple, or bf16 rows
    quantized on send, bytes and scales bit for bit; combine in bf16)."""
    from ep_a2a.reference import quantize_fp8

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    hidden, topk, experts, n = 7168, 8, 16 * world, 64
    fp8 = mode != "bf16"
    layer = _ll_layer(group, n=n, hidden=hidden, topk=topk, experts=experts,
                      dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)  # fmt: skip
    dev = layer.device

    def refs(xs, ids, ws):
        sent = [_fp8_bytes(*quantize_fp8(x)) for x in xs] if fp8 else xs
        return dispatch_ref(sent, ids, ws, num_tot_experts=experts)

    def arg(x):
        return quantize_fp8(x.to(dev)) if mode == "fp8" else x.to(dev)

    def rows_of(out, r):
        return _fp8_bytes(out[0][:r], out[1][:r]) if fp8 else out[:r].cpu()

    try:
        assert layer.backend_name == "triton"
        for call, ns in enumerate(([n] * world, [n - 5 * r for r in range(world)])):
            xs, ids, ws, gen = _inputs(40 + call, world, ns, hidden, topk, experts, torch.bfloat16,
                                       skew=call == 1, drop=0.05, with_w=True)  # fmt: skip
            ref, scat = refs(xs, ids, ws)
            out, out_w, desc = layer.dispatch(arg(xs[rank]), ids[rank].to(dev), ws[rank].to(dev),
                                              fp8=mode == "fp8-quantize")  # fmt: skip
            rows = desc.num_recv_rows
            assert rows == ref[rank].output.shape[0]
            assert torch.equal(rows_of(out, rows), ref[rank].output), f"call {call}: rows differ"
            assert torch.equal(out_w.cpu(), ref[rank].weights)
            assert torch.equal(desc.recv_expert_indices.cpu().long(), ref[rank].local_expert)
            assert torch.equal(desc.num_recv_tokens_per_expert.cpu(), ref[rank].num_recv_tokens_per_expert)
            ys = [torch.randn(r.output.shape[0], hidden, generator=gen).to(torch.bfloat16) for r in ref]
            got = layer.combine(ys[rank].to(dev), desc).cpu()
            layer.check_errors()  # (a wait that ran out names the rank before the values are compared)
            want = combine_ref([y.float() for y in ys], ids, scat, num_tot_experts=experts)[rank]
            mag = combine_ref([y.float().abs() for y in ys], ids, scat, num_tot_experts=experts)[rank]
            assert bool(((got.float() - want).abs() <= COMBINE_RTOL[torch.bfloat16] * mag + 1e-30).all())
        # static buffers, eager, then captured
        x = torch.zeros(n, hidden, dtype=torch.bfloat16, device=dev)
        idx = torch.zeros(n, topk, dtype=torch.int64, device=dev)
        w = torch.zeros(n, topk, dtype=torch.float32, device=dev)
        worst = world * n * topk
        scale = torch.full((), 0.5, device=dev)

        def step():
            d = layer.dispatch_static(arg(x), idx, w, fp8=mode == "fp8-quantize")
            y = torch.zeros(worst, hidden, dtype=torch.bfloat16, device=dev) + scale
            return d, y, layer.combine_static(y, d)

        graph, (d, _y, out) = _warm_up_and_capture(step)
        for call in range(3):
            xs, ids, ws, _gen = _inputs(60 + call, world, [n] * world, hidden, topk, experts, torch.bfloat16,
                                        skew=False, drop=0.1, with_w=True)  # fmt: skip
            x.copy_(xs[rank])
            idx.copy_(ids[rank])
            w.copy_(ws[rank])
            graph.replay()
            torch.cuda.synchronize()
            layer.check_errors()
            ref, scat = refs(xs, ids, ws)
            rows = int(d.num_recv_rows)
            assert rows == ref[rank].output.shape[0]
            assert torch.equal(rows_of(d.output, rows), ref[rank].output), f"replay {call}: rows differ"
            assert torch.equal(d.weights[:rows].cpu(), ref[rank].weights)
            # every expert output is 0.5: each token's sum is 0.5 per kept slot
            kept = (ids[rank] >= 0).sum(1, keepdim=True).float() * 0.5
            assert torch.equal(out.float().cpu(), kept.expand(-1, hidden)), f"replay {call}: combine differs"
        layer.check_errors()
    finally:
        torch.cuda.synchronize()
        layer.finalize()


def test_low_latency_too_many_tokens_raise_on_every_rank(group):
    """The last rank dispatches more tokens than ``max_tokens``: it raises ValueError at once, and every
    rank (itself included, at its next check) raises naming it, within seconds (not the timeout)."""
    import time

    from ep_a2a.backends.triton.low_latency import LowLatencyInputError

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layer = _ll_layer(group, n=16, hidden=256, topk=2, experts=4 * world, timeout_s=60.0, use_aot=True)
    dev = layer.device
    try:
        # use_aot compiled the low-latency variants too (with and without weights, bf16 / FP8 / quantized
        # rows, bf16 combine)
        assert layer.ctx.backend.aot_variants >= 7
        ids = torch.randint(0, 4 * world, (16, 2), device=dev)
        x = torch.randn(16, 256, device=dev).to(torch.bfloat16)
        layer.combine(*layer.dispatch(x, ids)[::2])  # (one round trip first)
        t0 = time.perf_counter()
        if rank == world - 1:
            big = torch.randn(17, 256, device=dev).to(torch.bfloat16)
            with pytest.raises(ValueError, match="more than max_tokens=16"):
                layer.dispatch(big, torch.zeros(17, 2, dtype=torch.int64, device=dev))
            with pytest.raises(LowLatencyInputError, match=f"rank {world - 1} dispatched more tokens"):
                layer.check_errors()
        else:
            with pytest.raises(LowLatencyInputError, match=f"rank {world - 1} dispatched more tokens"):
                layer.dispatch(x, ids)
        assert time.perf_counter() - t0 < 30
    finally:
        torch.cuda.synchronize()
        layer.finalize()
