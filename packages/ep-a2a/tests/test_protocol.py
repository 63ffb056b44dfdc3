"""Skipped checks stay memory-safe, and ranks that call the layer out of order all get the same clear
error instead of each other's data (gloo, 2 processes spawned by the test)."""

from __future__ import annotations

import re

import pytest
import torch

from ep_a2a.testing import run_local

H, K, E_PER_RANK, T = 16, 2, 2, 6


def _layer(rank: int, world: int, *, validate: bool = True):
    from ep_a2a import EPAll2AllLayer

    return EPAll2AllLayer(
        None, T, H, K, rank, E_PER_RANK * world, world, world, dtype=torch.float32, backend="torch",
        timeout_s=30, validate=validate,
    )  # fmt: skip


def _inputs(world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(T, H, generator=gen) for _ in range(world)]
    ids = [
        torch.randint(0, E_PER_RANK * world, (T, K), generator=gen, dtype=torch.int32) for _ in range(world)
    ]
    return xs, ids


def run_unchecked_ids(rank: int, world: int) -> list[str]:
    """``validate=False`` and an id of ``num_tot_experts`` (and a very negative one) on rank 1: every rank
    completes the call, the slot is dropped as -1 would be (the reference of the dropped slot)."""
    from ep_a2a.reference import combine_ref, dispatch_ref

    xs, ids = _inputs(world)
    bad = [t.clone() for t in ids]
    bad[1][0, 0] = E_PER_RANK * world
    bad[1][2, 1] = -(2**30)
    dropped = [torch.where((t >= 0) & (t < E_PER_RANK * world), t, -1) for t in bad]
    with _layer(rank, world, validate=False) as layer:
        rows, _, desc = layer.dispatch(xs[rank], bad[rank])
        received, scatter = dispatch_ref(xs, dropped, None, num_tot_experts=E_PER_RANK * world)
        assert torch.equal(rows, received[rank].output)
        out = layer.combine(rows, desc)
        want = combine_ref([r.output for r in received], dropped, scatter, num_tot_experts=E_PER_RANK * world)
        torch.testing.assert_close(out, want[rank])
        # int64 ids beyond int32 do not wrap onto an expert when the layer converts them
        wide = bad[rank].long()
        wide[1, 0] = 2**32 + 1
        drop64 = torch.where((wide >= 0) & (wide < E_PER_RANK * world), wide, -1).int()
        rows, _, _ = layer.dispatch(xs[rank], wide)
        rows_ref, _, _ = layer.dispatch(xs[rank], drop64)
        assert torch.equal(rows, rows_ref)
    return ["ok"]


def run_bad_ids_one_rank(rank: int, world: int, exchange_on_device: bool) -> list[str]:
    """``validate=True`` and an id of ``num_tot_experts`` on rank 1 only: every rank raises ``ValueError``
    (rank 1 naming its range, the others naming rank 1) in the same call, none returns data and none
    waits for a timeout; the next call, with valid ids, matches the reference on every rank."""
    from ep_a2a.reference import dispatch_ref

    xs, ids = _inputs(world)
    bad = [t.clone() for t in ids]
    bad[1][3, 0] = E_PER_RANK * world
    with _layer(rank, world) as layer:
        if exchange_on_device:  # the NCCL flow's logic over the gloo group
            layer.ctx.backend._on_device = True
        want = (
            f"got values in [0, {E_PER_RANK * world}]"
            if rank == 1
            else "rank(s) [1] passed 1 slot(s) outside"
        )
        with pytest.raises(ValueError, match=re.escape(want)):
            layer.dispatch(xs[rank], bad[rank])
        rows, _, _ = layer.dispatch(xs[rank], ids[rank])
        received, _ = dispatch_ref(xs, ids, None, num_tot_experts=E_PER_RANK * world)
        assert torch.equal(rows, received[rank].output)
    return ["ok"]


def run_combine_twice(rank: int, world: int) -> list[str]:
    """A dispatch combined twice (as DeepEP reuses a handle) gives the same sums both times."""
    xs, ids = _inputs(world)
    with _layer(rank, world) as layer:
        rows, _, desc = layer.dispatch(xs[rank], ids[rank])
        first = layer.combine(rows * 2, desc)
        assert torch.equal(layer.combine(rows * 2, desc), first)
    return ["ok"]


