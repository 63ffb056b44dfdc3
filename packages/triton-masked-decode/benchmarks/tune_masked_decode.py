"""Tuning sweep for the masked decode kernel (a tuning aid, not part of ``nox -s bench``).

    python packages/triton-masked-decode/benchmarks/tune_masked_decode.py [--out FILE.json] [--quick]

At the seed's shapes (Hq=32, Hkv=8, D=128, fp16, L=64K) and batch 1 / 8, for random and clustered (64)
masks of 10 / 25 / 50% visible and no mask, it times ``path="auto"`` under several variants of the knobs in
``_TUNE_OVERRIDE`` (split target per SM, sparse gather tile and pipelining depth, dense tile, compaction
block, programmatic dependent launch of the merge, sparse threshold), then the combination of the best
knobs found. Every variant's output is checked against the float32 reference, eagerly and after a
CUDA-graph replay. Last, a per-kernel breakdown (split kernel, merge kernel, launch gaps) of the default
configuration from the CUDA profiler. Times are medians of CUDA-graph replays with L2 flushed before each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_masked_decode import capture_graph, copy_bandwidth

from triton_masked_decode import masked_decode, masked_decode_ref

md = sys.modules["triton_masked_decode.masked_decode"]  # the package re-exports a function of that name

HQ, HKV, D, L = 32, 8, 128, 65536
CASES = [  # name, batch, visible fraction, pattern
    ("B1-rand50", 1, 0.5, "random"),
    ("B1-rand10", 1, 0.1, "random"),
    ("B1-rand25", 1, 0.25, "random"),
    ("B1-clus10", 1, 0.1, "cluster64"),
    ("B1-clus25", 1, 0.25, "cluster64"),
    ("B1-nomask", 1, 1.0, "none"),
    ("B8-rand50", 8, 0.5, "random"),
    ("B8-rand10", 8, 0.1, "random"),
    ("B8-rand25", 8, 0.25, "random"),
    ("B8-clus25", 8, 0.25, "cluster64"),
]
# The autotuner's pick for the dense loop at these shapes in the last benchmark (BLOCK_N=32, 4 warps, 3 stages).
BASE = {"block_n": 32, "num_warps": 4, "num_stages": 3}
VARIANTS = [  # tag, override on top of BASE, sparse threshold (None = default), batches
    ("base", {}, None, (1, 8)),
    ("no-pdl", {"pdl": 0}, None, (1, 8)),
    ("perSM2", {"programs_per_sm": 2}, None, (1,)),
    ("perSM8", {"programs_per_sm": 8}, None, (1, 8)),
    ("perSM16", {"programs_per_sm": 16}, None, (1,)),
    ("NS64-s2", {"block_ns": 64, "sparse_stages": 2}, None, (1, 8)),
    ("NS64-s3", {"block_ns": 64, "sparse_stages": 3}, None, (1, 8)),
    ("NS32-s2", {"block_ns": 32, "sparse_stages": 2}, None, (1, 8)),
    ("NS16-s4", {"block_ns": 16, "sparse_stages": 4}, None, (1,)),
    ("BC1024", {"block_c": 1024}, None, (8,)),
    ("BC4096", {"block_c": 4096}, None, (8,)),
    ("w8", {"num_warps": 8}, None, (1,)),
    ("dense-BN64-s2", {"block_n": 64, "num_stages": 2}, None, (1,)),
    ("thr1.0", {}, 1.0, (1, 8)),
]


def make(batch: int, dens: float, pattern: str):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(batch, HKV, L, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn_like(k)
    if pattern == "none":
        mask = None
    elif pattern == "cluster64":
        vis = torch.rand(batch, HKV, L // 64, device="cuda", generator=g) < dens
        mask = ~vis.repeat_interleave(64, -1)
    else:
        mask = torch.rand(batch, HKV, L, device="cuda", generator=g) >= dens
    return q, k, v, mask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    rep = 25 if args.quick else 50
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bw {bw / 1e12:.3f} TB/s", flush=True)
    data = {name: make(b, d, p) for name, b, d, p in CASES}
    refs = {}
    for name, (q, k, v, mask) in data.items():
        refs[name] = masked_decode_ref(q, k, v, mask)[0].float()
    rows: list[dict] = []
    times: dict[tuple[str, str], float] = {}

    def measure(tag: str, override: dict, thr: float | None, name: str) -> None:
        q, k, v, mask = data[name]
        md._TUNE_OVERRIDE.clear()
        md._TUNE_OVERRIDE.update({**BASE, **override})
        kw = {} if thr is None else {"sparse_threshold": thr}
        fn = lambda: masked_decode(q, k, v, mask, check_values=False, **kw)
        try:
            err_eager = float((fn()[0].float() - refs[name]).abs().max())
            graph, res = capture_graph(fn)
            res[0].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            err_graph = float((res[0].float() - refs[name]).abs().max())
            ms = triton.testing.do_bench(graph.replay, warmup=10, rep=rep, return_mode="median")
            t = ms * 1e3
        except Exception as e:  # a variant failing must not stop the sweep
            print(f"{tag:16s} {name:10s} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
            rows.append({"variant": tag, "case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            return
        ok = err_eager < 1e-2 and err_graph < 1e-2
        times[(tag, name)] = t
        rows.append(
            {"variant": tag, "case": name, "us": t, "err_eager": err_eager, "err_graph": err_graph, "ok": ok}
        )
        flag = "" if ok else f"  WRONG (eager {err_eager:.3g}, graph {err_graph:.3g})"
        print(f"{tag:16s} {name:10s} {t:8.1f} us{flag}", flush=True)

    for tag, ov, thr, batches in VARIANTS:
        for name, b, _, p in CASES:
            if b in batches and not (p == "none" and (thr is not None or "block_ns" in ov)):
                measure(tag, ov, thr, name)

    # Combination of the best sparse tile and split target (by the sum of the batch-1 sparse cases).
    sparse_b1 = ["B1-rand10", "B1-rand25", "B1-clus10", "B1-clus25"]

    def score(tag: str) -> float:
        return sum(times.get((tag, n), 1e9) for n in sparse_b1)

    tile_tag = min(["base", "NS64-s2", "NS64-s3", "NS32-s2", "NS16-s4"], key=score)
    split_tag = min(["base", "perSM2", "perSM8", "perSM16"], key=score)
    combo = {**dict(VARIANTS[[v[0] for v in VARIANTS].index(tile_tag)][1])}
    combo.update(dict(VARIANTS[[v[0] for v in VARIANTS].index(split_tag)][1]))
    print(f"best tile {tile_tag}, best split {split_tag}: combo {combo}", flush=True)
    for name, _b, _, _p in CASES:
        measure("combo", combo, None, name)

    # Per-kernel breakdown of the default configuration (eager calls, L2 flushed between them).
    md._TUNE_OVERRIDE.clear()
    md._TUNE_OVERRIDE.update(BASE)
    flush_buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    breakdown = {}
    for name in ("B1-rand50", "B1-rand10", "B1-rand25", "B1-clus25", "B1-nomask", "B8-rand25"):
        q, k, v, mask = data[name]
        masked_decode(q, k, v, mask, check_values=False)
        torch.cuda.synchronize()
        n_it = 20
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n_it):
                flush_buf.zero_()
                masked_decode(q, k, v, mask, check_values=False)
            torch.cuda.synchronize()
        per = {}
        for evt in prof.key_averages():
            if "masked_decode" in evt.key or "merge" in evt.key:
                per[evt.key] = evt.device_time_total / max(evt.count, 1)
        breakdown[name] = {"kernels_us": per, "graph_us": times.get(("base", name))}
        print(
            f"breakdown {name:10s} "
            + ", ".join(f"{k[:28]} {v:.1f} us" for k, v in per.items())
            + f"; graph total {times.get(('base', name), float('nan')):.1f} us",
            flush=True,
        )
    md._TUNE_OVERRIDE.clear()

    # Summary: variants x cases.
    names = [c[0] for c in CASES]
    tags = [v[0] for v in VARIANTS] + ["combo"]
    print("\n| variant | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for tag in tags:
        cells = [f"{times[(tag, n)]:.1f}" if (tag, n) in times else "" for n in names]
        print(f"| {tag} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"bw": bw, "device": torch.cuda.get_device_name(), "rows": rows, "breakdown": breakdown},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
