"""Benchmark pieces of ``run.py``: quality and host time of one rebalance against the greedy reference
(:func:`eplb_core.reference.greedy_rebalance`), migration, soft locality, growth, first calls.

Loads: ``eplb_core.synthetic_loads`` (58 layers x 256 experts, 8 groups), two successive windows: the
plan is made on the last window, the migration starts from a plan made on the one before.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import eplb_core as E
from eplb_core.bounds import node_cap_bound
from eplb_core.reference import greedy_rebalance

# (num_replicas, num_nodes, num_gpus) of DeepSeek-V3 serving configurations
CONFIGS = [(288, 4, 32), (320, 8, 64), (264, 1, 8), (288, 9, 72)]
NUM_LAYERS, NUM_EXPERTS, NUM_GROUPS = 58, 256, 8
# warm-up calls before every timed series (the first calls after a change of shape run slower)
WARMUP = 3


def median_ms(fn: Callable[[], Any], *, repeat: int, warmup: int = WARMUP) -> tuple[float, list[float]]:
    """Median wall time of ``fn`` in ms over ``repeat`` runs after ``warmup`` runs, and all samples."""
    wall, _, samples = timed(fn, repeat=repeat, warmup=warmup)
    return wall, samples


def timed(fn: Callable[[], Any], *, repeat: int, warmup: int = WARMUP) -> tuple[float, float, list[float]]:
    """``(median wall ms, median CPU ms of this process, wall samples)`` of ``fn`` over ``repeat`` runs.

    The CPU time (``time.process_time``) is what the call itself used: on a shared machine it moves
    less than the wall time when other processes compete for the cores.
    """
    res = timed_interleaved({"fn": fn}, repeat=repeat, warmup=warmup)["fn"]
    return res["ms_median"], res["cpu_ms_median"], res["ms_samples"]


def timed_interleaved(
    fns: dict[str, Callable[[], Any]], *, repeat: int, warmup: int = WARMUP
) -> dict[str, dict[str, Any]]:
    """Time several calls in turns (``A B C A B C ...``): ``warmup`` turns, then ``repeat`` timed turns.

    Every call gets the same warm-up and the same number of samples, and a drift of the machine
    during the stage hits all of them alike. Per call: median wall ms, median CPU ms of this process,
    median minor page faults, and the wall samples in order.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    faults: dict[str, list[int]] = {k: [] for k in fns}
    for _ in range(repeat):
        for key, fn in fns.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[key].append(1e3 * (time.perf_counter() - t0))
            cpu[key].append(1e3 * (time.process_time() - c0))
            faults[key].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {
        k: {
            "ms_median": statistics.median(wall[k]),
            "cpu_ms_median": statistics.median(cpu[k]),
            "minor_faults_median": statistics.median(faults[k]),
            "ms_samples": wall[k],
        }
        for k in fns
    }


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
    # the time of our call is measured by bench_timing, all configurations in turns
    t_greedy, _ = median_ms(
        lambda: greedy_rebalance(weight, r, NUM_GROUPS, nodes, gpus), repeat=max(3, repeat // 3)
    )
    row: dict[str, Any] = {
        "kind": "rebalance",
        "config": f"({r}, {nodes}, {gpus})",
        "mode": ours.mode,
        "balancedness": float(ours.balancedness.mean()),
        "min_layer_balancedness": float(ours.balancedness.min()),
        "greedy_balancedness": float(greedy_bal.mean()),
        "layers_below_greedy": int((ours.balancedness < greedy_bal - 1e-12).sum()),
        "worst_deficit_vs_greedy": float((greedy_bal - ours.balancedness).clamp_min(0).max()),
        "mean_gap_to_bound": float(ours.gap.mean()),
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

    # the call on the CUDA weight and on its host copy in turns: the same stretch of the machine
    t = timed_interleaved(
        {
            "cuda": call_gpu,
            "host": functools.partial(E.rebalance_experts, w_host, r, NUM_GROUPS, nodes, gpus),
        },
        repeat=repeat,
    )
    t_gpu, samples, t_host = t["cuda"]["ms_median"], t["cuda"]["ms_samples"], t["host"]["ms_median"]
    t_copy, _, _ = timed(copies, repeat=repeat)
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


def growth_config(num_experts: int, nodes: int) -> tuple[int, int]:
    """``(replicas, GPUs)`` of a growth row: 9/8 replicas per expert rounded up to whole GPUs, 8 nodes
    of 8 GPUs (strict) or 9 nodes of 8 GPUs (global, 8 groups)."""
    gpus = 64 if nodes == 8 else 72
    r = num_experts * 9 // 8
    return (r if r % gpus == 0 else (r // gpus + 1) * gpus), gpus


def bench_timing(
    weight: torch.Tensor, shapes: list[tuple[int, int]], *, repeat: int, configs: bool = True
) -> dict[str, Any]:
    """Time per ``rebalance_experts`` call of the benchmark configurations on ``weight`` and of the
    growth rows (``synthetic_loads(layers, experts, seed=7)``, strict 8 nodes / 64 GPUs and global
    9 nodes / 72 GPUs), all in one interleaved stage: the same warm-up and number of samples for
    every row, and a drift of the machine hits every row alike."""
    fns: dict[str, Callable[[], Any]] = {}
    if configs:
        for r, nodes, gpus in CONFIGS:
            fns[f"({r}, {nodes}, {gpus})"] = functools.partial(
                E.rebalance_experts, weight, r, NUM_GROUPS, nodes, gpus
            )
    grow: list[tuple[str, int, int, str]] = []
    for num_layers, num_experts in shapes:
        w = E.synthetic_loads(num_layers, num_experts, seed=7)
        for nodes in (8, 9):
            r, gpus = growth_config(num_experts, nodes)
            key = f"{num_layers}x{num_experts} ({r}, {nodes}, {gpus})"
            fns[key] = functools.partial(E.rebalance_experts, w, r, NUM_GROUPS, nodes, gpus)
            grow.append((key, num_layers, num_experts, f"({r}, {nodes}, {gpus})"))
    t = timed_interleaved(fns, repeat=repeat)
    return {
        "configs": {k: v for k, v in t.items() if k.startswith("(")},
        "scaling": [{"layers": nl, "experts": ne, "config": cfg, **t[key]} for key, nl, ne, cfg in grow],
    }


_FIRST_CALL = """
import json, sys, time, torch
torch.set_num_threads(1)
t0 = time.perf_counter()
import eplb_core as E
entry = sys.argv[1]
r, nodes, gpus = (int(x) for x in sys.argv[2:5])
w = E.synthetic_loads(58, 256, num_groups=8, num_windows=2, seed=0)
kw = dict(num_replicas=r, num_groups=8, num_nodes=nodes, num_gpus=gpus)
out = {"import_s": time.perf_counter() - t0}
def timed(key, fn):
    t = time.perf_counter()
    res = fn()
    out[key] = time.perf_counter() - t
    return res
if entry == "rebalance":
    timed("first_rebalance_s", lambda: E.rebalance_experts(w[-1], r, 8, nodes, gpus))
else:
    old = timed("first_plan_s", lambda: E.plan(w[0], **kw))
    # the other modes' first calls, in the same process (beside a background compile, if any)
    timed("then_migration_s", lambda: E.plan(w[-1], **kw, previous=old))
    if nodes > 1 and 8 % nodes == 0:
        timed("then_soft_s", lambda: E.plan(w[-1], **kw, soft_locality=0.05))
print(json.dumps(out))
"""


def first_call_seconds(config: tuple[int, int, int], cache_dir: str) -> dict[str, float]:
    """Seconds of first calls for one configuration on the benchmark's loads, each in a fresh process
    with the Numba cache in ``cache_dir`` (empty: the calls run interpreted while the planner compiles
    in the background; filled: they load the compiled planner): the first ``rebalance_experts`` of one
    process, the first ``plan`` of another, and then in that process the first migration and soft
    locality (hierarchical topologies) calls. An empty ``cache_dir`` is emptied again between the two
    processes."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    path = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    out: dict[str, float] = {}
    empty = not any(Path(cache_dir).iterdir())
    for entry in ("rebalance", "plan"):
        if empty:
            shutil.rmtree(cache_dir)
            Path(cache_dir).mkdir()
        env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        run = subprocess.run(
            [sys.executable, "-c", _FIRST_CALL, entry, *map(str, config)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        times = json.loads(run.stdout.splitlines()[-1])
        out[f"{entry}_import_s"] = times.pop("import_s")
        out.update(times)
    return out
