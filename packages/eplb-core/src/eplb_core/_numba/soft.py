"""Soft locality: allocation of the redundant replicas to experts and nodes, then trades between
nodes."""

from __future__ import annotations

import numpy as np

from eplb_core._numba.utils import _INF, INTERPRETED, njit


@njit
def soft_node_swaps(
    weight: np.ndarray,
    counts: np.ndarray,
    expert: np.ndarray,
    node: np.ndarray,
    home: np.ndarray,
    num_nodes: int,
    gpus_per_node: int,
    penalty: float,
    max_steps: int,
) -> None:
    """Even out the node loads of a soft-locality allocation by exchanging redundant replicas.

    Per layer, up to ``max_steps`` times: the heaviest node ``H`` trades one of its redundant replicas
    (slot ``>= N``: the first ``N`` slots are every expert's primary replica, which stays home) for a
    lighter redundant replica of another node ``L``, the exchange that lowers ``max(H, L)`` the most,
    if the drop exceeds ``penalty`` times the cross-node load it adds and no node then holds more
    replicas of an expert than it has GPUs.

    Args:
        weight: ``[L, N]`` float64 loads; counts: ``[L, N]`` int64 replica counts.
        expert, node: ``[L, R]`` int64 expert and node of every replica (``node`` updated in place).
        home: ``[L, N]`` int64 home node of every expert.
    """
    num_layers, num_replicas = expert.shape
    num_experts = weight.shape[1]
    load = np.empty(num_nodes)
    on_node = np.zeros((num_nodes, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        load[:] = 0.0
        on_node[:] = 0
        for p in range(num_replicas):
            e = expert[layer, p]
            load[node[layer, p]] += weight[layer, e] / counts[layer, e]
            on_node[node[layer, p], e] += 1
        for _ in range(max_steps):
            h = np.argmax(load)
            best = load[h]
            bi = -1
            bj = -1
            if INTERPRETED:
                bi, bj = _best_node_swap_np(
                    weight[layer],
                    counts[layer],
                    expert[layer],
                    node[layer],
                    home[layer],
                    on_node,
                    load,
                    h,
                    num_experts,
                    gpus_per_node,
                    penalty,
                )
            else:
                for i in range(num_experts, num_replicas):
                    if node[layer, i] != h:
                        continue
                    e = expert[layer, i]
                    pe = weight[layer, e] / counts[layer, e]
                    for j in range(num_experts, num_replicas):
                        lt = node[layer, j]
                        if lt == h:
                            continue
                        f = expert[layer, j]
                        pf = weight[layer, f] / counts[layer, f]
                        d = pe - pf
                        if d <= 0 or e == f:
                            continue
                        peak = max(load[h] - d, load[lt] + d)
                        if peak >= best:
                            continue
                        if on_node[lt, e] >= gpus_per_node or on_node[h, f] >= gpus_per_node:
                            continue
                        # cross-node load added by the exchange
                        cross = pe * (int(home[layer, e] != lt) - int(home[layer, e] != h))
                        cross += pf * (int(home[layer, f] != h) - int(home[layer, f] != lt))
                        if load[h] - peak <= penalty * max(cross, 0.0):
                            continue
                        best = peak
                        bi = i
                        bj = j
            if bi < 0:
                break
            lt = node[layer, bj]
            e = expert[layer, bi]
            f = expert[layer, bj]
            d = weight[layer, e] / counts[layer, e] - weight[layer, f] / counts[layer, f]
            load[h] -= d
            load[lt] += d
            on_node[h, e] -= 1
            on_node[lt, e] += 1
            on_node[lt, f] -= 1
            on_node[h, f] += 1
            node[layer, bi] = lt
            node[layer, bj] = h


def _best_node_swap_np(
    w: np.ndarray,
    c: np.ndarray,
    expert: np.ndarray,
    node: np.ndarray,
    home: np.ndarray,
    on_node: np.ndarray,
    load: np.ndarray,
    h: int | np.integer,
    num_experts: int,
    gpus_per_node: int,
    penalty: float,
) -> tuple[int, int]:
    """The exchange one step of :func:`soft_node_swaps` makes, in array operations: the same peaks
    and cross-node loads, the first lowest peak in ``(i, j)`` order; ``(-1, -1)`` when none helps."""
    redundant = np.arange(num_experts, expert.size)
    on_h = node[redundant] == h
    ii, jj = redundant[on_h], redundant[~on_h]
    if ii.size == 0 or jj.size == 0:
        return -1, -1
    e, f = expert[ii], expert[jj]
    lt = node[jj]
    pe, pf = w[e] / c[e], w[f] / c[f]
    d = pe[:, None] - pf[None, :]
    peak = np.maximum(load[h] - d, load[lt][None, :] + d)
    cross = pe[:, None] * (
        (home[e][:, None] != lt[None, :]).astype(np.int64) - (home[e] != h).astype(np.int64)[:, None]
    )
    cross = cross + pf[None, :] * (
        (home[f] != h).astype(np.int64)[None, :] - (home[f][None, :] != lt[None, :]).astype(np.int64)
    )
    ok = (d > 0) & (e[:, None] != f[None, :]) & (peak < load[h])
    ok &= (on_node[lt[None, :], e[:, None]] < gpus_per_node) & (on_node[h, f] < gpus_per_node)[None, :]
    ok &= ~(load[h] - peak <= penalty * np.maximum(cross, 0.0))
    if not ok.any():
        return -1, -1
    k = int(np.argmin(np.where(ok, peak, _INF)))
    return int(ii[k // jj.size]), int(jj[k % jj.size])


@njit
def soft_allocate(
    weight: np.ndarray, home: np.ndarray, num_replicas: int, num_nodes: int, num_gpus: int, penalty: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replica counts and nodes of the soft-locality mode, every layer.

    Every expert keeps its first replica on its home node. The ``R - N`` redundant replicas are handed
    out one at a time: each step either splits the expert with the heaviest replica (what GPU packing
    needs, option a) or the expert whose split takes the most load off the heaviest node (option b),
    whichever gives the lower estimate of the final peak ``max(heaviest node / GPUs per node,
    heaviest replica + the S - 1 lightest loads)``; the new replica goes to the node with a free slot
    where ``(load + replica) * (1 + W [not home])`` is lowest (option a weighs leaving home with
    ``max(W, 1)``: a split for packing stays home when it can). Experts that would need a second
    replica on a GPU of a node are skipped while others can still take one.

    Args:
        weight: ``[L, N]`` float64; home: ``[L, N]`` int64 home node of every expert.

    Returns:
        ``(expert [L, R], node [L, R], counts [L, N])`` int64: the first ``N`` replicas are the
        primaries (expert ``e`` at slot ``e``), then the redundant ones in the order they were made.
    """
    if INTERPRETED:
        return _soft_allocate_np(weight, home, num_replicas, num_nodes, num_gpus, penalty)
    num_layers, num_experts = weight.shape
    per_node_cap = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots = num_replicas // num_gpus
    expert = np.empty((num_layers, num_replicas), dtype=np.int64)
    node = np.empty((num_layers, num_replicas), dtype=np.int64)
    counts = np.empty((num_layers, num_experts), dtype=np.int64)
    on_node = np.empty((num_experts, num_nodes), dtype=np.int64)
    free = np.empty(num_nodes, dtype=np.int64)
    node_load = np.empty(num_nodes)
    load_after = np.empty(num_nodes)
    per = np.empty(num_experts)
    feasible = np.empty(num_experts, dtype=np.bool_)
    pick_e = np.empty(2, dtype=np.int64)
    pick_n = np.empty(2, dtype=np.int64)
    score = np.empty(2)
    for layer in range(num_layers):
        w = weight[layer]
        c = counts[layer]
        c[:] = 1
        on_node[:] = 0
        free[:] = per_node_cap
        for e in range(num_experts):
            on_node[e, home[layer, e]] = 1
            free[home[layer, e]] -= 1
            expert[layer, e] = e
            node[layer, e] = home[layer, e]
        # the S - 1 lightest loads, summed in order (the same sum compiled and interpreted)
        filler = 0.0
        for v in np.sort(w)[: slots - 1]:
            filler += v
        for step in range(num_experts, num_replicas):
            node_load[:] = 0.0
            for e in range(num_experts):
                per[e] = w[e] / c[e]
                for n in range(num_nodes):
                    node_load[n] += on_node[e, n] * per[e]
            heavy = np.argmax(node_load)
            any_feasible = False
            for e in range(num_experts):
                feasible[e] = False
                for n in range(num_nodes):
                    if free[n] > 0 and on_node[e, n] < gpus_per_node:
                        feasible[e] = True
                any_feasible = any_feasible or feasible[e]
            if not any_feasible:  # a repeat on some GPU is unavoidable
                feasible[:] = True
            # option a: the heaviest replica; option b: the most load off the heaviest node
            e_a, e_b = -1, -1
            best_a, best_b = -_INF, -_INF
            any_heavy = False
            for e in range(num_experts):
                any_heavy = any_heavy or (feasible[e] and on_node[e, heavy] > 0)
            for e in range(num_experts):
                if not feasible[e]:
                    continue
                if per[e] > best_a:
                    best_a, e_a = per[e], e
                if on_node[e, heavy] > 0 or not any_heavy:
                    shed = on_node[e, heavy] * (per[e] - w[e] / (c[e] + 1))
                    if shed > best_b:
                        best_b, e_b = shed, e
            pick_e[0], pick_e[1] = e_a, e_b
            for which in range(2):
                e = pick_e[which]
                new_per = w[e] / (c[e] + 1)
                any_open = False
                for n in range(num_nodes):
                    load_after[n] = node_load[n] - on_node[e, n] * (per[e] - new_per)
                    crowded = on_node[e, n] >= gpus_per_node and c[e] + 1 <= num_gpus
                    any_open = any_open or (free[n] > 0 and not crowded)
                best_cost = _INF
                best_n = 0
                for n in range(num_nodes):
                    crowded = on_node[e, n] >= gpus_per_node and c[e] + 1 <= num_gpus
                    if free[n] <= 0 or (crowded and any_open):
                        continue
                    away = 1.0
                    if n != home[layer, e]:
                        away += penalty if which == 1 else max(penalty, 1.0)
                    cost = (load_after[n] + new_per) * away
                    if cost < best_cost:
                        best_cost, best_n = cost, n
                load_after[best_n] += new_per
                top = new_per
                for f in range(num_experts):
                    if f != e:
                        top = max(top, per[f])
                score[which] = max(load_after.max() / gpus_per_node, top + filler)
                pick_n[which] = best_n
            take = 1 if score[1] < score[0] else 0
            e, n = pick_e[take], pick_n[take]
            c[e] += 1
            on_node[e, n] += 1
            free[n] -= 1
            expert[layer, step] = e
            node[layer, step] = n
    return expert, node, counts


def _soft_allocate_np(
    weight: np.ndarray, home: np.ndarray, num_replicas: int, num_nodes: int, num_gpus: int, penalty: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`soft_allocate` with every step in array operations: the same choices and the same
    floating-point operations in the same order (node loads are running sums over the experts in id
    order, as the loops add them), so the same result bit for bit."""
    num_layers, num_experts = weight.shape
    per_node_cap = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots = num_replicas // num_gpus
    expert = np.empty((num_layers, num_replicas), dtype=np.int64)
    node = np.empty((num_layers, num_replicas), dtype=np.int64)
    counts = np.empty((num_layers, num_experts), dtype=np.int64)
    experts = np.arange(num_experts)
    nodes = np.arange(num_nodes)
    for layer in range(num_layers):
        w = weight[layer]
        c = counts[layer]
        c[:] = 1
        home_l = home[layer]
        on_node = np.zeros((num_experts, num_nodes), dtype=np.int64)
        on_node[experts, home_l] = 1
        free = per_node_cap - np.bincount(home_l, minlength=num_nodes).astype(np.int64)
        expert[layer, :num_experts] = experts
        node[layer, :num_experts] = home_l
        filler = 0.0
        for v in np.sort(w)[: slots - 1]:
            filler += v
        for step in range(num_experts, num_replicas):
            per = w / c
            # sum over the experts in id order, one node per column (a running sum, as the loops add)
            node_load = np.add.accumulate(on_node * per[:, None], axis=0)[-1]
            heavy = int(np.argmax(node_load))
            feasible = ((free > 0)[None, :] & (on_node < gpus_per_node)).any(1)
            if not feasible.any():  # a repeat on some GPU is unavoidable
                feasible = np.ones(num_experts, dtype=np.bool_)
            on_heavy = on_node[:, heavy]
            any_heavy = bool((feasible & (on_heavy > 0)).any())
            e_a = int(np.argmax(np.where(feasible, per, -_INF)))
            cand_b = feasible & ((on_heavy > 0) | (not any_heavy))
            shed = on_heavy * (per - w / (c + 1))
            e_b = int(np.argmax(np.where(cand_b, shed, -_INF)))
            score = [0.0, 0.0]
            pick_n = [0, 0]
            for which, e in enumerate((e_a, e_b)):
                new_per = w[e] / (c[e] + 1)
                load_after = node_load - on_node[e] * (per[e] - new_per)
                crowded = (on_node[e] >= gpus_per_node) & (c[e] + 1 <= num_gpus)
                any_open = bool(((free > 0) & ~crowded).any())
                allowed = (free > 0) & ~(crowded & any_open)
                away = np.where(nodes != home_l[e], 1.0 + (penalty if which == 1 else max(penalty, 1.0)), 1.0)
                cost = np.where(allowed, (load_after + new_per) * away, _INF)
                best_n = int(np.argmin(cost)) if allowed.any() else 0
                load_after[best_n] += new_per
                others = per.copy()
                others[e] = -_INF
                top = max(new_per, others.max()) if num_experts > 1 else new_per
                score[which] = max(load_after.max() / gpus_per_node, top + filler)
                pick_n[which] = best_n
            take = 1 if score[1] < score[0] else 0
            e, n = (e_a, e_b)[take], pick_n[take]
            c[e] += 1
            on_node[e, n] += 1
            free[n] -= 1
            expert[layer, step] = e
            node[layer, step] = n
    return expert, node, counts
