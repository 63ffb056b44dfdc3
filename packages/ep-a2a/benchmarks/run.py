"""ep-a2a's published benchmark: writes ``docs/benchmarks/ep-a2a/<gpu>.json`` and ``<gpu>.png``.

    python packages/ep-a2a/benchmarks/run.py [--quick] [--gpus 2 4] [--out-dir docs/benchmarks/ep-a2a]

For each GPU count (default: 2, and 4 when at least 4 GPUs are visible) runs ``bench_triton.py`` (the
Triton backend against the copy engine and NCCL pipelines) and ``bench_torch_backend.py`` (the torch
backend) under ``python -m torch.distributed.run --standalone --nproc-per-node=<count>``, turns their raw
output into one row per (GPU count, shape, routing, tokens, method) and writes the results file of this
GPU kind (``h200.json`` on H200s): rows of GPU counts not run now are kept from the existing file, each
row carrying its own date and commit. Then draws the figure (``<gpu>.png``) from that file.
``--render-only`` runs nothing and redraws the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = {"triton": HERE / "bench_triton.py", "torch": HERE / "bench_torch_backend.py"}
#: arguments each bench gets (the published results use the torch symmetric-memory heap)
BENCH_ARGS = {"triton": ["--heaps", "torch"], "torch": []}
# NVLink SHARP/multicast stays off on the project's machines
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: the case of the figure and its bars: (result key, label)
FIGURE_CASE = {"shape": "deepseek-v3", "routing": "uniform", "tokens": 4096}
FIGURE_METHODS = [
    ("ours-graph-sm132", "Triton, CUDA graph, 132 SMs"),
    ("ours-sm132", "Triton, eager, 132 SMs"),
    ("ours-graph-sm32", "Triton, CUDA graph, 32 SMs"),
    ("nccl-dest", "NCCL all_to_all, one row per (token, rank)"),
    ("torch", "torch backend"),
]
_NUMBERS = (
    "dispatch_ms",
    "combine_ms",
    "round_trip_ms",
    "dispatch_host_ms",
    "combine_host_ms",
    "dispatch_launches_ms",
    "dispatch_launches_host_ms",
    "combine_launches_ms",
    "combine_launches_host_ms",
    "dispatch_ms_no_lead",
    "combine_ms_no_lead",
    "copy_ms",
    "quantize_dispatch_ms",
    "fp8_dispatch_ms",
    # the layer's row: its backend called directly, int32 ids, its calls again, how its calls ran
    *(f"{p}{op}_ms" for p in ("backend_", "int32_ids_", "repeat_") for op in ("dispatch", "combine")),
    "graph_captures",
    "graph_replays",
    "workspaces_allocated",
    "combine_outputs_allocated",
    # rows measured in rounds: how many, each round's times (paired round by round in the summary), and
    # the torch rows' medians of the rounds' ratios against the NCCL per-rank pipeline
    "rounds",
    *(f"{k}_rounds" for k in ("dispatch_ms", "combine_ms", "dispatch_launches_ms", "combine_launches_ms")),
    "dispatch_vs_nccl_dest",
    "combine_vs_nccl_dest",
)


#: what the FP8 rows record about quantize-on-send: where it ran, and whether its bytes equal the tuple's
#: work per call of the torch bench's rows (count_work.py)
_COUNTS = tuple(
    f"{op}_{k}"
    for op in ("dispatch", "combine")
    for k in ("collectives", "host_syncs", "peer_waits", "device_ops", "cuda_sync_warnings")
)
_FLAGS = (
    "quantize_in_kernel",
    "quantize_matches_tuple",
    "rows_match_normal_mode",
    "combine_close_to_normal_mode",
)


def gpu_kind(device_name: str) -> str:
    """``"h200"`` for "NVIDIA H200", ``"h100"`` for "NVIDIA H100 80GB HBM3", else the name's last word."""
    for word in device_name.lower().replace("-", " ").split():
        if word[:1] in "abhlv" and word[1:].isdigit():
            return word
    return device_name.lower().split()[-1]


