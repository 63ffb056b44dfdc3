"""eplb-core benchmark: quality and host time of one rebalance against the greedy reference.

    PYTHONPATH=packages/eplb-core/src python packages/eplb-core/benchmarks/run.py [--quick]

Writes ``docs/benchmarks/eplb-core/<gpu_kind>.json`` (raw numbers, device, date, commit, exact command)
and ``<gpu_kind>.png`` (the figure of the benchmarks page). The planner runs on the host CPU (one
thread); ``gpu_kind`` names the machine it ran on (``h200`` on an H200 machine, ``cpu`` without a GPU)
and the CUDA-input rows are measured when a GPU is present. ``--replot FILE`` redraws the figure of an
existing results file.
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

# One Numba cache for the run, empty at the start: the first-call rows compile into it (timed), and
# this process then loads the kernels instead of compiling them a second time.
NUMBA_CACHE = tempfile.mkdtemp(prefix="eplb-bench-numba-")
os.environ["NUMBA_CACHE_DIR"] = NUMBA_CACHE
atexit.register(shutil.rmtree, NUMBA_CACHE, ignore_errors=True)

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_rebalance as B  # noqa: E402

import eplb_core as E  # noqa: E402
from eplb_core import warmup  # noqa: E402
from eplb_core._numba import runner  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
OUT_DIR = ROOT / "docs" / "benchmarks" / "eplb-core"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_kind() -> str:
    """``h200`` / ``h100`` / ... from the GPU's name, ``cpu`` without one."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for kind in ("h200", "h100", "b200", "a100"):
        if kind in name:
            return kind
    return name.split()[-1]


def triton_version() -> str | None:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return None


