"""Soft locality: allocation of the redundant replicas to experts and nodes, then trades between
nodes."""

from __future__ import annotations

import numpy as np

from eplb_core._numba.utils import _INF, njit


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
                    cross = pe * ((home[layer, e] != lt) - (home[layer, e] != h))
                    cross += pf * ((home[layer, f] != h) - (home[layer, f] != lt))
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
        filler = np.sort(w)[: slots - 1].sum()
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
