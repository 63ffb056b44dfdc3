"""The compiled planner's pieces against the reference (item by item) and against NumPy."""

from __future__ import annotations

import os
import types
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplb_core._numba import runner
from eplb_core._numba.counts import _is_greedy_split, greedy_counts
from eplb_core._numba.refine import _workspace
from eplb_core._numba.rounds import _row_state, _sort_slots, _start_row, _swap_rounds
from eplb_core._numba.starts import _argsort_desc, lpt_bins
from eplb_core._numba.utils import GREEDY_SCAN_EXPERTS
from eplb_core.reference import greedy_replica_counts, lpt_pack

SETTINGS = settings(
    max_examples=int(os.environ.get("EPLB_HYPOTHESIS_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 5), st.integers(0, 2**31 - 1), st.booleans())
def test_lpt_bins_matches_greedy_baseline(
    rows: int, num_bins: int, slots: int, seed: int, with_experts: bool
) -> None:
    """The compiled LPT of the planner places every item exactly as the baseline's loop does."""

    rng = np.random.default_rng(seed)
    num_items = num_bins * slots
    num_experts = max(1, num_items - rng.integers(0, num_items))
    counts = np.ones((rows, num_experts), dtype=np.int64)
    for r in range(rows):
        np.add.at(counts[r], rng.integers(0, num_experts, num_items - num_experts), 1)
    w = (
        rng.integers(0, 4, (rows, num_experts)).astype(np.float64)
        if seed % 3 == 0
        else rng.random((rows, num_experts))
    )
    # expert-major items, as the planner builds them
    local = np.repeat(np.tile(np.arange(num_experts), rows), counts.reshape(-1)).reshape(rows, -1)
    load = np.take_along_axis(w / counts, local, 1)
    got = lpt_bins(load, local, with_experts, num_bins)
    np.testing.assert_array_equal(got, lpt_pack(load, num_bins, local if with_experts else None))


@pytest.mark.parametrize("num_bins", [17, 24, 72], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lpt_bins_many_bins_matches_greedy_baseline(num_bins: int, seed: int) -> None:
    """Rows of more than 16 GPUs (the heap of open bins, the bucket sort of the loads) place every
    item as the baseline's loop does, with hot experts, repeats and ties."""

    rng = np.random.default_rng(seed)
    slots = 4
    num_items = num_bins * slots
    num_experts = num_items - num_bins // 2
    counts = np.ones((2, num_experts), dtype=np.int64)
    for r in range(2):
        np.add.at(counts[r], rng.integers(0, 4, num_items - num_experts), 1)  # a few hot experts
    w = np.stack([rng.lognormal(0.0, 1.0, num_experts), rng.integers(0, 3, num_experts).astype(np.float64)])
    local = np.repeat(np.tile(np.arange(num_experts), 2), counts.reshape(-1)).reshape(2, -1)
    load = np.take_along_axis(w / counts, local, 1)
    for with_experts in (False, True):
        got = lpt_bins(load, local, with_experts, num_bins)
        np.testing.assert_array_equal(got, lpt_pack(load, num_bins, local if with_experts else None))


@pytest.mark.parametrize("kind", ["lognormal", "ints", "narrow", "signed_zero", "outlier"])
def test_argsort_desc_is_stable_descending(kind: str) -> None:
    """The compiled argsort (bucket sort of the loads' bits, merge sort otherwise) equals NumPy's
    stable argsort of ``-x`` on every length around the bucket threshold."""

    rng = np.random.default_rng(7)
    for n in [1, 7, 8, 9, 15, 16, 17, 40, 63, 64, 65, 72, 288, 300]:
        if kind == "lognormal":
            x = rng.lognormal(0.0, 1.5, n)
        elif kind == "ints":
            x = rng.integers(0, 4, n).astype(np.float64)
        elif kind == "narrow":
            x = 1.0 + 1e-3 * rng.random(n)
        elif kind == "signed_zero":
            x = np.where(rng.random(n) < 0.3, -0.0, rng.random(n))
        else:  # one outlier: every other load in one bucket, the merge sort takes over
            x = np.concatenate([[1e300], rng.random(n - 1)])
        np.testing.assert_array_equal(_argsort_desc(x), np.argsort(-x, kind="stable"))


@SETTINGS
@given(st.integers(1, 12), st.integers(0, 20), st.integers(0, 2**31 - 1), st.booleans())
def test_split_counts_equal_sequential_greedy(num_experts: int, extra: int, seed: int, ints: bool) -> None:

    rng = np.random.default_rng(seed)
    w = (
        rng.integers(0, 4, (3, num_experts)).astype(np.float64) + 1
        if ints
        else np.exp(2 * rng.standard_normal((3, num_experts)))
    )
    counts = np.ones(w.shape, dtype=np.int64)
    greedy_counts(w, counts, num_experts + extra)
    np.testing.assert_array_equal(counts, greedy_replica_counts(w, num_experts + extra))


@pytest.mark.parametrize("ints", [False, True], ids=["lognormal", "ints"])
def test_split_counts_of_many_experts_equal_sequential_greedy(ints: bool) -> None:
    """Rows of more than GREEDY_SCAN_EXPERTS experts hand out many replicas from a heap: the same
    counts as the sequential greedy split."""
    rng = np.random.default_rng(7)
    num_experts = GREEDY_SCAN_EXPERTS + 37
    for extra in (3, 8, 41, 300):
        w = (
            rng.integers(0, 4, (2, num_experts)).astype(np.float64) + 1
            if ints
            else np.exp(2 * rng.standard_normal((2, num_experts)))
        )
        counts = np.ones(w.shape, dtype=np.int64)
        greedy_counts(w, counts, num_experts + extra)
        np.testing.assert_array_equal(counts, greedy_replica_counts(w, num_experts + extra))


@SETTINGS
@given(st.integers(1, 12), st.integers(1, 20), st.integers(0, 2**31 - 1), st.booleans())
def test_greedy_split_recognised(num_experts: int, extra: int, seed: int, ints: bool) -> None:
    """The O(N) check that lets the planner skip recomputing the greedy split: true on the greedy
    split, false on every split that moves one replica elsewhere (ties included)."""

    rng = np.random.default_rng(seed)
    w = (
        rng.integers(0, 4, num_experts).astype(np.float64) + 1
        if ints
        else np.exp(2 * rng.standard_normal(num_experts))
    )
    greedy = greedy_replica_counts(w[None], num_experts + extra)[0]
    assert _is_greedy_split(w, greedy)
    for src in range(num_experts):
        for dst in range(num_experts):
            if src == dst or greedy[src] == 1:
                continue
            other = greedy.copy()
            other[src] -= 1
            other[dst] += 1
            assert not _is_greedy_split(w, other), (w, greedy, other)


def _all_pairs_swap_rounds() -> Callable[..., tuple[bool, int]]:
    """The interpreted form of ``_swap_rounds`` with every slot count below the all-pairs scoring's
    limit: it scores every (x, y) pair in array operations (``_brute_exchange_np``) on any row."""
    twin = runner.interpreted(_swap_rounds)
    env = {**twin.__globals__, "BRUTE_FORCE_SLOTS": 64}
    return types.FunctionType(twin.__code__, env, twin.__name__, twin.__defaults__, twin.__closure__)


@pytest.mark.parametrize("slots", [2, 6, 9, 16, 24, 33])
@pytest.mark.parametrize("kind", ["lognormal", "ints", "fixed"])
def test_exchange_sweep_equals_all_pairs_scoring(slots: int, kind: str) -> None:
    """The exchange rounds make exactly the exchanges of scoring every (x, y) pair, ties on equal
    loads included, on rows with repeated experts and fixed items: on up to BRUTE_FORCE_SLOTS slots
    the branch-free scoring of all pairs and the scoring with a migration budget too large to refuse
    anything, on more slots the sweep over slots sorted by load; all against the pairs scored in
    array operations."""

    rng = np.random.default_rng(slots)
    all_pairs = _all_pairs_swap_rounds()
    moves = 0
    for num_bins in (2, 5, 8, 12):
        num_items = num_bins * slots
        # experts with 1-3 replicas on distinct bins; under "fixed" one expert on every bin
        expert = np.full(num_items, -1, dtype=np.int64)
        fixed = np.zeros(num_items, dtype=np.bool_)
        load = np.empty(num_items)
        next_id = 0
        for b in range(num_bins) if kind == "fixed" else ():
            expert[b * slots] = 0
            fixed[b * slots] = True
        next_id = 1 if kind == "fixed" else 0
        for p in rng.permutation(num_items):
            if expert[p] >= 0:
                continue
            expert[p] = next_id
            free = [q for q in range(num_items) if expert[q] < 0 and q // slots != p // slots]
            for q in rng.choice(free, size=min(len(free), int(rng.integers(0, 3))), replace=False):
                if all(expert[r] != next_id for r in range((q // slots) * slots, (q // slots + 1) * slots)):
                    expert[q] = next_id
            next_id += 1
        per_expert = (
            rng.integers(1, 6, next_id).astype(np.float64) if kind == "ints" else rng.lognormal(0, 1, next_id)
        )
        load[:] = per_expert[expert]
        results = []
        # without a budget; with one that refuses nothing; every pair scored in array operations
        for budget, rounds_fn in ((-1, _swap_rounds), (10 * num_items, _swap_rounds), (-1, all_pairs)):
            rb, sb, _, _ = _workspace(num_bins, slots, next_id, 8, 1)
            rb, sb = _row_state(rb, sb, 0)
            fl, fe, ff = load.copy(), expert.copy(), fixed.copy()
            stamp = _start_row(fl, slots, rb[2], rb[3], rb[4], 0)
            _sort_slots(fl, num_bins, slots, sb[5])
            moved, _ = rounds_fn(
                fl,
                fe,
                ff,
                np.bool_(kind == "fixed"),
                1e-12,
                12,
                0,
                slots,
                rb,
                sb,
                stamp,
                expert.copy(),
                budget,
            )
            results.append((moved, fl, fe, ff))
        (m_plain, *plain), (m_budget, *budgeted), (m_all, *scored) = results
        assert m_plain == m_budget == m_all
        moves += m_plain
        for a, b, c in zip(plain, budgeted, scored, strict=True):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, c)
    # with one fixed and one free item per GPU an exchange only swaps two GPUs' loads: nothing moves
    assert moves > 0 or (kind == "fixed" and slots == 2)
