"""Migration-aware re-planning: start from the plan in service and change at most a budget of slots
per layer."""

from __future__ import annotations

import numpy as np

from eplb_core._numba.counts import _slot_aware_row
from eplb_core._numba.refine import _refine, _repair_row, _workspace
from eplb_core._numba.utils import _INF, njit


@njit
def _row_peak(weight: np.ndarray, row: np.ndarray, counts: np.ndarray, num_bins: int, slots: int) -> float:
    """Heaviest GPU of a row of expert ids, every replica carrying ``weight / counts`` of its expert."""
    peak = -_INF
    for g in range(num_bins):
        load = 0.0
        for s in range(slots):
            e = row[g * slots + s]
            load += weight[e] / max(counts[e], 1)
        peak = max(peak, load)
    return peak


@njit
def _transfer_row(
    weight: np.ndarray,
    row: np.ndarray,
    counts: np.ndarray,
    num_bins: int,
    slots: int,
    transfers: int,
    work: tuple,
) -> None:
    """Re-split replicas inside one row of a plan in service, one slot at a time, in place.

    Targets are the slot-aware counts of the experts present in the row (:func:`_slot_aware_row`).
    Each step moves one slot from the over-replicated expert whose replicas would stay lightest to the
    under-replicated expert with the heaviest replica, on a GPU that does not hold the receiver (a GPU
    holding the donor twice first; below ``num_bins + 1`` replicas it must be such a GPU), and is kept
    only if the row's peak does not rise; the first refused step ends the row.
    """
    target, sub_w, sub_c, per, small, ids = work
    n_present = 0
    for e in range(weight.size):
        target[e] = 0
        if counts[e] > 0:
            ids[n_present] = e
            sub_w[n_present] = weight[e]
            n_present += 1
    if n_present == 0:
        return
    _slot_aware_row(sub_w[:n_present], row.size, num_bins, sub_c[:n_present], per[:n_present], small)
    for j in range(n_present):
        target[ids[j]] = sub_c[j]
    for _ in range(transfers):
        recv, donor = -1, -1
        best_r, best_d = -_INF, _INF
        for j in range(n_present):
            e = ids[j]
            c = counts[e]
            if c < target[e] and weight[e] / c > best_r:
                best_r, recv = weight[e] / c, e
            if c > target[e] and weight[e] / max(c - 1, 1) < best_d:
                best_d, donor = weight[e] / max(c - 1, 1), e
        if recv < 0 or donor < 0:
            return
        any_doubled = False
        for g in range(num_bins):
            n_donor = 0
            for s in range(slots):
                n_donor += row[g * slots + s] == donor
            any_doubled = any_doubled or n_donor > 1
        must = counts[donor] - 1 <= num_bins and any_doubled
        slot, slot_doubled = -1, False
        for g in range(num_bins):
            has_recv = False
            n_donor = 0
            for s in range(slots):
                has_recv = has_recv or row[g * slots + s] == recv
                n_donor += row[g * slots + s] == donor
            if has_recv or (must and n_donor < 2):
                continue
            for s in range(slots):
                p = g * slots + s
                if row[p] == donor and (slot < 0 or (n_donor > 1 and not slot_doubled)):
                    slot, slot_doubled = p, n_donor > 1
        if slot < 0:
            return
        before = _row_peak(weight, row, counts, num_bins, slots)
        row[slot] = recv
        counts[donor] -= 1
        counts[recv] += 1
        if _row_peak(weight, row, counts, num_bins, slots) > before:
            row[slot] = donor
            counts[donor] += 1
            counts[recv] -= 1
            return


@njit
def migrate_layers(
    weight: np.ndarray,
    prev: np.ndarray,
    rows_per_layer: int,
    num_gpus: int,
    budget: int,
    iters: int,
    transfers_on: bool,
    tables: tuple,
) -> np.ndarray:
    """Migration-aware plan: keep ``prev``'s slots, re-split replicas and exchange within a budget.

    Replicas never leave their row (a node in strict and soft plans, the layer in global ones). In
    each row (1) up to half the row's budget moves single slots between experts (:func:`_transfer_row`,
    with ``transfers_on``), (2) exchange rounds (:func:`_refine` with the budget) run with the rest:
    no row ends with more than ``budget // rows_per_layer`` slots that differ from ``prev``, and no
    step raises a row's peak.

    Args:
        weight: ``[L, N]`` float64; prev: ``[L, R]`` int64 plan in service (GPU-major slots).

    Returns:
        ``[L, R]`` int64, the new ``phy2log`` (slots in place: unchanged slots keep their position).
    """
    num_layers, num_replicas = prev.shape
    num_experts = weight.shape[1]
    per_row = num_replicas // rows_per_layer
    num_bins = num_gpus // rows_per_layer
    slots = num_replicas // num_gpus
    row_budget = budget // rows_per_layer
    out = prev.copy()
    counts = np.zeros((rows_per_layer, num_experts), dtype=np.int64)
    layer_counts = np.zeros(num_experts, dtype=np.int64)
    row = np.empty(per_row, dtype=np.int64)
    work = (
        np.zeros(num_experts, dtype=np.int64),
        np.empty(num_experts),
        np.empty(num_experts, dtype=np.int64),
        np.empty(num_experts),
        np.empty(max(slots, 1)),
        np.empty(num_experts, dtype=np.int64),
    )
    load = np.empty((rows_per_layer, num_bins, slots))
    expert = np.empty((rows_per_layer, num_bins, slots), dtype=np.int64)
    origin = np.empty((rows_per_layer, num_bins, slots), dtype=np.int64)
    fixed = np.zeros((rows_per_layer, num_bins, slots), dtype=np.bool_)
    budgets = np.full(rows_per_layer, row_budget, dtype=np.int64)
    ws = _workspace(num_bins, slots, num_experts, tables[3].shape[1], rows_per_layer)
    stamp = np.int64(0)
    for layer in range(num_layers):
        layer_counts[:] = 0
        for q in range(rows_per_layer):
            counts[q] = 0
            for p in range(per_row):
                row[p] = out[layer, q * per_row + p]
                counts[q, row[p]] += 1
            if transfers_on and row_budget // 2 > 0:
                _transfer_row(weight[layer], row, counts[q], num_bins, slots, row_budget // 2, work)
            fe = expert[q].reshape(-1)
            fo = origin[q].reshape(-1)
            for p in range(per_row):
                fe[p] = row[p]
                fo[p] = prev[layer, q * per_row + p]
            for e in range(num_experts):
                layer_counts[e] += counts[q, e]
        for q in range(rows_per_layer):
            fl = load[q].reshape(-1)
            fe = expert[q].reshape(-1)
            for p in range(per_row):
                fl[p] = weight[layer, fe[p]] / layer_counts[fe[p]]
        stamp = _refine(
            load,
            expert,
            fixed,
            np.bool_(False),
            rows_per_layer,
            rows_per_layer,
            np.int64(1),
            iters,
            tables,
            ws,
            stamp,
            origin,
            budgets,
        )
        for q in range(rows_per_layer):
            # transfers can leave an expert twice on a GPU after its count fell to the row's GPUs or fewer
            fe = expert[q].reshape(-1)
            ff = fixed[q].reshape(-1)
            for p in range(per_row):
                ff[p] = counts[q, fe[p]] > num_bins  # (more replicas here than GPUs: repeats allowed)
            _repair_row(load[q].reshape(-1), fe, ff, num_bins, slots, origin[q].reshape(-1), row_budget)
            for p in range(per_row):
                ff[p] = False
                out[layer, q * per_row + p] = fe[p]
    return out
