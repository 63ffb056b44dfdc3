"""The low-latency mode's kernels (``TritonTuning(low_latency=True)``) against ``ep_a2a.reference``.

CPU: several ranks simulated in one process under ``TRITON_INTERPRET=1`` (heaps are CPU buffers sharing
one pointer table; every rank's sending half runs before the receiving halves). Consecutive calls reuse
the two sets of receive slots in turn. GPU (``-m gpu``, one GPU): the compiled kernels over simulated
ranks whose heaps are buffers of that GPU, one step after another, all ranks at once on their own
streams, and captured in a CUDA graph.

Dispatch must be bit-identical to the reference (rows, weights, local experts, counts; FP8 bytes and
scales); combine within the rounding of the row dtype (each rank's partial sum is rounded once).
"""

from __future__ import annotations

import pytest
import torch

from ep_a2a.backends.triton.engine import EPTimeoutFromDevice, interpreting
from ep_a2a.backends.triton.low_latency import LowLatencyInputError
from ep_a2a.backends.triton.simulate import SimLowLatency
from ep_a2a.reference import combine_ref, dispatch_ref, quantize_fp8

# combine tolerance per row dtype, relative to sum_k |row_k| of each token (two roundings; the
# interpreter's float32 -> bf16 cast truncates, so 2 * 2**-7 for bf16)
COMBINE_RTOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9, torch.float32: 1e-6}

cpu_only = pytest.mark.skipif(
    not interpreting(), reason="needs TRITON_INTERPRET=1 (the CPU simulation runs in Triton's interpreter)"
)


def _routing(
    n: int, topk: int, experts: int, gen: torch.Generator, *, skew: bool, drop: float
) -> torch.Tensor:
    """``[n, topk]`` int32 distinct experts per token (uniform, or most on the first experts with
    ``skew``), each slot dropped (-1) with probability ``drop``."""
    probs = torch.softmax(-torch.arange(experts, dtype=torch.float32) * (0.7 if skew else 0.0), 0)
    ids = torch.multinomial(probs.expand(max(n, 1), -1), topk, generator=gen)[:n].to(torch.int32)
    ids[torch.rand(ids.shape, generator=gen) < drop] = -1
    return ids


def _bytes(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.cat([x_fp8.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)], 1)


def _check_dispatch(res, ref, *, fp8: bool = False, hidden: int = 0, weights: bool = True) -> None:
    from ep_a2a.backends.triton.engine import unpack_fp8_rows

    for r, (got, want) in enumerate(zip(res, ref, strict=True)):
        rows = int(got.num_recv_rows)
        assert rows == want.output.shape[0], f"rank {r}: {rows} rows, want {want.output.shape[0]}"
        out = got.output[:rows]
        out = _bytes(*unpack_fp8_rows(out, hidden)) if fp8 else out
        assert torch.equal(out.cpu(), want.output), f"rank {r}: rows differ"
        assert torch.equal(got.recv_expert_indices[:rows].long().cpu(), want.local_expert), (
            f"rank {r}: local experts differ"
        )
        assert torch.equal(got.num_recv_tokens_per_expert.cpu(), want.num_recv_tokens_per_expert)
        assert torch.equal(got.num_recv_tokens_per_rank.cpu(), want.num_recv_tokens_per_rank)
        if weights:
            assert torch.equal(got.weights[:rows].cpu(), want.weights), f"rank {r}: weights differ"


def _check_combine(outs, ys, ids, scat, experts: int, dtype: torch.dtype, rtol: float | None = None) -> None:
    want = combine_ref([y.float().cpu() for y in ys], ids, scat, num_tot_experts=experts)
    mag = combine_ref([y.float().abs().cpu() for y in ys], ids, scat, num_tot_experts=experts)
    for r, (got, ref, m) in enumerate(zip(outs, want, mag, strict=True)):
        assert got.dtype == dtype
        assert not torch.isnan(got).any(), f"rank {r}: unwritten combine output"
        err = (got.float().cpu() - ref).abs()
        bound = (rtol or COMBINE_RTOL[dtype]) * m + 1e-30
        assert bool((err <= bound).all()), (
            f"rank {r}: combine error {float((err - bound).max())} over the bound"
        )


