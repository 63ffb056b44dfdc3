"""Two versions of eplb-core timed in turns in one process (one CPU thread):
``python packages/eplb-core/benchmarks/ab_versions.py --base DIR --base-commit SHA --out FILE``.

``DIR`` holds an older copy of the package renamed ``eplb_core_base`` (every ``eplb_core`` in its
sources replaced), e.g. ``git archive SHA packages/eplb-core/src/eplb_core`` then ``sed``. Both
versions plan the benchmark's loads (``run.py``: the last of two windows of
``synthetic_loads(58, 256, seed=0)``) for the four configurations; each turn calls
``rebalance_experts`` of both, the order alternating from turn to turn, so a machine that speeds up
or slows down during the run moves both alike. Writes the medians, the per-turn ratios and whether
the plans are identical.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

CONFIGS = [(288, 4, 32), (320, 8, 64), (264, 1, 8), (288, 9, 72)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="folder holding the package copy eplb_core_base")
    parser.add_argument("--base-commit", default="unknown")
    parser.add_argument("--out", required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--turns", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, args.base)
    new = importlib.import_module("eplb_core")
    old = importlib.import_module("eplb_core_base")
    weight = new.synthetic_loads(58, 256, num_groups=8, num_windows=2, seed=0)[-1]
    versions = {"base": old, "new": new}
    rows = []
    t0 = time.perf_counter()
    for cfg in CONFIGS:
        plans = {k: m.rebalance_experts(weight, cfg[0], 8, cfg[1], cfg[2]) for k, m in versions.items()}
        same = all(torch.equal(a, b) for a, b in zip(plans["base"], plans["new"], strict=True))
        rows.append({"config": str(cfg), "same_plan": same, "base_ms": [], "new_ms": []})
    compile_s = time.perf_counter() - t0
    for turn in range(args.warmup + args.turns):
        for cfg, row in zip(CONFIGS, rows, strict=True):
            order = ("base", "new") if turn % 2 == 0 else ("new", "base")
            for key in order:
                t = time.perf_counter()
                versions[key].rebalance_experts(weight, cfg[0], 8, cfg[1], cfg[2])
                if turn >= args.warmup:
                    row[f"{key}_ms"].append(1e3 * (time.perf_counter() - t))
    for row in rows:
        b, n = np.array(row["base_ms"]), np.array(row["new_ms"])
        row["base_ms_median"] = float(np.median(b))
        row["new_ms_median"] = float(np.median(n))
        row["ratio_of_medians"] = row["new_ms_median"] / row["base_ms_median"]
        row["ratio_per_turn_median"] = float(np.median(n / b))
        row["ratio_per_turn_range"] = [float((n / b).min()), float((n / b).max())]
    out = {
        "package": "eplb-core",
        "what": "rebalance_experts of two versions timed in turns in one process, one CPU thread",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "base_commit": args.base_commit,
        "loads": "eplb_core.synthetic_loads(58, 256, num_groups=8, num_windows=2, seed=0)[-1]",
        "warmup_turns": args.warmup,
        "turns": args.turns,
        "first_calls_s": compile_s,
        "configs": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for row in rows:
        print(
            f"{row['config']}: base {row['base_ms_median']:.2f} ms, new {row['new_ms_median']:.2f} ms, "
            f"ratio {row['ratio_per_turn_median']:.3f} (per turn {row['ratio_per_turn_range'][0]:.2f}-"
            f"{row['ratio_per_turn_range'][1]:.2f}), same plan: {row['same_plan']}"
        )


if __name__ == "__main__":
    main()
