"""Batch-1 ("one wave") launch knobs A/B, including the merge kernel's head-dim slices (a diagnostic).

    python packages/triton-masked-decode/benchmarks/ab_one_wave.py --out docs/benchmarks/triton-masked-decode-ab-one-wave.json

At the seed's shapes, batch 1, L=64K (random 10/25/50% and clustered 10/25% masks, as in ``run.py``), it
times ``masked_decode`` with each variant of the launch knobs (``tune_masked_decode.Sweep``: every variant's
output checked against the float32 reference eagerly and after a graph replay; CUDA-graph replays, L2
flushed by a read before each), in two rounds with the variant order reversed in the second. Reported per
variant: the median time per case, the geometric mean relative to the package defaults, and each sparse
case's time over the same variant's 50%-mask time. The defaults are not changed by this script.

``--set merge --batches 1,8 --rounds 3`` (run 10) compares merge-kernel launch shapes against the defaults
at batch 1 and batch 8 (batch 8 is a multi-wave launch: only the merge knobs are overridden, so each batch
keeps its own launch class's tile); ``--set sparse-only`` (run 10) the kernel without the dense loop against
the one with it; ``--set run9`` (default) is run 9's batch-1 knob list.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_masked_decode import run_header
from tune_masked_decode import Sweep, tuned

MASKS = ("rand10", "rand25", "rand50", "clus10", "clus25")
DEFAULT = {
    "block_ns": tuned.SPARSE_TILE_ONE_WAVE[0],
    "sparse_stages": tuned.SPARSE_TILE_ONE_WAVE[1],
    "programs_per_sm": tuned.PROGRAMS_PER_SM,
}
VARIANTS_RUN9 = {
    "default": {},
    "merge-d32": {"merge_block_d": 32},
    "merge-d32-w2": {"merge_block_d": 32, "merge_warps": 2},
    "no-pdl": {"pdl": 0},
    "compact-256": {"block_c": 256},
    "ns64-s3-psm3": {"block_ns": 64, "sparse_stages": 3, "programs_per_sm": 3},
    "ns32-s3-psm4": {"block_ns": 32, "sparse_stages": 3},
    "psm6": {"programs_per_sm": 6},
}
# Run 10: the merge kernel's head-dim slice and warps (32 wide with 2 warps when this set ran at 09886a9; the
# default since 81f4a00 is 32 wide with 1 warp).
VARIANTS_MERGE = {
    "default": {},
    "merge-whole-w4": {"merge_block_d": 128, "merge_warps": 4},
    "merge-d32-w1": {"merge_block_d": 32, "merge_warps": 1},
    "merge-d16-w1": {"merge_block_d": 16, "merge_warps": 1},
}
# Run 10, second call: the kernel without the dense loop when every split is sparse (default since run 10)
# against the kernel with it (the autotuner's 32- and 64-row dense tiles), run 9's whole kernel, the
# 1-warp merge, and 5 programs per SM (without the dense loop: 38,912 B shared, 87 registers at batch 1).
VARIANTS_SPARSE_ONLY = {
    "default": {},
    "dense-in-32x3": {"keep_dense_loop": 1},
    "dense-in-64x3": {"keep_dense_loop": 1, "block_n": 64},
    "run9-kernel": {"keep_dense_loop": 1, "merge_block_d": 128, "merge_warps": 4},
    "merge-d32-w1": {"merge_block_d": 32, "merge_warps": 1},
    "psm5": {"programs_per_sm": 5},
}
SETS = {
    "run9": (VARIANTS_RUN9, DEFAULT),
    "merge": (VARIANTS_MERGE, {}),
    "sparse-only": (VARIANTS_SPARSE_ONLY, {}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rep", type=int, default=40)
    ap.add_argument("--set", choices=sorted(SETS), default="run9")
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes (L=64K each)")
    ap.add_argument(
        "--rounds", type=int, default=2, help="rounds, the variant order reversed every other one"
    )
    args = ap.parse_args()
    variants, base = SETS[args.set]
    batches = [int(x) for x in args.batches.split(",")]
    sw = Sweep(args.rep)
    order = list(variants)
    for rnd in range(args.rounds):
        for tag in order if rnd % 2 == 0 else order[::-1]:
            for b in batches:
                for m in MASKS:
                    sw.measure(tag, {**base, **variants[tag]}, b, m, threshold=None)
    summary: dict[str, dict] = {}
    for b in batches:
        med: dict[str, dict[str, float]] = {}
        for tag in order:
            for m in MASKS:
                ts = [
                    r["us"]
                    for r in sw.rows
                    if r["variant"] == tag and r["batch"] == b and r["mask"] == m and r.get("ok")
                ]
                if len(ts) == args.rounds:
                    med.setdefault(tag, {})[m] = statistics.median(ts)
        for tag, t in med.items():
            if len(t) != len(MASKS) or len(med.get("default", {})) != len(MASKS):
                continue
            geo = math.exp(sum(math.log(t[m] / med["default"][m]) for m in MASKS) / len(MASKS))
            ratios = {m: t[m] / t["rand50"] for m in MASKS if m != "rand50"}
            key = tag if len(batches) == 1 else f"B{b}:{tag}"
            summary[key] = {"batch": b, "median_us": t, "geomean_vs_default": geo, "over_rand50": ratios}
            rs = "  ".join(f"{m} {t[m]:6.1f} ({ratios.get(m, 1.0):.3f})" for m in MASKS)
            print(f"B{b} {tag:14s} geo {geo:.4f}  {rs}", flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    **run_header("launch-knob A/B (defaults unchanged); see the module docstring"),
                    "set": args.set,
                    "batches": batches,
                    "rounds": args.rounds,
                    "base_knobs": base,
                    "variants": variants,
                    "summary": summary,
                    "rows": sw.rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
