"""Bad-input fuzzing of the public API: random shapes, dtypes, values (NaN, inf, huge, empty,
negative) and argument combinations. Every call either raises ``ValueError`` (the documented error) or
returns a valid result: placements pass ``validate()``, figures are finite."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import eplb_core as E

SETTINGS = settings(
    max_examples=int(os.environ.get("EPLB_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
VALUES = [0.0, 1.0, 3.0, 1e-300, 1e6, 1e300, 1e308, -1.0, float("nan"), float("inf")]
DTYPES = [torch.float64, torch.float64, torch.float32, torch.int64, torch.int32, torch.bool]
COUNTS = st.integers(-1, 10)


@st.composite
def weights(draw: st.DrawFn) -> torch.Tensor:
    rank = draw(st.sampled_from([2, 2, 2, 1, 3]))
    shape = tuple(draw(st.integers(0, 3) if i == 0 else st.integers(0, 12)) for i in range(rank))
    shape = tuple(max(s, 1) for s in shape) if draw(st.integers(0, 4)) else shape  # empty now and then
    n = 1
    for s in shape:
        n *= s
    kind = draw(st.sampled_from(["random", "random", "random", "special", "mixed", "clean"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if kind == "random":
        t = torch.rand(shape, generator=gen, dtype=torch.float64) * 100
    else:
        values = [v for v in VALUES if v >= 0 and v < 1e300] if kind == "clean" else VALUES
        picks = draw(st.lists(st.sampled_from(values), min_size=n, max_size=n))
        t = torch.tensor(picks, dtype=torch.float64).reshape(shape)
        if kind == "mixed":
            t = t + torch.rand(shape, generator=gen, dtype=torch.float64)
    dtype = draw(st.sampled_from(DTYPES))
    with torch.no_grad():
        if dtype in (torch.int64, torch.int32):
            t = torch.nan_to_num(t, nan=0.0, posinf=1e9, neginf=-1.0).clamp(-1, 1e9)
        return t.to(dtype)


def _check_placement(p: E.Placement) -> None:
    p.validate()
    for figure in (p.balancedness, p.gap, p.lower_bound, p.cross_node_share, p.gpu_loads):
        assert bool(torch.isfinite(figure).all())


@SETTINGS
@given(
    weights(),
    COUNTS,
    COUNTS,
    COUNTS,
    COUNTS,
    st.sampled_from([None, None, 0.0, 0.1, 1e6, -1.0, float("nan"), float("inf")]),
    st.sampled_from([None, None, -1, 0, 3, 1000]),
    st.sampled_from(["none", "plan", "plan", "plan", "float", "wrong-shape", "out-of-range"]),
)
def test_public_api_on_bad_and_unusual_input(
    weight: torch.Tensor,
    replicas: int,
    groups: int,
    nodes: int,
    gpus: int,
    soft: float | None,
    cap: int | None,
    previous_kind: str,
) -> None:
    if replicas >= -1 and weight.dim() == 2 and weight.shape[1] > 0:
        # mostly consistent topologies, so that the planner itself is fuzzed, not only the checks
        num_logical = weight.shape[1]
        nodes = max(nodes, 1)
        gpus = nodes * max(gpus // 3, 1)
        groups = groups if groups > 0 and num_logical % groups == 0 else 1
        replicas = (-(-num_logical // gpus) + replicas % 3) * gpus
    topology = {"num_replicas": replicas, "num_groups": groups, "num_nodes": nodes, "num_gpus": gpus}
    try:
        phy2log, _, logcnt = E.rebalance_experts(weight, replicas, groups, nodes, gpus)
    except ValueError:
        pass
    else:
        assert bool((logcnt >= 1).all())
        assert E.gpu_loads_of(weight, phy2log, logcnt, gpus).shape == (weight.shape[0], gpus)
    try:
        base = E.plan(weight, **topology)
    except ValueError:
        base = None
    else:
        _check_placement(base)
    previous: object = None
    if previous_kind != "none" and base is not None:
        previous = {
            "plan": base,
            "float": base.phy2log.to(torch.float64),
            "wrong-shape": base.phy2log[:, :-1],
            "out-of-range": base.phy2log + base.num_logical,
        }[previous_kind]
    try:
        p = E.plan(weight, **topology, soft_locality=soft, previous=previous, max_changed_slots=cap)
    except ValueError:
        event("plan with options: ValueError")
    else:
        event(f"plan with options: {p.mode}" + ("" if previous is None else ", migration"))
        _check_placement(p)
        if cap is not None and p.changed_slots is not None:
            assert int(p.changed_slots.max()) <= cap
    for fn in (E.lower_bound, E.reference.greedy_rebalance):
        try:
            out = fn(weight, replicas, groups, nodes, gpus)
        except ValueError:
            continue
        assert all(
            bool(torch.isfinite(t.double()).all()) for t in (out if isinstance(out, tuple) else (out,))
        )
    try:
        b = E.balancedness(weight)
    except ValueError:
        pass
    else:
        assert bool(((b > 0) & (b <= 1)).all())


@st.composite
def valid_problems(draw: st.DrawFn) -> tuple[torch.Tensor, dict]:
    """Loads that are valid but unusual (zeros, ties, 1e-300 next to 1e300, huge counts) on a
    consistent random topology."""
    num_nodes = draw(st.integers(1, 4))
    num_gpus = num_nodes * draw(st.integers(1, 3))
    num_groups = num_nodes * draw(st.integers(1, 2)) if draw(st.booleans()) else draw(st.integers(1, 5))
    num_logical = num_groups * draw(st.integers(1, 3))
    num_replicas = (-(-num_logical // num_gpus) + draw(st.integers(0, 3))) * num_gpus
    num_layers = draw(st.integers(1, 3))
    values = [0.0, 1e-300, 1.0, 2.0, 7.0, 1e6, 1e300, 3e300]
    picks = draw(
        st.lists(
            st.sampled_from(values), min_size=num_layers * num_logical, max_size=num_layers * num_logical
        )
    )
    weight = torch.tensor(picks, dtype=torch.float64).reshape(num_layers, num_logical)
    topology = {
        "num_replicas": num_replicas,
        "num_groups": num_groups,
        "num_nodes": num_nodes,
        "num_gpus": num_gpus,
    }
    return weight, topology


@SETTINGS
@given(
    valid_problems(),
    st.sampled_from([None, 0.0, 0.1, 1e6]),
    st.sampled_from([None, 0, 3, 1000]),
    st.booleans(),
)
def test_planner_on_unusual_valid_input(
    problem: tuple[torch.Tensor, dict], soft: float | None, cap: int | None, migrate: bool
) -> None:
    weight, topology = problem
    base = E.plan(weight, **topology)
    _check_placement(base)
    assert bool((base.gpu_loads.amax(1) >= base.lower_bound * (1 - 1e-9)).all())
    previous = E.plan(weight.flip(1), **topology) if migrate else None
    p = E.plan(
        weight, **topology, soft_locality=soft, previous=previous, max_changed_slots=cap if migrate else None
    )
    event(f"{p.mode}" + (", migration" if migrate else ""))
    _check_placement(p)
    if migrate and cap is not None:
        assert p.changed_slots is not None
        assert int(p.changed_slots.max()) <= cap
    phy2log, _, logcnt = E.rebalance_experts(weight, *topology.values())
    assert torch.equal(phy2log, base.phy2log)
    assert torch.equal(logcnt, base.logcnt)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5])
def test_soft_locality_must_be_finite_and_non_negative(value: float) -> None:
    with pytest.raises(ValueError, match="soft_locality"):
        E.plan(torch.ones(1, 8), num_replicas=8, num_groups=2, num_nodes=2, num_gpus=2, soft_locality=value)
