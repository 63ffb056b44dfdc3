"""Where batch-1 time goes: fixed cost of a launch against the visible fraction (a diagnostic, not ``nox -s bench``).

    python packages/triton-masked-decode/benchmarks/bench_overhead.py --out docs/benchmarks/triton-masked-decode-overhead.json

At the seed's shapes and batch 1 (Hq=32, Hkv=8, D=128, fp16, L=64K: 64 splits of 1024 positions, 512
programs), for random masks of 0 (every position excluded), 1, 10, 25 and 50% visible, it times
``masked_decode`` (default launch) as CUDA-graph replays exactly like ``run.py`` (median, L2 flushed by a read
before each replay), and reads the split and merge kernels' own durations from the CUDA profiler (eager
calls, L2 flushed the same way, the merge launched without programmatic dependent launch so that its
duration is its own work).
Two calibration graphs give the measurement's own floor: one and two tiny kernels. The fixed cost of a launch
is the time with no visible row; the slope of time against visible bytes is the effective bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_masked_decode import DEFAULT_FLUSH, Case, flush_l2, make_mask, run_header, time_us

from triton_masked_decode import masked_decode, masked_decode_ref

md = sys.modules["triton_masked_decode.masked_decode"]

HQ, HKV, D, L = 32, 8, 128, 65536
FRACTIONS = (0.0, 0.01, 0.1, 0.25, 0.5)


def kernel_times(fn, n_iter: int = 20) -> dict[str, float]:
    """Mean device time per call of each Triton kernel of ``fn`` (eager, L2 flushed between calls by
    :func:`bench_masked_decode.flush_l2`), µs."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n_iter):
            flush_l2(DEFAULT_FLUSH)
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        if "split_kernel" in evt.key or "merge" in evt.key:
            out[evt.key] = evt.device_time_total / max(evt.count, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, HQ, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(1, HKV, L, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn_like(k)

    tiny = torch.zeros(1, device="cuda")
    calib = {
        "one_tiny_kernel_us": time_us(lambda: tiny.add_(1.0))[0],
        "two_tiny_kernels_us": time_us(lambda: (tiny.add_(1.0), tiny.mul_(1.0)))[0],
    }
    print(f"{torch.cuda.get_device_name()}; calibration {calib}", flush=True)
    rows = []
    for frac in FRACTIONS:
        mask = make_mask(
            Case("overhead", 1, [L], L, frac, "random"), torch.Generator(device="cuda").manual_seed(1)
        )
        assert mask is not None
        visible = int((~mask).sum())
        ref = masked_decode_ref(q, k, v, mask)[0].float()

        def fn(mask=mask):
            return masked_decode(q, k, v, mask, check_values=False)

        err = float((fn()[0].float() - ref).abs().max())
        if not err < 1e-2:
            raise SystemExit(f"visible {frac}: max error {err} against the reference")
        graph_us = time_us(fn)[0]
        md._TUNE_OVERRIDE.update({"pdl": 0, "block_n": 32, "num_warps": 4, "num_stages": 3})
        try:
            kern = kernel_times(fn)
        finally:
            md._TUNE_OVERRIDE.clear()
        row = {
            "visible_fraction": frac,
            "visible_rows": visible,
            "visible_kv_bytes": 2 * visible * D * 2,
            "graph_us": graph_us,
            "kernels_us_no_pdl": kern,
            "max_abs_err": err,
        }
        rows.append(row)
        kstr = ", ".join(f"{n[:24]} {t:.1f}" for n, t in kern.items())
        print(
            f"visible {frac:5.2f} ({visible:7d} rows): graph {graph_us:6.1f} us; kernels: {kstr}", flush=True
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    **run_header(
                        "batch-1 launch cost against the visible fraction; see the module docstring"
                    ),
                    "shape": {"B": 1, "Hq": HQ, "Hkv": HKV, "D": D, "L": L, "dtype": "float16"},
                    "flush": DEFAULT_FLUSH,
                    "calibration": calib,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
