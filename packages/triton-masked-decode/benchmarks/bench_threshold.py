"""Where the sparse loop stops paying: dense vs sparse loop against the visible fraction (informs ``SPARSE_THRESHOLDS``).

    python packages/triton-masked-decode/benchmarks/bench_threshold.py --out docs/benchmarks/triton-masked-decode-threshold.json

At the seed's shapes (Hq=32, Hkv=8, D=128, fp16, L=64K) and batch 1 / 4 / 8, for random masks of 25 to 100%
visible and masks in clusters of 64 positions, it times ``path="dense"``, ``path="sparse"`` and
``path="auto"`` (the package default) as CUDA-graph replays (median, L2 flushed by ``do_bench``), after
checking that the two loops agree with the float32 reference. The crossover per batch is the largest visible
fraction at which the sparse loop is still at least as fast as the dense one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_masked_decode import capture_graph, run_header

from triton_masked_decode import SPARSE_THRESHOLDS, masked_decode, masked_decode_ref

HQ, HKV, D, L = 32, 8, 128, 65536
FRACTIONS = (0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CLUSTER_FRACTIONS = (0.5, 0.75, 0.9)
BATCHES = (1, 4, 8)


def make_inputs(batch: int, visible: float, pattern: str, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(batch, HKV, L, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn_like(k)
    if pattern == "cluster64":
        shown = torch.rand(batch, HKV, L // 64, device="cuda", generator=g) < visible
        mask = ~shown.repeat_interleave(64, -1)
    else:
        mask = torch.rand(batch, HKV, L, device="cuda", generator=g) >= visible
    return q, k, v, mask


def graph_us(fn, rep: int) -> float:
    graph, _ = capture_graph(fn)
    return triton.testing.do_bench(graph.replay, warmup=10, rep=rep, return_mode="median") * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rep", type=int, default=40, help="do_bench time budget per measurement, ms")
    args = ap.parse_args()
    rows: list[dict] = []
    cases = [(b, f, "random") for b in BATCHES for f in FRACTIONS]
    cases += [(b, f, "cluster64") for b in (1, 8) for f in CLUSTER_FRACTIONS]
    print(f"{torch.cuda.get_device_name()}; default SPARSE_THRESHOLDS = {SPARSE_THRESHOLDS}", flush=True)
    print(
        f"{'batch':>5} {'pattern':>9} {'visible':>7} {'dense us':>9} {'sparse us':>9} {'auto us':>8}",
        flush=True,
    )
    for batch, visible, pattern in cases:
        q, k, v, mask = make_inputs(batch, visible, pattern)
        ref = masked_decode_ref(q, k, v, mask)[0].float()
        row: dict = {"batch": batch, "pattern": pattern, "visible": visible}
        for path in ("dense", "sparse", "auto"):
            fn = lambda path=path, q=q, k=k, v=v, mask=mask: masked_decode(
                q, k, v, mask, path=path, check_values=False
            )
            err = float((fn()[0].float() - ref).abs().max())
            if not err < 1e-2:
                raise SystemExit(
                    f"path={path} batch={batch} {pattern} {visible}: max error {err} vs reference"
                )
            row[f"{path}_us"] = graph_us(fn, args.rep)
            row[f"{path}_err"] = err
        rows.append(row)
        print(
            f"{batch:5d} {pattern:>9} {visible:7.2f} {row['dense_us']:9.1f} {row['sparse_us']:9.1f} {row['auto_us']:8.1f}",
            flush=True,
        )
    crossover = {}
    for batch in BATCHES:
        sel = [r for r in rows if r["batch"] == batch and r["pattern"] == "random"]
        wins = [r["visible"] for r in sel if r["sparse_us"] <= r["dense_us"]]
        crossover[str(batch)] = max(wins) if wins else None
    print(f"largest visible fraction where sparse <= dense (random masks): {crossover}", flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    **run_header(
                        "dense vs sparse loop against the visible fraction (CUDA-graph replay, median)"
                    ),
                    "default_sparse_thresholds": SPARSE_THRESHOLDS,
                    "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "L": L, "dtype": "float16"},
                    "rows": rows,
                    "crossover": crossover,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
