"""Batched tensor building blocks of the balancer (private).

Every function works on a batch of independent sub-problems (layers, or layer x node in the strict
hierarchy) with a fixed number of operations per call, so one call costs a few hundred small tensor ops
whatever the number of layers, and runs unchanged on a CUDA tensor. Used by the bounds (node cap) and
the migration-aware mode; the strict/global and soft-locality planners are compiled (``_kernels``).
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import torch

# Swaps that improve a pair's peak by less than this fraction of the mean bin load are ignored: they
# cannot change the reported balance and would only make the loop run longer.
_REL_TOL = 1e-12


def min_max_counts(weight: torch.Tensor, num_replicas: int, base: torch.Tensor | None = None) -> torch.Tensor:
    """Replica counts minimising the largest per-replica load ``w_e / c_e`` (given minimum counts).

    Args:
        weight: ``[B, N]`` float64, non-negative.
        num_replicas: total replicas per row, ``>= N``.
        base: optional ``[B, N]`` int64 minimum counts (``>= 1``, row sums ``<= num_replicas``).

    Returns:
        ``[B, N]`` int64 counts ``>= base`` (or 1), each row summing to ``num_replicas``.

    Greedy allocation (split the expert with the heaviest replica, repeat) is optimal for this objective;
    it hands out the extra replicas to the largest values of ``{w_e / k : k >= base_e}``, all at once here.
    Only the experts with the heaviest replicas can receive one, and expert ``e`` ends with at most
    ``R w_e / total + 1`` replicas, which bounds the candidate table.
    """
    num_rows, num_experts = weight.shape
    device = weight.device
    counts = (
        torch.ones(num_rows, num_experts, dtype=torch.int64, device=device) if base is None else base.clone()
    )
    extra_rows = num_replicas - counts.sum(1)
    extra = int(extra_rows.max())
    if extra == 0:
        return counts
    top = min(extra, num_experts)
    per_replica = weight / counts.to(weight.dtype)
    heavy = torch.sort(per_replica, dim=1, descending=True, stable=True).indices[:, :top]
    w_top = weight.gather(1, heavy)
    c_top = counts.gather(1, heavy)
    total = weight.sum(dim=1, keepdim=True)
    # an expert that ends with c replicas had w / (c - 1) >= every other w_j / c_j, so c <= R w / total + 1
    bound = (num_replicas * w_top / total.clamp_min(1e-300) + 2 - c_top).amax()
    max_extra = math.ceil(float(bound)) if torch.isfinite(bound) else extra
    max_extra = min(extra, max(max_extra, -(-extra // top), 1))
    k = torch.arange(0, max_extra, dtype=weight.dtype, device=device)
    # the k-th extra replica of e is worth its per-replica load *before* the split, w / (c + k)
    cand = (w_top.unsqueeze(-1) / (c_top.to(weight.dtype).unsqueeze(-1) + k)).reshape(num_rows, -1)
    order = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :extra]
    take = (torch.arange(extra, device=device) < extra_rows.unsqueeze(1)).long()
    counts.scatter_add_(1, heavy.gather(1, order // max_extra), take)
    return counts


def slot_aware_counts(weight: torch.Tensor, num_replicas: int, num_bins: int) -> torch.Tensor:
    """Replica counts that leave room for the other items of a GPU.

    With ``S = num_replicas / num_bins`` slots per GPU, a GPU holding a replica of load ``h`` also holds
    ``S - 1`` other replicas, so its load is at least ``h`` plus the ``S - 1`` lightest replica loads. The
    min-max counts can leave ``h`` so close to the mean GPU load that no packing is balanced (few slots per
    GPU). Here every expert first gets enough replicas that each fits under ``mean - filler`` (``filler``:
    the ``S - 1`` lightest expert loads), when that is affordable, and the rest are spread min-max.

    Args:
        weight: ``[B, N]`` float64.

    Returns:
        ``[B, N]`` int64 counts.
    """
    _num_rows, num_experts = weight.shape
    slots = num_replicas // num_bins
    if slots <= 1 or num_replicas == num_experts:
        return min_max_counts(weight, num_replicas)
    mean_bin = weight.sum(1, keepdim=True) / num_bins
    filler = torch.sort(weight, dim=1).values[:, : slots - 1].sum(1, keepdim=True)
    room = mean_bin - filler
    need = torch.where(room > 0, torch.ceil(weight / room.clamp_min(1e-300)), torch.ones_like(weight))
    need = need.clamp(1, num_replicas).long()
    affordable = need.sum(1, keepdim=True) <= num_replicas
    base = torch.where(affordable, need, torch.ones_like(need))
    return min_max_counts(weight, num_replicas, base)


@lru_cache(maxsize=32)
def _equal_partitions(num_items: int, num_bins: int) -> torch.Tensor | None:
    """All ways to split ``num_items`` labelled items into ``num_bins`` unlabelled equal blocks.

    Returns ``[C, num_items]`` bin ids (canonical: blocks numbered by their smallest item), or None
    when there are too many to enumerate.
    """
    per_bin = num_items // num_bins
    count = math.factorial(num_items) // (math.factorial(per_bin) ** num_bins * math.factorial(num_bins))
    if count > 4096:
        return None
    out: list[list[int]] = []

    def rec(assign: list[int], remaining: list[int], next_bin: int) -> None:
        if not remaining:
            out.append(assign.copy())
            return
        first, rest = remaining[0], remaining[1:]
        for others in itertools.combinations(rest, per_bin - 1):
            for i in (first, *others):
                assign[i] = next_bin
            rec(assign, [r for r in rest if r not in others], next_bin + 1)

    rec([0] * num_items, list(range(num_items)), 0)
    return torch.tensor(out, dtype=torch.int64)


def assign_groups_to_nodes(group_load: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-size packing of groups onto nodes, minimising the heaviest node.

    Args:
        group_load: ``[L, num_groups]`` float64.
        num_nodes: divides ``num_groups``.

    Returns:
        ``(node_of_group [L, num_groups] int64, best_peak [L] float64)``. ``best_peak`` is the exact optimum
        when the partitions can be enumerated (DeepSeek-V3: 105 ways for 8 groups on 4 nodes), else the
        peak of an LPT + swap-refined packing (then it is not a lower bound; see ``node_cap_bound``).
    """
    num_layers, num_groups = group_load.shape
    device = group_load.device
    if num_nodes == 1:
        return torch.zeros(num_layers, num_groups, dtype=torch.int64, device=device), group_load.sum(1)
    parts = _equal_partitions(num_groups, num_nodes)
    if parts is not None:
        parts = parts.to(device)
        onehot = torch.nn.functional.one_hot(parts, num_nodes).to(group_load.dtype)  # [C, g, n]
        node_loads = torch.einsum("lg,cgn->lcn", group_load, onehot)
        peak = node_loads.amax(dim=2)
        best = peak.argmin(dim=1)
        return parts[best], peak.gather(1, best[:, None]).squeeze(1)
    per_node = num_groups // num_nodes
    eid = torch.arange(num_groups, device=device).expand(num_layers, -1)
    bins_load, bins_id = round_robin_pack(group_load, eid, num_nodes, per_node)[:2]
    bins_load, bins_id = refine_swaps(bins_load, bins_id, iters=4 * num_nodes)
    node_of_group = torch.empty(num_layers, num_groups, dtype=torch.int64, device=device)
    node_ids = torch.arange(num_nodes, device=device).repeat_interleave(per_node).expand(num_layers, -1)
    node_of_group.scatter_(1, bins_id.reshape(num_layers, -1), node_ids.contiguous())
    return node_of_group, bins_load.sum(-1).amax(-1)


