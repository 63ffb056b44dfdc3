"""Expert-parallel load balancing: replica counts and GPU placement of MoE experts."""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from eplb_core import io, reference
from eplb_core.bounds import lower_bound
from eplb_core.history import expected_load, plan_from_history
from eplb_core.metrics import balancedness
from eplb_core.placement import Placement, PlacementDiff, gpu_loads_of
from eplb_core.planner import plan, rebalance_experts
from eplb_core.synthetic import synthetic_loads

try:
    __version__ = _version("eplb-core")
except _PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+src"

__all__ = [
    "Placement",
    "PlacementDiff",
    "__version__",
    "balancedness",
    "expected_load",
    "gpu_loads_of",
    "io",
    "lower_bound",
    "plan",
    "plan_from_history",
    "rebalance_experts",
    "reference",
    "synthetic_loads",
]


def __dir__() -> list[str]:
    return list(__all__)
