"""Symmetric heaps the kernels run over: one allocation per rank, every peer's base address in a table.

* :class:`TorchSymmetricHeap` (default): ``torch.distributed._symmetric_memory`` (an allocation of its own,
  ``rendezvous``, ``get_buffer`` for each peer).
* :class:`NvshmemHeap`: nvshmem4py (``pip install "ep-a2a[nvshmem]"``), bootstrapped with a unique id
  broadcast over the process group; ``nvshmem.core.tensor`` and ``get_peer_tensor`` for each peer.
  Single node defaults (set only when unset): ``NVSHMEM_REMOTE_TRANSPORT=none``,
  ``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo``, ``NVSHMEM_DISABLE_NVLS=1`` (only the last for a group that
  spans nodes: NVSHMEM then picks its network transport and bootstrap interface itself). Ranks outside
  ``peers`` (other nodes, or forced remote) get address 0 in the table: the kernels never address them,
  :class:`NvshmemTransport` reaches them with host-side put-with-signal.

Both are zeroed at creation (flags start at epoch 0) and end with a barrier so no peer writes into a
heap that is not zeroed yet.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

HEAP_KINDS = ("torch", "nvshmem")


class SymmetricHeap:
    """A byte buffer of ``nbytes`` on every rank of ``group`` plus the table of their base addresses.

    Attributes:
        local: ``[nbytes]`` uint8 tensor, this rank's heap.
        ptr_table: ``[world_size]`` int64 tensor on the device, base address of every rank's heap as
            mapped in this process.
        peers: every rank's heap as a ``[nbytes]`` uint8 tensor mapped in this process (``None`` for
            ranks not mapped): the targets of copy-engine copies.
    """

    kind = ""
    local: torch.Tensor
    ptr_table: torch.Tensor
    peers: list[torch.Tensor | None]

    def free(self) -> None:
        raise NotImplementedError


class TorchSymmetricHeap(SymmetricHeap):
    """Heap from ``torch.distributed._symmetric_memory``."""

    kind = "torch"

    def __init__(self, nbytes: int, group: dist.ProcessGroup, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            # older torch needs the group enabled; newer torch enables every group itself and only warns
            # that the call is deprecated (a FutureWarning on every backend users build)
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(group.group_name)
        self.local = _symmetric_empty(nbytes, device)
        self.local.zero_()
        self._handle: Any = symm_mem.rendezvous(self.local, group)
        world = dist.get_world_size(group)
        mapped = [self._handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(world)]
        self.peers = list(mapped)
        ptrs = [t.data_ptr() for t in mapped]
        self.ptr_table = torch.tensor(ptrs, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def free(self) -> None:
        self._handle = None
        self.peers = []
        del self.local


def _symmetric_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of symmetric memory in an allocation of its own, outside torch's implicit pool.

    ``symm_mem.empty`` takes its memory from a caching pool that hands a freed allocation out again
    together with the peers' addresses of its first ``rendezvous`` (cached per allocation). That is
    right only where every rank frees and allocates in the same order, which a heap freed when its
    Python objects die (garbage collection, at a different moment on each rank) cannot promise: a reused
    allocation on one rank and a new one on another would give the peers wrong addresses. An allocation
    of its own is exchanged afresh by every ``rendezvous`` (as with ``TORCH_SYMMMEM_IMPLICIT_POOL=0``).
    """
    from torch._C._distributed_c10d import _SymmetricMemory

    return _SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device)


_NVSHMEM_USERS = 0


