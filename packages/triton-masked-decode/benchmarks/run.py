"""Benchmark driver for triton-masked-decode (``nox -s bench``).

    python packages/triton-masked-decode/benchmarks/run.py --out-dir docs/benchmarks \
        [--quick] [--seed-path .seed/seed_003.py]

Measures the HBM copy bandwidth first, then every case for this package and the baselines (the seed
Triton kernel when ``--seed-path`` is given, torch SDPA with a boolean mask, FlexAttention decode,
flash-attn's ``flash_attn_with_kvcache`` without mask when installed). Writes
``triton-masked-decode.json`` (raw numbers, device, date, commit, command), ``triton-masked-decode.md``
(tables) and ``triton-masked-decode.png`` (fraction of floor vs batch and vs density), and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_masked_decode
from bench_masked_decode import FLUSH_METHODS, Case, Runner, copy_bandwidth, load_seed

DIST = "triton-masked-decode"
SEED_L, SEED_ALLOC = 65536, 131072


def build_cases(quick: bool) -> list[Case]:
    cases: list[Case] = []
    seed_batches = [1, 8] if quick else [1, 2, 4, 8]
    for b in seed_batches:
        provs = ["ours", "ours_dense", "ours_readall", "seed", "sdpa", "flex", "flash_attn"]
        cases.append(Case("seed", b, [SEED_L] * b, SEED_ALLOC, 0.5, "random", providers=provs))
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
                providers=["ours", "ours_dense", "ours_readall", "seed", "sdpa"],
            )
        )
    sparse_batches = [1] if quick else [1, 8]
    for b in sparse_batches:
        for pattern in ("random", "cluster64"):
            for dens in (0.1, 0.25):
                if quick and (pattern, dens) == ("cluster64", 0.1):
                    continue
                cases.append(
                    Case(
                        "sparse",
                        b,
                        [SEED_L] * b,
                        SEED_L,
                        dens,
                        pattern,
                        providers=["ours", "ours_dense", "ours_sparse", "sdpa"],
                    )
                )
        cases.append(
            Case("sparse", b, [SEED_L] * b, SEED_L, 1.0, "none", providers=["ours", "sdpa", "flash_attn"])
        )
    densities = [0.1, 0.25, 0.5] if quick else [0.05, 0.1, 0.25, 0.5, 1.0]
    for dens in densities:
        cases.append(
            Case(
                "density",
                4,
                [SEED_L] * 4,
                SEED_L,
                dens,
                "random",
                providers=["ours", "ours_dense", "ours_sparse"],
            )
        )
    return cases


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


def _autotune_choices() -> list[dict]:
    """The (BLOCK_N, num_warps, num_stages) the autotuner chose per key during this run."""
    md = sys.modules["triton_masked_decode.masked_decode"]
    out = []
    for key, cfg in getattr(md._split_kernel_tuned, "cache", {}).items():
        out.append(
            {
                "key": [str(x) for x in key],
                "BLOCK_N": cfg.kwargs.get("BLOCK_N"),
                "num_warps": cfg.num_warps,
                "num_stages": cfg.num_stages,
            }
        )
    return out


def _launch_defaults() -> dict:
    """The tuned launch defaults (``_tuned.py``) and the merge kernel's launch shape this run used."""
    tuned = sys.modules["triton_masked_decode._tuned"]
    md = sys.modules["triton_masked_decode.masked_decode"]
    return {
        **{k: getattr(tuned, k) for k in dir(tuned) if k.isupper()},
        "MERGE_BLOCK_D": md._MERGE_BLOCK_D,
        "MERGE_WARPS": md._MERGE_WARPS,
    }


def _pct(r: dict, p: str) -> str:
    t = r["times_us"].get(p)
    return "—" if t is None else f"{r['floor_us'] / t * 100:.0f}% ({t:.0f} µs)"


SPARSE_GOALS = {0.1: 0.35, 0.25: 0.55}  # issue 4: time at most this fraction of the dense-mask time


