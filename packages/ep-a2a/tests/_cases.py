"""Per-rank bodies of the distributed tests (run inside processes started by ``ep_a2a.testing``).

Every rank draws *all* ranks' inputs from the same seed, so each rank can compute the single-process
reference for the whole group and check its own share of the results.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from ep_a2a import EPAll2AllLayer, EPConfigMismatchError, EPTimeoutError
from ep_a2a.reference import combine_ref, dispatch_ref

# tolerance of combine against the float32-accumulating reference, per row dtype
COMBINE_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


@dataclass(frozen=True)
class LayerCase:
    hidden: int
    topk: int
    experts_per_rank: int
    max_tokens: int
    dtype: torch.dtype
    local_combine: bool = False


@dataclass(frozen=True)
class CallCase:
    tokens: tuple[int, ...]  # tokens per rank (may be 0)
    routing: str  # "random" | "skewed" | "drop" | "all_dropped"
    weights: bool
    scatter: bool = False  # caller-given full_scatter_indices (a random permutation per receiver)


def make_inputs(world: int, layer: LayerCase, call: CallCase, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_experts = world * layer.experts_per_rank
    xs, idxs, ws = [], [], []
    for s in range(world):
        n = call.tokens[s]
        x = torch.randn(n, layer.hidden, generator=gen).to(layer.dtype)
        if call.routing == "skewed":  # 90% of slots go to the first two experts of rank 0
            hot = torch.randint(0, min(2, num_experts), (n, layer.topk), generator=gen)
            cold = torch.randint(0, num_experts, (n, layer.topk), generator=gen)
            idx = torch.where(torch.rand(n, layer.topk, generator=gen) < 0.9, hot, cold)
        elif layer.topk <= num_experts:  # distinct experts per token, as a router produces
            rows = [torch.randperm(num_experts, generator=gen)[: layer.topk] for _ in range(n)]
            idx = torch.stack(rows) if rows else torch.zeros(0, layer.topk, dtype=torch.int64)
        else:  # more slots than experts: repeats are part of the semantics
            idx = torch.randint(0, num_experts, (n, layer.topk), generator=gen)
        if call.routing == "drop":
            idx[torch.rand(n, layer.topk, generator=gen) < 0.3] = -1
        if call.routing == "all_dropped":
            idx[:] = -1
        w = torch.rand(n, layer.topk, generator=gen)
        w[idx < 0] = float("nan")  # poison: a dropped slot's weight must never be read
        x[(idx < 0).all(1)] = float("nan")  # and a token with every slot dropped must never be sent
        xs.append(x)
        idxs.append(idx.to(torch.int32))
        ws.append(w)
    return num_experts, xs, idxs, ws


def custom_scatter(idxs, scatter, world, e_local, seed):
    """Receiver rows as a random permutation of the default order, expressed per source slot."""
    gen = torch.Generator().manual_seed(seed + 1)
    counts = [sum(int(((i >= 0) & (i.long() // e_local == d)).sum()) for i in idxs) for d in range(world)]
    perms = [torch.randperm(c, generator=gen) for c in counts]
    out = []
    for idx, sc in zip(idxs, scatter, strict=True):
        mapped = torch.full(sc.shape, 12345, dtype=torch.int64)  # poison on dropped slots: must be ignored
        for t, k in torch.nonzero(idx >= 0).tolist():
            mapped[t, k] = perms[int(idx[t, k]) // e_local][int(sc[t, k])]
        out.append(mapped)
    return out


def expert_fn(rows: torch.Tensor, local_expert: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """A stand-in expert: scale by (local expert + 1) and the routing weight, in float32."""
    y = rows.float() * (local_expert.float()[:, None] + 1)
    if weights is not None:
        y = y * weights.float()[:, None]
    return y.to(rows.dtype)


def check_call(
    layer: EPAll2AllLayer, lc: LayerCase, cc: CallCase, rank: int, world: int, seed: int, device
) -> None:
    num_experts, xs, idxs, ws = make_inputs(world, lc, cc, seed)
    w_all = ws if cc.weights else None
    received, scatter = dispatch_ref(xs, idxs, w_all, num_tot_experts=num_experts)
    fsi = None
    if cc.scatter:
        custom = custom_scatter(idxs, scatter, world, lc.experts_per_rank, seed)
        received, scatter = dispatch_ref(
            xs, idxs, w_all, num_tot_experts=num_experts, full_scatter_indices=custom
        )
        fsi = custom[rank].to(device)
    mine = received[rank]
    out, w, desc = layer.dispatch(
        xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device) if cc.weights else None, fsi
    )
    tag = f"rank {rank} {lc} {cc}"
    assert torch.equal(out.cpu(), mine.output), f"dispatch rows differ: {tag}"
    if cc.weights:
        assert w is not None
        assert torch.equal(w.cpu(), mine.weights), f"dispatch weights differ: {tag}"
    else:
        assert w is None
    assert torch.equal(desc.token_dst_scatter_idx.cpu().long(), scatter[rank]), f"scatter idx differ: {tag}"
    assert torch.equal(desc.num_recv_tokens_per_expert.cpu(), mine.num_recv_tokens_per_expert), tag
    assert torch.equal(desc.num_recv_tokens_per_rank.cpu(), mine.num_recv_tokens_per_rank), tag
    assert torch.equal(desc.recv_expert_indices.cpu().long(), mine.local_expert), tag
    assert desc.num_input_tokens_per_rank.tolist() == list(cc.tokens), tag
    assert desc.num_recv_rows == mine.output.shape[0]
    # skipped-slot map: first slot of the token with the same destination rank
    dest = torch.where(idxs[rank] >= 0, idxs[rank].long() // lc.experts_per_rank, -1)
    skip = desc.skipped_token_topk_mapping_indices.cpu()
    for t, k in torch.nonzero(dest >= 0).tolist():
        first = next(j for j in range(k + 1) if dest[t, j] == dest[t, k])
        assert int(skip[t, k]) == first, tag

    ys = [expert_fn(r.output, r.local_expert, r.weights) for r in received]
    combined = layer.combine(expert_fn(out, desc.recv_expert_indices.long(), w), desc)
    expect = combine_ref(ys, idxs, scatter, num_tot_experts=num_experts)[rank]
    rtol, atol = COMBINE_TOL[lc.dtype]
    if lc.local_combine and lc.dtype == torch.bfloat16:
        rtol, atol = 3e-2, 3e-2  # one extra bf16 rounding of each expert-side partial sum
    assert combined.dtype == lc.dtype
    if layer.backend_name == "torch" and not lc.local_combine and combined.device.type == "cpu":
        # the torch backend sums each token's slots in float32 in slot order, as the reference does
        assert torch.equal(combined, expect), f"combine {tag}: not the reference's float32 sum"
    torch.testing.assert_close(
        combined.cpu(), expect, rtol=rtol, atol=atol, msg=lambda m: f"combine {tag}: {m}"
    )


def matrix(world: int) -> list[tuple[LayerCase, list[CallCase]]]:
    W = world
    variable = tuple((3 * r + 2) % 7 for r in range(W))  # 2, 5, 1, 4: different per rank
    with_zero = tuple(0 if r == W - 1 else 4 + r for r in range(W))
    return [
        (
            LayerCase(hidden=128, topk=1, experts_per_rank=2, max_tokens=16, dtype=torch.bfloat16),
            [
                CallCase((8,) * W, "random", True),
                CallCase(variable, "skewed", False),
                CallCase(with_zero, "drop", True),
            ],
        ),
        (
            LayerCase(hidden=256, topk=4, experts_per_rank=3, max_tokens=12, dtype=torch.float32),
            [
                CallCase(variable, "random", True),
                CallCase((12,) * W, "skewed", True),
                CallCase(with_zero, "drop", False, scatter=True),
                CallCase((0,) * W, "random", True),
                CallCase(variable, "all_dropped", True),
            ],
        ),
        (
            LayerCase(
                hidden=512,
                topk=6,
                experts_per_rank=4,
                max_tokens=10,
                dtype=torch.bfloat16,
                local_combine=True,
            ),
            [
                CallCase(variable, "random", True),
                CallCase(with_zero, "skewed", True, scatter=True),
                CallCase((10,) * W, "drop", False),
            ],
        ),
        (
            LayerCase(hidden=7168, topk=8, experts_per_rank=4, max_tokens=4, dtype=torch.bfloat16),
            [
                CallCase(tuple(min(v, 4) for v in variable), "random", True),
                CallCase(tuple(min(v, 4) for v in with_zero), "drop", True),
            ],
        ),
        (
            LayerCase(hidden=128, topk=16, experts_per_rank=2, max_tokens=6, dtype=torch.float32),
            [
                CallCase(tuple(min(v, 6) for v in variable), "random", True),
                CallCase((6,) * W, "drop", True, scatter=True),
            ],
        ),
        (
            LayerCase(
                hidden=128, topk=16, experts_per_rank=2, max_tokens=6, dtype=torch.float32, local_combine=True
            ),
            [
                CallCase(tuple(min(v, 6) for v in variable), "skewed", True),
            ],
        ),
    ]


def make_layer(
    lc: LayerCase,
    rank: int,
    world: int,
    group=None,
    *,
    local_combine: bool | None = None,
    backend: str = "torch",
    local_world_size: int | None = None,
) -> EPAll2AllLayer:
    layer = EPAll2AllLayer(
        group,
        lc.max_tokens,
        lc.hidden,
        lc.topk,
        rank,
        world * lc.experts_per_rank,
        local_world_size or world,
        world,
        dtype=lc.dtype,
        enable_local_combine=lc.local_combine if local_combine is None else local_combine,
        backend=backend,
        timeout_s=60,
    )
    if EXCHANGE_ON_DEVICE and layer.backend_name == "torch":
        # the torch backend's NCCL flow (exchanges on the group itself, the header checked after the
        # data is queued) over the gloo group: its logic runs on CPUs too
        layer.ctx.backend._on_device = True
    return layer


#: run the torch backend's NCCL flow over gloo (see make_layer; set by run_matrix_and_autograd)
EXCHANGE_ON_DEVICE = False


def run_matrix(rank: int, world: int, device: torch.device, group=None, backend: str = "torch") -> int:
    checked = 0
    for i, (lc, calls) in enumerate(matrix(world)):
        with make_layer(lc, rank, world, group, backend=backend) as layer:
            for j, cc in enumerate(calls):
                check_call(layer, lc, cc, rank, world, seed=1000 * i + j, device=device)
                checked += 1
    if world % 2 == 0 and world > 2:  # the group as two "nodes" of world/2 ranks: same results, node barrier
        lc, calls = matrix(world)[1]
        with make_layer(lc, rank, world, group, backend=backend, local_world_size=world // 2) as layer:
            assert not layer.config.is_intra_node
            check_call(layer, lc, calls[0], rank, world, seed=7, device=device)
            layer.ep_barrier_all(intra_node_only=True)
            layer.ep_barrier_all()
            checked += 1
    return checked


def run_autograd(rank: int, world: int, device: torch.device, group=None, backend: str = "torch") -> None:
    """out = combine(expert(dispatch(x)) * w): gradients equal the dense per-rank formula."""
    lc = LayerCase(hidden=64, topk=3, experts_per_rank=2, max_tokens=8, dtype=torch.float32)
    cc = CallCase(tuple(8 - r for r in range(world)), "drop", True)
    num_experts, xs, idxs, ws = make_inputs(world, lc, cc, seed=77)
    xs = [torch.nan_to_num(x) for x in xs]  # the dense check multiplies every row (0 * NaN = NaN)
    _, default_scatter = dispatch_ref(xs, idxs, None, num_tot_experts=num_experts)
    custom = custom_scatter(idxs, default_scatter, world, lc.experts_per_rank, seed=77)
    # (local combine, caller-given rows): the backward dispatch must reproduce the caller's placement
    for local_combine, caller_rows in ((False, False), (True, False), (False, True)):
        fsi = custom[rank].to(device) if caller_rows else None
        with make_layer(lc, rank, world, group, local_combine=local_combine, backend=backend) as layer:
            idx = idxs[rank]
            w_clean = torch.nan_to_num(ws[rank], nan=0.5)
            x = xs[rank].clone().to(device).requires_grad_(True)
            w = w_clean.clone().to(device).requires_grad_(True)
            g = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank)).to(device)
            rows, rw, desc = layer.dispatch(x, idx.to(device), w, fsi)
            assert desc.caller_scatter == caller_rows
            scale = desc.recv_expert_indices.float()[:, None] + 1
            out = layer.combine(rows * scale * rw[:, None], desc)
            (out * g).sum().backward()
            # dense formula on this rank alone
            xd = xs[rank].clone().requires_grad_(True)
            wd = w_clean.clone().requires_grad_(True)
            c = (idx.long().clamp(min=0) % lc.experts_per_rank + 1).float() * (idx >= 0)
            dense = xd * (c * wd).sum(1, keepdim=True)
            (dense * g.cpu()).sum().backward()
            torch.testing.assert_close(out.detach().cpu(), dense.detach(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(x.grad.cpu(), xd.grad, rtol=1e-5, atol=1e-5)
            wg = wd.grad * (idx >= 0)
            torch.testing.assert_close(w.grad.cpu(), wg, rtol=1e-5, atol=1e-5)


def expect_raises(exc_type, match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(exc_type, match=re.escape(match)):
        fn(*args, **kwargs)


def _check_dispatch_arg_errors(
    layer: EPAll2AllLayer, x: torch.Tensor, idx: torch.Tensor, E: int, H: int, K: int
) -> None:
    """Every bad argument of ``dispatch`` raises locally, naming it (``x``, ``idx``: a valid call)."""
    expect_raises(
        ValueError,
        "more than max_tokens=4",
        layer.dispatch,
        torch.randn(5, H),
        torch.zeros(5, K, dtype=torch.int32),
    )
    expect_raises(ValueError, "input must have shape [3, 32]", layer.dispatch, torch.randn(3, H + 1), idx)
    expect_raises(ValueError, "input must be a [num_tokens, hidden=32]", layer.dispatch, torch.randn(H), idx)
    expect_raises(TypeError, "input must have dtype torch.float32", layer.dispatch, x.bfloat16(), idx)
    expect_raises(ValueError, "input must be on cpu", layer.dispatch, x.to("meta"), idx)
    expect_raises(ValueError, "exp_indices must have shape [3, 2]", layer.dispatch, x, idx[:, :1])
    expect_raises(TypeError, "exp_indices must have an integer dtype", layer.dispatch, x, idx.float())
    expect_raises(ValueError, f"exp_indices must be in [-1, num_tot_experts={E})", layer.dispatch, x, idx + E)
    expect_raises(ValueError, f"got values in [-3, {E - 3}]", layer.dispatch, x, idx - 2)
    # checked in the caller's dtype: 2**32 + 1 would be expert 1 as int32
    wraps = idx.long()
    wraps[0, 0] = (1 << 32) + 1
    expect_raises(ValueError, f"got values in [-1, {(1 << 32) + 1}]", layer.dispatch, x, wraps)
    expect_raises(ValueError, "weight must have shape [3, 2]", layer.dispatch, x, idx, torch.rand(3, 1))
    expect_raises(
        TypeError, "weight must have dtype torch.float32", layer.dispatch, x, idx, torch.rand(3, K).double()
    )
    expect_raises(
        ValueError, "full_scatter_indices must be >= 0", layer.dispatch, x, idx, None, torch.full((3, K), -3)
    )


def _check_faults(
    rank: int, world: int, mk, x: torch.Tensor, idx: torch.Tensor, seen: list[str]
) -> list[str]:
    """A rank that arrives late, then one that exits: the others raise naming it and the step."""
    # a rank that never arrives (alive but late): the others' barrier times out naming it
    layer = mk(timeout_s=3.0)
    late = world - 1
    if rank == late:
        time.sleep(4.5)
    else:
        t0 = time.monotonic()
        with pytest.raises(EPTimeoutError, match="barrier") as info:
            layer.ep_barrier_all()
        assert info.value.missing_ranks == [late], info.value.missing_ranks
        assert time.monotonic() - t0 < 10
        seen.append("late-rank")
    dist.barrier()

    # a rank that exits early: the others' next dispatch raises naming it and the step
    gone = world - 1
    if rank == gone:
        seen.append("exited")
        return seen
    t0 = time.monotonic()
    with pytest.raises(EPTimeoutError, match=re.escape(f"rank(s) [{gone}]")) as info:
        layer.dispatch(x, idx)
    assert info.value.step.startswith("dispatch"), info.value.step
    assert time.monotonic() - t0 < 15
    seen.append("early-exit")
    return seen


def run_errors(rank: int, world: int) -> list[str]:
    """Every bad-input error, then a rank that never arrives, then a rank that exits early."""
    seen = []
    E, H, K = 2 * world, 32, 2

    def mk(timeout_s: float = 30.0) -> EPAll2AllLayer:
        return EPAll2AllLayer(
            None, 4, H, K, rank, E, world, world, dtype=torch.float32, backend="torch", timeout_s=timeout_s
        )

    # arguments checked locally, before any collective
    expect_raises(
        ValueError,
        "num_tot_experts",
        EPAll2AllLayer,
        None,
        4,
        H,
        K,
        rank,
        E + 1,
        world,
        world,
        backend="torch",
    )
    expect_raises(
        ValueError, "world_size", EPAll2AllLayer, None, 4, H, K, rank, E, world, world + 1, backend="torch"
    )
    expect_raises(
        ValueError,
        "rank",
        EPAll2AllLayer,
        None,
        4,
        H,
        K,
        (rank + 1) % world,
        E,
        world,
        world,
        backend="torch",
    )
    expect_raises(
        ValueError,
        "backend must be one of",
        EPAll2AllLayer,
        None,
        4,
        H,
        K,
        rank,
        E,
        world,
        world,
        backend="nope",
    )
    expect_raises(
        ValueError, "num_sm", EPAll2AllLayer, None, 4, H, K, rank, E, world, world, num_sm=0, backend="torch"
    )
    seen.append("construct-local")

    # mismatched configs across ranks: checked collectively, every rank raises naming the others
    hidden = H + (8 if rank == world - 1 else 0)
    other = 0 if rank == world - 1 else world - 1
    with pytest.raises(EPConfigMismatchError, match=f"rank {other} has"):
        EPAll2AllLayer(
            None, 4, hidden, K, rank, E, world, world, dtype=torch.float32, backend="torch", timeout_s=10
        )
    seen.append("mismatch")

    # the fast path asked for where it cannot run (gloo, CPU): every rank says why, nothing falls back silently
    with pytest.raises(ValueError, match="backend='triton' is not usable on every rank"):
        EPAll2AllLayer(
            None, 4, H, K, rank, E, world, world, dtype=torch.float32, backend="triton", timeout_s=10
        )
    auto = EPAll2AllLayer(
        None, 4, H, K, rank, E, world, world, dtype=torch.float32, backend="auto", timeout_s=10
    )
    assert auto.backend_name == "torch"
    assert "auto fell back to torch" in auto.backend_reason, auto.backend_reason
    auto.finalize()

    layer = mk()
    x = torch.randn(3, H)
    idx = torch.tensor([[0, 1], [E - 1, -1], [1, 1]], dtype=torch.int32)
    _check_dispatch_arg_errors(layer, x, idx, E, H, K)
    seen.append("dispatch-args")

    # a valid call, then combine misuse
    out, _, desc = layer.dispatch(x, idx)
    expect_raises(
        ValueError,
        f"input must have shape [{desc.num_recv_rows + 1}, 32]".replace(
            f"[{desc.num_recv_rows + 1}", f"[{desc.num_recv_rows}"
        ),
        layer.combine,
        torch.randn(desc.num_recv_rows + 1, H),
        desc,
    )
    expect_raises(TypeError, "EPAllToAllLayoutDesc", layer.combine, out, object())
    expect_raises(TypeError, "floating", layer.combine, out.long(), desc)
    other = mk()
    expect_raises(ValueError, "different EPAll2AllLayer", other.combine, out, desc)
    other.finalize()
    layer.combine(out, desc)
    seen.append("combine-args")

    # CUDA-graph mode is the Triton backend's: the torch backend refuses it by name, before any collective
    expect_raises(
        NotImplementedError,
        "dispatch_static() (CUDA-graph mode) needs backend='triton'",
        layer.dispatch_static,
        x,
        idx,
    )
    expect_raises(
        NotImplementedError,
        "combine_static() (CUDA-graph mode) needs backend='triton'",
        layer.combine_static,
        out,
        None,
    )
    layer.check_errors()  # nothing to check on the torch backend
    seen.append("static-mode")

    # caller-given rows that are not a permutation: every receiver raises (after the exchange)
    bad = torch.zeros(3, K, dtype=torch.int32)
    if rank in (0, world - 1):  # receivers of 2+ rows all told to use row 0
        expect_raises(ValueError, "exactly the rows", layer.dispatch, x, idx, None, bad)
    else:  # receives nothing: nothing to contradict
        layer.dispatch(x, idx, None, bad)
    seen.append("scatter-perm")

    layer.finalize()
    expect_raises(RuntimeError, "after finalize", layer.dispatch, x, idx)
    expect_raises(RuntimeError, "after finalize", layer.combine, out, desc)
    expect_raises(RuntimeError, "after finalize", layer.dispatch_static, x, idx)
    expect_raises(RuntimeError, "after finalize", layer.check_errors)
    with mk() as ctx_layer:
        ctx_layer.ep_barrier_all()
    expect_raises(RuntimeError, "after finalize", ctx_layer.ep_barrier_all)
    seen.append("finalize")

    return _check_faults(rank, world, mk, x, idx, seen)


def run_matrix_and_autograd(
    rank: int, world: int, exchange_on_device: bool = False, device_order: bool = False
) -> int:
    """The matrix and the autograd cases on CPUs; ``device_order``: the torch backend sorts combine's row
    order on the device at every size (as above ``_HOST_ORDER_ROWS`` output rows)."""
    global EXCHANGE_ON_DEVICE
    EXCHANGE_ON_DEVICE = exchange_on_device
    if device_order:
        import ep_a2a.backends.torch as torch_backend

        torch_backend._HOST_ORDER_ROWS = 0
    n = run_matrix(rank, world, torch.device("cpu"))
    run_autograd(rank, world, torch.device("cpu"))
    return n
