"""Shared helpers of the training-path benchmarks (bench_backward.py, bench_indexer.py).

Both write into one pair of files, ``<out-dir>/sparse-mla-attn-training.json`` (one section per bench, raw
numbers, device, date, commit, command) and ``.md`` (the tables), regenerated from the JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import triton

STEM = "sparse-mla-attn-training"
# Public sparse MLA backward figures, quoted for context only (not measured here).
TILELANG_NOTE = (
    "public tilelang sparse MLA backward examples report about 100-115 TFLOPS on H800/H200, counting "
    "2 * H * topk * (2 * d_v + 3 * d_qk) FLOPs per token (1.012x the count used here) at h_q 64, s_kv 8K, causal; "
    "quoted for context, not measured in this run (compare the h_q 64 row)"
)


def time_ms(fn, *, warmup: int = 25, rep: int = 200) -> float:
    """Median time of ``fn`` in ms (CUDA events via triton.testing.do_bench)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def dense_matmul_tflops(n: int = 8192) -> float:
    """Measured bf16 dense matmul rate on random data: this run's compute roofline."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / time_ms(lambda: a @ b) / 1e9


def copy_bandwidth_gbs(n_bytes: int = 2 << 30) -> float:
    """Measured device-to-device copy rate (bytes read + written): this run's memory roofline."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * n_bytes / time_ms(lambda: dst.copy_(src)) / 1e6


