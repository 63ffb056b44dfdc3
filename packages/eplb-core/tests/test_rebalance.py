"""Invariants of rebalance_experts / plan: property-based (hypothesis) and edge cases."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eplb_core as E
from eplb_core import _solve
from eplb_core.placement import avoidable_repeats
from eplb_core.reference import greedy_rebalance

# CI runs 30 examples per property; EPLB_HYPOTHESIS_EXAMPLES=500 for a longer local search
SETTINGS = settings(
    max_examples=int(os.environ.get("EPLB_HYPOTHESIS_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def problems(draw: st.DrawFn) -> dict:
    """A random topology (strict or global) and a load matrix of a random kind."""
    num_nodes = draw(st.sampled_from([1, 2, 3, 4]))
    gpus_per_node = draw(st.sampled_from([1, 2, 4]))
    num_gpus = num_nodes * gpus_per_node
    num_groups = draw(st.sampled_from([1, 2, 4, 6]))
    group_size = draw(st.integers(1, 4))
    num_logical = num_groups * group_size
    min_slots = -(-num_logical // num_gpus)
    slots = draw(st.integers(min_slots, min_slots + 3))
    num_replicas = slots * num_gpus
    num_layers = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["skewed", "uniform", "equal", "dominant", "sparse", "integer"]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_logical)
    if kind == "skewed":
        w = torch.exp(2.0 * torch.randn(shape, generator=gen, dtype=torch.float64))
    elif kind == "uniform":
        w = torch.rand(shape, generator=gen, dtype=torch.float64)
    elif kind == "equal":
        w = torch.full(shape, 7.0, dtype=torch.float64)
    elif kind == "dominant":
        w = torch.rand(shape, generator=gen, dtype=torch.float64)
        w[:, 0] = 1000.0
    elif kind == "sparse":
        w = torch.randint(0, 3, shape, generator=gen).to(torch.float64)
    else:
        w = torch.randint(0, 1000, shape, generator=gen).to(torch.float64)
    return {
        "weight": w,
        "num_replicas": num_replicas,
        "num_groups": num_groups,
        "num_nodes": num_nodes,
        "num_gpus": num_gpus,
    }


def check_invariants(p: dict, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor) -> None:
    """Independent checks (not through Placement.validate)."""
    w = p["weight"]
    num_layers, num_logical = w.shape
    num_replicas, num_gpus, num_nodes, num_groups = (
        p["num_replicas"],
        p["num_gpus"],
        p["num_nodes"],
        p["num_groups"],
    )
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert phy2log.shape == (num_layers, num_replicas)
    assert logcnt.shape == (num_layers, num_logical)
    assert log2phy.shape == (num_layers, num_logical, int(logcnt.max()))
    assert bool((logcnt >= 1).all()), "an expert has no replica"
    assert bool((logcnt.sum(1) == num_replicas).all())
    slots = num_replicas // num_gpus
    # DeepSeek's greedy plan (it may repeat an expert on a GPU): the only plan a layer may repeat with
    greedy_phy, _ = greedy_rebalance(w, num_replicas, num_groups, num_nodes, num_gpus)
    for layer in range(num_layers):
        counts = np.bincount(phy2log[layer].numpy(), minlength=num_logical)
        assert (counts == logcnt[layer].numpy()).all()
        for e in range(num_logical):
            c = int(logcnt[layer, e])
            row = log2phy[layer, e].tolist()
            assert all(x == -1 for x in row[c:]), "log2phy not -1 padded"
            assert sorted(row[:c]) == row[:c]
            assert len(set(row[:c])) == c
            assert all(int(phy2log[layer, x]) == e for x in row[:c])
        gpu_of = np.arange(num_replicas) // slots
        domain = num_gpus
        if num_groups % num_nodes == 0 and num_nodes > 1:
            domain = num_gpus // num_nodes
            group_size = num_logical // num_groups
            node_of = gpu_of // (num_gpus // num_nodes)
            nodes_of_group: dict[int, set[int]] = {}
            for slot, e in enumerate(phy2log[layer].tolist()):
                nodes_of_group.setdefault(e // group_size, set()).add(int(node_of[slot]))
            assert all(len(v) == 1 for v in nodes_of_group.values()), "group split across nodes"
        seen: dict[tuple[int, int], int] = {}
        for slot, e in enumerate(phy2log[layer].tolist()):
            key = (int(gpu_of[slot]), e)
            seen[key] = seen.get(key, 0) + 1
        is_greedy = torch.equal(phy2log[layer].cpu(), greedy_phy[layer])
        for (_, e), n in seen.items():
            if n > 1:
                assert int(logcnt[layer, e]) > domain or is_greedy, "avoidable duplicate replica on one GPU"


@SETTINGS
@given(problems())
def test_rebalance_invariants(p: dict) -> None:
    phy2log, log2phy, logcnt = E.rebalance_experts(
        p["weight"], p["num_replicas"], p["num_groups"], p["num_nodes"], p["num_gpus"]
    )
    check_invariants(p, phy2log, log2phy, logcnt)


@SETTINGS
@given(problems())
def test_plan_determinism_bound_and_greedy(p: dict) -> None:
    kw = {k: p[k] for k in ("num_replicas", "num_groups", "num_nodes", "num_gpus")}
    a = E.plan(p["weight"], **kw)
    b = E.plan(p["weight"].clone(), **kw)
    assert torch.equal(a.phy2log, b.phy2log)
    assert torch.equal(a.logcnt, b.logcnt)
    a.validate()
    peak = a.gpu_loads.amax(1)
    assert bool((peak >= a.lower_bound * (1 - 1e-9)).all()), "peak below the lower bound"
    assert bool((a.gap >= -1e-9).all())
    # never worse than greedy LPT (the duplicate-avoiding variant is a candidate of every call)
    gp, gc = greedy_rebalance(a.weight, avoid_duplicates=True, **kw)
    greedy_peak = E.gpu_loads_of(a.weight, gp, gc, p["num_gpus"]).amax(1)
    assert bool((peak <= greedy_peak * (1 + 1e-12)).all())


@SETTINGS
@given(problems(), st.sampled_from([None, 0.0, 0.1]))
def test_never_below_deepseek_greedy(p: dict, soft_locality: float | None) -> None:
    """balancedness(plan) >= balancedness(DeepSeek's greedy plan) on every layer; a layer repeats an
    expert on a GPU avoidably only where it is flagged, and it is flagged only where the planner's
    plan without such repeats is less balanced than the greedy plan (which it then is)."""
    kw = {k: p[k] for k in ("num_replicas", "num_groups", "num_nodes", "num_gpus")}
    w = p["weight"]
    a = E.plan(w, **kw, soft_locality=soft_locality)
    a.validate()
    gp, gc = greedy_rebalance(w, **kw)
    greedy = E.balancedness(E.gpu_loads_of(a.weight, gp, gc, p["num_gpus"]))
    assert bool((a.balancedness >= greedy - 1e-12).all())
    r = E.rebalance_experts(w, *kw.values())
    assert bool((E.balancedness(E.gpu_loads_of(a.weight, r[0], r[2], p["num_gpus"])) >= greedy - 1e-12).all())
    assert a.colocated_layers is not None
    flagged = a.colocated_layers
    assert torch.equal(a.phy2log[flagged], gp[flagged])
    repeats = avoidable_repeats(a.phy2log.numpy(), a.logcnt.numpy(), a.num_gpus, a.num_nodes, a.mode)
    assert not bool((torch.from_numpy(repeats) & ~flagged).any())
    if soft_locality is None and bool(flagged.any()):
        # flagged only where the planner's plan without the fallback is less balanced
        groups, nodes = (p["num_groups"], p["num_nodes"]) if a.mode == "strict" else (1, 1)
        own, _, _ = _solve.solve(a.weight.numpy(), p["num_replicas"], groups, nodes, p["num_gpus"])
        own_t = torch.from_numpy(own)
        own_cnt = torch.zeros_like(a.logcnt).scatter_add_(1, own_t, torch.ones_like(own_t))
        own_bal = E.balancedness(E.gpu_loads_of(a.weight, own_t, own_cnt, p["num_gpus"]))
        assert bool((greedy[flagged] > own_bal[flagged]).all())


@SETTINGS
@given(problems(), st.integers(0, 8), st.integers(0, 2**16))
def test_migration_respects_cap(p: dict, cap: int, seed: int) -> None:
    kw = {k: p[k] for k in ("num_replicas", "num_groups", "num_nodes", "num_gpus")}
    old = E.plan(p["weight"], **kw)
    gen = torch.Generator().manual_seed(seed)
    new_w = p["weight"] * torch.exp(0.5 * torch.randn(p["weight"].shape, generator=gen, dtype=torch.float64))
    m = E.plan(new_w, **kw, previous=old, max_changed_slots=cap)
    m.validate()
    assert m.changed_slots is not None
    assert int(m.changed_slots.max()) <= cap
    assert torch.equal(m.changed_slots, (m.phy2log != old.phy2log).sum(1))
    # the plan in service, scored on the new load, is never beaten by more than what was allowed to move
    stale_peak = old.gpu_loads_for(m.weight).amax(1)
    assert bool((m.gpu_loads.amax(1) <= stale_peak * (1 + 1e-12)).all()), "migration raised a peak"


@SETTINGS
@given(problems(), st.sampled_from([0.0, 0.1, 1.0]))
def test_soft_locality_valid(p: dict, penalty: float) -> None:
    kw = {k: p[k] for k in ("num_replicas", "num_groups", "num_nodes", "num_gpus")}
    s = E.plan(p["weight"], **kw, soft_locality=penalty)
    s.validate()
    assert bool(((s.cross_node_share >= 0) & (s.cross_node_share <= 1)).all())
    if s.mode == "soft":
        # every expert keeps a replica on its home node
        group_size = s.num_logical // s.num_groups
        node_of_slot = torch.arange(s.num_replicas) // (s.num_replicas // s.num_nodes)
        assert s.home_node is not None
        for layer in range(s.num_layers):
            home = s.home_node[layer][s.phy2log[layer] // group_size]
            at_home = set(s.phy2log[layer][home == node_of_slot].tolist())
            assert at_home == set(range(s.num_logical))


@pytest.mark.parametrize("penalty", [0.0, 0.1])
def test_soft_locality_undoes_a_repeat_that_costs_peak(penalty: float) -> None:
    """Found by the property test above: a node's packing left an expert twice on one of its GPUs
    because every swap that undoes it raises the node's peak; such a repeat must still be undone."""
    w = torch.tensor(
        [[0.9037, 0.9383, 0.7080, 0.1000, 0.8757, 0.0969, 0.5309, 0.7736, 0.3319, 0.0416, 0.0446, 0.1487]],
        dtype=torch.float64,
    )
    s = E.plan(w, num_replicas=30, num_groups=6, num_nodes=3, num_gpus=6, soft_locality=penalty)
    assert s.mode == "soft"
    s.validate()
    per_gpu = s.phy2log.view(6, 5)
    counts = s.logcnt[0]
    for g in range(6):
        ids = per_gpu[g].tolist()
        assert all(ids.count(e) == 1 or int(counts[e]) > 6 for e in ids), f"GPU {g}: {ids}"


def test_migration_undoes_a_repeat_left_by_transfers() -> None:
    """Found by a random search: slot transfers took an expert's replicas down to as many as its node's
    GPUs while one GPU still held it twice (that GPU also held the receiving expert); the migration must
    end without the avoidable repeat, within its slot budget."""
    prev = torch.tensor(
        [[7, 7, 7, 10, 7, 7, 7, 8, 7, 7, 7, 9, 6, 7, 7, 11, 1, 2, 2, 17, 1, 2, 15, 16, 0, 1, 2, 15, 2, 2, 2, 15,
          3, 4, 12, 14, 3, 4, 12, 14, 3, 3, 3, 5, 3, 3, 12, 13]]
    )  # fmt: skip
    w = torch.tensor(
        [[2.3306, 0.3822, 3.4994, 0.1535, 0.0644, 0.7206, 0.0210, 0.0624, 0.5847, 0.4728, 1.9094, 0.8283,
          0.8288, 0.0635, 0.2004, 0.3936, 0.1446, 1.1033]],
        dtype=torch.float64,
    )  # fmt: skip
    kw = {"num_replicas": 48, "num_groups": 6, "num_nodes": 3, "num_gpus": 12}
    for cap in (48, 12):
        m = E.plan(w, **kw, previous=prev, max_changed_slots=cap)
        m.validate()
        assert m.changed_slots is not None
        assert int(m.changed_slots.max()) <= cap


@SETTINGS
@given(problems(), st.integers(0, 8), st.sampled_from([0.0, 0.1, 1.0]))
def test_migration_with_soft_locality_is_valid(p: dict, cap: int, penalty: float) -> None:
    """A migration from a strict plan with soft locality keeps every replica on its node: the result
    is a valid plan (strict when the plan in service is), within the cap."""
    kw = {k: p[k] for k in ("num_replicas", "num_groups", "num_nodes", "num_gpus")}
    old = E.plan(p["weight"], **kw)
    for weight in (p["weight"], p["weight"].flip(1)):
        m = E.plan(weight, **kw, previous=old, soft_locality=penalty, max_changed_slots=cap)
        m.validate()
        assert m.mode == old.mode
        assert m.changed_slots is not None
        assert int(m.changed_slots.max()) <= cap
    soft = E.plan(p["weight"], **kw, soft_locality=penalty)
    m = E.plan(p["weight"].flip(1), **kw, previous=soft, soft_locality=penalty, max_changed_slots=cap)
    m.validate()
    assert m.changed_slots is not None
    assert int(m.changed_slots.max()) <= cap


# ------------------------------------------------------------------ edge cases
def _kw(r: int, g: int, n: int, gpus: int) -> dict:
    return {"num_replicas": r, "num_groups": g, "num_nodes": n, "num_gpus": gpus}


@pytest.mark.parametrize(
    ("shape", "kw"),
    [
        pytest.param((1, 16), _kw(24, 4, 2, 8), id="one-layer"),
        pytest.param((3, 16), _kw(20, 4, 1, 1), id="one-gpu"),
        pytest.param((3, 16), _kw(16, 4, 2, 8), id="no-redundancy"),
        pytest.param((3, 64), _kw(72, 8, 4, 8), id="strict-2slots"),
        pytest.param((2, 12), _kw(48, 3, 2, 4), id="global-many-replicas"),
        pytest.param((4, 64), _kw(160, 4, 1, 8), id="20-slots-binary-search-exchanges"),
        pytest.param((3, 48), _kw(96, 4, 2, 8), id="strict-12-slots-two-starts"),
        # rows of more than 16 GPUs re-split with the MANY_BINS schedule (heavier half of the pairs)
        pytest.param((3, 64), _kw(96, 4, 3, 24), id="global-24-gpus-4-slots"),
        pytest.param((2, 40), _kw(60, 4, 3, 30), id="global-30-gpus-2-slots"),
    ],
)
def test_edge_topologies(shape: tuple[int, int], kw: dict) -> None:
    w = E.synthetic_loads(*shape, num_groups=kw["num_groups"], seed=1)
    p = E.plan(w, **kw)
    p.validate()
    check_invariants({"weight": w, **kw}, *p.as_tuple())
    gp, gc = greedy_rebalance(w, avoid_duplicates=True, **kw)
    greedy_peak = E.gpu_loads_of(w, gp, gc, kw["num_gpus"]).amax(1)
    assert bool((p.gpu_loads.amax(1) <= greedy_peak * (1 + 1e-12)).all())


def test_all_equal_loads_are_perfect() -> None:
    w = torch.ones(2, 64)
    p = E.plan(w, **_kw(64, 8, 4, 32))
    assert torch.allclose(p.balancedness, torch.ones(2, dtype=torch.float64))
    assert torch.allclose(p.gap, torch.zeros(2, dtype=torch.float64))


def test_dominant_expert_gets_replicas_on_distinct_gpus() -> None:
    w = torch.ones(1, 32, dtype=torch.float64)
    w[0, 5] = 1000.0
    p = E.plan(w, **_kw(40, 1, 1, 8))
    p.validate()
    assert int(p.logcnt[0, 5]) == 9  # all 8 extra slots go to the hot expert
    gpus = (p.log2phy[0, 5][: int(p.logcnt[0, 5])] // 5).tolist()
    assert len(set(gpus)) == 8  # 9 replicas on 8 GPUs: one GPU twice, unavoidable


def test_very_large_counts_and_integer_input() -> None:
    w = (E.synthetic_loads(3, 32, num_groups=4, seed=5) * 1e9).to(torch.int64)
    p = E.plan(w, **_kw(40, 4, 2, 8))
    p.validate()
    q = E.plan(w.to(torch.float32).numpy(), **_kw(40, 4, 2, 8))
    assert q.num_layers == 3


def test_zero_layer_reported_and_planned() -> None:
    w = E.synthetic_loads(3, 32, num_groups=4, seed=5)
    w[1] = 0
    p = E.plan(w, **_kw(40, 4, 2, 8))
    p.validate()
    assert p.zero_layers is not None
    assert p.zero_layers.tolist() == [False, True, False]
    assert float(p.balancedness[1]) == pytest.approx(1.0)


def test_compat_signature_and_list_input() -> None:
    w = E.synthetic_loads(2, 16, num_groups=4, seed=0).tolist()
    phy2log, log2phy, logcnt = E.rebalance_experts(w, 24, 4, 2, 8)
    assert phy2log.shape == (2, 24)
    assert logcnt.shape == (2, 16)
    assert log2phy.shape[:2] == (2, 16)


def test_better_than_greedy_on_deepseek_shape() -> None:
    """Not a speed test: a quality floor on one realistic case (58 x 256, 72 GPUs, global)."""
    w = E.synthetic_loads(8, 256, seed=11)
    p = E.plan(w, **_kw(288, 8, 9, 72))
    gp, gc = greedy_rebalance(w, 288, 8, 9, 72)
    greedy = E.balancedness(E.gpu_loads_of(w, gp, gc, 72))
    assert float(p.balancedness.mean()) > float(greedy.mean()) + 0.01


# ------------------------------------------------------------------ bad input
BAD = [
    pytest.param(torch.ones(4), _kw(8, 1, 1, 2), "weight", id="rank1"),
    pytest.param(torch.ones(2, 3, 4), _kw(8, 1, 1, 2), "weight", id="rank3"),
    pytest.param(torch.ones(0, 8), _kw(8, 1, 1, 2), "empty", id="empty"),
    pytest.param(torch.tensor([[1.0, float("nan")]]), _kw(2, 1, 1, 1), "NaN", id="nan"),
    pytest.param(torch.tensor([[1.0, -1.0]]), _kw(2, 1, 1, 1), "negative", id="negative"),
    pytest.param(torch.ones(2, 8), _kw(6, 1, 1, 2), "num_replicas", id="too-few-replicas"),
    pytest.param(torch.ones(2, 8), _kw(9, 1, 1, 2), "num_replicas", id="replicas-not-multiple"),
    pytest.param(torch.ones(2, 8), _kw(8, 3, 1, 2), "num_groups", id="groups-not-dividing"),
    pytest.param(torch.ones(2, 8), _kw(12, 2, 4, 6), "num_gpus", id="gpus-not-multiple-of-nodes"),
    pytest.param(torch.ones(2, 8), _kw(8, 0, 1, 2), "num_groups", id="zero-groups"),
    pytest.param([["a", "b"]], _kw(2, 1, 1, 1), "weight", id="strings"),
]


@pytest.mark.parametrize(("weight", "kw", "match"), BAD)
def test_bad_input_names_argument(weight: object, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        E.rebalance_experts(weight, kw["num_replicas"], kw["num_groups"], kw["num_nodes"], kw["num_gpus"])


def test_bad_mode_arguments() -> None:
    w = torch.ones(2, 8)
    with pytest.raises(ValueError, match="soft_locality"):
        E.plan(w, **_kw(8, 1, 1, 2), soft_locality=-1.0)
    with pytest.raises(ValueError, match="max_changed_slots"):
        E.plan(w, **_kw(8, 1, 1, 2), max_changed_slots=3)
    with pytest.raises(ValueError, match="previous"):
        E.plan(w, **_kw(8, 1, 1, 2), previous=torch.zeros(2, 4, dtype=torch.int64))


@pytest.mark.parametrize("value", [1e308, 5e307], ids=["1e308", "5e307"])
def test_loads_whose_sums_overflow_raise(value: float) -> None:
    """Group and layer sums beyond float64: a clear error, never a crash or an invalid plan."""
    w = torch.full((2, 16), value, dtype=torch.float64)
    with pytest.raises(ValueError, match="overflow"):
        E.rebalance_experts(w, 24, 4, 2, 8)
    with pytest.raises(ValueError, match="overflow"):
        E.plan(w, **_kw(24, 4, 2, 8), soft_locality=0.1)
    with pytest.raises(ValueError, match="overflow"):
        E.lower_bound(w, 24, 4, 2, 8)


def test_largest_accepted_loads_plan_validly() -> None:
    from eplb_core._validate import MAX_LAYER_SUM

    gen = torch.Generator().manual_seed(0)
    w = torch.rand(3, 16, generator=gen, dtype=torch.float64)
    w = w / w.sum(1, keepdim=True) * MAX_LAYER_SUM
    kw = _kw(24, 4, 2, 8)
    old = E.plan(w, **kw)
    for extra in ({}, {"soft_locality": 0.1}, {"soft_locality": 1e6}, {"previous": old}):
        p = E.plan(w, **kw, **extra)
        p.validate()
        assert bool(torch.isfinite(p.balancedness).all())


def test_previous_must_hold_integers() -> None:
    w = E.synthetic_loads(2, 16, num_groups=4, seed=0)
    old = E.plan(w, **_kw(24, 4, 2, 8))
    with pytest.raises(ValueError, match="previous must hold integers"):
        E.plan(w, **_kw(24, 4, 2, 8), previous=old.phy2log.to(torch.float64) + 0.5)


def test_global_fallback_when_groups_do_not_divide() -> None:
    """Like DeepSeek's and vLLM's function: num_groups % num_nodes != 0 plans globally, also when the
    groups do not divide the experts."""
    phy2log, _, logcnt = E.rebalance_experts(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), 8, 3, 2, 4)
    assert phy2log.shape == (1, 8)
    assert int(logcnt.sum()) == 8
    p = E.plan(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), **_kw(8, 3, 2, 4))
    assert p.mode == "global"
    p.validate()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64], ids=["f32", "f64", "i64"])
