"""Drop-in compatibility of ``rebalance_experts`` with DeepSeek's and vLLM's function: the cases their
algorithm tests exercise (small hand-made loads, the example of DeepSeek's README, the global fallback,
the errors callers catch), checked against the contract both document."""

from __future__ import annotations

import pytest
import torch

import eplb_core as E
from eplb_core.reference import greedy_rebalance

# (weight, num_replicas, num_groups, num_nodes, num_gpus)
CASES = [
    pytest.param([[10, 20, 30, 40]], 4, 1, 1, 1, id="one-gpu"),
    pytest.param([[50] * 8], 8, 2, 2, 4, id="equal-loads-no-redundancy"),
    pytest.param([[1000, 1, 1, 1, 1, 1, 1, 1]], 12, 2, 2, 4, id="one-dominant-expert"),
    pytest.param(
        [[10, 20, 30, 40, 50, 60], [60, 50, 40, 30, 20, 10], [25] * 6], 8, 2, 2, 4, id="three-layers"
    ),
    pytest.param([[10, 20, 30, 40]], 8, 3, 2, 4, id="groups-not-dividing-nodes-nor-experts"),
    pytest.param([[100, 50, 200, 75, 150, 25, 300, 80]], 12, 4, 2, 4, id="two-nodes-four-groups"),
    pytest.param([[10, 20, 30, 40, 50, 60]], 8, 3, 2, 4, id="global-fallback-6-experts"),
    pytest.param([[10, 20, 30, 40]], 6, 2, 1, 2, id="one-node-two-gpus"),
    pytest.param(
        [[50, 100, 75, 120, 90, 60, 80, 110, 40, 70, 95, 85, 65, 55, 45, 35]], 24, 8, 4, 8, id="16-on-4-nodes"
    ),
    pytest.param(
        [[200, 150, 100, 50, 25, 12], [12, 25, 50, 100, 150, 200]], 10, 3, 1, 2, id="one-node-3-groups"
    ),
]


@pytest.mark.parametrize(("weight", "num_replicas", "num_groups", "num_nodes", "num_gpus"), CASES)
def test_contract_on_small_cases(
    weight: list[list[int]], num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    """Shapes, ranges and counts of the three tensors, every expert served, ``log2phy`` listing exactly
    the slots of each expert, no layer below the greedy plan, and (for integer loads as vLLM passes
    them) the heaviest expert of a layer with redundancy to spare gets at least two replicas."""
    w = torch.tensor(weight)
    num_layers, num_experts = w.shape
    phy2log, log2phy, logcnt = E.rebalance_experts(w, num_replicas, num_groups, num_nodes, num_gpus)
    assert phy2log.shape == (num_layers, num_replicas)
    assert logcnt.shape == (num_layers, num_experts)
    assert log2phy.shape[:2] == (num_layers, num_experts)
    assert log2phy.shape[2] == int(logcnt.max())
    assert bool(((phy2log >= 0) & (phy2log < num_experts)).all())
    assert bool((logcnt >= 1).all())
    assert bool((logcnt.sum(1) == num_replicas).all())
    for layer in range(num_layers):
        for e in range(num_experts):
            slots = log2phy[layer, e]
            listed = slots[slots >= 0]
            assert listed.numel() == int(logcnt[layer, e])
            assert bool((phy2log[layer, listed] == e).all())
    gp, gc = greedy_rebalance(w, num_replicas, num_groups, num_nodes, num_gpus)
    ours = E.balancedness(E.gpu_loads_of(w, phy2log, logcnt, num_gpus))
    greedy = E.balancedness(E.gpu_loads_of(w, gp, gc, num_gpus))
    assert bool((ours >= greedy - 1e-12).all())
    if num_replicas - num_experts >= 2:
        heaviest = w.argmax(1)
        assert bool((logcnt[torch.arange(num_layers), heaviest] >= 2).all())


def test_deepseek_readme_example_gives_deepseek_plan() -> None:
    """On the example of DeepSeek's README (2 layers, 12 experts, 16 replicas, 4 groups, 2 nodes,
    8 GPUs) the greedy plan cannot be improved, and eplb-core returns it slot for slot: the same GPUs
    hold the same replicas, in the order DeepSeek's packing fills a GPU."""
    w = torch.tensor(
        [
            [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
        ]
    )
    phy2log, _, logcnt = E.rebalance_experts(w, 16, 4, 2, 8)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]


def test_slots_of_a_gpu_by_decreasing_replica_load() -> None:
    w = E.synthetic_loads(3, 64, num_groups=8, seed=5)
    phy2log, _, logcnt = E.rebalance_experts(w, 80, 8, 2, 16)
    load = torch.gather(w / logcnt, 1, phy2log).view(3, 16, 5)
    ids = phy2log.view(3, 16, 5)
    later_lighter = load[..., 1:] < load[..., :-1]
    tie_by_id = (load[..., 1:] == load[..., :-1]) & (ids[..., 1:] > ids[..., :-1])
    assert bool((later_lighter | tie_by_id).all())


@pytest.mark.parametrize(
    ("num_replicas", "num_groups", "num_nodes", "num_gpus", "match"),
    [
        pytest.param(7, 2, 2, 4, "multiple of num_gpus", id="replicas-not-multiple-of-gpus"),
        pytest.param(3, 1, 1, 1, "every expert needs", id="fewer-replicas-than-experts"),
        pytest.param(9, 2, 2, 3, "multiple of num_nodes", id="gpus-not-multiple-of-nodes"),
        pytest.param(8, 3, 1, 4, "must divide", id="groups-not-dividing-experts"),
    ],
)
def test_topology_errors_are_value_and_assertion_errors(
    num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, match: str
) -> None:
    """DeepSeek's and vLLM's function assert these conditions: callers that catch ``AssertionError``
    keep working, and the error names the argument like every ``ValueError`` of eplb-core."""
    w = torch.tensor([[10, 20, 30, 40]])
    with pytest.raises(AssertionError, match=match):
        E.rebalance_experts(w, num_replicas, num_groups, num_nodes, num_gpus)
    with pytest.raises(ValueError, match=match):
        E.rebalance_experts(w, num_replicas, num_groups, num_nodes, num_gpus)
