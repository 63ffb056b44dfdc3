"""Expert-parallel all-to-all dispatch/combine for MoE.

Public API: :class:`EPAll2AllLayer` (dispatch/combine), :class:`EPConfig`,
:class:`EPAllToAllLayoutDesc`, :class:`DispatchCombineContext`, the errors, and the reference in
:mod:`ep_a2a.reference`.
"""

from importlib.metadata import PackageNotFoundError, version

from ep_a2a._dist import EPConfigMismatchError, EPError, EPTimeoutError
from ep_a2a.backend import A2ABackend, register_backend
from ep_a2a.config import EPConfig
from ep_a2a.layer import DispatchCombineContext, EPAll2AllLayer
from ep_a2a.layout import EPAllToAllLayoutDesc

try:
    __version__ = version("ep-a2a")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+src"

__all__ = [
    "A2ABackend",
    "DispatchCombineContext",
    "EPAll2AllLayer",
    "EPAllToAllLayoutDesc",
    "EPConfig",
    "EPConfigMismatchError",
    "EPError",
    "EPTimeoutError",
    "__version__",
    "register_backend",
]