def test_gpu_input_same_plan_as_host(dtype: torch.dtype) -> None:
    """A CUDA weight is planned on the host: exactly the tensors of its host copy, on its device, in
    every mode (strict, global, soft locality, migration), an all-zero layer included."""
    w = E.synthetic_loads(16, 256, seed=3)
    w[5] = 0  # a dense layer: no routed tokens
    w_gpu = w.to("cuda", dtype)
    w_host = w_gpu.cpu()
    for args in ((288, 8, 4, 32), (320, 8, 8, 64), (264, 8, 1, 8), (288, 8, 9, 72)):
        host = E.rebalance_experts(w_host, *args)
        dev = E.rebalance_experts(w_gpu, *args)
        for h, d in zip(host, dev, strict=True):
            assert d.device == w_gpu.device
            assert d.dtype == torch.int64
            assert torch.equal(d.cpu(), h)
    kw = _kw(288, 8, 4, 32)
    earlier = E.synthetic_loads(16, 256, seed=4).to("cuda", dtype)
    for extra in ({}, {"soft_locality": 0.05}, {"previous": E.plan(earlier, **kw), "max_changed_slots": 72}):
        host_p = E.plan(
            w_host, **kw, **{k: (v.phy2log.cpu() if k == "previous" else v) for k, v in extra.items()}
        )
        dev_p = E.plan(w_gpu, **kw, **extra)
        assert dev_p.phy2log.is_cuda
        assert dev_p.balancedness.is_cuda
        assert torch.equal(dev_p.phy2log.cpu(), host_p.phy2log)
        assert torch.allclose(dev_p.balancedness.cpu(), host_p.balancedness, rtol=1e-12, atol=0)
        assert bool(dev_p.zero_layers[5])
        assert int(dev_p.zero_layers.sum()) == 1
        dev_p.validate()


