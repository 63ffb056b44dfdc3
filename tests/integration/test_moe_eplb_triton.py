"""Cross-package MoE block on 2+ GPUs: eplb-core placement + ep-a2a dispatch/combine == dense reference.

Router top-8 over 256 logical experts; eplb-core's ``rebalance_experts`` places 256 + redundant
replicas on the GPUs (``log2phy``), each token slot picks one replica of its logical expert; ep-a2a
(``backend="triton"``) dispatches to the physical experts, each runs the MLP of its logical expert on
its rows (scaled by the routing weight), combine sums them back. The result must equal a single-GPU
dense computation of the same MoE block. Only this test imports both packages; the multigpu session
installs both (``nox -s multigpu``), so a missing package is an error, not a skip.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.multigpu

LOGICAL, TOPK, HIDDEN, FFN, TOKENS = 256, 8, 512, 256, 96


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
    return dist.group.WORLD


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ w1) @ w2


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_moe_block_with_eplb_placement(group, backend):
    from ep_a2a import EPAll2AllLayer
    from eplb_core import rebalance_experts, synthetic_loads

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    physical = LOGICAL + 16 * world  # redundant replicas for the hottest experts
    loads = synthetic_loads(num_layers=1, num_experts=LOGICAL, seed=3)
    phy2log, log2phy, logcnt = rebalance_experts(loads, physical, 8, 1, world)
    phy2log, log2phy, logcnt = phy2log[0], log2phy[0], logcnt[0]
    assert int(logcnt.sum()) == physical
    # identical parameters and tokens on every rank (one seed)
    gen = torch.Generator().manual_seed(42)
    router = torch.randn(HIDDEN, LOGICAL, generator=gen) / HIDDEN**0.5
    w1 = torch.randn(LOGICAL, HIDDEN, FFN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(LOGICAL, FFN, HIDDEN, generator=gen) / FFN**0.5
    xs = [torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(world)]

    x = xs[rank].to(dev)
    logits = x.float() @ router.to(dev)
    top = logits.topk(TOPK, dim=1)
    logical_ids = top.indices
    weights = torch.softmax(top.values, dim=1)
    # replica per token slot: token-index round robin over the expert's replicas
    t_idx = torch.arange(TOKENS, device=dev)[:, None].expand(-1, TOPK)
    replica = (t_idx + rank) % logcnt.to(dev)[logical_ids]
    phys_ids = log2phy.to(dev)[logical_ids, replica].to(torch.int32)
    assert bool((phys_ids >= 0).all())

    layer = EPAll2AllLayer(
        group,
        TOKENS,
        HIDDEN,
        TOPK,
        rank,
        physical,
        world,
        world,
        torch.bfloat16,
        torch.float32,
        num_sm=16,
        backend=backend,
    )
    try:
        if backend == "triton":
            assert layer.backend_name == "triton", layer.backend_reason
        rows, row_w, desc = layer.dispatch(x, phys_ids, weights.float())
        # expert side: each physical expert runs its logical expert's MLP on its rows
        per_rank = physical // world
        local_phys = desc.recv_expert_indices.long() + rank * per_rank
        logical_of_row = phy2log.to(dev)[local_phys]
        y = torch.empty(rows.shape[0], HIDDEN, dtype=torch.float32, device=dev)
        w1d, w2d = w1.to(dev), w2.to(dev)
        for e in logical_of_row.unique().tolist():
            sel = (logical_of_row == e).nonzero().flatten()
            y[sel] = _mlp(rows[sel].float(), w1d[e], w2d[e])
        y = (y * row_w[:, None]).to(torch.bfloat16)
        out = layer.combine(y, desc)
    finally:
        layer.finalize()

    # dense single-GPU reference of the same block, float32
    ref = torch.zeros(TOKENS, HIDDEN, dtype=torch.float32, device=dev)
    xf = x.float()
    for k in range(TOPK):
        for e in logical_ids[:, k].unique().tolist():
            sel = (logical_ids[:, k] == e).nonzero().flatten()
            ref[sel] += weights[sel, k, None] * _mlp(xf[sel], w1d[e], w2d[e])
    err = (out.float() - ref).norm() / ref.norm()
    assert out.shape == (TOKENS, HIDDEN)
    assert float(err) < 1e-2, f"relative error {float(err):.2e} against the dense reference"
