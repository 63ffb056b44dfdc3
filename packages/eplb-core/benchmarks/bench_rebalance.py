"""Benchmark pieces for eplb-core: quality and CPU time of one rebalance vs the greedy baseline.

Used by ``run.py``; can also be run alone: ``python bench_rebalance.py`` prints the strict-mode rows.
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import eplb_core as E
from eplb_core._greedy import greedy_rebalance
from eplb_core.bounds import node_cap_bound

# (num_replicas, num_nodes, num_gpus) of the DeepSeek-V3 serving configurations in the issue
CONFIGS = [(288, 4, 32), (320, 8, 64), (264, 1, 8), (288, 9, 72)]
NUM_LAYERS, NUM_EXPERTS, NUM_GROUPS = 58, 256, 8


def median_ms(fn: Callable[[], Any], *, repeat: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``fn`` in ms over ``repeat`` runs after ``warmup`` runs, and all samples."""
    wall, _, samples = timed(fn, repeat=repeat, warmup=warmup)
    return wall, samples


def timed(fn: Callable[[], Any], *, repeat: int, warmup: int = 1) -> tuple[float, float, list[float]]:
    """``(median wall ms, median CPU ms of this process, wall samples)`` of ``fn`` over ``repeat`` runs.

    The CPU time (``time.process_time``) is what the call itself used: on a shared machine it moves
    less than the wall time when other processes compete for the cores.
    """
    for _ in range(warmup):
        fn()
    samples, cpu = [], []
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        samples.append(1e3 * (time.perf_counter() - t0))
        cpu.append(1e3 * (time.process_time() - c0))
    return statistics.median(samples), statistics.median(cpu), samples


