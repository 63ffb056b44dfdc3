"""Benchmark of triton-masked-decode: writes the published results file and figure.

    python packages/triton-masked-decode/benchmarks/run.py [--quick] [--baseline-kernel PATH]

Measures the HBM copy bandwidth first, then every case with this package and the comparators (torch SDPA
with a boolean mask, FlexAttention, flash-attn's ``flash_attn_with_kvcache`` without a mask when installed,
and with ``--baseline-kernel`` the Triton ``triton_masked_flash_decoding`` of the given script). Writes
``<out-dir>/triton-masked-decode/<gpu>.json`` (raw numbers, device, date, commit, command) and
``<gpu>.png`` (``<gpu>`` e.g. ``h200``), and prints the docs page's table; ``--update-page`` also puts the
figure and the table into ``docs/triton-masked-decode/benchmarks.md``. ``--render-from JSON`` redraws the
figure and the table from a results file without measuring.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_masked_decode import Case, Runner, copy_bandwidth, load_baseline

DIST = "triton-masked-decode"
L64K, ALLOC = 65536, 131072
BATCH_PROVIDERS = [
    "ours",
    "ours_eager",
    "ours_eager_b2b",
    "ours_dense",
    "baseline_triton",
    "sdpa",
    "sdpa_eager",
    "sdpa_eager_b2b",
    "flex",
    "flash_attn",
]
LABELS = {
    "ours": "masked_decode (graph)",
    "ours_eager": "masked_decode, eager from idle",
    "ours_eager_b2b": "masked_decode, eager back-to-back",
    "ours_dense": "dense loop (graph)",
    "ours_sparse": "sparse loop (graph)",
    "baseline_triton": "triton_masked_flash_decoding script",
    "sdpa": "SDPA + bool mask (graph)",
    "sdpa_eager": "SDPA, eager from idle",
    "sdpa_eager_b2b": "SDPA, eager back-to-back",
    "flex": "FlexAttention",
    "flash_attn": "flash_attn (no mask)",
}
TIMING = (
    "median microseconds, L2 flushed before each call by reading 256 MB. Providers without a suffix: "
    "CUDA-graph replay of the call. *_eager: a direct call with default arguments started from an idle "
    "GPU (the host waits for the flush, then calls), so the whole host cost of the call is in the time. "
    "*_eager_b2b: direct calls back-to-back as triton.testing.do_bench makes them (flush, call, flush, "
    "call, ... timed with events; the host runs ahead, so host cost counts only where it exceeds the "
    "flush's GPU time). host_us: median wall-clock host time of one eager call (launch included), "
    "measured around each call"
)


def build_cases(quick: bool) -> list[Case]:
    """Batch sweep at Hq 32, Hkv 8, D 128, fp16 (64K valid of 128K, random 50% mask); a short cache; ragged
    batches; sparse masks at batch 1 and 8; FP8 caches at batch 8; a density sweep at batch 4."""
    cases = [
        Case("batch", b, [L64K] * b, ALLOC, 0.5, "random", providers=BATCH_PROVIDERS)
        for b in ([1, 8] if quick else [1, 2, 4, 8])
    ]
    cases.append(
        Case(
            "short",
            1,
            [1024],
            1024,
            0.5,
            "random",
            providers=["ours", "ours_eager", "ours_eager_b2b", "sdpa", "sdpa_eager", "sdpa_eager_b2b"],
        )
    )
    rng = random.Random(0)
    for b in [32] if quick else [32, 64]:
        lens = [rng.randint(4096, 32768) for _ in range(b)]
        cases.append(
            Case(
                "ragged",
                b,
                lens,
                32768,
                0.5,
                "random",
                providers=["ours", "ours_dense", "baseline_triton", "sdpa"],
            )
        )
    for b in [1] if quick else [1, 8]:
        for pattern in ("random", "cluster64"):
            for dens in (0.1, 0.25):
                sparse = ["ours", "ours_dense", "ours_sparse", "sdpa"]
                cases.append(Case("sparse", b, [L64K] * b, L64K, dens, pattern, providers=sparse))
        cases.append(
            Case("sparse", b, [L64K] * b, L64K, 1.0, "none", providers=["ours", "sdpa", "flash_attn"])
        )
    for dens in (0.5, 0.1):  # FP8 K/V (per-tensor scales as device tensors), CUDA graph and eager
        cases.append(
            Case(
                "fp8",
                8,
                [L64K] * 8,
                L64K,
                dens,
                "random",
                providers=["ours", "ours_eager", "ours_eager_b2b"],
                kv_dtype="fp8",
            )
        )
    for dens in [0.1, 0.25, 0.5] if quick else [0.05, 0.1, 0.25, 0.5, 1.0]:
        cases.append(
            Case(
                "density",
                4,
                [L64K] * 4,
                L64K,
                dens,
                "random",
                providers=["ours", "ours_dense", "ours_sparse"],
            )
        )
    return cases


def gpu_kind(device_name: str) -> str:
    """``h200`` for "NVIDIA H200", ``h100`` for "NVIDIA H100 80GB HBM3", else the name in lower case."""
    m = re.search(r"\b([A-Z]+\d+[A-Z]?)\b", device_name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"\W+", "-", device_name)).lower()


def _git_commit() -> str:
    """``TMD_COMMIT`` when set (a copied tree may carry a stale ``.git``), else the checkout's HEAD."""
    if os.environ.get("TMD_COMMIT"):
        return os.environ["TMD_COMMIT"]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except Exception:
        return "unknown"