def rows_of(raw: dict, bench: str) -> list[dict]:
    """One row per (case, method) of a bench's raw output; times in ms, % of the copy engine added."""
    rows = []
    meta = {"gpus": raw["world_size"], "bench": bench, "date": raw.get("date"), "commit": raw.get("commit")}
    for case in raw.get("cases", []):
        keys = ("shape", "routing", "tokens", "hidden", "topk", "experts", "default_num_sm")
        base = {k: case[k] for k in keys if k in case}
        base.update(heap=case.get("heap", "torch"), nvlink_bytes=case["nvlink_bytes"])
        host = case.get("host")
        if host:  # (the slowest rank's host speed as the case started, the CPU steal over the case)
            base.update(host_python_us=round(max(host["python_us"]), 1), host_steal_pct=host.get("steal_pct"))
        ce = case["results"].get("ce", {}).get("copy_ms")
        ce_fp8 = case["results"].get("ce-fp8", {}).get("copy_ms")
        for method, r in case["results"].items():
            row = {**meta, **base, "method": method, **{k: r[k] for k in _NUMBERS if r.get(k) is not None}}
            row.update({k: r[k] for k in _FLAGS + _COUNTS if k in r})
            fp8 = "fp8" in method  # (FP8 rows: their own bytes, FP8 rows and scales, and their ceiling)
            if fp8 and case.get("nvlink_bytes_fp8"):
                row["nvlink_bytes"] = case["nvlink_bytes_fp8"]
            for op in ("dispatch", "combine"):
                c = ce_fp8 if fp8 and op == "dispatch" else ce  # (combine moves bf16 rows either way)
                if c and r.get(f"{op}_ms"):
                    row[f"{op}_pct_ce"] = round(100 * c / r[f"{op}_ms"], 1)
            if len(row) > len(meta) + len(base) + 1:
                rows.append(row)
    return rows


def paired_ratio(a: dict, a_field: str, b: dict, b_field: str) -> float:
    """``a[a_field] / b[b_field]`` of two rows: the median of the rounds' ratios where both rows carry
    each round's value (``<field>_rounds``, as many rounds each: measured in the same rounds), else the
    ratio of the two figures."""
    ra, rb = a.get(f"{a_field}_rounds"), b.get(f"{b_field}_rounds")
    if ra and rb and len(ra) == len(rb):
        return statistics.median(x / y for x, y in zip(ra, rb, strict=True))
    return a[a_field] / b[b_field]


