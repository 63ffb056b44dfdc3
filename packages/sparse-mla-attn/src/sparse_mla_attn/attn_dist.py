"""Attention distribution over the top-k slots, summed over heads: the lightning indexer's KL target.

Given the forward's log-sum-exp, ``attn_sum[i, j] = sum_h exp(sm_scale * q[i, h]·k[idx[i, j]] - lse[i, h])``
for every valid slot ``j`` (index in range and not past the causal limit), 0 otherwise. One program owns a
query token and a tile of heads, keeps the query tile on chip, gathers the token's KV rows ``BLOCK_T`` at
a time and reduces the probabilities over its heads. When the heads span two tiles the two partial sums
meet through an fp32 ``atomic_add`` into a zeroed output; with two addends onto 0 the result does not
depend on their order, so the output stays deterministic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import triton
import triton.language as tl

from sparse_mla_attn._runtime import (
    LaunchReplay,
    cached,
    call_signature,
    causal_hi,
    cdiv,
    check_kernel_device,
    define_op,
    eager_stream,
    interpreting,
    keep_replay,
    l2_cache_bytes,
    launch,
    launch_context,
    next_power_of_2,
    no_launch_hooks,
    num_sms,
    plan_replay,
    record_launch,
    record_launches,
)
from sparse_mla_attn._validate import (
    SparseDims,
    check_arg_types,
    check_causal_args,
    check_kernel_dims,
    check_lse,
    check_sm_scale,
    check_sparse_inputs,
)
from sparse_mla_attn.backends.gluon_sm90 import (
    attn_dist_adds_partials,
    index_programs,
    index_tokens,
    launch_attn_dist_gluon,
    launch_attn_dist_index_gluon,
    use_gluon,
)
from sparse_mla_attn.config import DEFAULT, Config, config_of
from sparse_mla_attn.forward import LOG2E, _load_q_tile


@triton.jit
def _attn_dist_block(
    t0, topk, idx, hi,
    KV,
    stride_kv_row,
    q_nope, q_rope, lse2, sm_scale_log2,
    OUT_ROW,
    D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_T: tl.constexpr, ATOMIC: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_mask = offs_t < topk
    valid = (idx >= 0) & (idx < hi)
    k_ptr = KV + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kv_row
    k_nope = tl.load(k_ptr + tl.arange(0, D_NOPE)[None, :], mask=valid[:, None], other=0.0)
    if DOT_F32:
        k_nope = k_nope.to(tl.float32)
    s = tl.dot(q_nope, tl.trans(k_nope))
    if D_ROPE > 0:
        # Loaded after the first product is issued (the order the compiled pipeline is tuned for).
        k_rope = tl.load(k_ptr + D_NOPE + tl.arange(0, D_ROPE)[None, :], mask=valid[:, None], other=0.0)
        if DOT_F32:
            k_rope = k_rope.to(tl.float32)
        s = tl.dot(q_rope, tl.trans(k_rope), s)
    p = tl.exp2(s * sm_scale_log2 - lse2[:, None])
    col = tl.where(valid, tl.sum(p, 0), 0.0)
    if ATOMIC:
        tl.atomic_add(OUT_ROW + offs_t, col, mask=t_mask, sem="relaxed")
    else:
        tl.store(OUT_ROW + offs_t, col, mask=t_mask)


@triton.jit
def _attn_dist_kernel(
    Q, KV, IDX, LSE, OUT,
    stride_q_s, stride_q_h, stride_kv_row, stride_idx_s, stride_lse_s,
    h_q, n_head_tiles, topk, s_kv, q_start_index, k_stride, sm_scale_log2, lse_to_log2,
    D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    CAUSAL: tl.constexpr, ATOMIC: tl.constexpr, STATIC_T: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_h = pid % n_head_tiles
    pid_s = pid // n_head_tiles
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < h_q
    q_nope, q_rope = _load_q_tile(Q, pid_s, stride_q_s, stride_q_h, offs_h, h_mask, D_NOPE, D_ROPE, DOT_F32)
    # Padding heads get lse = +inf, so their probabilities are exactly 0.
    lse2 = tl.load(LSE + pid_s.to(tl.int64) * stride_lse_s + offs_h, mask=h_mask, other=float("inf"))
    lse2 = lse2 * lse_to_log2
    hi = causal_hi(s_kv, q_start_index + pid_s, k_stride, CAUSAL)
    idx_row = IDX + pid_s.to(tl.int64) * stride_idx_s
    out_row = OUT + pid_s.to(tl.int64) * topk
    # Indices of block t+1 are loaded one iteration ahead (see forward.py) so the gather can be pipelined.
    offs_t = tl.arange(0, BLOCK_T)
    idx_n = tl.load(idx_row + offs_t, mask=offs_t < topk, other=-1)
    if STATIC_T > 0:
        for t0 in range(0, STATIC_T, BLOCK_T):
            idx = idx_n
            idx_n = tl.load(idx_row + t0 + BLOCK_T + offs_t, mask=t0 + BLOCK_T + offs_t < topk, other=-1)
            _attn_dist_block(t0, topk, idx, hi, KV, stride_kv_row, q_nope, q_rope, lse2, sm_scale_log2, out_row,
                             D_NOPE, D_ROPE, BLOCK_T, ATOMIC, DOT_F32)  # fmt: skip
    else:
        for t0 in range(0, topk, BLOCK_T):
            idx = idx_n
            idx_n = tl.load(idx_row + t0 + BLOCK_T + offs_t, mask=t0 + BLOCK_T + offs_t < topk, other=-1)
            _attn_dist_block(t0, topk, idx, hi, KV, stride_kv_row, q_nope, q_rope, lse2, sm_scale_log2, out_row,
                             D_NOPE, D_ROPE, BLOCK_T, ATOMIC, DOT_F32)  # fmt: skip


@triton.jit
def _index_order_kernel(
    IDX, IDX_S, POS, COUNT, OUT,
    stride_idx_s, topk, s_kv, q_start_index, k_stride, chunk_rows, flip_every,
    N_CHUNKS: tl.constexpr, T: tl.constexpr, CAUSAL: tl.constexpr, FLIP: tl.constexpr,
):  # fmt: skip
    """One token's valid slots (index in range, not past the causal limit) grouped by KV chunk (rows
    ``[c * chunk_rows, (c + 1) * chunk_rows)``), chunk by chunk, in slot order within a chunk: their indices
    into ``IDX_S``, the slots into ``POS`` (both ``[s_q, topk]``, from column 0), their number into
    ``COUNT``, and 0 into ``OUT`` at the invalid slots. The whole row (``topk <= T``, a power of two) is held
    at once; each scan ranks the slots of several chunks at once, one ``F``-bit count field per chunk in an
    int64. With ``FLIP`` the tokens ``[flip_every, 2 flip_every)``, ``[3 flip_every, 4 flip_every)``, ... take
    the chunks last to first."""
    F: tl.constexpr = T.bit_length()  # a field holds any count up to T
    PER: tl.constexpr = 63 // F  # chunks per scan
    pid = tl.program_id(0)
    hi = causal_hi(s_kv, q_start_index + pid, k_stride, CAUSAL)
    offs = tl.arange(0, T)
    idx = tl.load(IDX + pid.to(tl.int64) * stride_idx_s + offs, mask=offs < topk, other=-1)
    valid = (idx >= 0) & (idx < hi)
    chunk = idx // chunk_rows
    if FLIP:
        chunk = tl.where((pid // flip_every) % 2 == 1, N_CHUNKS - 1 - chunk, chunk)
    chunk = tl.where(valid, chunk, N_CHUNKS)  # invalid slots: past the last chunk
    col = tl.zeros([T], tl.int32)
    first = pid * 0  # the next chunk's first column
    for c0 in tl.static_range(0, N_CHUNKS, PER):
        field = chunk - c0  # this scan's field of the slot (in range for its chunks only)
        mine = (field >= 0) & (field < PER) & valid
        shift = (tl.where(mine, field, 0) * F).to(tl.int64)
        one = tl.where(mine, tl.full([T], 1, tl.int64) << shift, 0)
        totals = tl.sum(one, 0)
        # The first column of each of the scan's chunks, packed as the counts are: added to the running
        # counts, each field holds its slots' columns + 1 (at most T: within the field).
        starts = totals * 0
        for f in tl.static_range(PER):
            if c0 + f < N_CHUNKS:
                starts += first.to(tl.int64) << (f * F)
                first += ((totals >> (f * F)) & ((1 << F) - 1)).to(tl.int32)
        at = ((tl.cumsum(one, 0) + starts) >> shift) & ((1 << F) - 1)
        col = tl.where(mine, at.to(tl.int32) - 1, col)
    row = pid.to(tl.int64) * topk
    tl.store(POS + row + col, offs, mask=valid)
    tl.store(IDX_S + row + col, idx, mask=valid)
    tl.store(COUNT + pid, first)
    tl.store(OUT + row + offs, tl.zeros([T], tl.float32), mask=(offs < topk) & ~valid)


@functools.lru_cache(maxsize=64)
def attn_dist_config(h_q: int, s_kv: int = 0) -> dict[str, Any]:
    """Tile shape and launch options for ``attn_dist`` (at most two head tiles for any h_q <= 128)."""
    if interpreting():
        return {
            "BLOCK_H": max(16, next_power_of_2(min(h_q, 64))),
            "BLOCK_T": 16,
            "num_warps": 4,
            "num_stages": 1,
        }
    if h_q > 64:  # one 128-head tile: each gathered KV row serves all heads
        return {"BLOCK_H": 128, "BLOCK_T": 64, "num_warps": 8, "num_stages": 1}
    block_h = max(16, next_power_of_2(h_q))
    if s_kv > 16384:
        # KV past L2: three 32-row blocks in flight beat two of 64 rows.
        return {"BLOCK_H": block_h, "BLOCK_T": 32, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_H": block_h, "BLOCK_T": 64, "num_warps": 4, "num_stages": 2}


def attn_dist_index_chunks(config: Config, dims: SparseDims, row_bytes: int, l2_bytes: int, n_sm: int) -> int:
    """KV chunks of the Gluon attn_dist's index-order form (``Config.attn_dist_order``), 0 where the
    per-token kernel runs instead: 0 with ``"slot"``, where ``topk > INDEX_ORDER_MAX_TOPK``, up to 64 heads
    with ``attn_dist_split="cols"``, and with ``"auto"`` where there are fewer than
    ``INDEX_ORDER_MIN_TOKENS_PER_SM`` query tokens per multiprocessor or, above 64 heads, where the KV rows
    (``s_kv * row_bytes`` bytes) do not fit in L2 (``l2_bytes``). The KV rows are cut into chunks of at
    most ``l2_bytes * INDEX_CHUNK_L2_FRACTION`` bytes, at most ``INDEX_MAX_CHUNKS`` (on an H200: 2 chunks at
    8K rows of 576, 5 at 32K, 8 at 128K)."""
    if config.attn_dist_order == "slot" or dims.topk > INDEX_ORDER_MAX_TOPK:
        return 0
    if dims.h_q <= 64 and config.attn_dist_split != "blocks":
        return 0
    if config.attn_dist_order == "auto" and (
        dims.s_q < INDEX_ORDER_MIN_TOKENS_PER_SM * n_sm
        or (dims.h_q > 64 and dims.s_kv * row_bytes > l2_bytes)
    ):
        return 0
    chunk_bytes = max(int(l2_bytes * INDEX_CHUNK_L2_FRACTION), 1)
    return max(1, min(cdiv(dims.s_kv * row_bytes, chunk_bytes), INDEX_MAX_CHUNKS, max(dims.s_kv, 1)))


#: The index-order attn_dist (:func:`attn_dist_index_chunks`): the fewest query tokens per multiprocessor of
#: ``"auto"``, the chunks' share of L2 and their largest number.
INDEX_ORDER_MIN_TOKENS_PER_SM = 4
INDEX_CHUNK_L2_FRACTION = 0.125
INDEX_MAX_CHUNKS = 8
#: Largest ``topk`` of the index-order attn_dist (its ordering kernel holds a token's row at once).
INDEX_ORDER_MAX_TOPK = 8192


def plan_attn_dist(
    q: torch.Tensor, kv_rows: torch.Tensor, dims: SparseDims, config: Config, tiles: dict[str, Any] | None
) -> tuple[dict[str, Any], int, bool, bool, int, bool, dict[Any, Any]]:
    """Triton tile, head tiles, whether the Gluon kernel runs, whether the kernel adds partial sums, the KV
    chunks of the Gluon kernel's index-order form (:func:`attn_dist_index_chunks`; 0: the per-token
    kernel), whether that form takes alternate waves' chunks last to first (where the KV rows do not fit
    in L2: a wave then starts on the rows the previous one ended on, still in L2) and the slots of its
    compiled kernels (see :func:`sparse_mla_attn._runtime.launch`)."""
    cfg = {**attn_dist_config(dims.h_q, dims.s_kv), **(tiles or {})}
    n_head_tiles = cdiv(dims.h_q, cfg["BLOCK_H"])
    if n_head_tiles > 2:
        raise ValueError(
            f"attn_dist: BLOCK_H={cfg['BLOCK_H']} gives {n_head_tiles} head tiles; at most 2 keep it deterministic"
        )
    gluon = use_gluon(config.backend, dims.h_q > 32, "attn_dist", q, kv_rows)
    # Kernels that add partial sums (two head tiles) need a zeroed output.
    atomic = attn_dist_adds_partials(dims.h_q) if gluon else n_head_tiles > 1
    n_chunks, flip = 0, False
    if gluon:
        row_bytes, l2_bytes = dims.d_qk * q.element_size(), l2_cache_bytes(q.device)
        n_chunks = attn_dist_index_chunks(config, dims, row_bytes, l2_bytes, num_sms(q.device))
        flip = n_chunks > 0 and dims.s_kv * row_bytes > l2_bytes
    return cfg, n_head_tiles, gluon, atomic, n_chunks, flip, {}


_PLANS: dict[Any, tuple[dict[str, Any], int, bool, bool, int, bool, dict[Any, Any]]] = {}


def launch_attn_dist(
    q: torch.Tensor, kv_rows: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor, dims: SparseDims,
    sm_scale: float, lse_to_log2: float, *, q_start_index: int = 0, k_stride: int = 1, causal: bool = True,
    config: Config = DEFAULT, tiles: dict[str, Any] | None = None, key: Any = None,
) -> torch.Tensor:  # fmt: skip
    """Launch attn_dist on validated inputs (``kv_rows [s_kv, d_qk]``, ``idx [s_q, topk]``); ``tiles``
    overrides :func:`attn_dist_config`'s Triton tile (tests); ``key``: the caller's call signature, under
    which the plan and its compiled kernels are cached (see :func:`sparse_mla_attn._runtime.launch`)."""
    if tiles is not None:
        key = None
    compute = lambda: plan_attn_dist(q, kv_rows, dims, config, tiles)
    cfg, n_head_tiles, gluon, atomic, n_chunks, flip, slots = (
        compute() if key is None else cached(_PLANS, key, compute)
    )
    if key is None:
        slots = None  # a plan made for this call only
    alloc = torch.zeros if atomic else torch.empty
    out = alloc(dims.s_q, dims.topk, dtype=torch.float32, device=q.device)
    if dims.s_q == 0:
        return out
    if n_chunks:
        # Persistent programs take pairs of tokens (or tokens) in waves, each token's rows chunk by chunk in
        # index order, so the tokens in flight gather from about the same chunk of rows at a time.
        n_programs = num_sms(q.device)
        wave = index_tokens(dims.h_q) * index_programs(dims.s_q, dims.h_q, n_programs)
        order = index_order(
            idx,
            out,
            dims,
            n_chunks,
            q_start_index=q_start_index,
            k_stride=k_stride,
            causal=causal,
            flip_every=wave if flip else 0,
            slots=slots,
        )
        kernel = launch_attn_dist_index_gluon(
            q,
            kv_rows,
            lse,
            out,
            order,
            dims,
            sm_scale * LOG2E,
            lse_to_log2,
            n_programs=n_programs,
            slots=slots,
        )
        record_launch("attn_dist", kernel, backend="gluon")
        return out
    if gluon:
        # Hopper: all heads of a token in one program, query in registers, explicit cp.async ring.
        kernel = launch_attn_dist_gluon(
            q, kv_rows, idx, lse, out, dims, sm_scale * LOG2E, lse_to_log2, q_start_index=q_start_index,
            k_stride=k_stride, causal=causal, split_blocks=config.attn_dist_split == "blocks", slots=slots,
        )  # fmt: skip
        record_launch("attn_dist", kernel, backend="gluon")
        return out
    kernel = launch(
        _attn_dist_kernel, (dims.s_q * n_head_tiles,), slots, "attn_dist",
        (q, kv_rows, idx, lse, out, q.stride(0), q.stride(1), kv_rows.stride(0), idx.stride(0), lse.stride(0),
         dims.h_q, n_head_tiles, dims.topk, dims.s_kv, q_start_index, k_stride, sm_scale * LOG2E, lse_to_log2),
        dict(D_NOPE=512, D_ROPE=dims.d_qk - 512, BLOCK_H=cfg["BLOCK_H"], BLOCK_T=cfg["BLOCK_T"], CAUSAL=causal,
             ATOMIC=atomic, STATIC_T=dims.topk if interpreting() else 0, DOT_F32=interpreting(),
             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
    )  # fmt: skip
    record_launch("attn_dist", kernel)
    return out


def index_order(
    idx: torch.Tensor, out: torch.Tensor, dims: SparseDims, n_chunks: int, *, q_start_index: int, k_stride: int,
    causal: bool, flip_every: int = 0, slots: dict[Any, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each token's valid slots of ``idx [s_q, topk]`` (``topk <= INDEX_ORDER_MAX_TOPK``) grouped by KV
    chunk, ``n_chunks`` chunks of ``ceil(s_kv / n_chunks)`` rows in index order, in slot order within a
    chunk (``_index_order_kernel``): ``(indices, slots, counts)``, int32 ``[s_q, topk]``, ``[s_q, topk]``
    and ``[s_q]`` (the first ``counts[i]`` columns of row ``i`` are set). Writes 0 into ``out [s_q, topk]``
    at the invalid slots. ``flip_every`` > 0: the tokens ``[flip_every, 2 flip_every)``, ``[3 flip_every,
    4 flip_every)``, ... take the chunks last to first."""
    t = next_power_of_2(dims.topk)
    idx_s = torch.empty(dims.s_q, dims.topk, dtype=torch.int32, device=idx.device)
    pos = torch.empty(dims.s_q, dims.topk, dtype=torch.int32, device=idx.device)
    counts = torch.empty(dims.s_q, dtype=torch.int32, device=idx.device)
    launch(
        _index_order_kernel, (dims.s_q,), slots, "index_order",
        (idx, idx_s, pos, counts, out, idx.stride(0), dims.topk, dims.s_kv, q_start_index, k_stride,
         cdiv(max(dims.s_kv, 1), n_chunks), max(flip_every, 1)),
        dict(N_CHUNKS=n_chunks, T=t, CAUSAL=causal, FLIP=flip_every > 0, num_warps=max(4, min(16, t // 512))),
    )  # fmt: skip
    return idx_s, pos, counts


def indexer_target(attn_sum: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """L1-normalise ``attn_sum`` over the top-k slots and detach it: the lightning indexer's KL target.

    Args:
        attn_sum: ``[s_q, topk]`` float32 from :func:`attn_dist`.
        eps: added to each row's sum before dividing (a row of zeros, i.e. no valid slot, stays 0).

    Returns:
        ``[s_q, topk]`` float32, each row summing to 1 (or all 0), with no autograd history.

    Raises:
        ValueError: ``attn_sum`` is not 2-D, or holds a negative or NaN entry. The entries are checked
            with one synchronising read, except while the current CUDA stream is capturing a graph
            (there a negative or NaN entry gives a meaningless row; nothing is read out of bounds).
    """
    if not isinstance(attn_sum, torch.Tensor) or attn_sum.dim() != 2:
        raise ValueError(
            f"attn_sum must be a 2-D tensor [s_q, topk], got {getattr(attn_sum, 'shape', attn_sum)}"
        )
    return _target_op(attn_sum.detach(), float(eps))


def _target_fake(attn_sum: torch.Tensor, eps: float) -> torch.Tensor:
    return attn_sum.new_empty(attn_sum.shape, dtype=torch.float32)


@define_op("indexer_target", _target_fake)
def _target_op(attn_sum: torch.Tensor, eps: float) -> torch.Tensor:
    # An op of its own so that its value check (a synchronising read) stays out of compiled graphs.
    a = attn_sum.float()
    capturing = a.is_cuda and torch.cuda.is_current_stream_capturing()
    if a.numel() and not capturing and bool((a < 0).any() | a.isnan().any()):
        raise ValueError("attn_sum must hold probabilities (>= 0, not NaN), e.g. from attn_dist")
    total = a.sum(-1, keepdim=True) + eps
    return torch.where(total > 0, a / torch.where(total > 0, total, 1.0), 0.0)


def _attn_dist_fake(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *_: Any) -> torch.Tensor:
    dims = check_sparse_inputs(q, kv, indices, 1, float_ok=False)
    return q.new_empty(dims.s_q, dims.topk, dtype=torch.float32)


def _check_attn_dist(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, q_start_index: int,
    k_stride: int, lse_base: str,
) -> SparseDims:  # fmt: skip
    dims = check_sparse_inputs(q, kv, indices, 1, float_ok=False)
    check_kernel_dims(dims, q.dtype, "attn_dist", check_d_v=False)
    check_lse(lse, dims, q.device)
    check_causal_args(q_start_index, k_stride)
    if lse_base not in ("e", "2"):
        raise ValueError(f'lse_base must be "e" or "2", got {lse_base!r}')
    check_kernel_device(q, "attn_dist")
    return dims


@dataclass
class _Checked:
    """A validated call signature of ``attn_dist``: its sizes, and the launches recorded per (device,
    stream, thread) that its later eager calls replay (:func:`_attn_dist_eager`)."""

    dims: SparseDims
    replays: dict[Any, LaunchReplay] = field(default_factory=dict)
    #: Whether the kernels add partial sums into a zeroed output (set by the first recorded call).
    zeroed: bool = False


_CHECKED: dict[Any, _Checked] = {}


@functools.lru_cache(maxsize=64)
def _config(backend: str, split: str, order: str) -> Config:
    return replace(config_of(backend), attn_dist_split=split, attn_dist_order=order)


def _attn_dist_key(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, q_start_index: int,
    k_stride: int, lse_base: str, causal: bool, options: tuple[str, str, str],
) -> tuple[Any, ...]:  # fmt: skip
    """What a call's validation and launch plan depend on (``_runtime.call_signature`` of its tensors and
    its other arguments but the scale): the key of ``_CHECKED``."""
    return (*call_signature(q, kv, indices, lse), q_start_index, k_stride, lse_base, causal, *options)


@define_op("attn_dist", _attn_dist_fake)
def _attn_dist_op(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float,
    q_start_index: int, k_stride: int, lse_base: str, causal: bool, backend: str, split: str = "blocks",
    order: str = "auto",
) -> torch.Tensor:  # fmt: skip
    # Validation and launch plan depend only on the call signature: checked once per signature.
    key = _attn_dist_key(
        q, kv, indices, lse, q_start_index, k_stride, lse_base, causal, (backend, split, order)
    )
    checked = cached(
        _CHECKED,
        key,
        lambda: _Checked(_check_attn_dist(q, kv, indices, lse, q_start_index, k_stride, lse_base)),
    )
    scale = check_sm_scale(sm_scale)
    kv_rows, idx = kv[:, 0], indices[:, 0]
    ctx = launch_context(q.device)

    def run() -> torch.Tensor:
        return launch_attn_dist(
            q, kv_rows, idx, lse, checked.dims, scale, LOG2E if lse_base == "e" else 1.0,
            q_start_index=q_start_index, k_stride=k_stride, causal=causal, config=_config(backend, split, order),
            key=key,
        )  # fmt: skip

    if ctx is None or ctx.capturing or not no_launch_hooks():
        return run()
    # Eager on a GPU: once this signature's launches all go through cached kernels on this stream, they are
    # recorded, and later eager calls replay them with their own tensors (_attn_dist_eager); kv_rows and idx
    # start where kv and indices do.
    out, records = record_launches(run)
    plan = _PLANS.get(key)
    if plan is not None:
        checked.zeroed = plan[3]
        keep_replay(checked.replays, records, (q, kv_rows, idx, lse, out), scale * LOG2E, ctx, "attn_dist")
    return out


def _attn_dist_eager(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float,
    q_start_index: int, k_stride: int, lse_base: str, causal: bool, options: tuple[str, str, str],
) -> torch.Tensor | None:  # fmt: skip
    """A repeated eager call on a CUDA stream: the launches its signature recorded on this device, stream
    and thread (``_Checked.replays``), replayed with this call's tensors; ``None`` where the call takes the
    op (a new signature or stream, tracing, graph capture, launch hooks, inputs that require grad). The
    caller checked the argument types and that ``sm_scale`` is a float."""
    where = eager_stream(q)
    if where is None or (
        torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad or lse.requires_grad)
    ):
        return None
    checked = _CHECKED.get(
        _attn_dist_key(q, kv, indices, lse, q_start_index, k_stride, lse_base, causal, options)
    )
    replay = plan_replay(checked, where, sm_scale)
    if replay is None or checked is None:
        return None
    dims = checked.dims
    # (The kernels that add partial sums need a zeroed output: the launches recorded with one had it too.)
    alloc = torch.zeros if checked.zeroed else torch.empty
    out = alloc(dims.s_q, dims.topk, dtype=torch.float32, device=q.device)
    replay.run(
        q.data_ptr(), kv.data_ptr(), indices.data_ptr(), lse.data_ptr(), out.data_ptr(), sm_scale * LOG2E
    )
    return out


def attn_dist(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    *,
    q_start_index: int = 0,
    k_stride: int = 1,
    lse_base: str = "e",
    causal: bool = True,
    config: Config | None = None,
) -> torch.Tensor:
    """Per-slot attention probability summed over heads, from the forward's log-sum-exp.

    ``attn_sum[i, j] = sum_h exp(sm_scale * q[i, h]·kv[indices[i, 0, j]] - lse[i, h])`` for a valid slot,
    0 for an invalid one (index ``< 0``, ``>= s_kv``, or past the causal limit
    ``(q_start_index + i + 1 - k_stride) / k_stride``, C integer division). Feed it to
    :func:`indexer_target` for the lightning indexer's KL target. Pass ``lse`` from
    :func:`sparse_mla_fwd` run with the same ``causal``, ``q_start_index`` and ``k_stride``, so each head's
    probabilities sum to 1 over the slots.

    Args:
        q: ``[s_q, h_q, d_qk]`` bf16 (or fp16), ``d_qk`` 576 or 512, ``1 <= h_q <= 128``.
        kv: ``[s_kv, 1, d_qk]`` q's dtype.
        indices: ``[s_q, 1, topk]`` int32, any ``topk >= 1``.
        lse: ``[s_q, h_q]`` float32 log-sum-exp per head, the forward's for the same causal settings.
            Where the forward found no valid index (``lse = -inf``) every slot is invalid and ``attn_sum``
            is 0; an ``lse`` that is -inf or NaN where valid slots exist gives inf / NaN, as
            :func:`~sparse_mla_attn.reference.attn_dist_ref` does (not checked: that would synchronise
            with the device).
        sm_scale: softmax scale applied to ``q · k``.
        q_start_index: position of query 0.
        k_stride: query positions per KV entry.
        lse_base: ``"e"`` (natural log, what :func:`sparse_mla_fwd` returns) or ``"2"`` (base-2
            log-sum-exp, the convention of the CUDA kernel this follows).
        causal: apply the causal limit (default ``True``, as the CUDA kernel always does; note that
            :func:`sparse_mla_fwd` defaults to ``False``: pass the value the forward used).
        config: tuning options (:class:`~sparse_mla_attn.Config`; ``backend``, ``attn_dist_split`` and
            ``attn_dist_order`` apply).

    Returns:
        ``attn_sum [s_q, topk]`` float32.

    Raises:
        ValueError, TypeError: on a wrong shape, dtype, device or layout (the message names the argument).
    """
    cfg = config or DEFAULT
    options = (cfg.backend, cfg.attn_dist_split, cfg.attn_dist_order)
    T = torch.Tensor
    # A repeated eager call replays its signature's launches (the checks below are those of its first call).
    if (type(q) is T and type(kv) is T and type(indices) is T and type(lse) is T and type(sm_scale) is float
            and type(q_start_index) is int and type(k_stride) is int and type(causal) is bool
            and type(lse_base) is str):  # fmt: skip
        done = _attn_dist_eager(
            q, kv, indices, lse, sm_scale, q_start_index, k_stride, lse_base, causal, options
        )
        if done is not None:
            return done
    check_arg_types(
        {"q": q, "kv": kv, "indices": indices, "lse": lse},
        {"q_start_index": q_start_index, "k_stride": k_stride},
    )
    check_sm_scale(sm_scale)
    return _attn_dist_op(q, kv, indices, lse, sm_scale, q_start_index, k_stride, lse_base, causal, *options)