class NvshmemHeap(SymmetricHeap):
    """Heap from nvshmem4py, initialised once per process with a unique id broadcast over ``group``."""

    kind = "nvshmem"

    def __init__(
        self,
        nbytes: int,
        group: dist.ProcessGroup,
        device: torch.device,
        *,
        peers: Sequence[int] | None = None,
        single_node: bool = True,
    ) -> None:
        global _NVSHMEM_USERS
        defaults = [("NVSHMEM_DISABLE_NVLS", "1")]
        if single_node:
            defaults += [("NVSHMEM_REMOTE_TRANSPORT", "none"), ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")]
        for key, value in defaults:
            os.environ.setdefault(key, value)
        try:
            import nvshmem.core as nvshmem
        except ImportError as exc:
            raise ImportError(
                'heap="nvshmem" needs nvshmem4py: pip install "ep-a2a[nvshmem]" (nvshmem4py-cu13)'
            ) from exc
        self._nvshmem: Any = nvshmem
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if _NVSHMEM_USERS == 0:
            try:
                from cuda.core import Device
            except ImportError:  # older cuda.core
                from cuda.core.experimental import Device
            dev = Device(device.index if device.index is not None else torch.cuda.current_device())
            dev.set_current()
            uid = nvshmem.get_unique_id(empty=rank != 0)
            raw = [bytes(uid._data.view("int8").tobytes()) if rank == 0 else None]
            dist.broadcast_object_list(raw, src=dist.get_global_rank(group, 0), group=group)
            if rank != 0:
                import numpy as np

                assert raw[0] is not None
                uid._data.view("int8")[:] = np.frombuffer(raw[0], dtype="int8")
            nvshmem.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")
            atexit.register(nvshmem.finalize)
        _NVSHMEM_USERS += 1
        self.local = nvshmem.tensor((nbytes,), dtype=torch.uint8)
        self.local.zero_()
        mapped = set(range(world) if peers is None else peers) | {rank}
        self.peers = [nvshmem.get_peer_tensor(self.local, r) if r in mapped else None for r in range(world)]
        ptrs = [0 if t is None else t.data_ptr() for t in self.peers]
        self.ptr_table = torch.tensor(ptrs, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def free(self) -> None:
        # NVSHMEM stays initialised for the life of the process (it cannot be initialised twice);
        # nvshmem.core.finalize() runs at exit
        self.peers = []
        self._nvshmem.free_tensor(self.local)
        del self.local


class NvshmemTransport:
    """Host-side put-with-signal over an :class:`NvshmemHeap`, on the current CUDA stream.

    nvshmem4py's ``nvshmem.bindings.putmem_signal_on_stream`` / ``signal_op_on_stream`` (the calls under
    ``nvshmem.core.put_signal`` / ``signal_op``, which only take whole nvshmem tensors) with symmetric
    addresses inside this rank's heap; NVSHMEM translates them to the peer's heap. Signal op: set. A put
    of 0 bytes is a signal alone.
    """

    def __init__(self, heap: NvshmemHeap) -> None:
        import nvshmem.bindings as bindings

        self._b: Any = bindings
        self._base = heap.local.data_ptr()
        self._set = int(bindings.Signal_op.SIGNAL_SET)
        self._device = heap.local.device

    def _stream(self) -> int:
        return int(torch.cuda.current_stream(self._device).cuda_stream)

    def put_signal(self, pe: int, dst_off: int, src_off: int, nbytes: int, sig_off: int, value: int) -> None:
        if nbytes == 0:
            self.signal(pe, sig_off, value)
            return
        b = self._base
        self._b.putmem_signal_on_stream(
            b + dst_off, b + src_off, nbytes, b + sig_off, value, self._set, pe, self._stream()
        )

    def signal(self, pe: int, sig_off: int, value: int) -> None:
        self._b.signal_op_on_stream(self._base + sig_off, value, self._set, pe, self._stream())


def make_heap(
    kind: str,
    nbytes: int,
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    peers: Sequence[int] | None = None,
    single_node: bool = True,
) -> SymmetricHeap:
    """Create a heap of ``kind`` (``"torch"`` or ``"nvshmem"``), collectively over ``group``.

    ``peers``: the ranks whose heaps this rank addresses directly (default: all); nvshmem only.
    """
    if kind == "torch":
        if peers is not None or not single_node:
            raise ValueError("heap='torch' maps every peer directly: remote peers need heap='nvshmem'")
        return TorchSymmetricHeap(nbytes, group, device)
    if kind == "nvshmem":
        return NvshmemHeap(nbytes, group, device, peers=peers, single_node=single_node)
    raise ValueError(f"heap must be one of {HEAP_KINDS}, got {kind!r}")