def metadata() -> dict[str, Any]:
    commit = os.environ.get("BENCH_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def kernel_resources(compiled: Any) -> dict[str, Any]:
    if compiled is None:
        return {}
    asm = getattr(compiled, "asm", {}) or {}
    return {
        "n_regs": getattr(compiled, "n_regs", None),
        "n_spills": getattr(compiled, "n_spills", None),
        "shared_bytes": getattr(getattr(compiled, "metadata", None), "shared", None),
        "wgmma": "wgmma" in asm.get("ptx", ""),
    }


def update_results(out_dir: str | None, section: str, data: dict[str, Any]) -> None:
    """Store ``data`` under ``section`` of the JSON in ``out_dir`` and rewrite the Markdown tables."""
    if not out_dir:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{STEM}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[section] = data
    path.write_text(json.dumps(results, indent=2) + "\n")
    md = render_markdown(results)
    (out / f"{STEM}.md").write_text(md)
    print(f"wrote {path} and {out / f'{STEM}.md'}")


def render_markdown(results: dict[str, Any]) -> str:
    lines = ["# sparse-mla-attn training path: benchmark results", ""]
    b = results.get("backward")
    if b:
        m = b["meta"]
        lines += [
            "## Backward (`sparse_mla_bwd`)",
            "",
            f"{m['device']}, {m['date']}, commit `{m['commit'][:12]}`, torch {m['torch']}, triton {m['triton']}.",
            f"Command: `{m['command']}`.",
            "",
            "TFLOPS = 2.5 x the forward's FLOPs `2 * s_q * h_q * topk * (d_qk + d_v)` / time "
            f"(d_qk {b['d_qk']}, d_v {b['d_v']}); median of many runs after warm-up. Dense bf16 matmul "
            f"(8192^3, random data) measured in the same run: **{b['dense_matmul_tflops']:.0f} TFLOPS**.",
            "",
            "| s_q | h_q | topk | s_kv | default ms | default TFLOPS | % of matmul | deterministic ms "
            "| deterministic TFLOPS | det / default |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in b["rows"]:
            lines.append(
                f"| {r['s_q']} | {r['h_q']} | {r['topk']} | {r['s_kv']} | {r['ms']:.2f} | {r['tflops']:.0f} "
                f"| {100 * r['tflops'] / b['dense_matmul_tflops']:.0f}% | {r['det_ms']:.2f} | {r['det_tflops']:.0f} "
                f"| {r['det_ms'] / r['ms']:.2f}x |"
            )
        if b.get("baseline"):
            bl = b["baseline"]
            lines += [
                "",
                f"Baseline in the same run: the chunked float32 torch reference `sparse_mla_bwd_ref` at "
                f"s_q {bl['s_q']}, h_q {bl['h_q']}, topk {bl['topk']}: {bl['ms']:.1f} ms "
                f"({bl['tflops']:.0f} TFLOPS by the same counting).",
            ]
        if b.get("check"):
            c = b["check"]
            lines += [
                "",
                f"Accuracy at the first row's shape against that reference (relative Frobenius error): "
                f"dq {c['dq_rel_err']:.2e}, dkv {c['dkv_rel_err']:.2e}; deterministic mode dq "
                f"{c['det_dq_rel_err']:.2e}, dkv {c['det_dkv_rel_err']:.2e}; two deterministic runs bit-identical: "
                f"{c['det_bit_identical']}.",
            ]
        r0 = b["rows"][0]
        if "attn_sum_ms" in r0:
            lines += [
                "",
                f"Indexer target as a by-product (`return_attn_sum=True`) at the first row's shape: backward "
                f"{r0['attn_sum_ms']:.2f} ms with it vs {r0['ms']:.2f} ms without (+{r0['attn_sum_ms'] - r0['ms']:.2f} "
                f"ms), against {r0['attn_dist_ms']:.2f} ms for a separate `attn_dist` pass; relative error against "
                f"`attn_dist`: {r0['attn_sum_rel_err_vs_attn_dist']:.1e}.",
            ]
        for key, mode in (("breakdown", "default"), ("breakdown_det", "deterministic")):
            if b.get(key):
                total = sum(b[key].values())
                lines += [
                    "",
                    f"Where the time goes at the first row's shape, {mode} mode (torch profiler, device ms per "
                    f"call, sum {total:.2f} ms):",
                    "",
                    "| kernel | ms | share |",
                    "|---|---|---|",
                ]
                big = {k: v for k, v in b[key].items() if v >= 0.01 * total}
                lines += [f"| `{k[:70]}` | {v:.2f} | {100 * v / total:.0f}% |" for k, v in big.items()]
                rest = total - sum(big.values())
                if rest > 0:
                    n_rest = len(b[key]) - len(big)
                    lines.append(
                        f"| {n_rest} other kernels, each under 1% (preprocess, torch sort, copies, fills) | {rest:.2f} | {100 * rest / total:.0f}% |"
                    )
        if b.get("sweep"):
            lines += [
                "",
                "Other kernel configurations timed in the same run at the first row's shape (`SPLIT_DKV` 0: the "
                "fused kernel, dkv products per 64-head block inside the main kernel, the default before the "
                "separate dkv kernel; `N_CSPLIT`: channel groups of the dkv kernel; `DKV_WRITE` 1 / 2 are "
                "diagnostics that compute a wrong dkv: plain stores instead of atomics / no dkv update):",
                "",
                "| config (changes from the default) | mode | ms | TFLOPS |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| `{sw['config']}` | {'deterministic' if sw.get('deterministic') else 'default'} | {sw['ms']:.2f} "
                f"| {sw['tflops']:.0f} |"
                for sw in b["sweep"]
            ]
        lines += ["", f"Context: {TILELANG_NOTE}.", ""]
    ix = results.get("indexer")
    if ix:
        m = ix["meta"]
        lines += [
            "## Indexer logits forward (`indexer_logits`)",
            "",
            f"{m['device']}, {m['date']}, commit `{m['commit'][:12]}`. Command: `{m['command']}`.",
            "",
            "FLOPs = `2 * pairs * h_idx * d_idx`, pairs = s_q * s_kv (causal: only the unmasked pairs; the "
            "queries are the last s_q positions and the kernel skips fully masked tiles). Roofline time = max(FLOPs / measured dense bf16 matmul "
            f"rate ({ix['dense_matmul_tflops']:.0f} TFLOPS), bytes / measured copy rate "
            f"({ix['copy_gbs']:.0f} GB/s)), bytes = q + k + weights read once + fp32 logits written once.",
            "",
            "| s_q | h_idx | d_idx | s_kv | causal | ms | TFLOPS | roofline ms | % of roofline | torch bf16 ms |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in ix["rows"]:
            lines.append(
                f"| {r['s_q']} | {r['h_idx']} | {r['d_idx']} | {r['s_kv']} | {r['causal']} | {r['ms']:.3f} "
                f"| {r['tflops']:.0f} | {r['roofline_ms']:.3f} | {100 * r['roofline_ms'] / r['ms']:.0f}% "
                f"| {'not run' if r['torch_ms'] != r['torch_ms'] else format(r['torch_ms'], '.3f')} |"
            )
        lines.append("")
        if ix.get("bwd_rows"):
            lines += [
                "## Indexer logits backward (`indexer_logits` to `q_idx`, `k_idx`, `weights`)",
                "",
                "Same run. Minimum FLOPs = 3 x the forward's (`z = q·k`, `dq`, `dk`; the two kernels execute 4, "
                "recomputing `z` in each); roofline time = max(minimum FLOPs / matmul rate, bytes / copy rate), "
                "bytes = the fp32 upstream gradient + q, k, weights read once + their gradients written once. "
                "Baseline: the former chunked float32 torch backward (`_indexer_logits_bwd_torch`); rel. err. = "
                "relative Frobenius error against it (dq / dk / dweights).",
                "",
                "| s_q | h_idx | d_idx | s_kv | causal | ms | TFLOPS (3 products) | roofline ms | % of roofline "
                "| torch fp32 ms | rel. err. | same bits on rerun |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in ix["bwd_rows"]:
                e = r.get("rel_err_vs_torch_fp32", {})
                torch_ms = "not run" if r["torch_ms"] != r["torch_ms"] else format(r["torch_ms"], ".1f")
                lines.append(
                    f"| {r['s_q']} | {r['h_idx']} | {r['d_idx']} | {r['s_kv']} | {r['causal']} | {r['ms']:.3f} "
                    f"| {r['tflops_min']:.0f} | {r['roofline_ms']:.3f} | {100 * r['roofline_ms'] / r['ms']:.0f}% "
                    f"| {torch_ms} | {' / '.join(f'{v:.1e}' for v in e.values())} "
                    f"| {r.get('bit_identical_rerun')} |"
                )
            lines.append("")
    return "\n".join(lines)
