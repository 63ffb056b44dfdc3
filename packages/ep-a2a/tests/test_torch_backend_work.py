"""The torch backend does no more work per call than the benchmark's NCCL per-rank pipeline (gloo, CPU).

Counted by ``benchmarks/count_work.py`` on the flow the backend runs on NCCL (exchanges on the group
itself, awaited where the host needs them): collectives, points where the host waits for the device,
and ATen operations on the data.
"""

from __future__ import annotations

import pytest

from ep_a2a.testing import run_local


def count(rank: int, world: int) -> dict:
    import count_work

    return count_work.count_methods(rank, world, 24, hidden=256, experts=8 * world, topk=4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_torch_backend_does_no_more_work_than_the_nccl_pipeline(world: int) -> None:
    counts = run_local(f"{__file__}:count", world, timeout_s=110)
    for got in counts:
        torch_d, torch_c = got["torch"]["dispatch"], got["torch"]["combine"]
        nccl_d, nccl_c = got["nccl-dest"]["dispatch"], got["nccl-dest"]["combine"]
        # dispatch on one host: the counts go through host shared memory, then one payload; one wait,
        # for the counts
        assert torch_d["collectives"] == 1 < nccl_d["collectives"] == 3
        assert torch_d["host_syncs"] == 1 < nccl_d["host_syncs"]
        assert torch_d["device_ops"] <= nccl_d["device_ops"], (torch_d, nccl_d)
        assert torch_d["allocations"] <= nccl_d["allocations"], (torch_d, nccl_d)
        # every operation checks on the operation board (one host) that the peers are in it too
        assert torch_d["peer_waits"] == torch_c["peer_waits"] == 1
        # combine: one payload, no wait for the device (the board is its protocol check)
        assert torch_c["collectives"] == nccl_c["collectives"] == 1
        assert torch_c["host_syncs"] == nccl_c["host_syncs"] == 0
        assert torch_c["device_ops"] <= nccl_c["device_ops"], (torch_c, nccl_c)
        assert torch_c["allocations"] <= nccl_c["allocations"], (torch_c, nccl_c)
        lc_d, lc_c = got["torch-lc"]["dispatch"], got["torch-lc"]["combine"]
        assert lc_d["collectives"] == 1
        assert lc_d["host_syncs"] == 1
        assert lc_d["device_ops"] <= nccl_d["device_ops"], (lc_d, nccl_d)
        assert lc_c["collectives"] == 1
        assert lc_c["host_syncs"] == 0
        assert lc_c["device_ops"] <= nccl_c["device_ops"], (lc_c, nccl_c)