def load_deepseek(path: str) -> Callable[..., Any]:
    """``rebalance_experts`` of DeepSeek's public ``eplb.py``, imported by path at run time (the file
    is not part of this project: ``git clone https://github.com/deepseek-ai/EPLB``)."""
    spec = importlib.util.spec_from_file_location("deepseek_eplb_peer", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--deepseek-ref {path!r} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rebalance_experts


def strict_cap(weight: torch.Tensor, num_nodes: int, num_gpus: int) -> torch.Tensor:
    """Best balancedness any strict-hierarchy plan can reach, per layer (the strict-hierarchy cap)."""
    num_layers = weight.shape[0]
    group_load = weight.view(num_layers, NUM_GROUPS, -1).sum(-1)
    peak = node_cap_bound(group_load, num_nodes) / (num_gpus // num_nodes)
    return (weight.sum(1) / num_gpus) / peak


def bench_config(
    weight: torch.Tensor,
    earlier: torch.Tensor,
    r: int,
    nodes: int,
    gpus: int,
    *,
    repeat: int,
    deepseek: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Strict/global plan, greedy baseline, DeepSeek's reference (if given) and migration for one
    configuration."""
    kw: dict[str, Any] = {"num_replicas": r, "num_groups": NUM_GROUPS, "num_nodes": nodes, "num_gpus": gpus}
    ours = E.plan(weight, **kw)
    ours.validate()
    gp, gc = greedy_rebalance(weight, r, NUM_GROUPS, nodes, gpus)
    greedy_bal = E.balancedness(E.gpu_loads_of(weight, gp, gc, gpus))
    t_ours, cpu_ours, samples = timed(
        functools.partial(E.rebalance_experts, weight, r, NUM_GROUPS, nodes, gpus), repeat=repeat
    )
    t_greedy, _ = median_ms(
        lambda: greedy_rebalance(weight, r, NUM_GROUPS, nodes, gpus), repeat=max(3, repeat // 3)
    )
    row: dict[str, Any] = {
        "config": f"({r}, {nodes}, {gpus})",
        "mode": ours.mode,
        "balancedness": float(ours.balancedness.mean()),
        "min_layer_balancedness": float(ours.balancedness.min()),
        "greedy_balancedness": float(greedy_bal.mean()),
        "layers_below_greedy": int((ours.balancedness < greedy_bal - 1e-12).sum()),
        "worst_deficit_vs_greedy": float((greedy_bal - ours.balancedness).clamp_min(0).max()),
        "mean_gap_to_bound": float(ours.gap.mean()),
        "ms_per_call_median": t_ours,
        "cpu_ms_per_call_median": cpu_ours,
        "ms_samples": samples,
        "greedy_ms_median": t_greedy,
    }
    if torch.cuda.is_available():
        row["cuda_input"] = bench_cuda_input(weight, r, nodes, gpus, repeat=repeat)
    if deepseek is not None:
        dp, _, dc = deepseek(weight, r, NUM_GROUPS, nodes, gpus)
        ds_bal = E.balancedness(E.gpu_loads_of(weight, dp, dc, gpus))
        # 0.3-3.5 s per call: the median of 3 after the call above
        t_ds, _ = median_ms(lambda: deepseek(weight, r, NUM_GROUPS, nodes, gpus), repeat=3, warmup=0)
        row["deepseek"] = {
            "balancedness": float(ds_bal.mean()),
            "ms_median": t_ds,
            "speedup": t_ds / t_ours,
            "layers_below_deepseek": int((ours.balancedness < ds_bal - 1e-12).sum()),
        }
    if ours.mode == "strict" and nodes > 1:
        cap = strict_cap(weight, nodes, gpus)
        row["strict_cap_balancedness"] = float(cap.mean())
        row["fraction_of_cap"] = float((ours.balancedness / cap).mean())
    # migration: the plan in service was made on an earlier window; the new window arrives
    old = E.plan(earlier, **kw)
    cap_slots = r // 4
    mig = E.plan(weight, **kw, previous=old, max_changed_slots=cap_slots)
    mig.validate()
    t_mig, _ = median_ms(
        lambda: E.plan(weight, **kw, previous=old, max_changed_slots=cap_slots), repeat=max(3, repeat // 3)
    )
    t_plan, _ = median_ms(lambda: E.plan(weight, **kw), repeat=max(3, repeat // 3))
    row["plan_ms_median"] = t_plan
    assert mig.changed_slots is not None
    row["migration"] = {
        "max_changed_slots_per_layer": cap_slots,
        "ms_median": t_mig,
        "balancedness": float(mig.balancedness.mean()),
        "changed_fraction": float(mig.changed_slots.sum()) / mig.phy2log.numel(),
        "stale_plan_balancedness": float(old.balancedness_for(weight).mean()),
        "replan_changed_fraction_ours": float((ours.phy2log != old.phy2log).float().mean()),
        "replan_changed_fraction_greedy": float(
            (gp != greedy_rebalance(earlier, r, NUM_GROUPS, nodes, gpus)[0]).float().mean()
        ),
    }
    return row


def bench_cuda_input(weight: torch.Tensor, r: int, nodes: int, gpus: int, *, repeat: int) -> dict[str, Any]:
    """End to end ``rebalance_experts`` on a CUDA ``weight`` (float32, as serving stacks keep their
    expert-load counters), until the three tensors are usable on the GPU (``torch.cuda.synchronize``),
    beside the copies alone (the load matrix to the host, three int64 tensors of the plan's sizes
    back) and the same call on the host copy, all in this run."""
    w_gpu = weight.to("cuda", torch.float32)
    w_host = w_gpu.cpu()
    phy, l2p, cnt = E.rebalance_experts(w_host, r, NUM_GROUPS, nodes, gpus)
    phy_g, l2p_g, cnt_g = E.rebalance_experts(w_gpu, r, NUM_GROUPS, nodes, gpus)
    torch.cuda.synchronize()
    same = bool(
        torch.equal(phy_g.cpu(), phy) and torch.equal(l2p_g.cpu(), l2p) and torch.equal(cnt_g.cpu(), cnt)
    )

    def call_gpu() -> None:
        E.rebalance_experts(w_gpu, r, NUM_GROUPS, nodes, gpus)
        torch.cuda.synchronize()

    def copies() -> None:
        w_gpu.cpu()
        for t in (phy, l2p, cnt):
            t.to("cuda")
        torch.cuda.synchronize()

    t_gpu, _, samples = timed(call_gpu, repeat=repeat)
    t_copy, _, _ = timed(copies, repeat=repeat)
    t_host, _, _ = timed(
        functools.partial(E.rebalance_experts, w_host, r, NUM_GROUPS, nodes, gpus), repeat=repeat
    )
    return {
        "ms_median": t_gpu,
        "ms_samples": samples,
        "copies_ms_median": t_copy,
        "host_input_ms_median": t_host,
        "same_plan_as_host_input": same,
    }


def bench_soft(weight: torch.Tensor, penalties: list[float]) -> list[dict[str, Any]]:
    """Soft locality on (288, 4, 32)."""
    out = []
    for w_pen in penalties:
        kw: dict[str, Any] = {"num_replicas": 288, "num_groups": 8, "num_nodes": 4, "num_gpus": 32}
        s = E.plan(weight, **kw, soft_locality=w_pen)
        s.validate()
        t_soft, _ = median_ms(functools.partial(E.plan, weight, **kw, soft_locality=w_pen), repeat=5)
        out.append(
            {
                "penalty": w_pen,
                "balancedness": float(s.balancedness.mean()),
                "cross_node_share": float(s.cross_node_share.mean()),
                "ms_median": t_soft,
            }
        )
    return out


def bench_scaling(shapes: list[tuple[int, int]], *, repeat: int) -> list[dict[str, Any]]:
    """Time of one call as layers x experts grow (R = 9/8 N, 8 groups, 8 nodes, 64 GPUs; and global)."""
    out = []
    for num_layers, num_experts in shapes:
        w = E.synthetic_loads(num_layers, num_experts, seed=7)
        r = num_experts * 9 // 8
        for nodes in (8, 9):
            gpus = 64 if nodes == 8 else 72
            r_cfg = r if r % gpus == 0 else (r // gpus + 1) * gpus
            t, _ = median_ms(
                functools.partial(E.rebalance_experts, w, r_cfg, 8, nodes, gpus),
                repeat=repeat,
            )
            out.append(
                {
                    "layers": num_layers,
                    "experts": num_experts,
                    "config": f"({r_cfg}, {nodes}, {gpus})",
                    "ms": t,
                }
            )
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    hist = E.synthetic_loads(NUM_LAYERS, NUM_EXPERTS, num_windows=2, seed=0)
    for cfg in CONFIGS:
        print(bench_config(hist[-1], hist[0], *cfg, repeat=5))
