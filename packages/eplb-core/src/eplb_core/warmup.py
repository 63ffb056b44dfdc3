"""``python -m eplb_core.warmup``: compile (or load from the disk cache) the planner of every mode.

Run it once after installing, or while building a serving image: later processes then plan with the
compiled planner from their first call. Without it, the first process that plans in a fresh environment
compiles the planner in a background thread and plans with the interpreted planner until then (the same
plans, slower). Prints the time it took.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from eplb_core._numba import runner
from eplb_core.planner import plan, rebalance_experts
from eplb_core.synthetic import synthetic_loads

__all__ = ["main"]


def main() -> int:
    """Plan a small problem in every mode (strict, global, soft locality, migration), compiled."""
    t0 = time.perf_counter()
    weight = synthetic_loads(2, 32, num_groups=4, seed=0)
    topology: dict[str, Any] = {"num_replicas": 40, "num_groups": 4, "num_nodes": 2, "num_gpus": 8}
    print("eplb-core: compiling the planner (about a minute of one CPU core when not cached)", flush=True)
    with runner.forced("compiled"):
        rebalance_experts(weight, 40, 4, 1, 8)
        strict = plan(weight, **topology)
        plan(weight, **topology, soft_locality=0.0)
        plan(weight * 2.0 + 1.0, **topology, previous=strict)
    print(f"eplb-core planner ready in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
