"""Benchmark suite of sparse-mla-attn: writes <out-dir>/sparse-mla-attn.{json,md} and PNG plots.

    python packages/sparse-mla-attn/benchmarks/run.py --out-dir docs/benchmarks [--quick]

Measures, in one process on one GPU: the dense bf16 matmul rate (the roofline of this run), the forward
at FlashMLA's benchmark shape (s_q 4096, topk 2048, h_q 128 and 64, s_kv 8K / 32K / 128K), its scaling
with topk, attn_dist at the same shapes (time relative to the forward), paged decode (batch 64 / 128,
h_q 128, topk 2048) and a chunked torch gather + einsum baseline. Times are medians of CUDA-event timed
runs after warm-up (triton.testing.do_bench); each configuration is also checked against the float32
reference on a slice of its queries.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import triton
from bench_attn_dist import bench_attn_dist
from bench_decode import bench_decode
from bench_forward import bench_baseline, bench_fwd, dense_matmul_tflops

from sparse_mla_attn._gluon import GLUON_FWD, gluon_attn_dist_config, gluon_enabled
from sparse_mla_attn.attn_dist import attn_dist_config
from sparse_mla_attn.forward import fwd_config

DIST = "sparse-mla-attn"
# FlashMLA's CUDA kernel on one H100 at this shape, as quoted in the project's issue: context only,
# not measured by this script.
FLASHMLA_H100 = {128: {8192: 610, 32768: 584, 131072: 519}, 64: {8192: 591, 32768: 555, 131072: 365}}


def git_commit() -> str:
    env = os.environ.get("SPARSE_MLA_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="docs/benchmarks")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("run.py needs a CUDA GPU")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    s_q = 1024 if a.quick else 4096
    kvs = [8192, 131072] if a.quick else [8192, 32768, 131072]

    peak = dense_matmul_tflops()
    print(f"dense bf16 matmul: {peak:.0f} TFLOPS", flush=True)
    fwd, dist, base, topk_scan, dec = [], [], [], [], []
    for h_q in (128, 64):
        for s_kv in kvs:
            r = bench_fwd(s_q, h_q, s_kv, 2048)
            r["flashmla_h100_tflops_quoted"] = FLASHMLA_H100[h_q][s_kv] if s_q == 4096 else None
            fwd.append(r)
            d = bench_attn_dist(s_q, h_q, s_kv, 2048)
            d["ratio_to_fwd"] = d["ms"] / r["ms"]
            dist.append(d)
            print(
                f"fwd h_q={h_q} s_kv={s_kv}: {r['tflops']:.0f} TF; attn_dist {d['ratio_to_fwd']:.2f}x fwd",
                flush=True,
            )
    for s_kv in kvs[:: len(kvs) - 1]:
        base.append(bench_baseline(s_q, 128, s_kv, 2048))
    for topk in [512, 1024, 2048] if a.quick else [256, 512, 1024, 2048, 4096]:
        topk_scan.append(bench_fwd(s_q, 128, 32768, topk, check=False))
    for b in (64, 128):
        for seqlen in [32768] if a.quick else [8192, 32768, 131072]:
            dec.append(bench_decode(b, 128, seqlen, 2048))
    for b in (1, 8):  # small batches: the grid is split-K (choose_splits)
        dec.append(bench_decode(b, 128, 32768, 2048))

    result = {
        "package": DIST,
        "device": torch.cuda.get_device_name(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "flops_convention": "fwd and decode: 2*s_q*h_q*topk*(d_qk+d_v); attn_dist: 2*s_q*h_q*topk*d_qk; d_qk=576, d_v=512",
        "timing": "median of triton.testing.do_bench (CUDA events, warm-up 25 ms, 200 ms of repeats); decode: "
        "median of triton.testing.do_bench_cudagraph (CUDA-graph replay, no host launch cost), the event "
        "timing of eager calls in ms_eager",
        "dense_bf16_matmul_tflops": peak,
        "default_configs": {
            "fwd_h128": fwd_config(128, 2048),
            "attn_dist_h128": attn_dist_config(128),
            "attn_dist_h64_s_kv_8K": attn_dist_config(64, 8192),
            "attn_dist_h64_s_kv_32K_128K": attn_dist_config(64, 32768),
            # On sm_90 the Gluon kernels run instead of the Triton ones above (rows' "backend" field).
            "gluon_enabled": gluon_enabled(),
            "gluon_fwd": GLUON_FWD,
            "gluon_attn_dist": gluon_attn_dist_config(128),
        },
        "fwd": fwd,
        "attn_dist": dist,
        "torch_baseline": base,
        "fwd_topk_scan": topk_scan,
        "decode": dec,
        "flashmla_h100_tflops_quoted": {
            "source": "figures quoted in the project's issue, not measured here",
            **FLASHMLA_H100,
        },
    }
    (out_dir / f"{DIST}.json").write_text(json.dumps(result, indent=1, default=str))
    md = render_md(result)
    (out_dir / f"{DIST}.md").write_text(md)
    plot(result, out_dir)
    print(md)


def render_md(r: dict) -> str:
    peak = r["dense_bf16_matmul_tflops"]
    lines = [
        f"Device: {r['device']} · date {r['date']} · commit `{r['git_commit'][:12]}` · torch {r['versions']['torch']}, "
        f"triton {r['versions']['triton']}",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Dense bf16 matmul measured in the same run: **{peak:.0f} TFLOPS**.",
        "",
        "Kernel family that ran (`backend` of the rows): "
        + ", ".join(
            f"{k} {'/'.join(sorted({str(x.get('backend')) for x in r[k]}))}"
            for k in ("fwd", "attn_dist", "decode")
        )
        + ".",
        "",
        "### Forward (`sparse_mla_fwd`), topk 2048, d_qk 576, d_v 512",
        "",
        "| s_q | h_q | s_kv | time (ms) | TFLOPS | % of matmul | torch gather+einsum (TFLOPS) | FlashMLA H100, quoted (TFLOPS) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {(b["h_q"], b["s_kv"]): b for b in r["torch_baseline"]}
    for f in r["fwd"]:
        b = base.get((f["h_q"], f["s_kv"]))
        q = f.get("flashmla_h100_tflops_quoted")
        b_txt = "" if b is None else f"{b['tflops']:.0f}"
        lines.append(
            f"| {f['s_q']} | {f['h_q']} | {f['s_kv']} | {f['ms']:.3f} | {f['tflops']:.0f} | {100 * f['tflops'] / peak:.0f}% | "
            f"{b_txt} | {'' if q is None else q} |"
        )
    lines += [
        "",
        "### attn_dist (head-summed probabilities from the forward's lse), topk 2048",
        "",
        "| s_q | h_q | s_kv | time (ms) | TFLOPS (2·s_q·h_q·topk·576) | time / forward time |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for d in r["attn_dist"]:
        lines.append(
            f"| {d['s_q']} | {d['h_q']} | {d['s_kv']} | {d['ms']:.3f} | {d['tflops']:.0f} | {d['ratio_to_fwd']:.2f} |"
        )
    lines += [
        "",
        "### Forward vs topk (h_q 128, s_kv 32K)",
        "",
        "| topk | time (ms) | TFLOPS |",
        "|---:|---:|---:|",
    ]
    for t in r["fwd_topk_scan"]:
        lines.append(f"| {t['topk']} | {t['ms']:.3f} | {t['tflops']:.0f} |")
    lines += [
        "",
        "### Decode (`sparse_mla_decode`), one token, h_q 128, topk 2048, paged bf16 cache (block 64)",
        "",
        "Timed as a CUDA-graph replay; the eager column times plain calls (host launch cost included).",
        "",
        "| batch | seqlen | split-K | time (µs) | TFLOPS | % of matmul | eager time (µs) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in r["decode"]:
        eager = d.get("ms_eager")
        lines.append(
            f"| {d['batch']} | {d['seqlen']} | {d.get('n_splits', 1)} | {1000 * d['ms']:.1f} | {d['tflops']:.0f} | "
            f"{100 * d['tflops'] / peak:.0f}% | {'' if eager is None else f'{1000 * eager:.1f}'} |"
        )
    return "\n".join(lines) + "\n"


def plot(r: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for h_q in (128, 64):
        pts = [f for f in r["fwd"] if f["h_q"] == h_q]
        ax.plot([p["s_kv"] for p in pts], [p["tflops"] for p in pts], "o-", label=f"sparse_mla_fwd h_q={h_q}")
        dpts = [d for d in r["attn_dist"] if d["h_q"] == h_q]
        ax.plot([p["s_kv"] for p in dpts], [p["tflops"] for p in dpts], "s--", label=f"attn_dist h_q={h_q}")
    ax.plot(
        [b["s_kv"] for b in r["torch_baseline"]],
        [b["tflops"] for b in r["torch_baseline"]],
        "x:",
        label="torch gather+einsum h_q=128",
    )
    ax.axhline(
        r["dense_bf16_matmul_tflops"], color="gray", lw=0.8, ls="--", label="dense bf16 matmul (measured)"
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("s_kv")
    ax.set_ylabel("TFLOPS")
    ax.set_title("vs s_kv (s_q 4096, topk 2048)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(
        [t["topk"] for t in r["fwd_topk_scan"]],
        [t["tflops"] for t in r["fwd_topk_scan"]],
        "o-",
        label="sparse_mla_fwd",
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("topk")
    ax.set_ylabel("TFLOPS")
    ax.set_title("forward vs topk (h_q 128, s_kv 32K)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax = axes[2]
    for b in (64, 128):
        pts = [d for d in r["decode"] if d["batch"] == b]
        ax.plot([p["seqlen"] for p in pts], [p["tflops"] for p in pts], "o-", label=f"decode batch {b}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache seqlen")
    ax.set_ylabel("TFLOPS")
    ax.set_title("decode (h_q 128, topk 2048)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.suptitle(f"sparse-mla-attn on {r['device']} ({r['date'][:10]}, {r['git_commit'][:8]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / f"{DIST}.png", dpi=110)


if __name__ == "__main__":
    main()
