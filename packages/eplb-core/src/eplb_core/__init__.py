"""Expert-parallel load balancing: replica counts and GPU placement of MoE experts."""

from importlib.metadata import PackageNotFoundError, version

from eplb_core.metrics import balancedness

try:
    __version__ = version("eplb-core")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+src"

__all__ = ["__version__", "balancedness"]