def _round_trip(sim: SimLowLatency, xs, ids, ws, experts: int, *, concurrent: bool = False) -> None:
    """One dispatch and one combine on every rank, checked against the reference."""
    res = sim.dispatch(xs, ids, ws, concurrent=concurrent)
    ref, scat = dispatch_ref([x.cpu() for x in xs], [i.cpu() for i in ids],
                             [w.cpu() for w in ws] if ws is not None else None, num_tot_experts=experts)  # fmt: skip
    _check_dispatch(res, ref, weights=ws is not None)
    # stand-in experts: a scale per (local expert, row), rows of the dispatch's dtype
    ys = []
    for d in res:
        rows = int(d.num_recv_rows)
        y = d.output[:rows].float() * (1.0 + d.recv_expert_indices[:rows, None].float() * 0.25)
        ys.append(y.to(d.output.dtype))
    outs = sim.combine(ys, res, concurrent=concurrent)
    for e in sim.engines:
        e.check_error()
    _check_combine(outs, ys, [i.cpu() for i in ids], scat, experts, xs[0].dtype)


CASES = [
    # world, tokens per rank, hidden, topk, experts, dtype, weights, skew, drop
    pytest.param(2, [5, 3], 32, 4, 8, torch.bfloat16, True, False, 0.0, id="W2-n5,3-H32-k4-E8-bf16"),
    pytest.param(2, [6, 0], 32, 2, 4, torch.bfloat16, False, False, 0.2, id="W2-n6,0-k2-E4-noW-drop"),
    pytest.param(3, [4, 6, 1], 16, 3, 6, torch.float32, True, True, 0.1, id="W3-n4,6,1-H16-k3-E6-f32-skew"),
    pytest.param(
        4, [5, 3, 6, 2], 48, 8, 16, torch.float16, True, True, 0.15, id="W4-H48-k8-E16-f16-skew-drop"
    ),
]


@cpu_only
@pytest.mark.parametrize(
    ("world", "ns", "hidden", "topk", "experts", "dtype", "with_w", "skew", "drop"), CASES
)
def test_low_latency_matches_reference(world, ns, hidden, topk, experts, dtype, with_w, skew, drop) -> None:
    """Three round trips with fresh inputs: both sets of receive slots, then the first again (stale
    counts, rows and slot tables of two calls before must not leak into the third)."""
    gen = torch.Generator().manual_seed(7 + world * 100 + hidden + topk)
    sim = SimLowLatency(
        world_size=world,
        max_tokens=max(ns),
        hidden=hidden,
        topk=topk,
        num_tot_experts=experts,
        token_dtype=dtype,
    )
    for call in range(3):
        cur = [max(0, n - call) for n in ns]  # (a different token count each call)
        xs = [torch.randn(n, hidden, generator=gen).to(dtype) for n in cur]
        ids = [_routing(n, topk, experts, gen, skew=skew, drop=drop) for n in cur]
        ws = [torch.rand(n, topk, generator=gen) for n in cur] if with_w else None
        _round_trip(sim, xs, ids, ws, experts)
    assert all(e.dispatches == e.combines == 3 for e in sim.engines)


