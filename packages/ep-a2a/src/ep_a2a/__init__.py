"""Expert-parallel all-to-all dispatch/combine for MoE."""

from importlib.metadata import PackageNotFoundError, version

from ep_a2a.config import EPConfig

try:
    __version__ = version("ep-a2a")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+src"

__all__ = ["EPConfig", "__version__"]
