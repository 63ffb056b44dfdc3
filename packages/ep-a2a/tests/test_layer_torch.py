"""The torch backend against the reference, on gloo (CPU, in CI) and NCCL (multigpu, under torchrun)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ep_a2a.testing import load_target, run_local

CASES = str(Path(__file__).with_name("_cases.py"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("world", "on_device", "device_order"),
    [
        pytest.param(2, False, False, id="gloo-2"),
        pytest.param(4, False, False, id="gloo-4"),
        pytest.param(3, True, False, id="gloo-3-nccl-flow"),  # the NCCL flow's logic over the gloo group
        pytest.param(4, True, False, id="gloo-4-nccl-flow"),  # (with two "nodes": combine's header exchange)
        # combine's row order sorted on the device, as for calls of more output rows than the host builds
        pytest.param(2, True, True, id="gloo-2-nccl-flow-device-order"),
    ],
)
def test_torch_backend_matches_reference(world: int, on_device: bool, device_order: bool) -> None:
    args = (on_device, device_order)
    checked = run_local(f"{CASES}:run_matrix_and_autograd", world, args, timeout_s=170)
    assert checked == [checked[0]] * world
    assert checked[0] >= 16


@pytest.mark.multigpu
def test_torch_backend_nccl_matches_reference() -> None:
    """Under torchrun (`nox -s multigpu`): every rank runs this test on its own GPU."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        pytest.fail("multigpu tests run under torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment)")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    run_matrix = load_target(f"{CASES}:run_matrix")
    run_autograd = load_target(f"{CASES}:run_autograd")
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert run_matrix(rank, world, device) >= 16
    run_autograd(rank, world, device)
    dist.barrier()
