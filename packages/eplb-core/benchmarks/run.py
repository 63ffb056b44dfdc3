"""eplb-core benchmark: ``python packages/eplb-core/benchmarks/run.py --out-dir docs/benchmarks [--quick]``.

Writes ``eplb-core.json`` (raw numbers, CPU model, thread count, date, git commit, exact command) and
``eplb-core.md`` (the tables) into ``--out-dir`` and prints the tables.

Loads: ``eplb_core.synthetic_loads`` (58 layers x 256 experts, 8 groups; log-normal spread, 2-6 hot
experts per layer at 5-13x the mean, per-group drift; see its docstring), two successive windows: the
plan is made on the last window, the migration starts from a plan made on the one before. One CPU
thread (``torch.set_num_threads(1)``); times are medians of repeated calls, the greedy DeepSeek-style
baseline (``eplb_core._greedy``, batched NumPy) is timed in the same run.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# One Numba cache for the run, empty at the start: the first-call stage compiles into it (timed), and
# this process then loads the kernels it compiled instead of compiling them a second time.
NUMBA_CACHE = tempfile.mkdtemp(prefix="eplb-bench-numba-")
os.environ["NUMBA_CACHE_DIR"] = NUMBA_CACHE
atexit.register(shutil.rmtree, NUMBA_CACHE, ignore_errors=True)

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_rebalance as B  # noqa: E402

import eplb_core as E  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    # A copied tree's .git can lag its files (the device machine's does): EPLB_COMMIT names the commit sent.
    if os.environ.get("EPLB_COMMIT"):
        return os.environ["EPLB_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


_FIRST_CALL = """
import time, torch
torch.set_num_threads(1)
t0 = time.perf_counter()
import eplb_core as E
w = E.synthetic_loads(58, 256, seed=0)
t1 = time.perf_counter()
E.rebalance_experts(w, 288, 8, 4, 32)  # LPT, replica split, exchange refinement
E.rebalance_experts(w, 320, 8, 8, 64)  # re-split refinement
print(t1 - t0, time.perf_counter() - t1)
"""


def first_call_seconds() -> dict[str, float]:
    """Seconds of the first two calls in a fresh process (every compiled kernel used once), with an
    empty Numba cache (compilation) and again with the cache it left (loading), plus the import."""

    out: dict[str, float] = {}
    cache = NUMBA_CACHE if not any(Path(NUMBA_CACHE).iterdir()) else tempfile.mkdtemp(prefix="eplb-cold-")
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
    for key in ("cold", "cached"):
        run = subprocess.run(
            [sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True, check=True
        )
        imp, first = (float(x) for x in run.stdout.split())
        out[f"{key}_first_calls_s"] = first
        out[f"{key}_import_s"] = imp
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# eplb-core benchmark",
        "",
        f"CPU: {res['cpu']} ({res['cpu_count']} cores, {res['torch_threads']} torch thread, one planner "
        f"thread; load average at start {[round(x, 2) for x in res['load_average']]}); GPU: {res['device']}; "
        f"Python {res.get('python', '?')}, torch {res['torch']}, NumPy {res['numpy']}, Numba {res['numba']}; "
        f"{res['date']}, commit `{res['commit'][:12]}`.",
        f"Command: `{res['command']}`. Loads: {res['loads']}.",
        "",
        "## Strict / global mode (58 layers x 256 experts, 8 groups)",
        "",
        f"Timing: {res['timing_method']}.",
        "",
        "| (replicas, nodes, GPUs) | mode | balancedness | worst layer | greedy | layers below greedy "
        "| strict cap | of cap | gap to bound | ms / call (median) | CPU ms | ms at start | `plan()` ms "
        "| greedy ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["configs"]:
        cap = f"{r['strict_cap_balancedness']:.4f}" if "strict_cap_balancedness" in r else "-"
        of_cap = f"{100 * r['fraction_of_cap']:.2f}%" if "fraction_of_cap" in r else "-"
        lines.append(
            f"| {r['config']} | {r['mode']} | {r['balancedness']:.4f} | {r['min_layer_balancedness']:.4f} "
            f"| {r['greedy_balancedness']:.4f} | {r['layers_below_greedy']} | {cap} | {of_cap} "
            f"| {100 * r['mean_gap_to_bound']:.2f}% | {r['ms_per_call_median']:.1f} "
            f"| {r['cpu_ms_per_call_median']:.1f} | {r['ms_per_call_median_at_start']:.1f} "
            f"| {r['plan_ms_median']:.1f} | {r['greedy_ms_median']:.1f} |"
        )
    if all("deepseek" in r for r in res["configs"]):
        lines += [
            "",
            f"DeepSeek's public reference (`{res['deepseek_ref']}`, `rebalance_experts`, imported by path, "
            "same loads, same run, one thread):",
            "",
            "| (replicas, nodes, GPUs) | DeepSeek balancedness | ours | layers where ours is lower "
            "| DeepSeek ms | ours ms | speed-up |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in res["configs"]:
            d = r["deepseek"]
            lines.append(
                f"| {r['config']} | {d['balancedness']:.4f} | {r['balancedness']:.4f} "
                f"| {d['layers_below_deepseek']} | {d['ms_median']:.1f} | {r['ms_per_call_median']:.1f} "
                f"| {d['speedup']:.0f}x |"
            )
    if all("cuda_input" in r for r in res["configs"]):
        lines += [
            "",
            f"CUDA input ({res['device']}): `rebalance_experts` on a float32 CUDA `weight`, until the three "
            "tensors are on the GPU (`torch.cuda.synchronize()`); the plan is made on the host (copies "
            "included), same run:",
            "",
            "| (replicas, nodes, GPUs) | CUDA input ms | host input ms | copies alone ms | same plan |",
            "|---|---|---|---|---|",
        ]
        for r in res["configs"]:
            c = r["cuda_input"]
            lines.append(
                f"| {r['config']} | {c['ms_median']:.2f} | {c['host_input_ms_median']:.2f} "
                f"| {c['copies_ms_median']:.3f} | {'yes' if c['same_plan_as_host_input'] else 'NO'} |"
            )
    fc = res["first_call"]
    lines += [
        "",
        "First calls in a fresh process ((288, 4, 32) then (320, 8, 64), every compiled kernel once): "
        f"{fc['cold_first_calls_s']:.1f} s with an empty Numba cache (compilation), "
        f"{fc['cached_first_calls_s']:.2f} s once the cache exists (import {fc['cached_import_s']:.1f} s).",
    ]
    lines += [
        "",
        "## Migration-aware mode (plan in service made on the previous window; cap 25% of slots per layer)",
        "",
        "| (replicas, nodes, GPUs) | migrated | greedy re-plan | stale plan | slots changed | "
        "re-plan changes (ours) | re-plan changes (greedy) | ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["configs"]:
        m = r["migration"]
        lines.append(
            f"| {r['config']} | {m['balancedness']:.4f} | {r['greedy_balancedness']:.4f} "
            f"| {m['stale_plan_balancedness']:.4f} | {100 * m['changed_fraction']:.1f}% "
            f"| {100 * m['replan_changed_fraction_ours']:.1f}% | {100 * m['replan_changed_fraction_greedy']:.1f}% "
            f"| {m['ms_median']:.1f} |"
        )
    lines += [
        "",
        "## Soft locality on (288, 4, 32)",
        "",
        "| penalty W | balancedness | cross-node token share | ms |",
        "|---|---|---|---|",
    ]
    for s in res["soft_locality"]:
        lines.append(
            f"| {s['penalty']:g} | {s['balancedness']:.4f} | {100 * s['cross_node_share']:.1f}% "
            f"| {s['ms_median']:.1f} |"
        )
    hg = res["hard_group_loads"]
    lines += [
        "",
        f"Harder loads, `{hg['loads']}` (strict cap {hg['strict_cap_balancedness']:.4f}, "
        f"strict plan {hg['strict_balancedness']:.4f}):",
        "",
        "| penalty W | balancedness | cross-node token share | ms |",
        "|---|---|---|---|",
    ]
    for s in hg["soft_locality"]:
        lines.append(
            f"| {s['penalty']:g} | {s['balancedness']:.4f} | {100 * s['cross_node_share']:.1f}% "
            f"| {s['ms_median']:.1f} |"
        )
    start = {(s["layers"], s["experts"], s["config"]): s["ms"] for s in res["timing_at_start"]["scaling"]}
    lines += [
        "",
        "## Time per call as the problem grows (one CPU thread)",
        "",
        "Loads `eplb_core.synthetic_loads(layers, experts, seed=7)`; measured in turns with the four "
        "configurations above (same stage, same warm-up and number of samples).",
        "",
        "| layers | experts | config | ms (median) | CPU ms | ms at the start of the run |",
        "|---|---|---|---|---|---|",
    ]
    for s in res["scaling"]:
        at_start = start.get((s["layers"], s["experts"], s["config"]))
        lines.append(
            f"| {s['layers']} | {s['experts']} | {s['config']} | {s['ms']:.1f} | {s['cpu_ms_median']:.1f} "
            f"| {'-' if at_start is None else f'{at_start:.1f}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default="docs/benchmarks")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller scaling sweep")
    parser.add_argument(
        "--deepseek-ref",
        metavar="PATH",
        help="eplb.py of DeepSeek's public EPLB repository (git clone https://github.com/deepseek-ai/EPLB), "
        "imported by path to time its rebalance_experts on the same loads",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    repeat = 5 if args.quick else 21
    hist = E.synthetic_loads(B.NUM_LAYERS, B.NUM_EXPERTS, num_groups=B.NUM_GROUPS, num_windows=2, seed=0)
    weight, earlier = hist[-1], hist[0]
    res: dict[str, Any] = {
        "package": "eplb-core",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "numba": numba.__version__,
        "planner": "NumPy + Numba on the host, one thread (CUDA input is copied to the host and back)",
        "python": platform.python_version(),
        "host": platform.node(),
        "loads": "eplb_core.synthetic_loads(58, 256, num_groups=8, num_windows=2, seed=0)",
        "deepseek_ref": args.deepseek_ref,
        "seed_program": "not timed: 17-200 s per call on these shapes (see the docs)",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu only",
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
    }
    res["first_call"] = first_call_seconds()
    shapes = (
        [(58, 256), (128, 256), (128, 512)]
        if args.quick
        else [(58, 256), (128, 256), (128, 512), (128, 1024)]
    )
    # the 58 x 256 rows at the start of the run as well (before DeepSeek's reference and the other
    # modes run): a drift of the machine between the two stages shows in the JSON
    res["timing_at_start"] = B.bench_timing(weight, shapes[:1], repeat=repeat)
    deepseek = B.load_deepseek(args.deepseek_ref) if args.deepseek_ref else None
    res["configs"] = [
        B.bench_config(weight, earlier, *cfg, repeat=repeat, deepseek=deepseek) for cfg in B.CONFIGS
    ]
    res["soft_locality"] = B.bench_soft(weight, [0.0, 0.05, 0.2])
    # harder loads: groups differ more (group_sigma 0.6), strict cap near 0.85 as on recorded DeepSeek-V3 loads
    hard = E.synthetic_loads(B.NUM_LAYERS, B.NUM_EXPERTS, num_groups=B.NUM_GROUPS, group_sigma=0.6, seed=0)
    strict_hard = E.plan(hard, num_replicas=288, num_groups=8, num_nodes=4, num_gpus=32)
    res["hard_group_loads"] = {
        "loads": "eplb_core.synthetic_loads(58, 256, num_groups=8, group_sigma=0.6, seed=0)",
        "strict_cap_balancedness": float(B.strict_cap(hard, 4, 32).mean()),
        "strict_balancedness": float(strict_hard.balancedness.mean()),
        "soft_locality": B.bench_soft(hard, [0.0, 0.05, 0.2]),
    }
    # every configuration and growth row in one interleaved stage (same warm-up and samples for all)
    timing = B.bench_timing(weight, shapes, repeat=repeat)
    for row in res["configs"]:
        t = timing["configs"][row["config"]]
        row["ms_per_call_median"] = t["ms_median"]
        row["cpu_ms_per_call_median"] = t["cpu_ms_median"]
        row["minor_faults_per_call_median"] = t["minor_faults_median"]
        row["ms_samples"] = t["ms_samples"]
        row["ms_per_call_median_at_start"] = res["timing_at_start"]["configs"][row["config"]]["ms_median"]
        if "deepseek" in row:
            row["deepseek"]["speedup"] = row["deepseek"]["ms_median"] / t["ms_median"]
    res["scaling"] = timing["scaling"]
    res["timing_method"] = (
        f"rebalance_experts on the host, one thread: all four configurations and all growth rows in one "
        f"stage at the end of the run, called in turns ({B.WARMUP} warm-up turns, then {repeat} timed "
        f"turns; medians); the configurations and the 58 x 256 growth rows also in a stage at the start"
    )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eplb-core.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "eplb-core.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
