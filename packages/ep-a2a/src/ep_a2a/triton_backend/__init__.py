"""Fast path: Triton kernels over a symmetric heap (``backend="triton"``), intra-node by stores, ranks on
other nodes (or forced remote) by NVSHMEM host-side put-with-signal.

Importing this module registers :class:`TritonBackend` under the name ``"triton"``. The kernels take a
table of peer heap addresses, so they run over ``torch.distributed._symmetric_memory`` (default) or
nvshmem4py (``heap="nvshmem"``, or ``EP_A2A_TRITON_HEAP=nvshmem`` when the layer builds the backend).
"""

from ep_a2a.triton_backend.backend import (
    FORCE_REMOTE_ENV,
    HEAP_ENV,
    StaticDispatch,
    TritonBackend,
    remote_plan,
    resolve_heap,
)
from ep_a2a.triton_backend.engine import EPTimeoutFromDevice, HeapLayout, TritonEPEngine

__all__ = [
    "FORCE_REMOTE_ENV",
    "HEAP_ENV",
    "EPTimeoutFromDevice",
    "HeapLayout",
    "StaticDispatch",
    "TritonBackend",
    "TritonEPEngine",
    "remote_plan",
    "resolve_heap",
]
