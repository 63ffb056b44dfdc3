"""``backend="triton"``: Triton kernels over a symmetric heap, intra-node by stores, ranks on other nodes
(or forced remote) by NVSHMEM host-side put-with-signal.

Importing this module registers :class:`TritonBackend` under the name ``"triton"``. The kernels take a
table of peer heap addresses, so they run over ``torch.distributed._symmetric_memory`` (default) or
nvshmem4py (``TritonTuning(heap="nvshmem")``).
"""

from ep_a2a.backends.triton.backend import StaticDispatch, TritonBackend
from ep_a2a.backends.triton.engine import EPTimeoutFromDevice, HeapLayout, TritonEPEngine
from ep_a2a.backends.triton.resolve import engine_options, remote_plan, resolve_heap

__all__ = [
    "EPTimeoutFromDevice",
    "HeapLayout",
    "StaticDispatch",
    "TritonBackend",
    "TritonEPEngine",
    "engine_options",
    "remote_plan",
    "resolve_heap",
]