def run_compiled(rank: int, world: int) -> list[str]:
    """Under ``torch.compile`` dispatch and combine run eagerly (a graph break, same result); a
    ``fullgraph=True`` region containing them raises at compile time, naming the reason."""
    xs, ids = _inputs(world)
    with _layer(rank, world) as layer:

        def round_trip(x, idx):
            rows, _, desc = layer.dispatch(x, idx)
            return layer.combine(rows * 2, desc)

        want = round_trip(xs[rank], ids[rank])
        got = torch.compile(round_trip, backend="eager")(xs[rank], ids[rank])
        assert torch.equal(got, want)

        def strict(x, idx):
            rows, _, desc = layer.dispatch(x, idx)
            return layer.combine(rows, desc)

        with pytest.raises(Exception, match=r"cannot be traced by torch\.compile"):
            torch.compile(strict, backend="eager", fullgraph=True)(xs[rank], ids[rank])
    return ["ok"]


def run_out_of_order(rank: int, world: int, first: str, second: str, on_device: bool = False) -> str:
    """After one dispatch on every rank, rank 0 calls ``first`` and the others ``second``: every rank
    must raise ``EPProtocolError`` naming both operations, none returns data (``on_device``: the NCCL
    flow's logic over the gloo group)."""
    from ep_a2a import EPProtocolError

    xs, ids = _inputs(world)
    layer = _layer(rank, world)
    layer.ctx.backend._on_device = on_device or layer.ctx.backend._on_device
    rows, _, desc = layer.dispatch(xs[rank], ids[rank])
    op = first if rank == 0 else second
    calls = {
        "dispatch": lambda: layer.dispatch(xs[rank], ids[rank]),
        "combine": lambda: layer.combine(rows, desc),
        "barrier": lambda: layer.ep_barrier_all(),
    }
    try:
        with pytest.raises(EPProtocolError) as exc:
            calls[op]()
    finally:
        layer.finalize()
    msg = str(exc.value)
    assert f"rank 0 is in {first}" in msg, msg
    assert f"rank 1 is in {second}" in msg, msg
    assert set(exc.value.operations) == set(range(world))
    return "raised"


@pytest.mark.timeout(120)
def test_unchecked_out_of_range_ids_are_dropped() -> None:
    assert run_local(f"{__file__}:run_unchecked_ids", 2, timeout_s=110) == [["ok"], ["ok"]]


