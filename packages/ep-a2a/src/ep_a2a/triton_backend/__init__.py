"""Fast intra-node path: Triton kernels over a symmetric heap (``backend="triton"``).

Importing this module registers :class:`TritonBackend` under the name ``"triton"``. The kernels take a
table of peer heap addresses, so they run over ``torch.distributed._symmetric_memory`` (default) or
nvshmem4py (``heap="nvshmem"``, or ``EP_A2A_TRITON_HEAP=nvshmem`` when the layer builds the backend).
"""

from ep_a2a.triton_backend.backend import HEAP_ENV, StaticDispatch, TritonBackend
from ep_a2a.triton_backend.engine import EPTimeoutFromDevice, HeapLayout, TritonEPEngine

__all__ = [
    "HEAP_ENV",
    "EPTimeoutFromDevice",
    "HeapLayout",
    "StaticDispatch",
    "TritonBackend",
    "TritonEPEngine",
]