def summary(rows: list[dict]) -> list[str]:
    """What to read off a run: per case, the layer's default ``num_sm`` against the best one of the sweep
    (eager and graph), eager against graph at the default, and the torch backend against the NCCL
    per-rank pipeline measured beside it."""
    lines = []
    cases = sorted({(r["gpus"], r["shape"], r["routing"], r["tokens"]) for r in rows})
    for gpus, shape, routing, tokens in cases:
        mine = [
            r
            for r in rows
            if (r["gpus"], r["shape"], r["routing"], r["tokens"]) == (gpus, shape, routing, tokens)
        ]
        name = f"{gpus} GPUs, {shape} {routing}, {tokens} tok"
        default = next((r["default_num_sm"] for r in mine if r.get("default_num_sm")), None)
        by = {(r["bench"], r["method"]): r for r in mine}
        for mode, prefix in (("eager", "ours-sm"), ("graph", "ours-graph-sm")):
            cand = {int(m[len(prefix):]): r for (b, m), r in by.items() if b == "triton" and m.startswith(prefix)
                    and m[len(prefix):].isdigit()}  # fmt: skip
            if default not in cand or len(cand) < 2:
                continue
            for op in ("dispatch", "combine"):
                field = f"{op}_ms"
                times = {k: r[field] for k, r in cand.items() if r.get(field)}
                if default not in times:
                    continue
                # each num_sm's time over the default's (paired round by round where measured in rounds)
                speed = {k: paired_ratio(cand[k], field, cand[default], field) for k in times}
                best = min(speed, key=speed.__getitem__)
                lines.append(
                    f"{name}: {mode} {op}: default num_sm={default} {1e3 * times[default]:.0f} us, best "
                    f"num_sm={best} {1e3 * times[best]:.0f} us: default at {100 * speed[best]:.0f}% "
                    "of the best's speed (target >= 95%)"
                )
        eager, graph = by.get(("triton", f"ours-sm{default}")), by.get(("triton", f"ours-graph-sm{default}"))
        if eager and graph and tokens <= 1024:
            for op in ("dispatch", "combine"):
                host = eager.get(f"{op}_host_ms")
                lines.append(
                    f"{name}: eager {op} {1e3 * eager[f'{op}_ms']:.0f} us = "
                    f"{paired_ratio(eager, f'{op}_ms', graph, f'{op}_ms'):.1f}x its graph replay (target <= 2x)"
                    + (f"; {1e3 * host:.0f} us of it on the host" if host else "")
                )
            for op, what in (("dispatch", "its kernels one by one"), ("combine", "its kernel")):
                launches = eager.get(f"{op}_launches_ms")
                if launches:  # (the same tensors every call: the eager rows above replay a captured graph)
                    lines.append(
                        f"{name}: eager {op} launching {what} (eager_graphs off) "
                        f"{1e3 * launches:.0f} us = "
                        f"{paired_ratio(eager, f'{op}_launches_ms', graph, f'{op}_ms'):.1f}x its graph replay; "
                        f"{1e3 * eager.get(f'{op}_launches_host_ms', 0.0):.0f} us of it on the host"
                    )
        if eager and eager.get("host_python_us"):
            steal = eager.get("host_steal_pct")
            lines.append(
                f"{name}: host: a fixed Python loop {eager['host_python_us']:.0f} us on the slowest rank as the "
                "case started (the eager rows are bound by host work)"
                + (f"; CPU steal {steal:.1f}% over the case" if steal is not None else "")
            )
        layer = by.get(("triton", "ours-layer-default"))
        if layer and layer.get("backend_dispatch_ms"):  # (what sets the layer's rows apart)
            for op in ("dispatch", "combine"):
                parts = [
                    f"{label} {1e3 * layer[key]:.0f} us"
                    for label, key in (
                        ("its backend called directly", f"backend_{op}_ms"),
                        ("int32 ids", f"int32_ids_{op}_ms"),
                        ("again", f"repeat_{op}_ms"),
                    )
                    if layer.get(key)
                ]
                lines.append(
                    f"{name}: the layer as the README builds it: eager {op} {1e3 * layer[f'{op}_ms']:.0f} us "
                    f"({1e3 * layer.get(f'{op}_host_ms', 0.0):.0f} us host); " + ", ".join(parts)
                )
            lines.append(
                f"{name}: the layer's calls: {layer.get('graph_replays')} graph replays, "
                f"{layer.get('graph_captures')} captures, {layer.get('workspaces_allocated')} workspaces, "
                f"{layer.get('combine_outputs_allocated')} combine outputs allocated"
            )
        if eager and tokens > 1024 and eager.get("dispatch_pct_ce"):
            others = [
                (label, r)
                for label, r in (("graph", graph), ("the layer as the README builds it", layer))
                if r
            ]
            lines.append(
                f"{name}: eager dispatch {1e3 * eager['dispatch_ms']:.0f} us = {eager['dispatch_pct_ce']:.0f}% of the "
                "copy engine (target >= 75% on 2 GPUs)"
                + "".join(
                    f"; {label} {1e3 * r['dispatch_ms']:.0f} us = {r['dispatch_pct_ce']:.0f}%"
                    for label, r in others
                    if r.get("dispatch_pct_ce")
                )
            )
        for mode, key in (("graph", "ours-fp8-graph-sm"), ("eager", "ours-fp8-sm")):
            f8, bf = (
                by.get(("triton", f"{key}{default}")),
                by.get(("triton", f"{key.replace('fp8-', '')}{default}")),
            )
            if f8 and bf and f8.get("dispatch_ms") and bf.get("dispatch_ms"):
                ratio = f8["dispatch_ms"] / bf["dispatch_ms"]
                pct = (
                    f", {f8['dispatch_pct_ce']:.0f}% of the copy engine for its bytes"
                    if f8.get("dispatch_pct_ce")
                    else ""
                )
                lines.append(
                    f"{name}: Triton {mode} FP8 dispatch {1e3 * f8['dispatch_ms']:.0f} us vs bf16 "
                    f"{1e3 * bf['dispatch_ms']:.0f} us: {ratio:.2f}x{pct}"
                    + (" (targets at 4096 tokens: <= 0.6x, >= 85%)" if mode == "graph" else "")
                )
                if f8.get("quantize_dispatch_ms"):
                    lines.append(
                        f"{name}: Triton {mode} FP8 dispatch of bf16 rows, fp8=True (quantized in the send kernel) "
                        f"{1e3 * f8['quantize_dispatch_ms']:.0f} us: {f8['quantize_dispatch_ms'] / bf['dispatch_ms']:.2f}x "
                        "bf16"
                        + (" (target at 4096 tokens: <= 0.65x)" if mode == "graph" else "")
                        + ("" if f8.get("quantize_in_kernel", True) else " [quantized with torch operations]")
                        + {True: "; bytes equal the tuple's", False: "; BYTES DIFFER FROM THE TUPLE'S"}.get(
                            f8.get("quantize_matches_tuple"), ""
                        )
                    )
        ll_g, ll_e = (
            by.get(("triton", f"ours-ll-graph-sm{default}")),
            by.get(("triton", f"ours-ll-sm{default}")),
        )
        if ll_g and graph:
            lines.append(
                f"{name}: low-latency mode, graph: dispatch {1e3 * ll_g['dispatch_ms']:.0f} us (FP8 "
                f"{1e3 * ll_g.get('fp8_dispatch_ms', 0):.0f}, bf16 quantized on send "
                f"{1e3 * ll_g.get('quantize_dispatch_ms', 0):.0f}), combine {1e3 * ll_g['combine_ms']:.0f} us; "
                f"normal mode {1e3 * graph['dispatch_ms']:.0f} / {1e3 * graph['combine_ms']:.0f} us"
                + (" (targets at 128 tokens on 4 GPUs: <= 30 us each)" if tokens <= 128 else "")
                + (
                    ""
                    if (ll_e or {}).get("rows_match_normal_mode", True)
                    else "; ROWS DIFFER FROM THE NORMAL MODE'S"
                )
                + ("" if (ll_e or {}).get("combine_close_to_normal_mode", True) else "; COMBINE DIFFERS")
            )
        if ll_e:
            lines.append(
                f"{name}: low-latency mode, eager (no graph): dispatch {1e3 * ll_e['dispatch_ms']:.0f} us, "
                f"combine {1e3 * ll_e['combine_ms']:.0f} us"
            )
        fp8 = by.get(("torch", "torch-fp8"))
        if fp8 and by.get(("torch", "torch")):
            bf16 = by[("torch", "torch")]["dispatch_ms"]
            lines.append(
                f"{name}: torch backend FP8 dispatch {1e3 * fp8['dispatch_ms']:.0f} us vs bf16 {1e3 * bf16:.0f} us: "
                f"{fp8['dispatch_ms'] / bf16:.2f}x"
            )
        torch_row, nccl = by.get(("torch", "torch")), by.get(("torch", "nccl-dest"))
        if torch_row and nccl:
            for op in ("dispatch", "combine"):
                hosts = (torch_row.get(f"{op}_host_ms"), nccl.get(f"{op}_host_ms"))
                # the median of the rounds' paired ratios where recorded, else the ratio of the medians
                ratio = torch_row.get(f"{op}_vs_nccl_dest", torch_row[f"{op}_ms"] / nccl[f"{op}_ms"])
                lines.append(
                    f"{name}: torch backend {op} {1e3 * torch_row[f'{op}_ms']:.0f} us vs NCCL per-rank "
                    f"pipeline {1e3 * nccl[f'{op}_ms']:.0f} us: {ratio:.2f}x (target <= 1x)"
                    + (f"; host {1e3 * hosts[0]:.0f} vs {1e3 * hosts[1]:.0f} us" if all(hosts) else "")
                )
                if (
                    torch_row.get(f"{op}_collectives") is not None
                    and nccl.get(f"{op}_collectives") is not None
                ):
                    work = [
                        ", ".join(str(r[f"{op}_{k}"]) for k in ("collectives", "host_syncs", "device_ops"))
                        for r in (torch_row, nccl)
                    ]
                    lines.append(
                        f"{name}: work per {op} (collectives, host waits, tensor operations): torch backend "
                        f"{work[0]} vs NCCL per-rank pipeline {work[1]}; synchronizing CUDA calls "
                        f"{torch_row.get(f'{op}_cuda_sync_warnings')} (torch backend)"
                    )
    return lines