def sparse_ratios(r: dict, seed: list[dict]) -> dict[str, float | None]:
    """A sparse case's time over its denominators: (a) the dense-mask time as a kernel that reads every row
    is bound by it -- the read-once floor ("floor") and this package's dense loop reading every row with
    the same batch's 50% mask ("read_all"); (b) this package's own 50%-mask time ("own_50"), stricter."""
    t = r["times_us"].get("ours")
    same = [s for s in seed if s["batch"] == r["batch"]]
    d = same[0]["times_us"] if same else {}

    def over(base: float | None) -> float | None:
        return t / base if t and base else None

    return {
        "floor": over(r["floor_us"]),
        "read_all": over(d.get("ours_readall")),
        "own_50": over(d.get("ours")),
    }


def sparse_verdicts(sp: list[dict], seed: list[dict]) -> list[dict]:
    """Per sparse case with a goal: the ratios and whether the goal is met under reading (a) and (b)."""
    out = []
    for r in sp:
        goal = SPARSE_GOALS.get(r["density"]) if r["pattern"] != "none" else None
        if goal is None:
            continue
        rt = sparse_ratios(r, seed)
        a = [x for x in (rt["floor"], rt["read_all"]) if x is not None]
        out.append(
            {
                "batch": r["batch"],
                "mask": f"{r['pattern']} {r['density'] * 100:.0f}%",
                "goal": goal,
                **rt,
                "met_a": bool(a) and max(a) <= goal,
                "met_b": rt["own_50"] is not None and rt["own_50"] <= goal,
            }
        )
    return out