@cpu_only
def test_low_latency_int64_ids_out_of_range_dropped_and_counted() -> None:
    """``torch.topk``'s int64 ids are read in place; ids outside ``[-1, E)`` are dropped (as -1) and
    counted per rank, never wrapped onto an expert."""
    world, hidden, topk, experts = 2, 16, 3, 4
    gen = torch.Generator().manual_seed(3)
    sim = SimLowLatency(world_size=world, max_tokens=4, hidden=hidden, topk=topk, num_tot_experts=experts)
    xs = [torch.randn(4, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    ids = [_routing(4, topk, experts, gen, skew=False, drop=0.0).long() for _ in range(world)]
    ids[0][0, 0], ids[0][2, 1], ids[1][3, 2] = experts, 1 << 40, -5
    res = sim.dispatch(xs, ids, None)
    clean = [torch.where((i >= 0) & (i < experts), i, -1) for i in ids]
    ref, _ = dispatch_ref(xs, clean, None, num_tot_experts=experts)
    _check_dispatch(res, ref, weights=False)
    assert [int(d.num_invalid_ids) for d in res] == [2, 1]


@cpu_only
@pytest.mark.parametrize("quantize", [False, True], ids=["tuple", "quantize-on-send"])
def test_low_latency_fp8_bit_exact(quantize: bool) -> None:
    """FP8 rows in DeepEP's format, as ``(x_fp8, scales)`` or bf16 rows quantized in the send: received
    bytes and scales equal the reference quantizer's (zero, tiny, infinite and NaN blocks included); then
    a bf16 combine of the dequantized rows."""
    world, hidden, topk, experts, ns = 2, 256, 2, 4, [5, 4]
    gen = torch.Generator().manual_seed(11)
    sim = SimLowLatency(
        world_size=world, max_tokens=max(ns), hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=torch.float8_e4m3fn,
    )  # fmt: skip
    for call in range(2):
        xs = [(torch.randn(n, hidden, generator=gen) * torch.logspace(-3, 4, n)[:, None]) for n in ns]
        xs[0][1, :128] = 0
        xs[0][2, -128:] *= 1e-35
        xs[1][3, 5], xs[1][0, -7] = float("-inf"), float("nan")
        xs = [x.to(torch.bfloat16) for x in xs]
        ids = [_routing(n, topk, experts, gen, skew=call == 1, drop=0.1) for n in ns]
        ws = [torch.rand(n, topk, generator=gen) for n in ns]
        quantized = [quantize_fp8(x) for x in xs]
        res = sim.dispatch(xs if quantize else quantized, ids, ws, quantize=quantize)
        ref, scat = dispatch_ref([_bytes(*q) for q in quantized], ids, ws, num_tot_experts=experts)
        _check_dispatch(res, ref, fp8=True, hidden=hidden)
        ys = [torch.randn(int(d.num_recv_rows), hidden, generator=gen).to(torch.bfloat16) for d in res]
        outs = sim.combine(ys, res)
        _check_combine(outs, ys, ids, scat, experts, torch.bfloat16)


@cpu_only
def test_low_latency_refused_call_raises_on_every_peer() -> None:
    """A rank whose call was refused (more tokens than ``max_tokens``: the layer refuses it on the host)
    still takes part in the exchange, marked: every rank records an error naming it, and writes neither
    counts nor rows."""
    world, hidden, topk, experts = 3, 16, 2, 6
    gen = torch.Generator().manual_seed(5)
    sim = SimLowLatency(world_size=world, max_tokens=4, hidden=hidden, topk=topk, num_tot_experts=experts)
    xs = [torch.randn(4, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    ids = [_routing(4, topk, experts, gen, skew=False, drop=0.0) for _ in range(world)]
    with pytest.raises(ValueError, match="more than max_tokens=4"):
        sim.engines[1].dispatch(
            torch.zeros(5, hidden, dtype=torch.bfloat16), torch.zeros(5, topk, dtype=torch.int32)
        )
    for d in sim.dispatch(xs, ids, None):  # (a call before, so that stale counts exist)
        d.info.fill_(-3)
    res = sim.dispatch(xs, ids, None, refuse=[1])
    for r in range(world):  # (the refusing rank too: it gets its own marked count)
        with pytest.raises(LowLatencyInputError, match="rank 1 dispatched more tokens than max_tokens=4"):
            sim.engines[r].check_error()
        assert int(res[r].num_recv_rows) == -3, f"rank {r}: counts written after a refused call"


@cpu_only
@pytest.mark.parametrize("step", ["dispatch", "combine"])
def test_low_latency_wait_names_the_missing_rank(step: str) -> None:
    """A rank that never calls makes the others' bounded waits run out, naming it and the step."""
    world, hidden, topk, experts = 3, 16, 2, 6
    gen = torch.Generator().manual_seed(9)
    sim = SimLowLatency(
        world_size=world, max_tokens=3, hidden=hidden, topk=topk, num_tot_experts=experts, timeout_s=0.05
    )
    xs = [torch.randn(3, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    ids = [_routing(3, topk, experts, gen, skew=False, drop=0.0) for _ in range(world)]
    skip = [2] if step == "dispatch" else []
    res = sim.dispatch(xs, ids, None, skip_ranks=skip)
    if step == "combine":
        ys = [d.output[: int(d.num_recv_rows)] for d in res]
        sim.combine(ys[:2], res[:2], skip_ranks=[2])
    for r in (0, 1):
        with pytest.raises(EPTimeoutFromDevice, match=f"in '{step}' waiting for rank 2") as info:
            sim.engines[r].check_error()
        assert info.value.peer == 2


@cpu_only
@pytest.mark.parametrize("ahead", [0, 1], ids=["rank0-ahead", "rank1-ahead"])
def test_low_latency_rank_ahead_of_its_peer(ahead: int) -> None:
    """One rank runs as far ahead as its waits let it, each half of a kernel one step: its next call's
    rows, slot lists and counts land in the peer's heap while the peer still receives or combines the
    current one, and its combine sums while the peer has not received yet. Four calls of varying sizes
    (both sets of receive slots twice), each against the reference: the parity of the call number and the
    epoch-tagged words keep the calls apart without a barrier."""
    world, hidden, topk, experts, calls = 2, 16, 2, 4, 4
    gen = torch.Generator().manual_seed(31 + ahead)
    sim = SimLowLatency(world_size=world, max_tokens=5, hidden=hidden, topk=topk, num_tot_experts=experts)
    inputs = []
    for c in range(calls):
        ns = [(5, 2, 0, 4)[c], (3, 5, 4, 1)[c]]
        xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in ns]
        ids = [_routing(n, topk, experts, gen, skew=c % 2 == 1, drop=0.2) for n in ns]
        inputs.append((xs, ids, [torch.rand(n, topk, generator=gen) for n in ns]))
    steps = [
        (c, s)
        for c in range(calls)
        for s in ("dispatch-send", "dispatch-recv", "combine-send", "combine-recv")
    ]
    pos, done = [0, 0], set()
    got: dict[tuple[int, int], list] = {}
    while min(pos) < len(steps):
        # the rank ahead takes its next step whenever its waits allow it (a receiving half waits for
        # every rank's sending half of the same call)
        for r in (ahead, 1 - ahead):
            if pos[r] == len(steps):
                continue
            c, s = steps[pos[r]]
            if s.endswith("recv") and any(
                (q, c, s.replace("recv", "send")) not in done for q in range(world)
            ):
                continue
            break
        xs, ids, ws = inputs[c]
        eng = sim.engines[r]
        if s.startswith("dispatch"):
            d = eng.dispatch(xs[r], ids[r], ws[r], send=s.endswith("send"), recv=s.endswith("recv"))
            if s.endswith("recv"):
                rows = int(d.num_recv_rows)
                y = (d.output[:rows].float() * (1.0 + d.recv_expert_indices[:rows, None].float())).to(
                    torch.bfloat16
                )
                got[r, c] = [d, d.output[:rows].clone(), d.weights[:rows].clone(), y, None]
        else:
            d, _, _, y, out = got[r, c]
            if out is None:
                out = got[r, c][4] = torch.full((ids[r].shape[0], hidden), float("nan"), dtype=torch.bfloat16)
            eng.combine(y, d, out=out, send=s.endswith("send"), recv=s.endswith("recv"))
        done.add((r, c, s))
        pos[r] += 1
    for e in sim.engines:
        e.check_error()
    for c, (xs, ids, ws) in enumerate(inputs):
        ref, scat = dispatch_ref(xs, ids, ws, num_tot_experts=experts)
        for r in range(world):
            assert torch.equal(got[r, c][1], ref[r].output), f"call {c} rank {r}: rows differ"
            assert torch.equal(got[r, c][2], ref[r].weights), f"call {c} rank {r}: weights differ"
        ys = [got[r, c][3] for r in range(world)]
        _check_combine([got[r, c][4] for r in range(world)], ys, ids, scat, experts, torch.bfloat16)


@cpu_only
def test_low_latency_arguments_checked() -> None:
    """More tokens than ``max_tokens``, rows wider than the slots, a combine of a dispatch that a later
    one replaced, combine rows too wide for the slots: clear errors before any launch."""
    world, hidden, topk, experts = 2, 16, 2, 4
    sim = SimLowLatency(world_size=world, max_tokens=3, hidden=hidden, topk=topk, num_tot_experts=experts)
    eng = sim.engines[0]
    ids = torch.zeros(2, topk, dtype=torch.int32)
    with pytest.raises(ValueError, match="more than max_tokens=3"):
        eng.dispatch(torch.zeros(4, hidden, dtype=torch.bfloat16), torch.zeros(4, topk, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not fit the low-latency receive slots"):
        eng.dispatch(torch.zeros(2, hidden, dtype=torch.float32), ids)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    first = sim.dispatch(xs, [ids, ids], None)
    sim.dispatch(xs, [ids, ids], None)
    with pytest.raises(ValueError, match="latest dispatch"):
        eng.combine(first[0].output[:1], first[0])
    with pytest.raises(ValueError, match="at most 2 bytes per channel"):
        eng.combine(torch.zeros(1, hidden), sim.dispatch(xs, [ids, ids], None)[0])


@cpu_only
def test_low_latency_fuzz_against_reference() -> None:
    """Random shapes, token counts (zero included), routings with drops and repeated experts in a token:
    dispatch bit-exact and combine within tolerance, over consecutive calls of one simulated group."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=6, deadline=None)
    @given(
        world=st.integers(1, 3),
        topk=st.integers(1, 3),
        per_rank=st.integers(1, 3),
        seed=st.integers(0, 2**16),
    )
    def check(world: int, topk: int, per_rank: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        experts, hidden, max_tokens = world * per_rank, 16, 4
        sim = SimLowLatency(
            world_size=world, max_tokens=max_tokens, hidden=hidden, topk=topk, num_tot_experts=experts
        )
        for _ in range(2):
            ns = torch.randint(0, max_tokens + 1, (world,), generator=gen).tolist()
            xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in ns]
            # (with replacement: a token may pick one expert twice, each slot its own row)
            ids = [torch.randint(-1, experts, (n, topk), generator=gen, dtype=torch.int32) for n in ns]
            ws = [torch.rand(n, topk, generator=gen) for n in ns]
            _round_trip(sim, xs, ids, ws, experts)

    check()


def _gloo_low_latency(rank: int, world: int) -> str:
    """(run on every rank of a gloo group) The mode is part of the arguments every rank must agree on;
    where the Triton backend cannot run, ``backend="auto"`` takes the torch backend, which ignores it."""
    from ep_a2a import EPConfigMismatchError, EPLayer, TritonTuning

    experts, hidden, topk = 2 * world, 32, 2
    with pytest.raises(EPConfigMismatchError, match="rank 0 has"):
        EPLayer(max_tokens=4, hidden=hidden, topk=topk, num_experts=experts, timeout_s=20.0,
                tuning=TritonTuning(low_latency=rank == 0))  # fmt: skip
    layer = EPLayer(max_tokens=4, hidden=hidden, topk=topk, num_experts=experts, timeout_s=20.0,
                    tuning=TritonTuning(low_latency=True))  # fmt: skip
    try:
        assert layer.backend_name == "torch", layer.backend_reason
        gen = torch.Generator().manual_seed(2)
        xs = [torch.randn(4, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
        ids = [_routing(4, topk, experts, gen, skew=False, drop=0.0) for _ in range(world)]
        out, _w, desc = layer.dispatch(xs[rank], ids[rank])
        ref, _ = dispatch_ref(xs, ids, None, num_tot_experts=experts)
        assert torch.equal(out, ref[rank].output)
        assert layer.combine(out, desc).shape == (4, hidden)
    finally:
        layer.finalize()
    return "ok"


@pytest.mark.timeout(120)
def test_low_latency_tuning_agreed_and_ignored_off_gpu() -> None:
    """gloo, 2 processes: ranks that disagree on ``low_latency`` all raise; the torch backend (what
    ``backend="auto"`` runs without GPUs) takes the field and ignores it."""
    from pathlib import Path

    from ep_a2a.testing import run_local

    assert run_local(f"{Path(__file__)}:_gloo_low_latency", 2, timeout_s=110) == ["ok", "ok"]


# --------------------------------------------------------------------------------------------------
# one GPU: the compiled kernels
# --------------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# DeepSeek-V3's shape at decode size, 4 simulated ranks
GPU_SHAPE = dict(max_tokens=128, hidden=7168, topk=8, num_tot_experts=256)
GPU_RTOL = {torch.bfloat16: 2.0**-7}


def _gpu_inputs(world: int, gen: torch.Generator, *, n: int, fp8: bool = False):
    topk, experts, hidden = GPU_SHAPE["topk"], GPU_SHAPE["num_tot_experts"], GPU_SHAPE["hidden"]
    ns = [n - 13 * r for r in range(world)]
    xs = [torch.randn(m, hidden, generator=gen).to(torch.bfloat16).cuda() for m in ns]
    ids = [_routing(m, topk, experts, gen, skew=False, drop=0.02).cuda() for m in ns]
    ws = [torch.rand(m, topk, generator=gen).cuda() for m in ns]
    return xs, ids, ws


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["bf16", "fp8-tuple", "fp8-quantize"])
@pytest.mark.parametrize("concurrent", [False, True], ids=["steps", "concurrent"])
def test_low_latency_one_gpu(mode: str, concurrent: bool) -> None:
    """4 simulated ranks on one GPU, DeepSeek-V3 width, 128 tokens, three calls: each step's halves one
    after another, or every rank's whole kernel at once on its own stream (32 CTAs each, all resident:
    the in-kernel protocol as on 4 GPUs)."""
    world = 4
    fp8 = mode != "bf16"
    sim = SimLowLatency(
        world_size=world, device="cuda", **GPU_SHAPE, token_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        num_sm=32 if concurrent else 16, timeout_s=20.0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(21)
    experts, hidden = GPU_SHAPE["num_tot_experts"], GPU_SHAPE["hidden"]
    for _ in range(3):
        xs, ids, ws = _gpu_inputs(world, gen, n=128)
        if not fp8:
            _round_trip(sim, xs, ids, ws, experts, concurrent=concurrent)
            continue
        quantized = [quantize_fp8(x) for x in xs]
        res = sim.dispatch(xs if mode == "fp8-quantize" else quantized, ids, ws, quantize=mode == "fp8-quantize",
                           concurrent=concurrent)  # fmt: skip
        torch.cuda.synchronize()
        ref, scat = dispatch_ref([_bytes(*q).cpu() for q in quantized], [i.cpu() for i in ids],
                                 [w.cpu() for w in ws], num_tot_experts=experts)  # fmt: skip
        _check_dispatch(res, ref, fp8=True, hidden=hidden)
        ys = [torch.randn(int(d.num_recv_rows), hidden, generator=gen).to(torch.bfloat16).cuda() for d in res]
        outs = sim.combine(ys, res, concurrent=concurrent)
        torch.cuda.synchronize()
        _check_combine(
            outs, ys, [i.cpu() for i in ids], scat, experts, torch.bfloat16, GPU_RTOL[torch.bfloat16]
        )
    for e in sim.engines:
        e.check_error()


@pytest.mark.gpu
@needs_gpu
def test_low_latency_back_to_back_one_gpu() -> None:
    """4 simulated ranks on one GPU, each on its own stream, six dispatch/combine rounds enqueued with no
    synchronisation between ranks or rounds (the two sets of receive slots are what keeps a fast rank
    from overwriting rows a slow one still reads); every round's results copied on its rank's stream and
    checked at the end."""
    world = 4
    sim = SimLowLatency(world_size=world, device="cuda", **GPU_SHAPE, num_sm=32, timeout_s=20.0)
    experts = GPU_SHAPE["num_tot_experts"]
    gen = torch.Generator().manual_seed(4)
    rounds = [_gpu_inputs(world, gen, n=128 - 7 * i) for i in range(6)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    torch.cuda.synchronize()
    got: list[list] = [[] for _ in range(world)]
    for r in range(world):  # (rank by rank: rank 0 runs ahead alone until its peers' rounds are queued)
        with torch.cuda.stream(streams[r]):
            for xs, ids, ws in rounds:
                d = sim.engines[r].dispatch(xs[r], ids[r], ws[r])
                rows = d.output.clone(), d.weights.clone(), d.recv_expert_indices.clone(), d.info.clone()
                y = d.output.float() * (1.0 + d.recv_expert_indices[:, None].float() * 0.25)
                out = sim.engines[r].combine(y.to(torch.bfloat16), d)
                got[r].append((rows, y.to(torch.bfloat16), out))
    torch.cuda.synchronize()
    for e in sim.engines:
        e.check_error()
    for i, (xs, ids, ws) in enumerate(rounds):
        ref, scat = dispatch_ref([x.cpu() for x in xs], [t.cpu() for t in ids], [w.cpu() for w in ws],
                                 num_tot_experts=experts)  # fmt: skip
        ys = []
        for r in range(world):
            (out, w, e, info), y, _ = got[r][i]
            rows = int(info[0])
            assert rows == ref[r].output.shape[0], f"round {i} rank {r}: {rows} rows"
            assert torch.equal(out[:rows].cpu(), ref[r].output), f"round {i} rank {r}: rows differ"
            assert torch.equal(w[:rows].cpu(), ref[r].weights)
            assert torch.equal(e[:rows].long().cpu(), ref[r].local_expert)
            ys.append(y[:rows])
        _check_combine([got[r][i][2] for r in range(world)], ys, [t.cpu() for t in ids], scat, experts,
                       torch.bfloat16, GPU_RTOL[torch.bfloat16])  # fmt: skip


@pytest.mark.gpu
@needs_gpu
def test_low_latency_cuda_graph_one_gpu() -> None:
    """Every simulated rank's dispatch and combine captured in one CUDA graph (each step's halves one
    after another) and replayed with new inputs copied into the captured ones: each replay matches the
    reference (the device epochs and receive-slot parity advance inside the graph)."""
    world = 2
    sim = SimLowLatency(world_size=world, device="cuda", **GPU_SHAPE, num_sm=16, timeout_s=20.0)
    experts = GPU_SHAPE["num_tot_experts"]
    gen = torch.Generator().manual_seed(8)
    xs, ids, ws = _gpu_inputs(world, gen, n=96)

    def step():
        res = sim.dispatch(xs, ids, ws)
        ys = [(d.output.float() * 1.5).to(torch.bfloat16) for d in res]
        return res, ys, sim.combine(ys, res)

    step()  # (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res, ys, outs = step()
    for _ in range(3):
        nxs, nids, nws = _gpu_inputs(world, gen, n=96)
        for dst, src in zip(xs + ids + ws, nxs + nids + nws, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        ref, scat = dispatch_ref([x.cpu() for x in xs], [t.cpu() for t in ids], [w.cpu() for w in ws],
                                 num_tot_experts=experts)  # fmt: skip
        _check_dispatch(res, ref)
        rows = [int(d.num_recv_rows) for d in res]
        _check_combine(outs, [y[:n] for y, n in zip(ys, rows, strict=True)], [t.cpu() for t in ids], scat,
                       experts, torch.bfloat16, GPU_RTOL[torch.bfloat16])  # fmt: skip
    for e in sim.engines:
        e.check_error()