def plot(res: dict[str, Any], path: Path) -> None:
    """Two panels per configuration: mean balancedness (greedy reference, eplb-core, strict cap) and
    host milliseconds per call (eplb-core's rebalance, the greedy reference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["results"] if r["kind"] == "rebalance"]
    labels = [r["config"] for r in rows]
    x = np.arange(len(rows))
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_b.bar(x - 0.2, [r["greedy_balancedness"] for r in rows], 0.4, label="greedy reference")
    ax_b.bar(x + 0.2, [r["balancedness"] for r in rows], 0.4, label="eplb-core")
    caps = [(i, r["strict_cap_balancedness"]) for i, r in enumerate(rows) if "strict_cap_balancedness" in r]
    if caps:
        ax_b.scatter(
            [i + 0.2 for i, _ in caps], [c for _, c in caps], marker="_", s=400, c="k", label="strict cap"
        )
    ax_b.set_ylim(0.5, 1.02)
    ax_b.set_ylabel("mean balancedness (mean / max GPU load)")
    ax_t.bar(x - 0.2, [r["greedy_ms_median"] for r in rows], 0.4, label="greedy reference")
    ax_t.bar(x + 0.2, [r["ms_median"] for r in rows], 0.4, label="eplb-core")
    ax_t.set_ylabel("ms per call (host, one thread)")
    for ax in (ax_b, ax_t):
        ax.set_xticks(x, labels)
        ax.set_xlabel("(replicas, nodes, GPUs)")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        f"eplb-core: 58 layers x 256 experts, host CPU of the {res['gpu_kind']} machine", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def page_table(res: dict[str, Any]) -> str:
    """The table of the benchmarks page (``docs/eplb-core/benchmarks.md``) from a results file."""
    cold = {r["config"]: r for r in res["results"] if r["kind"] == "first_call" and r.get("cache") == "empty"}
    lines = [
        "| (replicas, nodes, GPUs) | mode | balancedness, eplb-core | greedy reference | strict cap "
        "| ms per call, eplb-core (warm) | greedy reference ms | first call, empty cache: "
        "`rebalance_experts` / `plan` s | migration, 25% cap: balancedness / slots changed / ms "
        "| CUDA `weight`, end to end ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in res["results"] if r["kind"] == "rebalance"):
        m, c = r["migration"], cold.get(r["config"])
        cap = f"{r['strict_cap_balancedness']:.4f}" if "strict_cap_balancedness" in r else "-"
        first = f"{c['first_rebalance_s']:.2f} / {c['first_plan_s']:.2f}" if c else "-"
        cuda = f"{r['cuda_input']['ms_median']:.1f}" if "cuda_input" in r else "-"
        lines.append(
            f"| {r['config']} | {r['mode']} | {r['balancedness']:.4f} | {r['greedy_balancedness']:.4f} | {cap} "
            f"| {r['ms_median']:.1f} | {r['greedy_ms_median']:.1f} | {first} "
            f"| {m['balancedness']:.4f} / {100 * m['changed_fraction']:.1f}% / {m['ms_median']:.1f} | {cuda} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller growth sweep")
    parser.add_argument(
        "--deepseek-ref",
        metavar="PATH",
        help="eplb.py of DeepSeek's public EPLB repository, imported by path to time its "
        "rebalance_experts on the same loads (not part of this repository)",
    )
    parser.add_argument("--replot", type=Path, metavar="FILE", help="only redraw the figure of FILE")
    args = parser.parse_args()
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    torch.set_num_threads(1)
    repeat = 5 if args.quick else 21
    hist = E.synthetic_loads(B.NUM_LAYERS, B.NUM_EXPERTS, num_groups=B.NUM_GROUPS, num_windows=2, seed=0)
    weight, earlier = hist[-1], hist[0]
    kind = gpu_kind()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    res: dict[str, Any] = {
        "package": "eplb-core",
        "device": f"host CPU {cpu_model()} ({os.cpu_count()} cores, one planner thread) of a machine with {gpu}",
        "gpu_kind": kind,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "torch": torch.__version__,
        "triton": triton_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "python": platform.python_version(),
        "loads": "synthetic_loads(58, 256, num_groups=8, num_windows=2, seed=0)",
        "results": [],
    }
    results: list[dict[str, Any]] = res["results"]
    # first calls of fresh processes: one per configuration with an empty compile cache (interpreted
    # while compiling in the background), then this process compiles every mode into the run's cache
    # (untimed) and one more process per configuration finds it filled
    for cfg in B.CONFIGS:
        with tempfile.TemporaryDirectory(prefix="eplb-bench-cold-") as cold:
            results.append(
                {
                    "kind": "first_call",
                    "cache": "empty",
                    "config": f"{cfg}",
                    **B.first_call_seconds(cfg, cold),
                }
            )
    # every timed call below runs the compiled planner
    with runner.forced("compiled"):
        warmup.main()
        for cfg in B.CONFIGS:
            results.append(
                {
                    "kind": "first_call",
                    "cache": "filled",
                    "config": f"{cfg}",
                    **B.first_call_seconds(cfg, NUMBA_CACHE),
                }
            )
        deepseek = B.load_deepseek(args.deepseek_ref) if args.deepseek_ref else None
        rows = [B.bench_config(weight, earlier, *cfg, repeat=repeat, deepseek=deepseek) for cfg in B.CONFIGS]
        shapes = [(58, 256), (128, 256), (128, 512)] + ([] if args.quick else [(128, 1024)])
        # every configuration and growth row in one stage, in turns: a drift of the machine hits all alike
        timing = B.bench_timing(weight, shapes, repeat=repeat)
        for row in rows:
            row.update(timing["configs"][row["config"]])
        results += rows
        results += [{"kind": "scaling", **s} for s in timing["scaling"]]
        results += [
            {"kind": "soft_locality", "loads": "default", **s} for s in B.bench_soft(weight, [0.0, 0.05, 0.2])
        ]
        # harder loads: groups differ more (group_sigma 0.6), strict cap near 0.85
        hard = E.synthetic_loads(
            B.NUM_LAYERS, B.NUM_EXPERTS, num_groups=B.NUM_GROUPS, group_sigma=0.6, seed=0
        )
        results += [
            {"kind": "soft_locality", "loads": "group_sigma=0.6", **s}
            for s in B.bench_soft(hard, [0.0, 0.05, 0.2])
        ]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{kind}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    try:
        plot(res, path.with_suffix(".png"))
    except ImportError:
        print(f"no matplotlib here: draw the figure elsewhere with `run.py --replot {path}`")
    cold = {r["config"]: r for r in results if r["kind"] == "first_call" and r.get("cache") == "empty"}
    for row in rows:
        c = cold[row["config"]]
        print(
            f"{row['config']:>14s} {row['mode']:6s} balancedness {row['balancedness']:.4f} "
            f"(greedy {row['greedy_balancedness']:.4f}) {row['ms_median']:.2f} ms/call warm; "
            f"empty cache: first rebalance {c['first_rebalance_s']:.2f} s, first plan {c['first_plan_s']:.2f} s"
        )
    print(f"wrote {path} and {path.with_suffix('.png')}; the table of the benchmarks page:\n")
    print(page_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