@pytest.mark.parametrize("mode", ["strict", "soft", "migration"])
def test_many_groups_split_without_enumeration(mode: str) -> None:
    """16 groups on 4 nodes (2.6 million equal splits): the groups are packed onto nodes instead of
    enumerated; the plan is valid, strict plans keep groups whole and the bound stays below the peak."""
    gen = torch.Generator().manual_seed(3)
    w = torch.exp(torch.randn(3, 64, generator=gen, dtype=torch.float64))
    kw = {"num_replicas": 80, "num_groups": 16, "num_nodes": 4, "num_gpus": 8}
    if mode == "migration":
        old = E.plan(w, **kw)
        p = E.plan(w * 1.5 + 1.0, **kw, previous=old, max_changed_slots=10)
        assert p.changed_slots is not None
        assert int(p.changed_slots.max()) <= 10
    else:
        p = E.plan(w, **kw, soft_locality=0.0 if mode == "soft" else None)
    p.validate()
    assert bool((p.gpu_loads.amax(1) >= p.lower_bound * (1 - 1e-9)).all())
    if mode == "strict":
        node_groups = p.home_node
        assert node_groups is not None
        counts = torch.zeros(3, 4, dtype=torch.int64).scatter_add_(
            1, node_groups, torch.ones_like(node_groups)
        )
        assert bool((counts == 4).all())