def sparse_table(sp: list[dict], seed: list[dict]) -> list[str]:
    def f2(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    lines = [
        "### Sparse masks (seed shapes, L=64K): time over the same batch's dense-mask time, two readings",
        "",
        "Goal (issue 4): 10% visible at most 0.35×, 25% visible at most 0.55× \"the same shape's dense-mask "
        'time — i.e. faster than the dense floor that every other kernel is bound by". '
        "**(a)** the dense-mask time as every kernel that reads the cache is bound by it: the read-once "
        "floor (K, V and the mask once at the copy bandwidth) and this package's dense loop reading every "
        "row at the same batch (50% mask, column *dense loop, all rows read* above); met when both ratios "
        "are within the goal. **(b)** this package's own 50%-random-mask time at the same batch "
        "(`masked_decode` auto, which already skips the excluded half of the rows): stricter.",
        "",
        "| batch | mask | masked_decode (auto) | goal | (a) × read-once floor | (a) × all-rows-read 50%-mask time "
        "| (b) × own 50%-mask time | met (a) | met (b) | dense loop | sparse loop | torch SDPA + bool mask |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdict = {(v["batch"], v["mask"]): v for v in sparse_verdicts(sp, seed)}
    for r in sp:
        t = r["times_us"].get("ours")
        rt = sparse_ratios(r, seed)
        mask_name = "none" if r["pattern"] == "none" else f"{r['pattern']} {r['density'] * 100:.0f}%"
        v = verdict.get((r["batch"], mask_name))
        goal = f"≤ {v['goal']:.2f}" if v else ""
        met_a = ("**yes**" if v["met_a"] else "no") if v else ""
        met_b = ("**yes**" if v["met_b"] else "no") if v else ""
        cells = " | ".join(
            "—" if r["times_us"].get(p) is None else f"{r['times_us'][p]:.0f} µs"
            for p in ("ours_dense", "ours_sparse", "sdpa")
        )
        tt = "—" if t is None else f"{t:.0f} µs"
        lines.append(
            f"| {r['batch']} | {mask_name} | {tt} | {goal} | {f2(rt['floor'])} | {f2(rt['read_all'])} "
            f"| {f2(rt['own_50'])} | {met_a} | {met_b} | {cells} |"
        )
    vs = list(verdict.values())
    if vs:

        def names(ok: list[dict]) -> str:
            return ", ".join(f"batch {v['batch']} {v['mask']}" for v in ok) or "none"

        lines += [
            "",
            f"Met under (a): {sum(v['met_a'] for v in vs)} of {len(vs)} sparse cases"
            f" (missed: {names([v for v in vs if not v['met_a']])}). "
            f"Met under (b): {sum(v['met_b'] for v in vs)} of {len(vs)}"
            f" (missed: {names([v for v in vs if not v['met_b']])}).",
        ]
    lines.append("")
    return lines


def make_tables(results: list[dict], bw: float) -> str:
    lines = [
        f"HBM copy bandwidth (read + write): **{bw / 1e12:.2f} TB/s**. Cells: fraction of the read-once floor (time).",
        "",
    ]
    seed = [r for r in results if r["group"] == "seed"]
    if seed:
        lines += [
            "### Seed shapes: Hq=32, Hkv=8, D=128, fp16, 64K valid of 128K, random 50% mask",
            "",
            "| batch | floor | masked_decode (auto) | dense loop | dense loop, all rows read | seed Triton | torch SDPA + bool mask | FlexAttention | flash_attn_with_kvcache (no mask) | speed-up vs SDPA |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in seed:
            t, s = r["times_us"].get("ours"), r["times_us"].get("sdpa")
            sp = f"{s / t:.2f}x" if t and s else "—"
            cells = " | ".join(
                _pct(r, p)
                for p in ("ours", "ours_dense", "ours_readall", "seed", "sdpa", "flex", "flash_attn")
            )
            lines.append(f"| {r['batch']} | {r['floor_us']:.0f} µs | {cells} | {sp} |")
        lines.append("")
    rag = [r for r in results if r["group"] == "ragged"]
    if rag:
        lines += [
            "### Ragged batches: lengths uniform in [4K, 32K] (seqlens tensor), 32K allocated, random 50% mask",
            "",
            "| batch | mean length | floor | masked_decode (auto) | dense loop | dense loop, all rows read | seed Triton (reads padded 32K) | torch SDPA + bool mask |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rag:
            cells = " | ".join(_pct(r, p) for p in ("ours", "ours_dense", "ours_readall", "seed", "sdpa"))
            lines.append(f"| {r['batch']} | {r['mean_length']:.0f} | {r['floor_us']:.0f} µs | {cells} |")
        lines.append("")
    sp = [r for r in results if r["group"] == "sparse"]
    if sp:
        lines += sparse_table(sp, seed)
    dn = [r for r in results if r["group"] == "density"]
    if dn:
        lines += [
            "### Density sweep (batch 4, L=64K, random mask): fraction of the dense read-once floor",
            "",
            "| visible | auto | dense loop | sparse loop |",
            "|---|---|---|---|",
        ]
        for r in dn:
            cells = " | ".join(_pct(r, p) for p in ("ours", "ours_dense", "ours_sparse"))
            lines.append(f"| {r['density'] * 100:.1f}% | {cells} |")
        lines.append("")
    return "\n".join(lines)


def make_plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    seed = [r for r in results if r["group"] == "seed"]
    labels = {
        "ours": "masked_decode",
        "seed": "seed Triton",
        "sdpa": "SDPA + bool mask",
        "flex": "FlexAttention",
        "flash_attn": "flash_attn (no mask)",
    }
    for p, lab in labels.items():
        pts = [(r["batch"], r["floor_us"] / r["times_us"][p]) for r in seed if r["times_us"].get(p)]
        if pts:
            ax1.plot(*zip(*pts, strict=True), marker="o", label=lab)
    ax1.axhline(1.0, color="gray", ls="--", lw=0.8)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch (Hq=32, Hkv=8, D=128, 64K of 128K, 50% mask)")
    ax1.set_ylabel("fraction of read-once floor")
    ax1.legend(fontsize=8)
    dn = sorted((r for r in results if r["group"] == "density"), key=lambda r: r["density"])
    for p, lab in (("ours", "auto"), ("ours_dense", "dense loop"), ("ours_sparse", "sparse loop")):
        pts = [(r["density"], r["floor_us"] / r["times_us"][p]) for r in dn if r["times_us"].get(p)]
        if pts:
            ax2.plot(*zip(*pts, strict=True), marker="o", label=lab)
    if dn:
        ax2.plot(
            [r["density"] for r in dn],
            [1 / max(r["density"], 1e-3) for r in dn],
            color="gray",
            ls=":",
            label="visible-rows bound",
        )
    ax2.axhline(1.0, color="gray", ls="--", lw=0.8)
    ax2.set_xlabel("visible fraction (batch 4, L=64K, random mask)")
    ax2.set_ylabel("fraction of dense read-once floor")
    ax2.set_yscale("log")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _md_text(meta: dict, tables: str) -> str:
    fa = meta.get("flash_attn_installed")
    fa_note = (
        "\n\nflash-attn was not installed on this machine: the `flash_attn_with_kvcache` columns are empty."
        if fa is False
        else ""
    )
    return (
        f"<!-- generated by packages/{DIST}/benchmarks/run.py -->\n"
        f"Device: {meta['device']}; date: {meta['date']}; commit: `{meta['commit']}`; torch {meta['torch']}, "
        f"triton {meta['triton']}.\n\nCommand: `{meta['command']}`{fa_note}\n\n"
        f"Timing: {meta.get('timing', 'see the JSON')}.\n\n{tables}\n"
    )


def render_from(json_path: Path, out_dir: Path) -> None:
    """Rebuild the table and plot from saved raw numbers (the JSON keeps the measuring run's metadata)."""
    meta = json.loads(json_path.read_text())
    tables = make_tables(meta["results"], meta["copy_bandwidth_Bps"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{DIST}.md").write_text(_md_text(meta, tables))
    make_plot(meta["results"], out_dir / f"{DIST}.png")
    print(tables)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="docs/benchmarks")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--seed-path", default=None, help="path of the seed script whose Triton kernel is compared"
    )
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles per shape)")
    ap.add_argument(
        "--flush",
        choices=FLUSH_METHODS,
        default=bench_masked_decode.DEFAULT_FLUSH,
        help="L2 flush before each timed call: read a 256 MB buffer (clean, default) or write zeros to it "
        "(zero, what triton.testing.do_bench does; leaves dirty lines to be written back during the call)",
    )
    ap.add_argument(
        "--render-from",
        default=None,
        help="re-render the .md and .png from an existing JSON (no measurement)",
    )
    args = ap.parse_args()
    if args.render_from:
        render_from(Path(args.render_from), Path(args.out_dir))
        return
    if not torch.cuda.is_available():
        sys.exit("run.py needs a CUDA GPU (or --render-from JSON)")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    bench_masked_decode.DEFAULT_FLUSH = args.flush
    bw = copy_bandwidth()
    log(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {bw / 1e12:.3f} TB/s")
    seed_mod = None
    if args.seed_path:
        try:
            seed_mod = load_seed(args.seed_path)
        except Exception as e:
            log(f"seed kernel not loaded from {args.seed_path}: {e}")
    runner = Runner(seed_mod, bw, flex_ok=not args.no_flex)
    results: list[dict] = []

    def write_outputs() -> str:
        # Rewritten after every case, so that a run cut short still leaves its numbers.
        tables = make_tables(results, bw)
        meta = {
            "package": DIST,
            "device": torch.cuda.get_device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _git_commit(),
            "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "copy_bandwidth_Bps": bw,
            "timing": (
                "median over CUDA-graph replays (event-timed, triton.testing.do_bench's loop), L2 flushed before "
                f"each by {'reading' if args.flush == 'clean' else 'writing zeros to'} a 256 MB buffer "
                f"(flush={args.flush}); microseconds"
            ),
            "flush": args.flush,
            "floor": "K+V over valid lengths + bool mask (1 B/position) + q + out, at the measured copy bandwidth",
            "quick": args.quick,
            "flash_attn_installed": runner.fa_kvcache is not None,
            "autotuned_configs": _autotune_choices(),
            "launch_defaults": _launch_defaults(),
            # Issue 4's sparse goals per case under both readings (see sparse_ratios / the .md table).
            "sparse_goals": sparse_verdicts(
                [r for r in results if r["group"] == "sparse"], [r for r in results if r["group"] == "seed"]
            ),
            "results": results,
        }
        (out_dir / f"{DIST}.json").write_text(json.dumps(meta, indent=1))
        (out_dir / f"{DIST}.md").write_text(_md_text(meta, tables))
        return tables

    for c in build_cases(args.quick):
        results.append(runner.run_case(c, log))
        write_outputs()
    tables = write_outputs()
    try:
        make_plot(results, out_dir / f"{DIST}.png")
    except Exception as e:
        log(f"plot failed: {e}")
    print(tables)


if __name__ == "__main__":
    main()
