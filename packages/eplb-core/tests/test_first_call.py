"""The planner's two forms (compiled, interpreted) give the same plans, bit for bit, and a process whose
compile cache is empty plans with the interpreted form at once while the compiled one builds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eplb_core as E
from eplb_core._numba import runner

SETTINGS = settings(
    max_examples=int(os.environ.get("EPLB_HYPOTHESIS_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


COLD = textwrap.dedent(
    """
    import time
    import eplb_core as E
    from eplb_core._numba import runner
    from eplb_core._numba.solve import solve_layers

    w = E.synthetic_loads(4, 64, num_groups=8, seed=0)
    t0 = time.perf_counter()
    first = E.rebalance_experts(w, 80, 8, 2, 16)
    print("first", time.perf_counter() - t0, len(solve_layers.overloads))
    assert runner.wait_compiled(timeout=600)
    again = E.rebalance_experts(w, 80, 8, 2, 16)
    print("compiled", len(solve_layers.overloads))
    assert all(bool((a == b).all()) for a, b in zip(first, again))
    """
)


# First in the file, so that pytest-xdist starts it at once: its own compile then runs beside the one
# the other tests share (the compiled_planner fixture).
def test_cold_then_warm_cache(tmp_path: Path) -> None:
    """In a process with an empty compile cache the first call returns before anything is compiled and
    says what happens on standard error; later calls use the compiled planner (the same plan). The
    next process finds it in the disk cache and plans compiled from its first call, silently."""
    src = str(Path(E.__file__).resolve().parents[1])
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": src}
    run = subprocess.run(
        [sys.executable, "-c", COLD], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert lines["first"].split()[1] == "0"  # nothing compiled when the first plan returned
    assert lines["compiled"] == "1"
    assert run.stderr.count("eplb-core: the compiled planner is not in this environment's cache") == 1
    assert "python -m eplb_core.warmup" in run.stderr
    warm = (
        "import eplb_core as E\nfrom eplb_core._numba.solve import solve_layers\n"
        "w = E.synthetic_loads(4, 64, num_groups=8, seed=0)\nE.rebalance_experts(w, 80, 8, 2, 16)\n"
        "print(len(solve_layers.overloads))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", warm], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "1"
    assert "not in this environment's cache" not in run.stderr


def both_forms(fn: Any) -> tuple[Any, Any]:
    with runner.forced("compiled"):
        compiled = fn()
    with runner.forced("interpreted"):
        interpreted = fn()
    return compiled, interpreted


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, E.Placement):
        a, b = (a.phy2log, a.logcnt, a.colocated_layers), (b.phy2log, b.logcnt, b.colocated_layers)
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


# (replicas, groups, nodes, GPUs): slots per GPU 1-5 (re-split), 6-16 (two starts, exchanges), more;
# experts with more replicas than GPUs; the global fallback of 3 groups on 2 nodes
CONFIGS = [
    pytest.param(64, 8, 2, 16, id="R64-n2-G16-S4"),
    pytest.param(80, 8, 4, 16, id="R80-n4-G16-S5"),
    pytest.param(72, 8, 8, 72, id="R72-n8-G72-S1"),
    pytest.param(72, 8, 1, 8, id="R72-n1-G8-S9"),
    pytest.param(96, 4, 2, 4, id="R96-n2-G4-S24"),
    pytest.param(48, 4, 1, 2, id="R48-n1-G2-S24-fixed"),
    pytest.param(72, 3, 2, 8, id="R72-g3-n2-global"),
]


@pytest.mark.usefixtures("compiled_planner")
@pytest.mark.parametrize(("num_replicas", "num_groups", "num_nodes", "num_gpus"), CONFIGS)
def test_forms_agree_on_every_mode(num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    num_experts = 48
    hist = E.synthetic_loads(4, num_experts, num_groups=num_groups, num_windows=2, seed=3)
    w = hist[-1]
    kw: dict[str, Any] = {
        "num_replicas": num_replicas,
        "num_groups": num_groups,
        "num_nodes": num_nodes,
        "num_gpus": num_gpus,
    }
    assert_same(*both_forms(lambda: E.rebalance_experts(w, num_replicas, num_groups, num_nodes, num_gpus)))
    old = E.plan(hist[0], **kw)
    assert_same(*both_forms(lambda: E.plan(w, **kw)))
    assert_same(*both_forms(lambda: E.plan(w, **kw, previous=old, max_changed_slots=num_replicas // 3)))
    if num_nodes > 1 and num_groups % num_nodes == 0:
        for penalty in (0.0, 0.3):
            soft = E.plan(hist[0], **kw, soft_locality=penalty)
            assert_same(*both_forms(lambda p=penalty: E.plan(w, **kw, soft_locality=p)))
            assert_same(*both_forms(lambda p=penalty, s=soft: E.plan(w, **kw, soft_locality=p, previous=s)))


@pytest.mark.usefixtures("compiled_planner")
def test_forms_agree_at_deepseek_v3_scale() -> None:
    """One layer of each benchmark configuration (256 experts, 8 groups)."""
    w = E.synthetic_loads(2, 256, num_groups=8, seed=0)
    for r, nodes, gpus in [(288, 4, 32), (320, 8, 64), (264, 1, 8), (288, 9, 72)]:
        assert_same(*both_forms(lambda r=r, n=nodes, g=gpus: E.rebalance_experts(w, r, 8, n, g)))


@st.composite
def problems(draw: st.DrawFn) -> tuple[torch.Tensor, dict[str, Any]]:
    num_nodes = draw(st.sampled_from([1, 1, 2, 4]))
    gpus_per_node = draw(st.integers(1, 6))
    num_gpus = num_nodes * gpus_per_node
    num_groups = num_nodes * draw(st.integers(1, 3)) if draw(st.integers(0, 5)) else 3
    num_experts = num_groups * draw(st.integers(1, 5))
    slots = draw(st.integers(-(-num_experts // num_gpus), -(-num_experts // num_gpus) + 12))
    num_layers = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["random", "ties", "zeros", "spread", "hot"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if kind == "random":
        w = torch.rand(num_layers, num_experts, generator=gen, dtype=torch.float64) * 100
    elif kind == "ties":
        w = torch.randint(0, 4, (num_layers, num_experts), generator=gen).to(torch.float64)
    elif kind == "zeros":
        w = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        w[:, 0] = 1.0
    elif kind == "spread":
        w = 10.0 ** (torch.rand(num_layers, num_experts, generator=gen, dtype=torch.float64) * 12 - 6)
    else:
        w = torch.rand(num_layers, num_experts, generator=gen, dtype=torch.float64)
        w[:, : max(1, num_experts // 8)] *= 1000.0
    kw = {
        "num_replicas": slots * num_gpus,
        "num_groups": num_groups,
        "num_nodes": num_nodes,
        "num_gpus": num_gpus,
    }
    return w, kw


@pytest.mark.usefixtures("compiled_planner")
@SETTINGS
@given(problems(), st.sampled_from(["rebalance", "plan", "soft", "migration"]))
def test_forms_agree_fuzz(problem: tuple[torch.Tensor, dict[str, Any]], mode: str) -> None:
    w, kw = problem
    if mode == "rebalance":
        args = (kw["num_replicas"], kw["num_groups"], kw["num_nodes"], kw["num_gpus"])
        assert_same(*both_forms(lambda: E.rebalance_experts(w, *args)))
    elif mode == "plan":
        assert_same(*both_forms(lambda: E.plan(w, **kw)))
    elif mode == "soft":
        assert_same(*both_forms(lambda: E.plan(w, **kw, soft_locality=0.1)))
    else:
        old = E.plan(w.flip(1), **kw)
        assert_same(*both_forms(lambda: E.plan(w, **kw, previous=old)))
