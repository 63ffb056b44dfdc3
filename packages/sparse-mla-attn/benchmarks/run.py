"""Benchmark of sparse-mla-attn: writes ``<out-dir>/<gpu>.json`` (raw rows, device, date, commit, command,
versions) and the figure ``<out-dir>/<gpu>.png``.

    PYTHONPATH=packages/sparse-mla-attn/src python packages/sparse-mla-attn/benchmarks/run.py \\
        --out-dir docs/benchmarks/sparse-mla-attn [--quick] [--flashmla PATH]

Measured in one process on one GPU: the dense bf16 matmul rate (this run's roofline); the forward at
FlashMLA's benchmark shape (s_q 4096, topk 2048, d_qk 576, d_v 512, h_q 128 and 64, s_kv 8K / 32K / 128K)
with the default kernels and with ``Config(backend="triton")``; attn_dist at the same shapes; paged decode
(topk 2048, 32K-token caches, h_q 128 at batch 1 / 8 / 64 / 128 and at batch 1 / 8 with each split-K merge
of ``Config(split_merge=...)``, h_q 64 at batch 64 / 128); the bf16 and FP8 decode side by side
(``decode_fp8`` rows: batch 64 / 128, s_q 1 / 2, h_q 64 / 128, the FP8 cache FlashMLA's layout, its
cache-row indices); the backward
(default and deterministic) and the indexer logits; a torch gather + einsum forward baseline. Times are
medians of CUDA-event timed runs after warm-up, the L2 cache flushed before each (decode: the replay of one
call captured in a CUDA graph, ``ms``, and eager calls, ``ms_eager``; also from an idle GPU and as
back-to-back replays, see ``bench_decode.py``); each row is also checked against the float32 reference on
a slice.
``host_cost`` rows give every public op's host time per call (a tiny problem called back to back in
batches, the GPU drained between them; ``us_per_call_back_to_back`` includes the GPU's time), measured
first, before the other rows.
``--flashmla PATH`` imports FlashMLA's Python package from PATH (a build of deepseek-ai/FlashMLA) and times
its ``flash_mla_sparse_fwd`` on the forward rows' inputs and its FP8 sparse decode on the ``decode_fp8``
rows' FP8 cache; ``--flashmla-commit`` records which commit.
``--plot FILE`` redraws the figure of a results file; ``--table FILE`` prints its docs table (Markdown).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

PACKAGE = "sparse-mla-attn"


def gpu_kind(name: str) -> str:
    """``h200``, ``h100``, ... from a CUDA device name."""
    for kind in ("H200", "H100", "H800", "H20", "B200", "A100"):
        if kind in name:
            return kind.lower()
    return name.split()[-1].lower()


def git_commit() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(quick: bool, flashmla: Any) -> list[dict[str, Any]]:
    from bench_attn_dist import bench_attn_dist
    from bench_backward import bench_bwd
    from bench_decode import FP8_SHAPES, bench_decode, bench_decode_fp8, decode_rows
    from bench_forward import bench_fwd, bench_torch_baseline

    from sparse_mla_attn import Config

    s_q = 1024 if quick else 4096
    kvs = [8192, 131072] if quick else [8192, 32768, 131072]
    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> dict[str, Any]:
        rows.append(row)
        shape = {
            k: v
            for k, v in row.items()
            if k in ("s_q", "h_q", "s_kv", "batch", "seqlen", "topk", "causal", "config") and v is not None
        }
        eager = f" (eager {row['ms_eager']:.3f} ms)" if "ms_eager" in row else ""
        print(
            f"{row['op']:18s} {row.get('backend')!s:7s} {shape} {row['ms']:.3f} ms{eager} {row['tflops']:.0f} TFLOPS",
            flush=True,
        )
        return row

    # Host costs first, in a process that has run nothing else yet (as a user's), before the other rows'
    # large allocations and CUDA-graph captures.
    from bench_decode import bench_host_cost

    for row in bench_host_cost():
        rows.append(row)
        print(f"host cost {row['function']:26s} {row['us_per_call']:.1f} us per call "
              f"(back to back {row['us_per_call_back_to_back']:.1f})", flush=True)  # fmt: skip
    for h_q in (128, 64):
        for s_kv in kvs:
            fwd = add(bench_fwd(s_q, h_q, s_kv, 2048, flashmla=flashmla))
            add(bench_attn_dist(s_q, h_q, s_kv, 2048, fwd_ms=fwd["ms"]))
        # The Triton kernels where the Gluon ones are the default (sm_90), compared through Config.
        fwd = add(bench_fwd(s_q, h_q, 32768, 2048, config=Config(backend="triton")))
        add(bench_attn_dist(s_q, h_q, 32768, 2048, fwd_ms=fwd["ms"], config=Config(backend="triton")))
    add(bench_torch_baseline(s_q, 128, 32768, 2048))
    for row in decode_rows():
        add(row)
    for b in (64, 128):  # a tensor-parallel shard of DeepSeek's 128 heads
        add(bench_decode(b, 64, 32768, 2048))
    # bf16 and FP8 decode beside FlashMLA's FP8 sparse decode, on the same (quantized) caches.
    for b, dec_s_q, dec_h_q in FP8_SHAPES[:2] if quick else FP8_SHAPES:  # (s_q stays the prefill's)
        row = bench_decode_fp8(b, dec_s_q, dec_h_q, flashmla=flashmla)
        rows.append(row)
        fm = f", FlashMLA fp8 {row['flashmla_ms'] * 1e3:.0f} us" if "flashmla_ms" in row else ""
        print(f"decode_fp8 b{b} s_q{dec_s_q} h_q{dec_h_q}: bf16 {row['ms_bf16'] * 1e3:.0f} us, fp8 "
              f"{row['ms_fp8'] * 1e3:.0f} us{fm}", flush=True)  # fmt: skip
    for h_q, s_kv in ((128, 32768),) if quick else ((128, 32768), (64, 32768), (128, 131072)):
        add(bench_bwd(s_q, h_q, s_kv, 2048))
    if not quick:
        from bench_indexer import bench_indexer

        for causal in (False, True):
            add(bench_indexer(4096, 64, 128, 32768, causal))
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for h_q, color in ((128, "C0"), (64, "C1")):
        for op, key, style, label in (
            ("fwd", "tflops", "o-", "sparse_mla_fwd"),
            ("attn_dist", "tflops", "s--", "attn_dist"),
            ("fwd", "flashmla_tflops", "x:", "FlashMLA"),
        ):
            pts = [r for r in rows if r["op"] == op and r["h_q"] == h_q and key in r and not r.get("config")]
            if pts:
                ax.plot(
                    [r["s_kv"] for r in pts],
                    [r[key] for r in pts],
                    style,
                    color=color,
                    label=f"{label} h_q={h_q}",
                )
    ax.axhline(result["dense_bf16_matmul_tflops"], color="gray", lw=0.8, ls="--", label="dense bf16 matmul")
    ax.set(
        xscale="log", xlabel="s_kv", ylabel="TFLOPS", title="prefill (s_q 4096, topk 2048)", ylim=(0, None)
    )
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    ax = axes[1]
    dec = [r for r in rows if r["op"] == "decode_fp8"]
    x = range(len(dec))
    series = [
        ("ms_bf16", "ours, bf16 cache"),
        ("ms_fp8", "ours, FP8 cache"),
        ("flashmla_ms", "FlashMLA, FP8"),
    ]
    for i, (key, label) in enumerate(series):
        ax.bar([j + (i - 1) * 0.27 for j in x], [r.get(key, 0.0) * 1e3 for r in dec], 0.27, label=label)
    ax.set_xticks(list(x), [f"b{r['batch']} s{r['s_q']}\nh{r['h_q']}" for r in dec], fontsize=7)
    ax.set(ylabel="µs", title="sparse decode (topk 2048, 32K caches)")
    ax.legend(fontsize=7)
    ax = axes[2]
    bwd = [r for r in rows if r["op"] == "bwd"]
    labels = [f"h{r['h_q']} {r['s_kv'] // 1024}K" for r in bwd]
    x = range(len(bwd))
    ax.bar([i - 0.2 for i in x], [r["tflops"] for r in bwd], 0.4, label="default")
    ax.bar([i + 0.2 for i in x], [r["det_tflops"] for r in bwd], 0.4, label="deterministic")
    ax.set_xticks(list(x), labels)
    ax.set(ylabel="TFLOPS (2.5x forward FLOPs)", title="backward (s_q 4096, topk 2048)")
    ax.legend(fontsize=7)
    fig.suptitle(
        f"{PACKAGE} on {result['device']} ({result['date'][:10]}, torch {result['torch']}, triton {result['triton']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _us(ms: float) -> str:
    return f"{ms * 1e3:.0f} µs"


def docs_table(result: dict[str, Any]) -> str:
    """The Markdown table of the docs' Benchmarks page, from a results file: one line per default-config
    row of each op (decode_fp8 rows: ours bf16 and FP8 beside FlashMLA's FP8 decode)."""
    lines = ["| operation | time | TFLOPS | FlashMLA, same run (ours / FlashMLA time) |", "|---|---|---|---|"]
    order = ["fwd", "attn_dist", "decode", "decode_fp8", "bwd", "indexer_logits", "fwd_torch_baseline"]
    rows = sorted(
        (r for r in result["results"] if not r.get("config") and r["op"] in order),
        key=lambda r: order.index(r["op"]),
    )
    fwd_ms = {}

    def add(operation: str, time: str, tflops: str, flashmla: str = "—") -> None:
        lines.append(f"| {operation} | {time} | {tflops} | {flashmla} |")

    for r in rows:
        op = r["op"]
        at = f"h_q {r.get('h_q')}, s_kv {r.get('s_kv', 0) // 1024}K"
        if op == "fwd":
            fwd_ms[(r["h_q"], r["s_kv"])] = r["ms"]
            fm = "—"
            if "flashmla_ms" in r:
                ratio = r.get("time_vs_flashmla", r["ms"] / r["flashmla_ms"])  # paired calls where recorded
                fm = f"{r['flashmla_ms']:.2f} ms, {r['flashmla_tflops']:.0f} TFLOPS ({ratio:.2f}x)"
            add(f"forward, {at}", f"{r['ms']:.2f} ms", f"{r['tflops']:.0f}", fm)
        elif op == "attn_dist":
            ratio = fwd_ms.get((r["h_q"], r["s_kv"]), float("nan"))
            add(
                f"attn_dist, {at}",
                f"{r['ms']:.2f} ms ({r['ms'] / ratio:.2f}x the forward)",
                f"{r['tflops']:.0f}",
            )
        elif op == "decode":
            add(
                f"decode, batch {r['batch']}, h_q {r['h_q']}, 32K cache (eager call)",
                f"{_us(r['ms'])} ({_us(r['ms_eager'])})",
                f"{r['tflops']:.0f}",
            )
        elif op == "decode_fp8":
            shape = f"batch {r['batch']}, s_q {r['s_q']}, h_q {r['h_q']}"
            for kind in ("bf16", "fp8"):
                fm = "—"
                if "flashmla_ms" in r:
                    fm = f"{_us(r['flashmla_ms'])}, {r['flashmla_tflops']:.0f} TFLOPS ({r['ms_' + kind] / r['flashmla_ms']:.2f}x)"
                cache = "bf16 cache" if kind == "bf16" else "FP8 cache, cache-row indices"
                add(f"decode, {shape}, {cache}", _us(r["ms_" + kind]), f"{r['tflops_' + kind]:.0f}", fm)
        elif op == "bwd":
            add(
                f"backward, {at} (deterministic)",
                f"{r['ms']:.1f} ms ({r['det_ms']:.1f} ms)",
                f"{r['tflops']:.0f} ({r['det_tflops']:.0f})",
            )
        elif op == "indexer_logits":
            name = "indexer logits causal" if r.get("causal") else "indexer logits"
            add(
                f"{name}, fwd / bwd",
                f"{r['ms']:.2f} / {r['bwd_ms']:.1f} ms",
                f"{r['tflops']:.0f} / {r['bwd_tflops']:.0f}",
            )
        elif op == "fwd_torch_baseline":
            add(f"torch gather + einsum forward, {at}", f"{r['ms']:.1f} ms", f"{r['tflops']:.0f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="docs/benchmarks/sparse-mla-attn")
    ap.add_argument("--quick", action="store_true", help="fewer shapes, s_q 1024 (a smoke run)")
    ap.add_argument("--flashmla", default=None, help="folder holding FlashMLA's built flash_mla package")
    ap.add_argument(
        "--flashmla-commit",
        default=os.environ.get("FLASHMLA_COMMIT", "unknown"),
        help="FlashMLA commit the build came from (recorded in the results file)",
    )
    ap.add_argument("--plot", default=None, help="only redraw the figure of this results file")
    ap.add_argument("--table", default=None, help="only print the docs table of this results file")
    a = ap.parse_args()
    if a.table:
        print(docs_table(json.loads(Path(a.table).read_text())))
        return
    if a.plot:
        path = Path(a.plot)
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("run.py needs a CUDA GPU")
    from bench_forward import dense_matmul_tflops

    flashmla = None
    if a.flashmla:
        sys.path.insert(0, a.flashmla)
        flashmla = importlib.import_module("flash_mla")
    device = torch.cuda.get_device_name()
    result: dict[str, Any] = {
        "package": PACKAGE,
        "device": device,
        "gpu_kind": gpu_kind(device),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dense_bf16_matmul_tflops": dense_matmul_tflops(),
        "flashmla": None if flashmla is None else {"path": a.flashmla, "commit": a.flashmla_commit},
        "flops": "fwd/decode 2*s_q*h_q*topk*(d_qk+d_v); attn_dist 2*s_q*h_q*topk*d_qk; bwd 2.5x fwd; "
        "indexer 2*pairs*h_idx*d_idx (bwd 3x)",
        "results": [],
    }
    result["results"] = measure(a.quick, flashmla)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result['gpu_kind']}{'-quick' if a.quick else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
