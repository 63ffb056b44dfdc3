"""Batch-1 ("one wave") launch knobs A/B, including the merge kernel's head-dim slices (a diagnostic).

    python packages/triton-masked-decode/benchmarks/ab_one_wave.py --out docs/benchmarks/triton-masked-decode-ab-one-wave.json

At the seed's shapes, batch 1, L=64K (random 10/25/50% and clustered 10/25% masks, as in ``run.py``), it
times ``masked_decode`` with each variant of the launch knobs (``tune_masked_decode.Sweep``: every variant's
output checked against the float32 reference eagerly and after a graph replay; CUDA-graph replays, L2
flushed by a read before each), in two rounds with the variant order reversed in the second. Reported per
variant: the median time per case, the geometric mean relative to the package defaults, and each sparse
case's time over the same variant's 50%-mask time. The defaults are not changed by this script.
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
VARIANTS = {
    "default": {},
    "merge-d32": {"merge_block_d": 32},
    "merge-d32-w2": {"merge_block_d": 32, "merge_warps": 2},
    "no-pdl": {"pdl": 0},
    "compact-256": {"block_c": 256},
    "ns64-s3-psm3": {"block_ns": 64, "sparse_stages": 3, "programs_per_sm": 3},
    "ns32-s3-psm4": {"block_ns": 32, "sparse_stages": 3},
    "psm6": {"programs_per_sm": 6},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rep", type=int, default=40)
    args = ap.parse_args()
    sw = Sweep(args.rep)
    order = list(VARIANTS)
    for rnd in range(2):
        for tag in order if rnd == 0 else order[::-1]:
            for m in MASKS:
                sw.measure(tag, {**DEFAULT, **VARIANTS[tag]}, 1, m, threshold=None)
    med: dict[str, dict[str, float]] = {}
    for tag in order:
        for m in MASKS:
            ts = [r["us"] for r in sw.rows if r["variant"] == tag and r["mask"] == m and r.get("ok")]
            if len(ts) == 2:
                med.setdefault(tag, {})[m] = statistics.median(ts)
    summary = {}
    for tag, t in med.items():
        if len(t) != len(MASKS) or len(med.get("default", {})) != len(MASKS):
            continue
        geo = math.exp(sum(math.log(t[m] / med["default"][m]) for m in MASKS) / len(MASKS))
        ratios = {m: t[m] / t["rand50"] for m in MASKS if m != "rand50"}
        summary[tag] = {"median_us": t, "geomean_vs_default": geo, "over_rand50": ratios}
        rs = "  ".join(f"{m} {t[m]:6.1f} ({ratios.get(m, 1.0):.3f})" for m in MASKS)
        print(f"{tag:14s} geo {geo:.4f}  {rs}", flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    **run_header("batch-1 launch-knob A/B (defaults unchanged); see the module docstring"),
                    "defaults": DEFAULT,
                    "variants": VARIANTS,
                    "summary": summary,
                    "rows": sw.rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
