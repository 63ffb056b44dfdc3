"""The torch symmetric heap's allocation (no GPU needed: torch's symmetric-memory calls are stood in for)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from ep_a2a.backends.triton import heaps


class _Handle:
    """What ``symm_mem.rendezvous`` returns: every rank's buffer (CPU tensors here)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers

    def get_buffer(self, rank: int, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert dtype == torch.uint8
        return self.buffers[rank][: sizes[0]]


def test_torch_heap_is_an_allocation_of_its_own(monkeypatch):
    """The heap comes from ``_SymmetricMemory.empty_strided_p2p`` (an allocation of its own, exchanged
    by its rendezvous), never from ``symm_mem.empty``'s caching pool, which hands a freed allocation out
    again with its peers' addresses from an earlier rendezvous; then it is zeroed, every rank's address
    is in the table, and the ranks meet at a barrier."""
    import torch._C._distributed_c10d as c10d

    nbytes, world, rank = 4096, 2, 0
    allocated: list[tuple] = []
    peer = torch.full((nbytes,), 7, dtype=torch.uint8)

    class _FakeSymmetricMemory:
        @staticmethod
        def empty_strided_p2p(size, stride, dtype, device):
            allocated.append((tuple(size), tuple(stride), dtype, torch.device(device)))
            return torch.full(size, 0xFF, dtype=dtype)  # (not zeroed: the heap zeroes it)

    def pooled(*args, **kwargs):
        raise AssertionError("the heap must not come from symm_mem.empty's pool")

    def rendezvous(tensor, group):
        assert group.group_name == "g"
        return _Handle([tensor, peer] if rank == 0 else [peer, tensor])

    barriers: list[object] = []
    monkeypatch.setattr(c10d, "_SymmetricMemory", _FakeSymmetricMemory, raising=False)
    monkeypatch.setattr(symm_mem, "empty", pooled)
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", lambda name: None, raising=False)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "barrier", lambda group=None: barriers.append(group))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    class _Group:
        group_name = "g"

    group = _Group()
    heap = heaps.make_heap("torch", nbytes, group, torch.device("cpu"))  # type: ignore[arg-type]
    assert allocated == [((nbytes,), (1,), torch.uint8, torch.device("cpu"))]
    assert heap.kind == "torch"
    assert bool((heap.local == 0).all()), "the heap is zeroed before any peer may write into it"
    assert heap.ptr_table.tolist() == [heap.local.data_ptr(), peer.data_ptr()]
    assert barriers == [group]
    heap.free()
    assert heap.peers == []
    with pytest.raises(AttributeError):
        _ = heap.local
