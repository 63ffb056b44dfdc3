"""Scaling summary of the Triton backend over the number of GPUs of one host (no GPU needed).

    python packages/ep-a2a/benchmarks/scaling.py [--dir docs/benchmarks/ep-a2a-scaling]

Reads ``<dir>/x<N>/ep-a2a-triton-bench.json``, one raw output of ``bench_triton.py`` per GPU count
(each written by ``run.py --out-dir <dir>/x<N> --only triton`` on N GPUs of the same host), and writes
``<dir>.json`` (the summary rows, each with its source file, date and commit), ``<dir>.md`` (the
tables) and ``<dir>.png`` (GB/s and 128-token latency against the number of GPUs).

Per-rank GB/s count only token rows that cross NVLink (one per token and destination rank), at the
busiest rank, taking the larger of what it sends and what it receives; % CE is against the copy engine
copying that many bytes to one peer in the same run, all ranks at once.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROWS = {  # summary column -> result row in bench_triton.py's output
    "eager": "ours-sm132",
    "graph": "ours-graph-sm132",
    "sm32": "ours-sm32",
    "nccl-dest": "nccl-dest",
    "nccl-expert": "nccl-expert",
}


def load(dir_: Path) -> dict[int, dict]:
    runs = {}
    for path in sorted(dir_.glob("x*/ep-a2a-triton-bench.json")):
        m = re.fullmatch(r"x(\d+)", path.parent.name)
        if m:
            runs[int(m.group(1))] = {"file": str(path), **json.loads(path.read_text())}
    return runs


def summarize(runs: dict[int, dict]) -> list[dict]:
    rows = []
    for world, run in sorted(runs.items()):
        for case in run["cases"]:
            if case.get("heap", "torch") != "torch":
                continue
            res, nbytes = case["results"], case["nvlink_bytes"]
            ce = res.get("ce", {}).get("copy_ms")
            row = {
                "gpus": world,
                "shape": case["shape"],
                "routing": case["routing"],
                "tokens": case["tokens"],
                "nvlink_mb_per_rank": nbytes / 1e6,
                "ce_ms": ce,
                "ce_gbps": nbytes / (ce * 1e-3) / 1e9 if ce else None,
                "source": run["file"],
                "date": run.get("date"),
                "commit": run.get("commit"),
            }
            for col, key in ROWS.items():
                r = res.get(key)
                if not r:
                    continue
                for op in ("dispatch", "combine"):
                    ms = r.get(f"{op}_ms")
                    row[f"{col}_{op}_ms"] = ms
                    row[f"{col}_{op}_gbps"] = nbytes / (ms * 1e-3) / 1e9 if ms else None
            rows.append(row)
    return rows


def _fmt(row: dict, col: str, op: str, ce: float | None) -> str:
    ms = row.get(f"{col}_{op}_ms")
    if ms is None:
        return "-"
    pct = f" ({100 * ce / ms:.0f}%)" if ce else ""
    return f"{ms * 1e3:.0f} us / {row[f'{col}_{op}_gbps']:.0f}{pct}"


def render(rows: list[dict]) -> str:
    lines = [
        "# ep-a2a scaling over GPUs of one host",
        "",
        "Each cell: time per call / GB/s at the busiest rank (the larger of its sent and received crossing "
        "bytes) / (% of the copy engine moving those bytes in the same run). "
        "`eager` and `graph`: the Triton backend with 132 SMs, exact-shape mode (one device-to-host copy) and "
        "CUDA-graph replay (static shapes); `sm32`: eager with `num_sm=32`.",
    ]
    keys = sorted({(r["shape"], r["routing"], r["tokens"]) for r in rows}, key=lambda k: (-k[2], k[0], k[1]))
    for shape, routing, tokens in keys:
        sel = [r for r in rows if (r["shape"], r["routing"], r["tokens"]) == (shape, routing, tokens)]
        lines += [
            "",
            f"## {shape}, {routing} routing, {tokens} tokens per rank",
            "",
            "| GPUs | MB/rank | copy engine | op | eager | graph | sm32 | nccl-dest | nccl-expert |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sel:
            ce = r["ce_ms"]
            ce_cell = f"{ce * 1e3:.0f} us / {r['ce_gbps']:.0f}" if ce else "-"
            for op in ("dispatch", "combine"):
                cells = [_fmt(r, col, op, ce) for col in ROWS]
                lead = (
                    [str(r["gpus"]), f"{r['nvlink_mb_per_rank']:.1f}", ce_cell]
                    if op == "dispatch"
                    else ["", "", ""]
                )
                lines.append("| " + " | ".join([*lead, op, *cells]) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, shape in zip(axes[:2], ("deepseek-v3", "qwen3-30b-a3b"), strict=True):
        sel = sorted(
            (r for r in rows if (r["shape"], r["routing"], r["tokens"]) == (shape, "uniform", 4096)),
            key=lambda r: r["gpus"],
        )
        gpus = [r["gpus"] for r in sel]
        ax.plot(gpus, [r["ce_gbps"] for r in sel], "k--", label="copy engine")
        for col, style in (("graph", "o-"), ("eager", "s-"), ("nccl-dest", "^:")):
            for op, color in (("dispatch", "tab:blue"), ("combine", "tab:orange")):
                ax.plot(
                    gpus, [r.get(f"{col}_{op}_gbps") for r in sel], style, color=color, label=f"{col} {op}"
                )
        ax.set(
            title=f"{shape}, uniform, 4096 tokens/rank", xlabel="GPUs", ylabel="GB/s per rank", xticks=gpus
        )
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[2]
    for shape, marker in (("deepseek-v3", "o"), ("qwen3-30b-a3b", "s")):
        sel = sorted(
            (r for r in rows if (r["shape"], r["routing"], r["tokens"]) == (shape, "uniform", 128)),
            key=lambda r: r["gpus"],
        )
        gpus = [r["gpus"] for r in sel]
        for op, color in (("dispatch", "tab:blue"), ("combine", "tab:orange")):
            ax.plot(
                gpus,
                [r[f"graph_{op}_ms"] * 1e3 for r in sel],
                marker + "-",
                color=color,
                label=f"{shape} {op}",
            )
        ax.set_xticks(gpus)
    ax.axhline(30, color="k", ls=":", lw=1, label="30 us goal")
    ax.set(title="128 tokens/rank, CUDA-graph replay", xlabel="GPUs", ylabel="us per call")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("docs/benchmarks/ep-a2a-scaling"))
    args = p.parse_args()
    runs = load(args.dir)
    if not runs:
        raise SystemExit(f"no {args.dir}/x<N>/ep-a2a-triton-bench.json found")
    rows = summarize(runs)
    out = args.dir.with_suffix("")
    summary = {"package": "ep-a2a", "what": "scaling over GPUs of one host", "rows": rows}
    summary["runs"] = {
        str(w): {
            k: r.get(k) for k in ("file", "device", "date", "commit", "command", "torch", "triton", "env")
        }
        for w, r in sorted(runs.items())
    }
    Path(f"{out}.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = render(rows)
    Path(f"{out}.md").write_text(md)
    plot(rows, Path(f"{out}.png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