def table(record: dict) -> str:
    """The benchmarks page's table (markdown) from a results file: per GPU count and case, the copy engine
    and dispatch / combine of the Triton backend at the default ``num_sm`` (graph, eager, the layer as
    the README builds it), the torch backend and the NCCL per-rank pipeline, in µs; in brackets the
    share of the copy engine's speed at 4096 tokens. Where FP8 dispatch was measured, two more rows per
    case: FP8 rows in DeepEP's format (``(x_fp8, scales)``, the layer of FP8 rows) and bf16 rows with
    ``fp8=True`` (quantized in the send kernel), their copy engine copying their own bytes (FP8 rows and
    scales), their dispatch with its share of that copy and its time over the bf16 dispatch's."""
    rows = record["results"]
    head = ("| GPUs | shape, routing | tokens/rank | rows | copy engine | graph dispatch | graph combine | "
            "eager dispatch | eager combine | layer defaults | torch backend | NCCL per-rank |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    cases = sorted(
        {(r["gpus"], r["shape"], r["routing"], r["tokens"]) for r in rows},
        key=lambda c: (c[0], -c[3], c[1], c[2]),
    )
    for gpus, shape, routing, tokens in cases:
        mine = [
            r
            for r in rows
            if (r["gpus"], r["shape"], r["routing"], r["tokens"]) == (gpus, shape, routing, tokens)
        ]
        by = {(r["bench"], r["method"]): r for r in mine if r.get("heap", "torch") == "torch"}
        default = next((r["default_num_sm"] for r in mine if r.get("default_num_sm")), 132)
        ce = by.get(("triton", "ce"), {}).get("copy_ms")
        ce_fp8 = by.get(("triton", "ce-fp8"), {}).get("copy_ms")

        def cell(key: tuple[str, str], field: str, ceiling: float | None, bf16: float | None = None,
                 by: dict = by, tokens: int = tokens) -> str:  # fmt: skip
            t = by.get(key, {}).get(field)
            if t is None:
                return "-"
            notes = [f"{100 * ceiling / t:.0f} %"] if ceiling and tokens >= 1024 else []
            notes += [f"{t / bf16:.2f}x"] if bf16 else []
            return f"{1e3 * t:.0f}" + (f" ({', '.join(notes)})" if notes else "")

        def pair(key: tuple[str, str], ceiling: float | None = ce) -> str:
            return f"{cell(key, 'dispatch_ms', ceiling)} / {cell(key, 'combine_ms', ceiling)}"

        def ms(t: float | None) -> str:
            return f"{1e3 * t:.0f}" if t else "-"

        graph, eager = ("triton", f"ours-graph-sm{default}"), ("triton", f"ours-sm{default}")
        layer = (
            ("triton", "ours-layer-default")
            if ("triton", "ours-layer-default") in by
            else ("triton", f"ours-layer-sm{default}")
        )
        lines.append(
            f"| {gpus} | {shape}, {routing} | {tokens} | bf16 | {ms(ce)} | {cell(graph, 'dispatch_ms', ce)} | "
            f"{cell(graph, 'combine_ms', ce)} | {cell(eager, 'dispatch_ms', ce)} | {cell(eager, 'combine_ms', ce)} | "
            f"{pair(layer)} | {pair(('torch', 'torch'))} | {pair(('torch', 'nccl-dest'))} |"
        )  # fmt: skip
        llg, lle = ("triton", f"ours-ll-graph-sm{default}"), ("triton", f"ours-ll-sm{default}")
        if llg in by or lle in by:
            lines.append(
                f"| {gpus} | {shape}, {routing} | {tokens} | bf16, low-latency mode | {ms(ce)} | "
                f"{cell(llg, 'dispatch_ms', ce)} | {cell(llg, 'combine_ms', ce)} | {cell(lle, 'dispatch_ms', ce)} | "
                f"{cell(lle, 'combine_ms', ce)} | - | - | - |"
            )  # fmt: skip
            if by.get(llg, {}).get("fp8_dispatch_ms"):
                lines.append(
                    f"| {gpus} | {shape}, {routing} | {tokens} | FP8 (x_fp8, scales), low-latency mode | "
                    f"{ms(ce_fp8)} | {cell(llg, 'fp8_dispatch_ms', ce_fp8)} | - | - | - | - | - | - |"
                )  # fmt: skip
        f8g, f8e = ("triton", f"ours-fp8-graph-sm{default}"), ("triton", f"ours-fp8-sm{default}")
        if f8g not in by and f8e not in by:
            continue
        bf_g, bf_e = by.get(graph, {}).get("dispatch_ms"), by.get(eager, {}).get("dispatch_ms")
        torch_fp8 = ("torch", "torch-fp8")
        for label, field, combine in (("FP8 (x_fp8, scales)", "dispatch_ms", True),
                                      ("bf16, fp8=True", "quantize_dispatch_ms", False)):  # fmt: skip
            lines.append(
                f"| {gpus} | {shape}, {routing} | {tokens} | {label} | {ms(ce_fp8)} | "
                f"{cell(f8g, field, ce_fp8, bf_g)} | {cell(f8g, 'combine_ms', ce) if combine else '-'} | "
                f"{cell(f8e, field, ce_fp8, bf_e)} | {cell(f8e, 'combine_ms', ce) if combine else '-'} | - | "
                f"{pair(torch_fp8, None) if combine and torch_fp8 in by else '-'} | - |"
            )  # fmt: skip
    return "\n".join(lines)