def node_cap_bound(group_load: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """A lower bound ``[L]`` on the heaviest node over every equal-size group-to-node assignment."""
    parts = _equal_partitions(group_load.shape[1], num_nodes) if num_nodes > 1 else None
    if num_nodes == 1:
        return group_load.sum(1)
    if parts is not None:
        return assign_groups_to_nodes(group_load, num_nodes)[1]
    # The node holding the heaviest group also holds per_node - 1 others, at least the lightest ones.
    per_node = group_load.shape[1] // num_nodes
    asc = group_load.sort(dim=1).values
    with_heaviest = asc[:, -1] + asc[:, : per_node - 1].sum(1)
    return torch.maximum(group_load.sum(1) / num_nodes, with_heaviest)


def round_robin_pack(
    item_load: torch.Tensor, item_expert: torch.Tensor, num_bins: int, slots: int, *extras: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Initial packing: items by decreasing load, position ``p`` goes to bin ``p mod num_bins``.

    Replicas of one expert have equal load and are adjacent in this order, so any ``c <= num_bins`` of
    them land on distinct bins, and more than ``num_bins`` are spread as evenly as possible.

    Args:
        item_load: ``[B, num_bins * slots]`` float64.
        item_expert: ``[B, num_bins * slots]`` int64 expert id of each item.

        extras: more ``[B, num_bins * slots]`` per-item tensors to lay out the same way.

    Returns:
        ``(load [B, num_bins, slots], expert [B, num_bins, slots], *extras)``.
    """
    key = item_expert.to(item_load.dtype)
    # Sort by (load desc, expert asc): replicas of one expert stay adjacent even among equal loads.
    order = torch.sort(key, dim=1, stable=True).indices
    order = order.gather(
        1, torch.sort(item_load.gather(1, order), dim=1, descending=True, stable=True).indices
    )
    return tuple(
        t.gather(1, order).view(-1, slots, num_bins).transpose(1, 2).contiguous()
        for t in (item_load, item_expert, *extras)
    )


_NUM_BUCKETS = 63
# up to this many slots per GPU the swap search is exhaustive (S x S pairs), above it a binary search
_BRUTE_FORCE_SLOTS = 10
# relative peak gap beyond which a losing candidate plan stops being refined
_PRUNE_MARGIN = 0.01
# a row stops once a block of rounds lowers its peak by less than this fraction
_MIN_BLOCK_GAIN = 1e-6


def duplicate_buckets(expert: torch.Tensor, counts_of_item: torch.Tensor) -> torch.Tensor:
    """Bucket id of every item for the no-duplicate check of :func:`refine_swaps`.

    Only replicated experts can end up twice on a GPU. Each replicated expert of a row gets a bucket
    (its rank among the row's replicated experts, modulo 63); single-replica items get bucket 63, which is
    never checked. Two experts sharing a bucket only make the check stricter, never looser.

    Args:
        expert: ``[B, G, S]`` int64 expert ids.
        counts_of_item: ``[B, G, S]`` replica count of each item's expert.
    """
    flat = expert.flatten(1)
    replicated = counts_of_item.flatten(1) > 1
    key = torch.where(replicated, flat, torch.full_like(flat, -1))
    # dense rank of the expert id among replicated ones: sort, mark first occurrences, cumsum
    sorted_key, order = key.sort(dim=1, stable=True)
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[:, 1:] = sorted_key[:, 1:] != sorted_key[:, :-1]
    rank = (first & (sorted_key >= 0)).long().cumsum(1) - 1
    bucket_sorted = torch.where(sorted_key >= 0, rank % _NUM_BUCKETS, torch.full_like(rank, _NUM_BUCKETS))
    bucket = torch.empty_like(bucket_sorted).scatter_(1, order, bucket_sorted)
    return bucket.view_as(expert)


def _excess(bin_load: torch.Tensor) -> torch.Tensor:
    """``[B]`` total load above the row mean (0 when perfectly balanced)."""
    return (bin_load - bin_load.mean(1, keepdim=True)).clamp_min(0).sum(1)


def refine_swaps(
    load: torch.Tensor,
    expert: torch.Tensor,
    *,
    iters: int,
    bucket: torch.Tensor | None = None,
    fixed: torch.Tensor | None = None,
    origin: torch.Tensor | None = None,
    budget: torch.Tensor | None = None,
    rows_per_group: int = 1,
    num_candidates: int = 1,
    block: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise exchange refinement; never raises any row's heaviest bin.

    Each round sorts the bins of every row by load and pairs the k-th heaviest bin with a light partner
    (the pairing rotates from round to round). For every item ``x`` of the heavy bin, the item ``y`` of
    the light bin whose swap best evens the pair is found by binary search (the moved load
    ``load[x] - load[y]`` closest to half the gap); the best ``x`` of each pair is swapped, all pairs of
    all rows at once. A swap is taken only when it strictly lowers the pair's larger load, so no row's
    peak ever rises. Cost per round: ``O(B * G * S log S)``.

    Rounds run in blocks of ``block`` on the rows that still matter: a row drops out once its peak is
    at its own lower bound (``max(total / G, heaviest item)``), once it is no heavier than the best
    bound of another row of its group (``rows_per_group`` consecutive rows form one layer, e.g. the
    nodes of a layer: only the layer's heaviest row decides its balance), or after a block without a
    swap.

    Args:
        load: ``[B, G, S]`` float64 per-item loads.
        expert: ``[B, G, S]`` int64 expert ids.
        iters: number of rounds.
        bucket: optional ``[B, G, S]`` from :func:`duplicate_buckets`; swaps that would put an item next
            to another item of its bucket are refused.
        fixed: optional ``[B, G, S]`` bool, items that must not move.
        origin: optional ``[B, G, S]`` expert ids of a previous plan, slot by slot; with ``budget``
            (``[B]`` int64), a swap is refused when it would leave more than ``budget`` slots holding
            another expert than ``origin`` (migration-aware mode).
        rows_per_group: rows of one layer (consecutive).
        num_candidates: the rows are ``num_candidates`` stacked plans of the same layers (candidate-major);
            a candidate whose layer peak is already no better than another's stops refining that layer
            (only the best candidate of a layer is kept by the caller).
        block: rounds between two re-selections of the active rows.

    Returns:
        ``(load, expert)`` after refinement (new tensors).
    """
    load, expert = load.clone(), expert.clone()
    bucket = None if bucket is None else bucket.clone()
    fixed = None if fixed is None else fixed.clone()
    num_rows, num_bins, _ = load.shape
    if num_bins < 2 or iters <= 0:
        return load, expert
    alive = torch.ones(num_rows, dtype=torch.bool, device=load.device)
    it = 0
    while it < iters:
        bin_load = load.sum(-1)
        peak = bin_load.amax(1)
        excess = _excess(bin_load)
        row_lb = torch.maximum(bin_load.sum(1) / num_bins, load.flatten(1).amax(1))
        floor = row_lb.view(-1, rows_per_group).amax(1).repeat_interleave(rows_per_group)
        active = alive & (peak > floor * (1 + 1e-9)) & (peak > row_lb * (1 + 1e-9))
        if num_candidates > 1 and it > 0:
            layer_peak = peak.view(num_candidates, -1, rows_per_group).amax(-1)  # [C, L]
            # a candidate stops once it trails the best one of its layer by more than _PRUNE_MARGIN
            keep = layer_peak <= layer_peak.amin(0, keepdim=True) * (1 + _PRUNE_MARGIN)
            active &= keep.unsqueeze(-1).expand(-1, -1, rows_per_group).reshape(-1)
        idx = torch.nonzero(active).flatten()
        if idx.numel() == 0:
            break
        rounds = min(block, iters - it)

        def sub(t: torch.Tensor | None, idx: torch.Tensor = idx) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, idx)

        l2, e2, b2, f2, moved = _refine_block(
            load.index_select(0, idx),
            expert.index_select(0, idx),
            iters=rounds,
            bucket=sub(bucket),
            fixed=sub(fixed),
            origin=sub(origin),
            budget=sub(budget),
            it0=it,
        )
        load.index_copy_(0, idx, l2)
        expert.index_copy_(0, idx, e2)
        if bucket is not None and b2 is not None:
            bucket.index_copy_(0, idx, b2)
        if fixed is not None and f2 is not None:
            fixed.index_copy_(0, idx, f2)
        # a row whose load above the mean hardly shrank in a whole block has converged in practice
        # (the peak alone can stall while several GPUs tie at the top and are lowered one by one)
        before = excess.index_select(0, idx)
        after = _excess(l2.sum(-1))
        total = bin_load.sum(1).index_select(0, idx)
        alive.index_copy_(0, idx, moved & (before - after > _MIN_BLOCK_GAIN * total))
        it += rounds
    return load, expert


def _refine_block(
    load: torch.Tensor,
    expert: torch.Tensor,
    *,
    iters: int,
    bucket: torch.Tensor | None = None,
    fixed: torch.Tensor | None = None,
    origin: torch.Tensor | None = None,
    budget: torch.Tensor | None = None,
    it0: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """One block of rounds of :func:`refine_swaps` on the given rows (tensors modified in place)."""
    num_rows, num_bins, slots = load.shape
    moved = torch.zeros(num_rows, dtype=torch.bool, device=load.device)
    if num_bins < 2:
        return load, expert, bucket, fixed, moved
    device = load.device
    num_pairs = num_bins // 2
    tol = _REL_TOL * load.sum(dim=(1, 2)).clamp_min(1e-300).view(-1, 1, 1) / num_bins
    torch.arange(num_rows, device=device).view(-1, 1)
    pair_idx = torch.arange(num_pairs, device=device)
    flat_l, flat_e = load.view(num_rows, -1), expert.view(num_rows, -1)
    width = _NUM_BUCKETS + 1
    if bucket is not None:
        flat_b = bucket.view(num_rows, -1)
        held = torch.zeros(num_rows, num_bins * width, dtype=torch.int32, device=device)
        bin_of = torch.arange(num_bins * slots, device=device) // slots
        held.scatter_add_(1, bin_of * width + flat_b, torch.ones_like(flat_b, dtype=torch.int32))
    if fixed is not None:
        flat_f = fixed.view(num_rows, -1)
    flat_o = torch.empty(0)
    budget_t = torch.empty(0)
    used = torch.empty(0)
    if origin is not None:
        flat_o = origin.reshape(num_rows, -1)
        if budget is None:
            raise ValueError("refine_swaps: origin needs budget")
        budget_t = budget
        used = (flat_e != flat_o).sum(1)
    for it in range(it0, it0 + iters):
        bin_load = load.sum(-1)
        order = torch.sort(bin_load, dim=1, descending=True, stable=True).indices
        heavy = order[:, :num_pairs]
        light_sorted = order[:, num_bins - num_pairs :].flip(1)  # lightest first
        shift = it % num_pairs
        light = light_sorted[:, (pair_idx + shift) % num_pairs] if shift else light_sorted
        # gathers, not advanced indexing: several times cheaper on CPU for these small shapes
        la = load.gather(1, heavy.unsqueeze(-1).expand(-1, -1, slots))  # [B, P, S]
        lb_raw = load.gather(1, light.unsqueeze(-1).expand(-1, -1, slots))
        gap = (bin_load.gather(1, heavy) - bin_load.gather(1, light)).unsqueeze(-1)
        if slots <= _BRUTE_FORCE_SLOTS:
            # few slots: try every (x, y) pair, cheaper than sorting tiny rows
            delta = la.unsqueeze(-1) - lb_raw.unsqueeze(-2)  # [B, P, S, S]
            gain, y = torch.minimum(delta, gap.unsqueeze(-1) - delta).max(-1)  # [B, P, S]
        else:
            lb, lb_idx = lb_raw.sort(dim=-1)
            pos = torch.searchsorted(lb, (la - 0.5 * gap).contiguous())
            cand = torch.stack([(pos - 1).clamp_min(0), pos.clamp_max(slots - 1)], dim=-1)  # [B, P, S, 2]
            delta = la.unsqueeze(-1) - lb.unsqueeze(-2).expand(-1, -1, slots, -1).gather(-1, cand)
            gain2 = torch.minimum(delta, gap.unsqueeze(-1) - delta)
            gain, which = gain2.max(-1)  # [B, P, S]
            y = lb_idx.gather(-1, cand.gather(-1, which.unsqueeze(-1)).squeeze(-1))  # slot in light bin
        pos_a = heavy.unsqueeze(-1) * slots + torch.arange(slots, device=device)  # [B, P, S]
        pos_b = light.unsqueeze(-1) * slots + y
        valid = gain > tol
        if bucket is not None:
            ba = flat_b.gather(1, pos_a.flatten(1)).view_as(pos_a)
            bb = flat_b.gather(1, pos_b.flatten(1)).view_as(pos_b)
            in_light = held.gather(1, (light.unsqueeze(-1) * width + ba).flatten(1)).view_as(ba)
            in_heavy = held.gather(1, (heavy.unsqueeze(-1) * width + bb).flatten(1)).view_as(bb)
            clash = ((ba < _NUM_BUCKETS) & (in_light > 0)) | ((bb < _NUM_BUCKETS) & (in_heavy > 0))
            valid &= ~clash
        if fixed is not None:
            fa = flat_f.gather(1, pos_a.flatten(1)).view_as(pos_a)
            fb = flat_f.gather(1, pos_b.flatten(1)).view_as(pos_b)
            valid &= ~(fa | fb)
        if origin is not None:
            ea_ = flat_e.gather(1, pos_a.flatten(1)).view_as(pos_a)
            eb_ = flat_e.gather(1, pos_b.flatten(1)).view_as(pos_b)
            oa_ = flat_o.gather(1, pos_a.flatten(1)).view_as(pos_a)
            ob_ = flat_o.gather(1, pos_b.flatten(1)).view_as(pos_b)
            change = (eb_ != oa_).long() + (ea_ != ob_).long() - (ea_ != oa_).long() - (eb_ != ob_).long()
            valid &= (used.view(-1, 1, 1) + change) <= budget_t.view(-1, 1, 1)
        gain = torch.where(valid, gain, torch.zeros((), dtype=gain.dtype, device=device))
        best_gain, best_x = gain.max(-1)  # [B, P]
        do = best_gain > 0
        if origin is not None:
            step = change.gather(-1, best_x.unsqueeze(-1)).squeeze(-1) * do
            do &= (used.unsqueeze(1) + step.clamp_min(0).cumsum(1)) <= budget_t.unsqueeze(1)
            used = used + (step * do).sum(1)
        if not bool(do.any()):
            continue
        moved |= do.any(1)
        src = pos_b.gather(-1, best_x.unsqueeze(-1)).squeeze(-1)
        dst = torch.where(do, pos_a.gather(-1, best_x.unsqueeze(-1)).squeeze(-1), src)  # no-op: self swap
        for t in (
            (flat_l, flat_e)
            + ((flat_b,) if bucket is not None else ())
            + ((flat_f,) if fixed is not None else ())
        ):
            va, vb = t.gather(1, dst), t.gather(1, src)
            t.scatter_(1, dst, vb)
            t.scatter_(1, src, va)
        if bucket is not None:
            # bucket counts: the item now at dst came from the light bin, the one at src from the heavy bin
            one = do.to(torch.int32)
            nb_dst, nb_src = flat_b.gather(1, dst), flat_b.gather(1, src)
            hb, lb_bin = dst // slots, src // slots
            held.scatter_add_(1, hb * width + nb_src, -one)  # old heavy item left heavy bin
            held.scatter_add_(1, lb_bin * width + nb_dst, -one)
            held.scatter_add_(1, hb * width + nb_dst, one)
            held.scatter_add_(1, lb_bin * width + nb_src, one)
    return load, expert, bucket, fixed, moved
