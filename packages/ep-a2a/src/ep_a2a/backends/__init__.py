"""Backends of the layer: the contract and registry (:mod:`.base`), the portable ``torch`` backend and
the ``triton`` fast path (imported on first use)."""

from ep_a2a.backends.base import (
    A2ABackend,
    BackendOptions,
    DispatchResult,
    get_backend_class,
    probe_backend,
    register_backend,
    registered_backends,
)

__all__ = [
    "A2ABackend",
    "BackendOptions",
    "DispatchResult",
    "get_backend_class",
    "probe_backend",
    "register_backend",
    "registered_backends",
]
