"""``eplb`` command line: ``eplb plan`` and ``eplb compare`` (needs the ``cli`` extra for ``rich``).

Bad input (files, topology, options) ends with a one-line message on standard error and exit status 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

import eplb_core
from eplb_core import io
from eplb_core._numba import runner
from eplb_core.history import expected_load
from eplb_core.metrics import balancedness
from eplb_core.placement import Placement, gpu_loads_of
from eplb_core.planner import plan
from eplb_core.reference import greedy_rebalance

__all__ = ["CliError", "demo_history", "main", "plot_heatmap", "static_gpu_loads"]

INSTALL_HINT = "the eplb command needs rich: pip install 'eplb-core[cli]'"


class CliError(ValueError):
    """Bad command-line input: printed as one line, exit status 2."""


def demo_history() -> torch.Tensor:
    """The bundled load history ``[4, 12, 256]`` (float64): 4 windows of 12 layers x 256 experts.

    Made by this project with ``synthetic_loads(12, 256, num_windows=4, seed=2026)``; layer 0 is set to
    zero to stand for a dense layer without expert traffic.
    """
    with resources.files("eplb_core").joinpath("data/demo_loads.npy").open("rb") as f:
        return torch.from_numpy(np.load(f).astype(np.float64))


def static_gpu_loads(weight: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """GPU loads without load balancing: expert ``e`` alone on GPU ``e // (N / num_gpus)``."""
    w = weight.to(torch.float64)
    num_layers, num_logical = w.shape
    if num_logical % num_gpus:
        gpu = torch.arange(num_logical) * num_gpus // num_logical
        return torch.zeros(num_layers, num_gpus, dtype=torch.float64).index_add_(1, gpu, w)
    return w.view(num_layers, num_gpus, -1).sum(-1)


