"""Expert-parallel all-to-all dispatch/combine for MoE.

The layer (:class:`EPLayer`, or :class:`EPAll2AllLayer` with Triton-distributed's positional
arguments) sends each token's rows to the ranks hosting its experts and sums the expert outputs back;
:class:`TritonTuning` holds the fast path's knobs; :mod:`ep_a2a.reference` is the single-process
reference of both operations.
"""

from ep_a2a._dist import EPConfigMismatchError, EPError, EPProtocolError, EPTimeoutError
from ep_a2a.backends.base import A2ABackend, register_backend
from ep_a2a.compat import EPAll2AllLayer
from ep_a2a.config import EPConfig
from ep_a2a.layer import DispatchCombineContext, EPLayer
from ep_a2a.layout import EPAllToAllLayoutDesc
from ep_a2a.tuning import TritonTuning


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ep-a2a")
    except PackageNotFoundError:  # running from a source tree
        return "0.0.0+src"


__version__ = _version()
del _version

__all__ = [
    "A2ABackend",
    "DispatchCombineContext",
    "EPAll2AllLayer",
    "EPAllToAllLayoutDesc",
    "EPConfig",
    "EPConfigMismatchError",
    "EPError",
    "EPLayer",
    "EPProtocolError",
    "EPTimeoutError",
    "TritonTuning",
    "__version__",
    "register_backend",
]


def __dir__() -> list[str]:
    return [*__all__, "backends", "reference", "testing"]