def _command() -> str:
    """The command line of this run, with the ``PYTHONPATH`` it was given."""
    path = os.environ.get("PYTHONPATH")
    prefix = f"PYTHONPATH={shlex.quote(path)} " if path else ""
    return prefix + "python " + " ".join(shlex.quote(a) for a in sys.argv)


def _cell(r: dict, p: str) -> str:
    t = r["times_us"].get(p)
    return "—" if t is None else f"{t:.1f}"


def make_table(results: list[dict]) -> str:
    """The docs page's table: microseconds per call, every case, the main providers."""
    cols = [
        "ours",
        "ours_eager",
        "ours_eager_b2b",
        "ours_dense",
        "ours_sparse",
        "sdpa",
        "sdpa_eager",
        "sdpa_eager_b2b",
        "flex",
        "baseline_triton",
    ]
    cols = [p for p in cols if any(r["times_us"].get(p) for r in results)]
    lines = [
        "| case | read-once floor | " + " | ".join(LABELS[p] for p in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for r in results:
        lines.append(f"| {r['case']} | {r['floor_us']:.1f} | " + " | ".join(_cell(r, p) for p in cols) + " |")
    return "\n".join(lines)


PAGE = Path(__file__).resolve().parents[3] / "docs" / DIST / "benchmarks.md"
PAGE_START, PAGE_END = "<!-- results: start (run.py --update-page) -->", "<!-- results: end -->"


CASE_TEXT = {
    "batch": "`batch-B<b>`: Hq 32, Hkv 8, D 128, fp16, 64K valid positions of 128K, random 50% mask",
    "short": "`short`: the same at batch 1 and L 1K",
    "ragged": "`ragged`: lengths uniform in [4K, 32K] given as a `seqlens` tensor",
    "sparse": "`sparse`: L 64K with 10% or 25% visible, random or in clusters of 64 positions, or no mask",
    "density": "`density`: batch 4, L 64K, random masks",
    "fp8": "`fp8`: batch 8, L 64K, FP8 (e4m3) K/V with per-tensor scales as device tensors, random masks; its "
    "floor counts K and V at one byte per value",
}


def page_block(meta: dict) -> str:
    """The results part of the docs page: the figure, what was measured where, and the table."""
    kind, date = meta["gpu_kind"], meta["date"][:10]
    groups = dict.fromkeys(r["group"] for r in meta["results"])
    cases = "; ".join(CASE_TEXT[g] for g in groups if g in CASE_TEXT)
    text = (
        f"One {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {date}. Microseconds per call "
        f"(lower is faster); *read-once floor* is the time to read K and V over the valid lengths once (with the "
        f"mask, q and out) at the copy bandwidth measured in the same run: a masked call reads only the visible "
        f"rows, so it can beat it. *(graph)*: CUDA-graph replay of the call; *eager from idle*: a direct call "
        f"with default arguments started from an idle GPU, so its whole host cost counts (its latency); *eager "
        f"back-to-back*: direct calls one after another as `triton.testing.do_bench` makes them, the host "
        f"running ahead of the GPU. Cases: {cases}. Raw numbers (with the host time of each eager call), device, "
        f"date, commit and command: `docs/benchmarks/{DIST}/{kind}.json`."
    )
    figure = "Dense read-once floor over the time of a call, against batch and against the visible fraction"
    return "\n".join(
        [
            PAGE_START,
            f"![{figure}](../benchmarks/{DIST}/{kind}.png)",
            "",
            textwrap.fill(text, width=110, break_on_hyphens=False),
            "",
            make_table(meta["results"]),
            PAGE_END,
        ]
    )


def update_page(meta: dict) -> None:
    text = PAGE.read_text()
    head, rest = text.split(PAGE_START, 1)
    tail = rest.split(PAGE_END, 1)[1]
    PAGE.write_text(head + page_block(meta) + tail)
    print(f"updated {PAGE}")


def make_plot(results: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    batch = [r for r in results if r["group"] == "batch"]
    for p in ("ours", "ours_eager", "ours_eager_b2b", "baseline_triton", "sdpa", "flex", "flash_attn"):
        pts = [(r["batch"], r["floor_us"] / r["times_us"][p]) for r in batch if r["times_us"].get(p)]
        if pts:
            ax1.plot(*zip(*pts, strict=True), marker="o", label=LABELS[p])
    ax1.axhline(1.0, color="gray", ls="--", lw=0.8)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch (Hq=32, Hkv=8, D=128, 64K of 128K, 50% mask)")
    ax1.set_ylabel("fraction of read-once floor (higher is faster)")
    ax1.legend(fontsize=8, loc="best")
    dn = sorted((r for r in results if r["group"] == "density"), key=lambda r: r["density"])
    for p in ("ours", "ours_dense", "ours_sparse"):
        pts = [(r["density"], r["floor_us"] / r["times_us"][p]) for r in dn if r["times_us"].get(p)]
        if pts:
            ax2.plot(*zip(*pts, strict=True), marker="o", label=LABELS[p])
    if dn:
        xs = [r["density"] for r in dn]
        ax2.plot(xs, [1 / max(x, 1e-3) for x in xs], color="gray", ls=":", label="visible-rows bound")
    ax2.axhline(1.0, color="gray", ls="--", lw=0.8)
    ax2.set_xlabel("visible fraction (batch 4, L=64K, random mask)")
    ax2.set_ylabel("fraction of dense read-once floor")
    ax2.set_yscale("log")
    ax2.legend(fontsize=8)
    fig.suptitle(device, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def eager_summary(results: list[dict]) -> str:
    """Eager calls against their graph replay (batch 1 and 8 at L 64K, within 1.15x?) and against SDPA's
    eager call (batch 1, L 1K, no slower?), by both eager methods, with the host time of a call."""
    rows = {r["case"]: r for r in results}
    lines = ["eager summary (ratio; host time of one call):"]

    def host(r: dict, p: str) -> str:
        h = r.get("host_us", {}).get(p)
        return "—" if h is None else f"{h:.1f} us"

    for case in ("batch-B1-L64K-random50", "batch-B8-L64K-random50"):
        r = rows.get(case)
        if r is None:
            continue
        graph = r["times_us"].get("ours")
        for p, how in (("ours_eager", "from idle"), ("ours_eager_b2b", "back-to-back")):
            t = r["times_us"].get(p)
            if graph and t:
                ratio = t / graph
                lines.append(
                    f"  {case:24s} eager {how:12s} / graph  {t:7.1f} / {graph:7.1f} = {ratio:5.2f}"
                    f"  within 1.15x: {'yes' if ratio <= 1.15 else 'NO'}  host {host(r, p)}"
                )
    r = rows.get("short-B1-L1K-random50")
    if r is not None:
        for p, s, how in (
            ("ours_eager", "sdpa_eager", "from idle"),
            ("ours_eager_b2b", "sdpa_eager_b2b", "back-to-back"),
        ):
            t, ts = r["times_us"].get(p), r["times_us"].get(s)
            if t and ts:
                lines.append(
                    f"  {r['case']:24s} eager {how:12s} / SDPA eager  {t:7.1f} / {ts:7.1f} = {t / ts:5.2f}"
                    f"  no slower: {'yes' if t <= ts else 'NO'}  host {host(r, p)} (SDPA {host(r, s)})"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out-dir", default="docs/benchmarks", help="results go to OUT_DIR/triton-masked-decode/"
    )
    ap.add_argument(
        "--quick", action="store_true", help="fewer batches and masks (about a third of the time)"
    )
    ap.add_argument("--baseline-kernel", default=None, help="script defining triton_masked_flash_decoding")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles per shape)")
    ap.add_argument("--render-from", default=None, help="redraw the figure and table from a results JSON")
    ap.add_argument("--update-page", action="store_true", help="put figure and table into the docs page")
    args = ap.parse_args()
    if args.render_from:
        meta = json.loads(Path(args.render_from).read_text())
        make_plot(meta["results"], Path(args.render_from).with_suffix(".png"), meta["device"])
        print(make_table(meta["results"]))
        print("\n" + eager_summary(meta["results"]))
        if args.update_page:
            update_page(meta)
        return
    if not torch.cuda.is_available():
        sys.exit("run.py needs a CUDA GPU (or --render-from JSON)")
    device = torch.cuda.get_device_name()
    out_dir = Path(args.out_dir) / DIST
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{gpu_kind(device)}.json"
    bw = copy_bandwidth()
    print(f"device: {device}  copy bandwidth (read+write): {bw / 1e12:.3f} TB/s", flush=True)
    baseline = load_baseline(args.baseline_kernel) if args.baseline_kernel else None
    runner = Runner(baseline, bw, flex_ok=not args.no_flex)
    meta = {
        "package": DIST,
        "device": device,
        "gpu_kind": gpu_kind(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "command": _command(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_bandwidth_Bps": bw,
        "timing": TIMING,
        "floor": "K+V over valid lengths (2 B/value fp16, 1 B/value FP8 + its scales) + bool mask (1 B/position) "
        "+ q + out, at the measured copy bandwidth",
        "flash_attn_installed": runner.fa_kvcache is not None,
        "results": [],
    }
    # torch.compile (FlexAttention) runs after every other measurement, so no eager row is timed in a
    # process where it has run and some rows not.
    cases = build_cases(args.quick)
    later = [
        (i, dataclasses.replace(c, providers=["flex"])) for i, c in enumerate(cases) if "flex" in c.providers
    ]
    for c in cases:
        c.providers = [p for p in c.providers if p != "flex"]
        meta["results"].append(runner.run_case(c, lambda msg: print(msg, flush=True)))
        json_path.write_text(json.dumps(meta, indent=1) + "\n")  # a run cut short still leaves its numbers
    for i, c in later:
        res = runner.run_case(c, lambda msg: print(msg, flush=True))
        for field in ("times_us", "errors", "method"):
            meta["results"][i].setdefault(field, {}).update(res.get(field, {}))
        json_path.write_text(json.dumps(meta, indent=1) + "\n")
    try:
        make_plot(meta["results"], json_path.with_suffix(".png"), device)
    except ImportError:
        print(f"matplotlib is missing: draw the figure with `run.py --render-from {json_path}` elsewhere")
    print(f"wrote {json_path}\n")
    print(make_table(meta["results"]))
    print("\n" + eager_summary(meta["results"]))
    if args.update_page:
        update_page(meta)


if __name__ == "__main__":
    main()