def plot_heatmap(
    before: torch.Tensor, after: torch.Tensor, path: str | Path, *, titles: tuple[str, str]
) -> None:
    """Save a two-panel heatmap of per-GPU load / layer mean (layers x GPUs), before and after."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise CliError("--plot needs matplotlib: pip install 'eplb-core[plot]'") from exc
    rel_b = (before / before.mean(1, keepdim=True).clamp_min(1e-300)).numpy()
    rel_a = (after / after.mean(1, keepdim=True).clamp_min(1e-300)).numpy()
    vmax = max(float(rel_b.max()), float(rel_a.max()), 1.05)
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.25 * rel_b.shape[0] + 2.2), sharey=True)
    for ax, data, title in zip(axes, (rel_b, rel_a), titles, strict=True):
        im = ax.imshow(data, aspect="auto", cmap="magma", vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.set_title(title)
        ax.set_xlabel("GPU")
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes, label="GPU load / layer mean", shrink=0.9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _load_input(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """(weight [L, N], history or None, description)."""
    if args.demo:
        hist = demo_history()
        source = "bundled demo loads (4 windows x 12 layers x 256 experts)"
    elif args.loads is None:
        raise CliError("give a LOADS file or --demo")
    else:
        hist = io.load_loads(args.loads)
        source = str(args.loads)
    if hist.dim() == 3:
        weight = hist[-1] if args.history == "last" else expected_load(hist, method=args.history)
        return weight, hist, f"{source}, {hist.shape[0]} windows -> {args.history}"
    return hist, None, source


def _topology(args: argparse.Namespace, num_logical: int) -> dict[str, Any]:
    if args.demo and args.replicas is None:
        args.replicas, args.groups, args.nodes, args.gpus = 288, 8, 4, 32
    if args.replicas is None or args.gpus is None:
        raise CliError("--replicas and --gpus are required (or use --demo)")
    return {
        "num_replicas": args.replicas,
        "num_groups": args.groups,
        "num_nodes": args.nodes,
        "num_gpus": args.gpus,
    }


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)


def _fmt(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}f}"


def cmd_plan(args: argparse.Namespace) -> int:
    weight, _hist, source = _load_input(args)
    topo = _topology(args, weight.shape[1])
    previous = Placement.load(args.previous) if args.previous else None
    for path in (args.output, args.sglang, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            raise CliError(f"cannot write {path!r}: its folder does not exist")
    before_calls = runner.interpreted_calls
    t0 = time.perf_counter()
    result = plan(
        weight,
        **topo,
        previous=previous,
        max_changed_slots=args.max_moves,
        soft_locality=args.soft_locality,
    )
    elapsed = time.perf_counter() - t0
    form = "compiled" if runner.interpreted_calls == before_calls else "interpreted: not compiled here yet"
    if previous is not None:
        before = previous.gpu_loads_for(weight)
        before_name = "previous plan"
    else:
        before = static_gpu_loads(result.weight, topo["num_gpus"])
        before_name = "no EPLB"
    bal_before = balancedness(before)
    rows = []
    for layer in range(result.num_layers):
        zero = result.zero_layers is not None and bool(result.zero_layers[layer])
        rows.append(
            [
                f"{layer}" + (" (zero load)" if zero else ""),
                _fmt(float(bal_before[layer])),
                _fmt(float(result.balancedness[layer])),
                _fmt(100 * float(result.gap[layer]), 2) + "%",
                "-" if result.changed_slots is None else str(int(result.changed_slots[layer])),
                _fmt(100 * float(result.cross_node_share[layer]), 1) + "%",
            ]
        )
    s = result.summary()
    rows.append(
        [
            "all layers (mean)",
            _fmt(float(bal_before.mean())),
            _fmt(s["balancedness"]),
            _fmt(100 * s["mean_gap"], 2) + "%",
            "-" if result.changed_slots is None else f"{100 * s['changed_fraction']:.1f}%",
            _fmt(100 * s["cross_node_share"], 1) + "%",
        ]
    )
    _table(
        f"eplb plan: {source}; R={topo['num_replicas']} groups={topo['num_groups']} nodes={topo['num_nodes']} "
        f"gpus={topo['num_gpus']}, mode={result.mode}, planned in {1e3 * elapsed:.1f} ms ({form})",
        [
            "layer",
            f"balancedness ({before_name})",
            "balancedness (plan)",
            "gap to bound",
            "changed slots",
            "cross-node",
        ],
        rows,
    )
    zeros = (
        io.zero_layers(weight)
        if result.zero_layers is None
        else torch.nonzero(result.zero_layers).flatten().tolist()
    )
    if zeros:
        print(f"layers with all-zero load (planned as uniform): {zeros}")
    result.validate()
    if args.output:
        result.save(args.output)
        print(f"plan written to {args.output}")
    if args.sglang:
        io.save_sglang(result, args.sglang)
        print(f"SGLang --init-expert-location file written to {args.sglang}")
    if args.plot:
        plot_heatmap(
            before, result.gpu_loads, args.plot, titles=(f"before ({before_name})", f"after ({result.mode})")
        )
        print(f"heatmap written to {args.plot}")
    return 0


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``(result, first call s, median of 3 warm calls s)``: the first call of a mode in this process
    (compiled, or interpreted while the planner is not compiled yet); the warm calls are the planning
    time of the compiled planner (compiled first, untimed, when it is not yet)."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    warm = []
    with runner.forced("compiled"):
        fn()
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            warm.append(time.perf_counter() - t0)
    return out, first, statistics.median(warm)


def cmd_compare(args: argparse.Namespace) -> int:
    weight, hist, source = _load_input(args)
    topo = _topology(args, weight.shape[1])
    # (name, balancedness [L], first call s, warm call s, changed slots, cross-node share)
    results: list[tuple[str, torch.Tensor, float | None, float | None, str, str]] = []
    w = weight.to(torch.float64)
    w_plan = torch.where((w.sum(1) == 0).unsqueeze(1), torch.ones_like(w), w)
    results.append(
        ("no EPLB", balancedness(static_gpu_loads(w_plan, topo["num_gpus"])), None, None, "-", "-")
    )
    args_greedy = (topo["num_replicas"], topo["num_groups"], topo["num_nodes"], topo["num_gpus"])
    (gp, gc), tg1, tg = _timed(lambda: greedy_rebalance(w_plan, *args_greedy))
    greedy_bal = balancedness(gpu_loads_of(w_plan, gp, gc, topo["num_gpus"]))
    results.append(("greedy reference", greedy_bal, tg1, tg, "-", "0.0%"))
    base, t1, t = _timed(lambda: plan(weight, **topo))
    results.append((f"eplb-core {base.mode}", base.balancedness, t1, t, "-", "0.0%"))
    if topo["num_groups"] % topo["num_nodes"] == 0 and topo["num_nodes"] > 1:
        w_soft = 0.0 if args.soft_locality is None else args.soft_locality
        soft, t1, t = _timed(lambda: plan(weight, **topo, soft_locality=w_soft))
        share = f"{100 * float(soft.cross_node_share.mean()):.1f}%"
        results.append((f"eplb-core soft (W={w_soft:g})", soft.balancedness, t1, t, "-", share))
    if hist is not None and hist.shape[0] >= 2:
        # plan on the older windows, then the last window arrives: re-plan vs migrate
        older = expected_load(hist[:-1], method=args.history if args.history != "last" else "ema")
        old_plan = plan(older, **topo)
        mig, t1, t = _timed(lambda: plan(weight, **topo, previous=old_plan, max_changed_slots=args.max_moves))
        assert mig.changed_slots is not None
        frac = 100 * float(mig.changed_slots.sum()) / mig.phy2log.numel()
        results.append(
            ("stale plan (older windows)", old_plan.balancedness_for(w_plan), None, None, "0.0%", "-")
        )
        results.append(("eplb-core migration", mig.balancedness, t1, t, f"{frac:.1f}%", "-"))
        fresh = f"{100 * float((base.phy2log != old_plan.phy2log).float().mean()):.1f}%"
        results[2] = (*results[2][:4], fresh, results[2][5])

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1e3 * x:.1f}"

    rows = [
        [name, _fmt(float(b.mean())), _fmt(float(b.min())), ms(t), ms(t1), ch, cross]
        for name, b, t1, t, ch, cross in results
    ]
    _table(
        f"eplb compare: {source}; R={topo['num_replicas']} groups={topo['num_groups']} nodes={topo['num_nodes']} gpus={topo['num_gpus']}",
        [
            "method",
            "mean balancedness",
            "worst layer",
            "ms (planning, compiled)",
            "ms (first call of the process)",
            "changed slots",
            "cross-node",
        ],
        rows,
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eplb", description="Expert-parallel load balancing for MoE serving."
    )
    parser.add_argument("--version", action="version", version=f"eplb-core {eplb_core.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "loads", nargs="?", help="load file: .json (SGLang logical_count), .pt, .npy, .npz, .csv"
        )
        p.add_argument(
            "--demo", action="store_true", help="use the bundled demo loads (defaults: 288/8/4/32)"
        )
        p.add_argument("--replicas", type=int, help="physical experts per layer")
        p.add_argument("--groups", type=int, default=1, help="expert groups (DeepSeek-V3: 8)")
        p.add_argument("--nodes", type=int, default=1, help="server nodes")
        p.add_argument("--gpus", type=int, help="GPUs in total")
        p.add_argument(
            "--history", choices=["ema", "mean", "last"], default="ema", help="how to reduce [T, L, N] loads"
        )
        p.add_argument(
            "--soft-locality", type=float, default=None, metavar="W", help="soft locality penalty W >= 0"
        )
        p.add_argument(
            "--max-moves", type=int, default=None, metavar="N", help="max changed slots per layer (migration)"
        )

    p_plan = sub.add_parser("plan", help="plan a placement and print its summary")
    common(p_plan)
    p_plan.add_argument("--previous", help="plan in service (JSON from eplb plan -o): migration-aware mode")
    p_plan.add_argument("-o", "--output", help="write the plan as JSON")
    p_plan.add_argument("--sglang", help="write an SGLang --init-expert-location file (.json or .pt)")
    p_plan.add_argument("--plot", help="write a before/after per-GPU load heatmap (PNG; needs matplotlib)")
    p_plan.set_defaults(func=cmd_plan)
    p_cmp = sub.add_parser("compare", help="run the modes and the greedy baseline side by side")
    common(p_cmp)
    p_cmp.set_defaults(func=cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``eplb`` console script: 0 on success, 2 on bad input (one line on
    standard error), 1 when the ``cli`` extra is missing."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        import rich  # noqa: F401
    except ImportError:
        print(f"eplb: {INSTALL_HINT}", file=sys.stderr)
        return 1
    try:
        return int(args.func(args))
    except (ValueError, OSError) as exc:
        print("eplb: error: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