@pytest.mark.timeout(180)
def test_torch_compile_breaks_the_graph_or_raises() -> None:
    assert run_local(f"{__file__}:run_compiled", 2, timeout_s=170) == [["ok"], ["ok"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_device", [False, True], ids=["gloo", "nccl-flow"])
def test_bad_ids_on_one_rank_raise_on_every_rank(on_device: bool) -> None:
    got = run_local(f"{__file__}:run_bad_ids_one_rank", 2, (on_device,), timeout_s=110)
    assert got == [["ok"], ["ok"]]


@pytest.mark.timeout(120)
def test_a_dispatch_may_be_combined_twice() -> None:
    assert run_local(f"{__file__}:run_combine_twice", 2, timeout_s=110) == [["ok"], ["ok"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("first", "second"),
    [("dispatch", "combine"), ("combine", "dispatch"), ("combine", "barrier"), ("barrier", "dispatch")],
    ids=["dispatch-vs-combine", "combine-vs-dispatch", "combine-vs-barrier", "barrier-vs-dispatch"],
)
def test_out_of_order_calls_raise_on_every_rank(first: str, second: str) -> None:
    got = run_local(f"{__file__}:run_out_of_order", 2, (first, second), timeout_s=110)
    assert got == ["raised", "raised"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("first", "second"),
    [("dispatch", "combine"), ("combine", "barrier")],
    ids=["dispatch-vs-combine", "combine-vs-barrier"],
)
def test_out_of_order_calls_raise_on_every_rank_in_the_nccl_flow(first: str, second: str) -> None:
    """The operation board checks every operation before its first message (combine sends none
    other), so the flow that queues its exchanges on the device raises too."""
    got = run_local(f"{__file__}:run_out_of_order", 2, (first, second, True), timeout_s=110)
    assert got == ["raised", "raised"]


def run_board(rank: int, world: int) -> str:
    """The Triton backend's operation board over 2-3 local processes: calls in one order pass; rank 0
    dispatching while the others combine raises ``EPProtocolError`` on every rank naming both; a rank
    that never starts an operation is named by the others' ``EPTimeoutError``; the files go at close."""
    import os
    import time

    import torch.distributed as dist

    from ep_a2a import EPProtocolError, EPTimeoutError
    from ep_a2a._dist import OpBoard, RankMonitor

    monitor = RankMonitor(dist.group.WORLD, 5.0)
    board = OpBoard(monitor)
    assert set(board.peers) == set(range(world)) - {rank}
    for op in ("dispatch", "combine", "barrier"):
        call = board.publish(op)
        board.wait(call, op, op)
    op = "dispatch" if rank == 0 else "combine"
    call = board.publish(op)
    with pytest.raises(EPProtocolError) as exc:
        board.wait(call, op, op)
    msg = str(exc.value)
    assert "rank 0 is in dispatch (call #3)" in msg, msg
    assert "is in combine (call #3)" in msg, msg
    assert exc.value.operations[rank] == f"{op} (call #3)"

    ring = OpBoard(monitor)  # more calls than the ring has slots
    for _ in range(20):
        call = ring.publish("dispatch")
        ring.wait(call, "dispatch", "dispatch")
    if rank != world - 1:
        call = ring.publish("combine")
        t0 = time.monotonic()
        with pytest.raises(EPTimeoutError) as late:
            ring.wait(call, "combine", "combine", deadline=time.monotonic() + 1.0)
        assert late.value.missing_ranks == [world - 1]
        assert time.monotonic() - t0 < 5
    dist.barrier()
    for b in (board, ring):
        b.close()
        assert not os.path.exists(b.path)
    monitor.destroy()
    return "ok"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3], ids=["gloo-2", "gloo-3"])
def test_operation_board_names_misordered_ranks(world: int) -> None:
    assert run_local(f"{__file__}:run_board", world, timeout_s=100) == ["ok"] * world


def run_counts_board(rank: int, world: int) -> str:
    """The torch backend's counts board over 2-3 local processes: every rank reads every rank's row of
    each call, also when the calls outnumber the ring's slots; a rank that never publishes its row is
    named by the others' ``EPTimeoutError``; a value keeps its 24 bits."""
    import time

    import numpy as np
    import torch.distributed as dist

    from ep_a2a import EPTimeoutError
    from ep_a2a._dist import RankMonitor
    from ep_a2a.backends.torch import _CountsBoard

    monitor = RankMonitor(dist.group.WORLD, 60.0)  # (construction checks in through the store)
    board = _CountsBoard(monitor, 5)
    assert board.ready
    board.timeout_s = 1.0
    out = np.zeros((world, 5), dtype=np.int64)
    for call in range(20):
        board.write(call, np.arange(5, dtype=np.int64) + 1000 * rank + call + (1 << 24) - 1 - 5000)
        board.read(call, out, "dispatch/counts")
        want = np.arange(5)[None, :] + 1000 * np.arange(world)[:, None] + call + (1 << 24) - 1 - 5000
        assert (out == want).all(), (call, out)
        dist.barrier()  # (a rank reads call c before any rank writes call c + 8)
    if rank != world - 1:
        board.write(20, np.zeros(5, dtype=np.int64))
        t0 = time.monotonic()
        with pytest.raises(EPTimeoutError) as late:
            board.read(20, out, "dispatch/counts")
        assert late.value.missing_ranks == [world - 1]
        assert late.value.step == "dispatch/counts"
        assert time.monotonic() - t0 < 5
    dist.barrier()
    board.close()
    monitor.destroy()
    return "ok"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3], ids=["gloo-2", "gloo-3"])
def test_counts_board_reads_every_rank_and_names_a_missing_one(world: int) -> None:
    assert run_local(f"{__file__}:run_counts_board", world, timeout_s=100) == ["ok"] * world
