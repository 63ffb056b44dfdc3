"""Single-process ground truth for dispatch and combine, given every rank's inputs.

Semantics (the contract every backend meets):

* Experts are split evenly: global expert ``e`` lives on rank ``e // E_local`` as local expert
  ``e % E_local``, with ``E_local = num_tot_experts // world_size``.
* Slot ``(t, k)`` of rank ``s`` (token ``t``, top-k slot ``k``) is *kept* when ``exp_indices[t, k] >= 0``;
  -1 drops it.
* Dispatch: rank ``d`` receives one row per kept slot whose expert lives on ``d``: the token row
  ``x_s[t]``, and the weight ``w_s[t, k]``. Rows are ordered by local expert, then source rank, then token
  index, then slot. With ``full_scatter_indices`` the caller decides the row instead: slot ``(t, k)`` lands
  at row ``full_scatter_indices_s[t, k]``; the rows a rank receives must then be exactly ``0 .. R-1``.
* Combine: rank ``s`` gets ``out_s[t] = sum over kept k of y_d[token_dst_scatter_idx_s[t, k]]`` with
  ``d`` the rank of the slot's expert, accumulated in float32 in slot order and cast to ``y``'s dtype;
  a token with no kept slot gets zeros. Combine does not apply routing weights: scale rows by
  ``weights`` inside the expert computation when the model wants a weighted sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class RefDispatch:
    """What one rank receives from ``dispatch_ref`` (``R`` rows).

    Attributes:
        output: ``[R, hidden]`` token rows, input dtype.
        weights: ``[R]`` routing weight of each row, or ``None`` when no weights were given.
        src_rank: ``[R]`` int64, rank that sent each row.
        src_token: ``[R]`` int64, token index on the source rank.
        src_slot: ``[R]`` int64, top-k slot on the source rank.
        local_expert: ``[R]`` int64, local expert of each row.
        num_recv_tokens_per_expert: ``[E_local]`` int64.
        num_recv_tokens_per_rank: ``[world_size]`` int64, rows from each source rank.
    """

    output: torch.Tensor
    weights: torch.Tensor | None
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_slot: torch.Tensor
    local_expert: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    num_recv_tokens_per_rank: torch.Tensor


def _check_inputs(
    inputs: Sequence[torch.Tensor],
    exp_indices: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None] | None,
    num_tot_experts: int,
) -> None:
    world_size = len(inputs)
    if world_size == 0 or len(exp_indices) != world_size:
        raise ValueError(
            f"need one inputs and one exp_indices tensor per rank, got {len(inputs)} and {len(exp_indices)}"
        )
    if num_tot_experts % world_size != 0:
        raise ValueError(
            f"num_tot_experts ({num_tot_experts}) must be divisible by world_size ({world_size})"
        )
    if weights is not None and len(weights) != world_size:
        raise ValueError(f"weights must have one entry per rank, got {len(weights)}")
    for s, (x, idx) in enumerate(zip(inputs, exp_indices, strict=True)):
        if x.dim() != 2 or idx.dim() != 2 or idx.shape[0] != x.shape[0]:
            raise ValueError(
                f"rank {s}: expected input [n, hidden] and exp_indices [n, topk], got {tuple(x.shape)}, {tuple(idx.shape)}"
            )
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_tot_experts):
            raise ValueError(f"rank {s}: exp_indices must be in [-1, {num_tot_experts})")
        if weights is not None and weights[s] is not None and tuple(weights[s].shape) != tuple(idx.shape):  # type: ignore[union-attr]
            raise ValueError(f"rank {s}: weight must have shape {tuple(idx.shape)}")


def scatter_indices_ref(exp_indices: Sequence[torch.Tensor], *, num_tot_experts: int) -> list[torch.Tensor]:
    """Default receiver row of every slot, per source rank.

    Args:
        exp_indices: per rank ``[n_s, topk]`` integer expert indices (-1 = dropped).
        num_tot_experts: experts in the group.

    Returns:
        per rank ``[n_s, topk]`` int64: row of slot ``(t, k)`` in the dispatch output of the rank hosting
        its expert (order: local expert, source rank, token, slot); -1 for dropped slots.
    """
    world_size = len(exp_indices)
    e_local = num_tot_experts // world_size
    result = [torch.full(idx.shape, -1, dtype=torch.int64) for idx in exp_indices]
    for d in range(world_size):
        keys = []  # (local expert, source rank, flat slot) of every slot bound for d, in (s, t, k) order
        for s, idx in enumerate(exp_indices):
            flat = idx.reshape(-1).long().cpu()
            slots = torch.nonzero((flat >= 0) & (flat // e_local == d)).flatten()
            keys.append((flat[slots] % e_local, torch.full_like(slots, s), slots))
        local = torch.cat([k[0] for k in keys])
        order = torch.sort(local, stable=True).indices  # stable: keeps (s, t, k) order inside an expert
        src = torch.cat([k[1] for k in keys])[order]
        slot = torch.cat([k[2] for k in keys])[order]
        for s in range(world_size):
            mine = src == s
            result[s].view(-1)[slot[mine]] = torch.nonzero(mine).flatten()
    return result


def dispatch_ref(
    inputs: Sequence[torch.Tensor],
    exp_indices: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None] | None = None,
    *,
    num_tot_experts: int,
    full_scatter_indices: Sequence[torch.Tensor] | None = None,
) -> tuple[list[RefDispatch], list[torch.Tensor]]:
    """Every rank's dispatch result.

    Args:
        inputs: per rank ``[n_s, hidden]`` token rows (any float dtype; copied bit-exactly).
        exp_indices: per rank ``[n_s, topk]`` integer expert indices in ``[-1, num_tot_experts)``.
        weights: per rank ``[n_s, topk]`` routing weights, or ``None`` (no weights anywhere).
        num_tot_experts: experts in the group (divisible by ``len(inputs)``).
        full_scatter_indices: per rank ``[n_s, topk]`` caller-given receiver rows, or ``None``.

    Returns:
        ``(received, scatter)``: ``received[d]`` is rank ``d``'s :class:`RefDispatch`; ``scatter[s]`` is
        rank ``s``'s ``[n_s, topk]`` int64 receiver row per slot (-1 dropped), i.e. the layout
        descriptor's ``token_dst_scatter_idx``.

    Raises:
        ValueError: malformed inputs, or ``full_scatter_indices`` that do not give each receiver exactly
            the rows ``0 .. R-1``.
    """
    _check_inputs(inputs, exp_indices, weights, num_tot_experts)
    world_size = len(inputs)
    e_local = num_tot_experts // world_size
    have_weights = weights is not None and any(w is not None for w in weights)
    if full_scatter_indices is None:
        scatter = scatter_indices_ref(exp_indices, num_tot_experts=num_tot_experts)
    else:
        scatter = [
            torch.where(idx.long().cpu() >= 0, f.long().cpu(), torch.full_like(f.long().cpu(), -1))
            for idx, f in zip(exp_indices, full_scatter_indices, strict=True)
        ]
    received = []
    for d in range(world_size):
        pos, src, tok, slt = [], [], [], []
        for s, idx in enumerate(exp_indices):
            idx_cpu = idx.long().cpu()
            t, k = torch.nonzero((idx_cpu >= 0) & (idx_cpu // e_local == d), as_tuple=True)
            pos.append(scatter[s][t, k])
            src.append(torch.full_like(t, s))
            tok.append(t)
            slt.append(k)
        row = torch.cat(pos)
        num_rows = row.numel()
        if not torch.equal(torch.sort(row).values, torch.arange(num_rows)):
            raise ValueError(f"full_scatter_indices must give rank {d} exactly the rows 0..{num_rows - 1}")
        src_rank = torch.empty(num_rows, dtype=torch.int64)
        src_token = torch.empty_like(src_rank)
        src_slot = torch.empty_like(src_rank)
        src_rank[row], src_token[row], src_slot[row] = torch.cat(src), torch.cat(tok), torch.cat(slt)
        hidden = inputs[0].shape[1]
        output = torch.empty(num_rows, hidden, dtype=inputs[0].dtype)
        local_expert = torch.empty_like(src_rank)
        out_w = None
        if have_weights:
            assert weights is not None
            w_dtype = next(wt.dtype for wt in weights if wt is not None)
            out_w = torch.empty(num_rows, dtype=w_dtype)
        for r in range(num_rows):
            si, ti, ki = int(src_rank[r]), int(src_token[r]), int(src_slot[r])
            output[r] = inputs[si][ti].cpu()
            local_expert[r] = int(exp_indices[si][ti, ki]) % e_local
            if out_w is not None:
                w = weights[si]  # type: ignore[index]
                out_w[r] = w[ti, ki].cpu() if w is not None else 0
        received.append(
            RefDispatch(
                output=output,
                weights=out_w,
                src_rank=src_rank,
                src_token=src_token,
                src_slot=src_slot,
                local_expert=local_expert,
                num_recv_tokens_per_expert=torch.bincount(local_expert, minlength=e_local),
                num_recv_tokens_per_rank=torch.bincount(src_rank, minlength=world_size),
            )
        )
    return received, scatter


def combine_ref(
    expert_outputs: Sequence[torch.Tensor],
    exp_indices: Sequence[torch.Tensor],
    scatter: Sequence[torch.Tensor],
    *,
    num_tot_experts: int,
) -> list[torch.Tensor]:
    """Every rank's combine result.

    Args:
        expert_outputs: per rank ``[R_d, C]`` rows in that rank's dispatch-output order.
        exp_indices: per rank ``[n_s, topk]`` the expert indices given to dispatch.
        scatter: per rank ``[n_s, topk]`` receiver rows (``dispatch_ref``'s second result).
        num_tot_experts: experts in the group.

    Returns:
        per rank ``[n_s, C]`` in ``expert_outputs``' dtype: the float32 sum, in slot order, of the rows of
        the kept slots; zeros for a token without kept slots.
    """
    per_slot = combine_per_slot_ref(expert_outputs, exp_indices, scatter, num_tot_experts=num_tot_experts)
    results = []
    for rows in per_slot:
        acc = torch.zeros(rows.shape[0], rows.shape[2], dtype=torch.float32)
        for k in range(rows.shape[1]):  # slot order fixes the float32 summation order (dropped: zeros)
            acc += rows[:, k].float()
        results.append(acc.to(rows.dtype))
    return results


def combine_per_slot_ref(
    expert_outputs: Sequence[torch.Tensor],
    exp_indices: Sequence[torch.Tensor],
    scatter: Sequence[torch.Tensor],
    *,
    num_tot_experts: int,
) -> list[torch.Tensor]:
    """Like :func:`combine_ref` without the sum: per rank ``[n_s, topk, C]``, zeros for dropped slots."""
    world_size = len(expert_outputs)
    e_local = num_tot_experts // world_size
    results = []
    for s, idx in enumerate(exp_indices):
        idx_cpu = idx.long().cpu()
        n, topk = idx_cpu.shape
        out = torch.zeros(n, topk, expert_outputs[0].shape[1], dtype=expert_outputs[0].dtype)
        for t in range(n):
            for k in range(topk):
                e = int(idx_cpu[t, k])
                if e >= 0:
                    out[t, k] = expert_outputs[e // e_local][int(scatter[s][t, k])].cpu()
        results.append(out)
    return results


#: channels that share one FP8 scale (DeepEP's format)
FP8_BLOCK = 128
#: largest finite value of ``torch.float8_e4m3fn``
FP8_MAX = 448.0
#: float32(1 / 448): torch on CUDA divides by a Python number as a product with its float32 reciprocal
FP8_RECIP_MAX = 0.0022321429569274187
#: smallest block maximum a scale is computed from (an all-zero block gets the scale 1e-4 / 448)
FP8_AMAX_FLOOR = 1e-4


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel FP8 quantization in DeepEP's format, bit for bit as DeepEP's
    ``per_token_cast_to_fp8`` computes it on a CUDA device, on any device.

    Every block of 128 channels of a row: ``amax`` = the block's largest absolute value in float32, at
    least ``1e-4`` (an all-zero block: scale ``1e-4 / 448``, bytes zero); bytes ``float8_e4m3fn(x *
    (448 / amax))`` (round to nearest even), scale ``amax / 448`` in float32, where ``448 / amax`` is
    ``reciprocal(amax) * 448`` and ``amax / 448`` is ``amax * float32(1 / 448)``, as torch evaluates those
    expressions on CUDA (on a CPU it divides exactly, which differs in the last bit of some scales).
    ``x_fp8.float() * scale`` (per block) gives the row back within FP8's rounding.

    Infinities and NaN: a block holding an infinity (and no NaN) gets the scale ``inf``, its infinities
    become NaN and its finite values zero (their sign kept); a block holding a NaN gets a NaN scale and
    NaN bytes. NaN is written in one encoding each (bytes ``0x7F``, scales ``0x7FC00000``), so results
    compare bit for bit.

    Args:
        x: ``[T, H]`` floating, ``H`` a multiple of 128.

    Returns:
        ``(x_fp8 [T, H] float8_e4m3fn, scales [T, H / 128] float32)``.

    Raises:
        ValueError: ``x`` not 2-D floating, or ``H`` not a multiple of 128.
    """
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be a [T, H] floating tensor, got {x.dtype} of shape {tuple(x.shape)}")
    t, h = x.shape
    if h % FP8_BLOCK:
        raise ValueError(
            f"x's width H={h} must be a multiple of {FP8_BLOCK} (one scale per {FP8_BLOCK} channels)"
        )
    if t == 0:  # (an empty reduction's output may have a last stride of 0: not viewable as bytes)
        empty = x.new_empty(0, h, dtype=torch.float8_e4m3fn)
        return empty, x.new_empty(0, h // FP8_BLOCK, dtype=torch.float32)
    blocks = x.float().view(t, h // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=FP8_AMAX_FLOOR)
    x_fp8 = (blocks * (amax.reciprocal() * FP8_MAX).unsqueeze(2)).to(torch.float8_e4m3fn).view(t, h)
    scales = amax * FP8_RECIP_MAX
    # one NaN encoding each: float8_e4m3fn's NaNs are 0x7F and 0xFF
    q = x_fp8.view(torch.uint8)
    x_fp8 = torch.where(q == 0xFF, 0x7F, q).view(torch.float8_e4m3fn)
    scales = torch.where(scales.isnan(), 0x7FC00000, scales.view(torch.int32)).view(torch.float32)
    return x_fp8, scales


def dequantize_fp8(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` float32 rows of :func:`quantize_fp8`'s output: each 128-channel block times its scale."""
    t, h = x_fp8.shape
    return (x_fp8.float().view(t, h // FP8_BLOCK, FP8_BLOCK) * scales.unsqueeze(2)).view(t, h)
