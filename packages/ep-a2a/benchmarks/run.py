"""ep-a2a benchmarks (``nox -s bench``): launches torchrun on every visible GPU, writes the results.

    python packages/ep-a2a/benchmarks/run.py --out-dir docs/benchmarks [--quick] [--only torch|triton]

Runs ``bench_torch_backend.py`` (torch backend, NCCL pipelines, copy-engine ceiling) and, when the file
exists, ``bench_triton.py`` (the Triton backend), each under
``python -m torch.distributed.run --standalone --nproc-per-node=<GPUs>``. Each writes its raw JSON to
``<out-dir>/ep-a2a-<bench>.json``; this script then writes ``<out-dir>/ep-a2a.json`` (every bench's raw
results, including ones from an earlier run of a bench not selected with ``--only``, each with its own
date, commit and command) and ``<out-dir>/ep-a2a.md`` (the tables) and ``<out-dir>/ep-a2a.png`` (the Triton bench's 4096-token cases as
% of the copy engine), and prints the tables.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = {"torch": HERE / "bench_torch_backend.py", "triton": HERE / "bench_triton.py"}
# where each bench's raw output goes (first name), and what else may hold its results (a curated file
# gathering several runs, kept as is and used when no fresh raw output exists)
RAW_NAMES = {"torch": ["ep-a2a-torch.json"], "triton": ["ep-a2a-triton-bench.json", "ep-a2a-triton.json"]}
# NVLink SHARP/multicast stays off on the project's machines (see the docs)
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_bench(name: str, path: Path, out: Path, ngpu: int, quick: bool) -> bool:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ngpu}",
        str(path),
        "--json",
        str(out),
    ]
    if quick:
        cmd.append("--quick")
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in ENV.items()}}
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    print(f"=== {name}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        print(f"!!! {name} failed with exit code {proc.returncode}", flush=True)
        return False
    return True


def gbps(nbytes: int, ms: float | None) -> str:
    return f"{nbytes / (ms * 1e-3) / 1e9:.0f}" if ms else "-"


def table(raw: dict) -> list[str]:
    lines = []
    for case in raw.get("cases", []):
        res = case["results"]
        nbytes = case["nvlink_bytes"]
        ceiling = res.get("ce", {}).get("copy_ms")
        head = (
            f"**{case['shape']}**, {case['routing']} routing, {case['tokens']} tokens/rank "
            f"(hidden {case['hidden']}, top-{case['topk']} of {case['experts']})"
        )
        if "heap" in case:
            head += f", heap {case['heap']}"
        if case.get("nvlink_bytes_rule"):
            head += (
                f": {nbytes / 1e6:.1f} MB cross NVLink at the busiest rank (the larger of sent and received)"
            )
        else:
            head += f": {nbytes / 1e6:.1f} MB cross NVLink per direction per rank"
        lines += [
            "",
            head,
            "",
            "| method | dispatch ms | GB/s | % CE | combine ms | GB/s | % CE | round trip ms | host ms (d / c) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        row = functools.partial(_row, nbytes, ceiling)
        for name, r in res.items():
            if "write_ms" in r:
                ms, wb = r["write_ms"], r["bytes"]
                lines.append(
                    f"| {name} (the busiest rank's {r['rows']} expert rows, {wb / 1e6:.0f} MB, written once) "
                    f"| {ms:.3f} | {wb / (ms * 1e-3) / 1e9:.0f} (written) | | | | | | |"
                )
                continue
            if "copy_ms" in r:
                ms = r["copy_ms"]
                pct = f"{100 * ceiling / ms:.0f}" if ceiling else "-"
                lines.append(f"| {name} (bytes only) | {ms:.3f} | {gbps(nbytes, ms)} | {pct} | | | | | |")
                continue
            hd, hc = r.get("dispatch_host_ms"), r.get("combine_host_ms")
            host = f"{hd:.3f} / {hc:.3f}" if hd is not None and hc is not None else "-"
            lines.append(row(name, r.get("dispatch_ms"), r.get("combine_ms"), r.get("round_trip_ms"), host))
            # the same calls timed the other way around the device-side lead (graph vs eager)
            for suffix, label in (("_lead", "after the lead"), ("_no_lead", "without the lead")):
                if f"dispatch_ms{suffix}" in r:
                    d, c = r[f"dispatch_ms{suffix}"], r.get(f"combine_ms{suffix}")
                    lines.append(row(f"{name} ({label})", d, c, None, "-"))
        if "varying" in case:
            lines += ["", _varying_line(case["varying"])]
    return lines


def _varying_line(v: dict) -> str:
    """The varying-batch case (``bench_triton.varying_case``) as one sentence."""
    parts = []
    for key, label in (("speculative", "with speculative rows"), ("no_speculation", "without")):
        r = v.get(key)
        if r:
            over = (
                f", {r['overflows']} of {r['speculative_calls']} calls outgrew their outputs"
                if r.get("speculative_calls")
                else ""
            )
            parts.append(
                f"{label} {r['dispatch_ms']:.3f} ms ({r['dispatch_ms_lead']:.3f} after the lead{over})"
            )
    return (
        f"Exact-shape dispatch over batch sizes that change every call ({v['low']} to {v['high']} "
        f"tokens per rank, drawn per rank, median per call): " + "; ".join(parts) + "."
    )


def _row(nbytes: int, ceiling: float | None, name: str, d: float, c: float | None, rt: float | None,
         host: str) -> str:  # fmt: skip
    """One table row: times, GB/s and % of the copy engine for dispatch and combine."""
    pd = f"{100 * ceiling / d:.0f}" if ceiling and d else "-"
    pc = f"{100 * ceiling / c:.0f}" if ceiling and c else "-"
    comb = f"{c:.3f} | {gbps(nbytes, c)} | {pc}" if c else "- | - | -"
    return (
        f"| {name} | {d:.3f} | {gbps(nbytes, d)} | {pd} | {comb} | "
        + (f"{rt:.3f} |" if rt else "- |")
        + f" {host} |"
    )


def render(merged: dict, out_dir: Path = Path("docs/benchmarks")) -> str:
    lines = ["# ep-a2a benchmark results", ""]
    if merged.get("command"):
        lines += [f"Reproduce (repository root): `{merged['command']}`", ""]
    lines.append(
        "Times are medians of CUDA-event timings, slowest rank; GB/s counts only token rows crossing NVLink "
        "(one per token and destination rank), for the busiest rank where the run records it (the larger of "
        "what a rank sends and receives, maximum over ranks; on 2 GPUs both are equal); % CE is relative to "
        "the copy-engine copy of the same bytes measured in the same run; host ms is the wall time the "
        "calling thread spends inside the call."
    )
    for name, raw in merged["benches"].items():
        lines += ["", f"## {name}", ""]
        if raw.get("file"):
            lines += [f"Raw numbers: `{out_dir.as_posix()}/{raw['file']}`.", ""]
        if raw.get("what"):
            lines += [str(raw["what"]), ""]
        runs = raw["runs"] if isinstance(raw.get("runs"), dict) else {"": raw}
        for run_name, run in runs.items():
            if run_name:
                lines += ["", f"### {run_name}", ""]
            world = run.get("world_size", raw.get("world_size"))
            lines += [
                f"{raw.get('device', run.get('device'))}{f' x{world}' if world else ''}, "
                f"torch {raw.get('torch', run.get('torch'))}, {run.get('date')}, commit `{run.get('commit')}`",
                "",
                f"Command: `{run.get('command')}` (env {raw.get('env', run.get('env'))})",
            ]
            lines += (
                table(run) if run.get("cases") else ["", "(no per-case table in this run: see the raw file)"]
            )
            if "first_call" in run:
                lines += ["", f"First call: {run['first_call']}"]
    return "\n".join(lines) + "\n"


# bars of the plot: (result key, label); the graph rows at both SM counts and the eager calls
PLOT_METHODS = [
    ("ours-sm132", "eager exact, 132 SMs"),
    ("ours-static-eager-sm132", "eager static, 132 SMs"),
    ("ours-graph-sm132", "CUDA graph, 132 SMs"),
    ("ours-graph-sm32", "CUDA graph, 32 SMs"),
    ("nccl-dest", "NCCL per-destination"),
]


def plot(raw: dict, path: Path) -> bool:
    """Bar chart of the Triton bench's 4096-token cases: % of the copy engine, dispatch and combine."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = [c for c in raw.get("cases", []) if c["tokens"] >= 1024 and c.get("heap", "torch") == "torch"]
    if not cases:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    width = 0.8 / len(PLOT_METHODS)
    for ax, op in zip(axes, ("dispatch", "combine"), strict=True):
        for i, (key, label) in enumerate(PLOT_METHODS):
            vals = []
            for c in cases:
                ce, r = c["results"].get("ce", {}).get("copy_ms"), c["results"].get(key, {})
                ms = r.get(f"{op}_ms")
                vals.append(100 * ce / ms if ce and ms else 0.0)
            ax.bar([j + (i - len(PLOT_METHODS) / 2 + 0.5) * width for j in range(len(cases))], vals, width,
                   label=label)  # fmt: skip
        ax.axhline(75, color="k", ls="--", lw=1)
        ax.axhline(65, color="k", ls=":", lw=1)
        ax.set_xticks(range(len(cases)), [f"{c['shape']}\n{c['routing']}" for c in cases], fontsize=8)
        ax.set(title=f"{op}, 4096 tokens/rank", ylabel="% of the copy engine (same bytes, same run)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, title="goals: 75 % (--), 65 % at 32 SMs (..)", title_fontsize=7)
    fig.suptitle(
        f"ep-a2a on {raw.get('device')} x{raw.get('world_size')}, commit {str(raw.get('commit'))[:7]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description="ep-a2a benchmarks")
    p.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=sorted(BENCHES), nargs="+", default=None)
    p.add_argument(
        "--render-only", action="store_true", help="run nothing: merge and render the raw files present"
    )
    args = p.parse_args()
    ngpu = 0 if args.render_only else gpu_count()
    if not args.render_only and ngpu < 2:
        print(f"ep-a2a benchmarks need at least 2 CUDA GPUs; this machine has {ngpu}.", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ok = True
    for name in [] if args.render_only else args.only or list(BENCHES):
        path = BENCHES[name]
        if not path.exists():
            print(f"=== {name}: {path.name} not present, skipped")
            continue
        ok &= run_bench(name, path, args.out_dir / RAW_NAMES[name][0], ngpu, args.quick)
    merged: dict = {
        "package": "ep-a2a",
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "benches": {},
    }
    if not args.render_only:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
        if topo.returncode == 0:
            merged["topology"] = topo.stdout
    elif (args.out_dir / "ep-a2a.json").exists():
        # re-rendering: keep the measuring run's command, time and topology
        prev = json.loads((args.out_dir / "ep-a2a.json").read_text())
        for key in ("command", "written", "topology"):
            if key in prev:
                merged[key] = prev[key]
    for name in BENCHES:
        for raw_name in RAW_NAMES[name]:
            raw_path = args.out_dir / raw_name
            if raw_path.exists():
                merged["benches"][name] = {"file": raw_name, **json.loads(raw_path.read_text())}
                break
    (args.out_dir / "ep-a2a.json").write_text(json.dumps(merged, indent=1) + "\n")
    if "triton" in merged["benches"]:
        plot(merged["benches"]["triton"], args.out_dir / "ep-a2a.png")
    md = render(merged, args.out_dir)
    (args.out_dir / "ep-a2a.md").write_text(md)
    print(md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