@pytest.mark.parametrize(
    ("weight", "kw", "greedy_balancedness"),
    [
        # DeepSeek's packing puts both replicas of expert 3 on one GPU: 50 / 50
        pytest.param([[10, 20, 30, 40]], _kw(6, 1, 1, 2), 1.0, id="4x6-1node-2gpus"),
        pytest.param(
            [[50, 100, 75, 120, 90, 60, 80, 110, 40, 70, 95, 85, 65, 55, 45, 35]],
            _kw(24, 8, 4, 8),
            0.9475806451612904,
            id="16x24-4nodes-8gpus",
        ),
    ],
)
def test_as_balanced_as_greedy_with_repeats(weight: list, kw: dict, greedy_balancedness: float) -> None:
    """Where only a repeat of an expert on a GPU reaches the greedy plan's balance, the plan takes it
    (and flags the layer); before, these gave 0.909 and 0.890."""
    w = torch.tensor(weight, dtype=torch.float64)
    p = E.plan(w, **kw)
    gp, gc = greedy_rebalance(w, **kw)
    assert float(E.balancedness(E.gpu_loads_of(w, gp, gc, kw["num_gpus"]))[0]) == greedy_balancedness
    assert float(p.balancedness[0]) >= greedy_balancedness - 1e-12
    assert p.colocated_layers is not None
    assert bool(p.colocated_layers[0])
    phy2log, _, logcnt = E.rebalance_experts(w, *kw.values())
    assert torch.equal(phy2log, p.phy2log)
    assert torch.equal(logcnt, p.logcnt)
    topology = {k: kw[k] for k in ("num_groups", "num_nodes", "num_gpus")}
    with pytest.raises(ValueError, match="avoidable"):  # not flagged: the repeat is refused
        E.Placement.from_tensors(p.phy2log, w, **topology, mode="strict")
