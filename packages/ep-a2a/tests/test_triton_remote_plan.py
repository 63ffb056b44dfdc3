"""Which peers the Triton backend reaches by NVSHMEM puts, and which heap that needs (no GPU needed)."""

from __future__ import annotations

import pytest

from ep_a2a.backends.triton.resolve import remote_plan, resolve_heap
from ep_a2a.config import EPConfig


def _cfg(rank: int, world: int, local: int) -> EPConfig:
    return EPConfig(
        max_tokens=4,
        hidden=16,
        topk=2,
        num_tot_experts=world * 2,
        rank=rank,
        world_size=world,
        local_world_size=local,
    )


def test_nodes_are_blocks_of_local_world_size():
    assert remote_plan(_cfg(1, 4, 4)) == (4, [])
    assert remote_plan(_cfg(1, 4, 2)) == (2, [2, 3])
    assert remote_plan(_cfg(2, 4, 2)) == (2, [0, 1])


def test_force_remote_splits_a_node():
    assert remote_plan(_cfg(0, 2, 2), force_remote=1) == (1, [1])
    assert remote_plan(_cfg(3, 4, 4), force_remote=2) == (2, [0, 1])
    assert remote_plan(_cfg(3, 4, 4), force_remote=4) == (4, [])
    for bad in (0, 3, 8):
        with pytest.raises(ValueError, match="force_remote"):
            remote_plan(_cfg(0, 4, 4), force_remote=bad)
    with pytest.raises(ValueError, match="force_remote"):  # forcing cannot merge real nodes
        remote_plan(_cfg(0, 4, 2), force_remote=4)


def test_remote_peers_need_the_nvshmem_heap():
    inter = _cfg(0, 4, 2)
    assert resolve_heap(None, inter, 2) == "nvshmem"  # the default once some peers are remote
    assert resolve_heap(None, _cfg(0, 4, 4), 4) == "torch"
    with pytest.raises(ValueError, match=r"heap='torch'.*on other nodes.*heap='nvshmem'"):
        resolve_heap("torch", inter, 2)
    with pytest.raises(ValueError, match=r"forced remote.*heap='nvshmem'"):
        resolve_heap("torch", _cfg(0, 2, 2), 1)
    with pytest.raises(ValueError, match="heap must be one of"):
        resolve_heap("shmem", inter, 2)
