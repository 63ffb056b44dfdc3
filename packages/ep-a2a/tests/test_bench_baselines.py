"""The benchmark's NCCL-style baselines compute exactly the layer's semantics (gloo, CPU)."""

from __future__ import annotations

import pytest

from ep_a2a.testing import run_local


def check_baselines(rank: int, world: int) -> int:
    import bench_torch_backend as bench
    import torch

    from ep_a2a.reference import combine_ref, dispatch_ref

    E, H, K = 8 * world, 32, 4
    checked = 0
    for route in ("uniform", "skewed"):
        xs, idxs, ws = [], [], []
        for s in range(world):
            n = 10 + 3 * s
            xs.append(torch.randn(n, H, generator=torch.Generator().manual_seed(s)))
            ids, w = bench.make_routing(n, E, K, route, s, "cpu")
            idxs.append(ids)
            ws.append(w)
        received, scatter = dispatch_ref(xs, idxs, ws, num_tot_experts=E)
        ys = [r.output * (r.local_expert[:, None] + 1) for r in received]
        expect = combine_ref(ys, idxs, scatter, num_tot_experts=E)[rank]
        for cls in (bench.NcclPerDest, bench.NcclPerExpert):
            pipe = cls(rank, world, E // world)
            out, w, state = pipe.dispatch(xs[rank], idxs[rank], ws[rank])
            assert torch.equal(out, received[rank].output), (cls.__name__, route)
            assert torch.equal(w, received[rank].weights), (cls.__name__, route)
            torch.testing.assert_close(pipe.combine(ys[rank], state), expect, rtol=1e-5, atol=1e-5)
            checked += 1
    return checked


@pytest.mark.timeout(120)
def test_nccl_style_baselines_match_reference() -> None:
    assert run_local(f"{__file__}:check_baselines", 2, timeout_s=110) == [4, 4]