def run_bench(bench: str, out: Path, ngpu: int, quick: bool, low_latency: bool = False) -> dict:
    """Run one bench script on ``ngpu`` processes; its raw JSON (``low_latency``: the Triton bench also
    times the low-latency mode)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ngpu}"]
    cmd += [str(BENCHES[bench]), "--json", str(out), *BENCH_ARGS[bench], *(["--quick"] if quick else [])]
    cmd += ["--low-latency"] if low_latency and bench == "triton" else []
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in ENV.items()}}
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    print(f"=== {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, env=env, check=True)
    return json.loads(out.read_text())


def plot(record: dict, path: Path) -> bool:
    """% of the copy engine of dispatch and combine at the figure's case, per method and GPU count."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure", file=sys.stderr)
        return False
    rows = [r for r in record["results"] if all(r.get(k) == v for k, v in FIGURE_CASE.items())]
    # (the NCCL rows of the Triton bench, measured beside it; the torch backend's from its own bench)
    rows = [
        r
        for r in rows
        if r.get("heap", "torch") == "torch" and (r["bench"] == "triton") != (r["method"] == "torch")
    ]
    counts = sorted({r["gpus"] for r in rows})
    if not counts:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    width = 0.8 / len(counts)
    for ax, op in zip(axes, ("dispatch", "combine"), strict=True):
        for i, gpus in enumerate(counts):
            by_method = {r["method"]: r.get(f"{op}_pct_ce", 0.0) for r in rows if r["gpus"] == gpus}
            xs = [j + (i - len(counts) / 2 + 0.5) * width for j in range(len(FIGURE_METHODS))]
            ax.bar(xs, [by_method.get(m, 0.0) for m, _ in FIGURE_METHODS], width, label=f"{gpus} GPUs")
        ax.set_xticks(
            range(len(FIGURE_METHODS)), [label for _, label in FIGURE_METHODS], fontsize=7, rotation=15
        )
        ax.set(title=f"{op}, DeepSeek-V3 shape, 4096 tokens per rank", ylabel="% of the copy engine")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"ep-a2a on {record['device']} (higher is better; 100 % = a copy-engine copy of the same bytes)",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description="ep-a2a benchmark")
    p.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks/ep-a2a"))
    p.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU counts to run (default: 2, and 4)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the DeepSeek-V3 uniform cases only (4096 and 128 tokens: num_sm sweep, layer default, torch "
        "backend, NCCL), without the other experiments",
    )
    p.add_argument(
        "--low-latency",
        action="store_true",
        help="also time the low-latency mode (TritonTuning(low_latency=True)) in the DeepSeek-V3 cases",
    )
    p.add_argument("--render-only", action="store_true", help="redraw the figure of --kind's results file")
    p.add_argument("--kind", default=None, help="GPU kind of the results file (default: this machine's)")
    p.add_argument("--table", action="store_true", help="print the benchmarks page's table (markdown)")
    args = p.parse_args()
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind = args.kind or (gpu_kind(torch.cuda.get_device_name(0)) if ngpu else None)
    if kind is None:
        print("no GPU: pass --kind to redraw a results file", file=sys.stderr)
        return 2
    path = args.out_dir / f"{kind}.json"
    record = json.loads(path.read_text()) if path.exists() else {"results": []}
    if not args.render_only:
        counts = args.gpus or [g for g in (2, 4) if g <= ngpu]
        if not counts or max(counts) > ngpu:
            print(f"the benchmark needs {max(counts or [2])} GPUs; this machine has {ngpu}", file=sys.stderr)
            return 2
        rows = [r for r in record["results"] if r["gpus"] not in counts]
        with tempfile.TemporaryDirectory() as tmp:
            for gpus in counts:
                for bench in BENCHES:
                    raw = run_bench(
                        bench, Path(tmp) / f"{bench}-{gpus}.json", gpus, args.quick, args.low_latency
                    )
                    rows += rows_of(raw, bench)
        import triton

        record = {
            "package": "ep-a2a",
            "device": torch.cuda.get_device_name(0),
            "gpu_kind": kind,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": next((r["commit"] for r in rows if r["gpus"] in counts), None),
            "command": "python " + " ".join(sys.argv),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "results": sorted(
                rows, key=lambda r: (r["gpus"], r["bench"], r["shape"], r["routing"], r["tokens"])
            ),
        }
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
        print("\n".join(summary([r for r in record["results"] if r["gpus"] in counts])))
    if args.table:
        print(table(record))
    if plot(record, args.out_dir / f"{kind}.png"):
        print(f"wrote {args.out_dir / f'{kind}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
