"""Torch references of every op: forward, attention distribution, paged decode, backward and indexer.

They compute in float32 (float64 where an input is float64) on whatever device the inputs live on and
walk the queries in chunks, so that the gathered KV rows and the score matrix stay bounded
(``REF_CHUNK_BYTES``) even at s_q = 4096, h_q = 128, topk = 2048.
"""

from __future__ import annotations

import math

import torch

from sparse_mla_attn._validate import (
    SparseDims,
    causal_keep,
    causal_limit,
    check_causal_args,
    check_decode_inputs,
    check_empty_lse,
    check_lse,
    check_optional_vectors,
    check_sm_scale,
    check_sparse_inputs,
    check_tensor,
    need,
)
from sparse_mla_attn.fp8_cache import FP8_CACHE_DTYPES, FP8_D_NOPE, FP8_TILE, FP8_TOKEN_BYTES

#: Rough upper bound on the temporary memory one reference chunk uses (bytes).
REF_CHUNK_BYTES = 512 * 1024 * 1024


def _chunk_len(dims: SparseDims) -> int:
    per_query = 4 * (dims.topk * dims.d_qk + 3 * dims.h_q * dims.topk + dims.h_q * dims.d_v)
    return max(1, REF_CHUNK_BYTES // max(per_query, 1))


def valid_slots(
    idx: torch.Tensor, s_kv: int, q_start_index: int, k_stride: int, causal: bool,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``[c, topk]`` bool for ``idx [c, topk]`` (queries at positions ``q_start_index + i``): index in
    ``[0, s_kv)``, inside ``topk_length`` and (if ``causal``) not above the causal limit."""
    idx = idx.long()
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        pos = torch.arange(idx.shape[1], device=idx.device)
        valid &= pos[None, :] < topk_length[:, None].long()
    if causal:
        q_pos = q_start_index + torch.arange(idx.shape[0], device=idx.device)
        valid &= idx <= causal_limit(q_pos, k_stride)[:, None]
    return valid


def _attend(
    q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, sm_scale: float, d_v: int,
    attn_sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Softmax attention of ``q [c, h, d]`` over ``rows [c, t, d]`` (float32) where ``valid [c, t]``."""
    rows = rows.masked_fill(~valid[..., None], 0.0)  # a stand-in row for an invalid slot may hold NaN
    scores = torch.einsum("chd,ctd->cht", q, rows) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    max_logits = scores.masked_fill(scores.isnan(), float("-inf")).amax(-1)  # as the kernels: NaN ignored
    lse = torch.logsumexp(scores, -1)
    lse_for_out = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.float()[None, :])
    # A query with no valid index (lse -inf): exp(-inf - -inf) is NaN; those probabilities are 0 by
    # definition. NaN from the data (NaN in q or a selected row) propagates.
    p = torch.exp(scores - lse_for_out[..., None])
    p = torch.where(torch.isneginf(lse_for_out)[..., None] | ~valid[:, None, :], 0.0, p)
    out = torch.einsum("cht,ctd->chd", p, rows[..., :d_v])
    return out, max_logits, lse


def sparse_mla_fwd_ref(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512, *,
    attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None, q_start_index: int = 0,
    k_stride: int = 1, causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sparse MLA forward in float32 (reference for :func:`sparse_mla_attn.sparse_mla_fwd`).

    Args:
        q: ``[s_q, h_q, d_qk]``.
        kv: ``[s_kv, 1, d_qk]``; the first ``d_v`` channels are the values.
        indices: ``[s_q, 1, topk]`` int32; an index ``< 0`` or ``>= s_kv`` is invalid and ignored.
        sm_scale: softmax scale applied to ``q · k``.
        d_v: value head dim.
        attn_sink: optional ``[h_q]`` float32 per-head sink logit, added to the softmax denominator only
            (``out *= 1 / (1 + exp(attn_sink - lse))``); ``lse`` and ``max_logits`` ignore it.
        topk_length: optional ``[s_q]`` int32; only the first ``topk_length[i]`` indices of query ``i`` count.
        q_start_index: position of query 0 (for ``causal``).
        k_stride: query positions per KV entry (a compressed KV; 1: one entry per position), for ``causal``.
        causal: also drop indices above ``(q_start_index + i + 1 - k_stride) / k_stride`` (C division).

    Returns:
        ``out [s_q, h_q, d_v]`` (q's dtype), ``max_logits [s_q, h_q]`` fp32 (of ``sm_scale * q·k``),
        ``lse [s_q, h_q]`` fp32 in natural log. A query with no valid index gives ``out = 0``,
        ``max_logits = lse = -inf``.
    """
    dims = check_sparse_inputs(q, kv, indices, d_v)
    check_optional_vectors(attn_sink, topk_length, dims, q.device)
    check_causal_args(q_start_index, k_stride)
    sm_scale = check_sm_scale(sm_scale)
    out = torch.empty(dims.s_q, dims.h_q, d_v, dtype=q.dtype, device=q.device)
    max_logits = torch.empty(dims.s_q, dims.h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(max_logits)
    kv_rows = kv[:, 0]
    step = _chunk_len(dims)
    for s0 in range(0, dims.s_q, step):
        s1 = min(s0 + step, dims.s_q)
        idx = indices[s0:s1, 0].long()
        tl = None if topk_length is None else topk_length[s0:s1]
        valid = valid_slots(idx, dims.s_kv, q_start_index + s0, k_stride, causal, tl)
        rows = kv_rows[torch.where(valid, idx, 0)].float() if dims.s_kv > 0 else _zeros_rows(idx, dims, q)
        o, m, lv = _attend(q[s0:s1].float(), rows, valid, sm_scale, d_v, attn_sink)
        out[s0:s1], max_logits[s0:s1], lse[s0:s1] = o.to(q.dtype), m, lv
    return out, max_logits, lse


def _zeros_rows(idx: torch.Tensor, dims: SparseDims, q: torch.Tensor) -> torch.Tensor:
    return torch.zeros(*idx.shape, dims.d_qk, dtype=torch.float32, device=q.device)


def attn_dist_ref(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float, *,
    q_start_index: int = 0, k_stride: int = 1, lse_base: str = "e", causal: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Head-summed attention probabilities in float32 (reference for :func:`sparse_mla_attn.attn_dist`).

    ``attn_sum[i, j] = sum_h exp(sm_scale * q[i, h] · kv[indices[i, 0, j]] - lse[i, h])`` for a valid
    index ``j`` (in range and, when ``causal``, not above the causal limit), else 0.

    Args:
        q: ``[s_q, h_q, d_qk]``.
        kv: ``[s_kv, 1, d_qk]``.
        indices: ``[s_q, 1, topk]`` int32.
        lse: ``[s_q, h_q]`` float32 log-sum-exp from the forward, natural log (``lse_base="e"``) or
            base 2 (``lse_base="2"``, then it must be ``lse_e * log2(e)``).
        sm_scale: softmax scale applied to ``q · k``.
        q_start_index: position of query 0.
        k_stride: query positions per KV entry (a compressed KV; 1: one entry per position).
        lse_base: ``"e"`` or ``"2"``.
        causal: apply the limit ``(q_start_index + i + 1 - k_stride) / k_stride`` (C division).

    Returns:
        ``attn_sum [s_q, topk]`` float32.
    """
    dims = check_sparse_inputs(q, kv, indices, 1)
    check_lse(lse, dims, q.device)
    check_causal_args(q_start_index, k_stride)
    sm_scale = check_sm_scale(sm_scale)
    lse_e = _lse_to_natural(lse, lse_base)
    attn_sum = torch.empty(dims.s_q, dims.topk, dtype=torch.float32, device=q.device)
    kv_rows = kv[:, 0]
    step = _chunk_len(dims)
    for s0 in range(0, dims.s_q, step):
        s1 = min(s0 + step, dims.s_q)
        idx = indices[s0:s1, 0].long()
        valid = valid_slots(idx, dims.s_kv, q_start_index + s0, k_stride, causal)
        rows = kv_rows[torch.where(valid, idx, 0)].float() if dims.s_kv > 0 else _zeros_rows(idx, dims, q)
        scores = torch.einsum("chd,ctd->cht", q[s0:s1].float(), rows) * sm_scale
        p = torch.exp(scores - lse_e[s0:s1, :, None])
        attn_sum[s0:s1] = torch.where(valid, p.sum(1), 0.0)
    return attn_sum


def _lse_to_natural(lse: torch.Tensor, lse_base: str) -> torch.Tensor:
    if lse_base == "e":
        return lse
    if lse_base == "2":
        return lse * math.log(2.0)
    raise ValueError(f'lse_base must be "e" or "2", got {lse_base!r}')


def paged_rows(
    indices: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, block_size: int,
    n_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Map per-sequence positions to rows of the flattened paged cache.

    Args:
        indices: ``[b, s_q, topk]`` int32 positions in each sequence.
        block_table: ``[b, max_blocks]`` int32 physical block of each logical block.
        cache_seqlens: ``[b]`` int32 tokens in each sequence's cache.
        block_size: tokens per block.
        n_rows: rows in the cache; a table entry that leads outside ``[0, n_rows)`` makes the slot invalid.

    Returns:
        ``rows [b, s_q, topk]`` int64 (0 where invalid) and ``valid [b, s_q, topk]`` bool
        (``0 <= index < min(cache_seqlens[b], max_blocks * block_size)``, and the row inside the cache).
    """
    idx = indices.long()
    limit = torch.clamp(cache_seqlens.long(), max=block_table.shape[1] * block_size)
    valid = (idx >= 0) & (idx < limit[:, None, None])
    safe = torch.where(valid, idx, 0)
    blk = torch.gather(block_table.long(), 1, (safe // block_size).flatten(1)).view_as(safe)
    rows = blk * block_size + safe % block_size
    if n_rows is not None:
        valid &= (blk >= 0) & (rows < n_rows)
    return torch.where(valid, rows, 0), valid


def dequantize_fp8_kv_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """The float32 values of an FP8 cache (:mod:`sparse_mla_attn.fp8_cache` layout, 656 bytes per token).

    Args:
        kv_cache: ``[..., 656]`` float8_e4m3fn or uint8 (e.g. ``[num_blocks, block_size, 1, 656]``), last
            dim contiguous.

    Returns:
        ``[..., 576]`` float32, contiguous: latent channel ``c`` is ``fp8[c] * scale[c // 128]``, then the
        64 rope channels.
    """
    check_tensor(kv_cache, "kv_cache")
    need(
        kv_cache.dtype in FP8_CACHE_DTYPES and kv_cache.dim() >= 1 and kv_cache.shape[-1] == FP8_TOKEN_BYTES,
        f"kv_cache must be float8_e4m3fn or uint8 [..., {FP8_TOKEN_BYTES}], got {kv_cache.dtype} "
        f"{tuple(kv_cache.shape)}",
    )
    raw = kv_cache.view(torch.uint8).contiguous()
    lead = raw.shape[:-1]
    n_tiles = FP8_D_NOPE // FP8_TILE
    nope = raw[..., :FP8_D_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scale = raw[..., FP8_D_NOPE : FP8_D_NOPE + 4 * n_tiles].contiguous().view(torch.float32)
    rope = raw[..., FP8_D_NOPE + 4 * n_tiles :].contiguous().view(torch.bfloat16).float()
    nope = (nope.view(*lead, n_tiles, FP8_TILE) * scale[..., None]).view(*lead, FP8_D_NOPE)
    return torch.cat([nope, rope], dim=-1)


def sparse_mla_decode_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None, indices: torch.Tensor, sm_scale: float, d_v: int = 512, *,
    index_kind: str = "positions", empty_lse: float = float("-inf"),
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sparse MLA decode over a paged cache in float32 (reference for :func:`sparse_mla_attn.sparse_mla_decode`).

    Args:
        q: ``[b, s_q, h_q, d_qk]``.
        kv_cache: ``[num_blocks, block_size, 1, d_qk]``, or an FP8 cache ``[num_blocks, block_size, 1, 656]``
            (read through :func:`dequantize_fp8_kv_cache`).
        block_table: ``[b, max_blocks]`` int32 (not read with ``index_kind="cache_rows"``).
        cache_seqlens: ``[b]`` int32 (not read with ``index_kind="cache_rows"``).
        indices: ``[b, s_q, topk]`` int32. ``index_kind="positions"``: positions in the sequence (invalid:
            ``< 0``, ``>= cache_seqlens[b]``, past the block table, or in a block whose table entry lies
            outside the cache). ``"cache_rows"``: rows ``block * block_size + offset`` of the cache
            (invalid: ``< 0`` or ``>= num_blocks * block_size``).
        sm_scale: softmax scale.
        d_v: value head dim.
        index_kind: ``"positions"`` or ``"cache_rows"``.
        empty_lse: the ``lse`` of a query with no valid index, ``-inf`` or ``+inf``.

    Returns:
        ``out [b, s_q, h_q, d_v]`` (q's dtype) and ``lse [b, s_q, h_q]`` float32 natural log
        (``empty_lse`` and ``out = 0`` for a query with no valid index).
    """
    dims = check_decode_inputs(q, kv_cache, block_table, cache_seqlens, indices, d_v, index_kind)
    check_empty_lse(empty_lse)
    sm_scale = check_sm_scale(sm_scale)
    b, s_q, h_q, d_qk = q.shape
    block_size = kv_cache.shape[1]
    n_rows = kv_cache.shape[0] * block_size
    if index_kind == "positions":
        assert block_table is not None
        assert cache_seqlens is not None
        rows, valid = paged_rows(indices, block_table, cache_seqlens, block_size, n_rows)
    else:
        valid = (indices >= 0) & (indices < n_rows)
        rows = torch.where(valid, indices.long(), 0)
    flat = (dequantize_fp8_kv_cache(kv_cache) if kv_cache.dtype in FP8_CACHE_DTYPES else kv_cache).reshape(
        -1, d_qk
    )
    qf = q.reshape(b * s_q, h_q, d_qk)
    topk = indices.shape[2]
    rows, valid = rows.reshape(b * s_q, topk), valid.reshape(b * s_q, topk)
    out = torch.empty(b * s_q, h_q, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b * s_q, h_q, dtype=torch.float32, device=q.device)
    step = _chunk_len(dims)
    for s0 in range(0, b * s_q, step):
        s1 = min(s0 + step, b * s_q)
        o, _, lv = _attend(qf[s0:s1].float(), flat[rows[s0:s1]].float(), valid[s0:s1], sm_scale, d_v, None)
        out[s0:s1], lse[s0:s1] = o.to(q.dtype), lv
    if empty_lse > 0:
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return out.view(b, s_q, h_q, d_v), lse.view(b, s_q, h_q)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _chunk_rows(s_q: int, per_token_elems: int, budget_elems: int = 1 << 26) -> int:
    return max(1, min(s_q, budget_elems // max(per_token_elems, 1)))


def sparse_mla_ref(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int, *,
    q_start_index: int = 0, k_stride: int = 1, causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Differentiable sparse MLA forward in float32 (float64 if an input is float64): ``(out, lse)``.

    Unchunked, for small shapes (tests, gradcheck); torch autograd gives the reference gradients of
    :func:`sparse_mla_attn.sparse_mla`. ``out`` is 0 and ``lse`` is -inf on a query with no usable slot.
    """
    cdt = _compute_dtype(q, kv)
    s_kv = kv.shape[0]
    valid = valid_slots(indices[:, 0], s_kv, q_start_index, k_stride, causal)
    rows = kv[:, 0].to(cdt)[indices[:, 0].long().clamp(0, s_kv - 1)]
    scores = torch.einsum("shd,std->sht", q.to(cdt), rows) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.where(valid[:, None, :], torch.exp(scores - lse[..., None]), torch.zeros_like(scores))
    out = torch.einsum("sht,std->shd", p, rows[..., :d_v])
    return out, lse


def sparse_mla_bwd_ref(
    q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, indices: torch.Tensor,
    lse: torch.Tensor, sm_scale: float, d_v: int = 512, *, q_start_index: int = 0, k_stride: int = 1,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Float32 torch reference of :func:`sparse_mla_attn.sparse_mla_bwd` (float64 when an input is float64).

    Chunked over query tokens so that memory stays bounded (about 256 MiB of temporaries per chunk) at
    s_q = 4096, topk = 2048. Uses the given ``out`` and ``lse`` exactly as the kernel does.

    Args:
        q: ``[s_q, h_q, d_qk]`` any floating dtype.
        kv: ``[s_kv, 1, d_qk]``; its first ``d_v`` channels are the values.
        out: ``[s_q, h_q, d_v]``, the forward's output.
        dout: ``[s_q, h_q, d_v]``, its gradient.
        indices: ``[s_q, 1, topk]`` int32; ``< 0`` or ``>= s_kv`` is invalid (skipped).
        lse: ``[s_q, h_q]`` float32 natural-log log-sum-exp from the forward.
        sm_scale, d_v, q_start_index, k_stride, causal: as :func:`sparse_mla_fwd_ref`.

    Returns:
        ``dq [s_q, h_q, d_qk]`` and ``dkv [s_kv, 1, d_qk]``, both in the compute dtype (float32/float64).
    """
    cdt = _compute_dtype(q, kv, out, dout, lse)
    s_q, h_q, d_qk = q.shape
    s_kv = kv.shape[0]
    topk = indices.shape[-1]
    kv_c = kv[:, 0].to(cdt)
    dq = torch.empty(s_q, h_q, d_qk, dtype=cdt, device=q.device)
    dkv = torch.zeros(s_kv, d_qk, dtype=cdt, device=q.device)
    chunk = _chunk_rows(s_q, topk * max(d_qk, h_q) * 3)
    for s0 in range(0, s_q, chunk):
        s1 = min(s_q, s0 + chunk)
        valid = valid_slots(indices[s0:s1, 0], s_kv, q_start_index + s0, k_stride, causal)
        idx = indices[s0:s1, 0].long().clamp(0, s_kv - 1)
        rows = kv_c[idx]  # [c, topk, d_qk]
        qc, doc = q[s0:s1].to(cdt), dout[s0:s1].to(cdt)
        scores = torch.einsum("shd,std->sht", qc, rows) * sm_scale
        p = torch.exp(scores - lse[s0:s1, :, None].to(cdt))
        p = torch.where(valid[:, None, :], p, torch.zeros_like(p))
        delta = (doc * out[s0:s1].to(cdt)).sum(-1)
        dp = torch.einsum("shd,std->sht", doc, rows[..., :d_v])
        ds = p * (dp - delta[..., None]) * sm_scale
        dq[s0:s1] = torch.einsum("sht,std->shd", ds, rows)
        drows = torch.einsum("sht,shd->std", ds, qc)
        drows[..., :d_v] += torch.einsum("sht,shd->std", p, doc)
        dkv.index_add_(0, idx[valid], drows[valid])
    return dq, dkv[:, None, :]


def indexer_logits_ref(
    q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, *, causal: bool = False,
    q_start_index: int = 0, k_stride: int = 1,
) -> torch.Tensor:  # fmt: skip
    """Float32 (float64 for float64 inputs) reference of :func:`sparse_mla_attn.indexer_logits`, chunked
    over queries and differentiable through torch autograd. Returns ``[s_q, s_kv]``; causally masked
    entries are -inf."""
    cdt = _compute_dtype(q_idx)
    s_q, h_idx, _ = q_idx.shape
    s_kv = k_idx.shape[0]
    chunk = max(1, (1 << 25) // max(1, h_idx * s_kv))
    parts = []
    for s0 in range(0, max(s_q, 1), chunk):  # one (empty) chunk at s_q = 0, still differentiable
        z = torch.einsum("shd,nd->shn", q_idx[s0 : s0 + chunk].to(cdt), k_idx.to(cdt))
        parts.append(torch.einsum("shn,sh->sn", torch.relu(z), weights[s0 : s0 + chunk].to(cdt)))
    logits = torch.cat(parts)
    if causal:
        keep = causal_keep(s_q, s_kv, q_start_index, k_stride, q_idx.device)
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def indexer_logits_bwd_ref(
    grad: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense backward of the indexer logits in float32 torch, chunked over queries: ``(dq_idx, dk_idx,
    dweights)`` in the inputs' dtypes. ``grad [s_q, s_kv]`` must be 0 at causally masked entries."""
    s_q, h_idx, _ = q_idx.shape
    s_kv = k_idx.shape[0]
    k32 = k_idx.float()
    dq = torch.empty(q_idx.shape, dtype=torch.float32, device=q_idx.device)
    dw = torch.empty(s_q, h_idx, dtype=torch.float32, device=q_idx.device)
    dk = torch.zeros(k_idx.shape, dtype=torch.float32, device=q_idx.device)
    chunk = max(1, (1 << 25) // max(1, h_idx * s_kv))
    for s0 in range(0, s_q, chunk):
        s1 = min(s_q, s0 + chunk)
        qc = q_idx[s0:s1].float()
        g = grad[s0:s1].float()
        z = torch.einsum("shd,nd->shn", qc, k32)
        dw[s0:s1] = torch.einsum("sn,shn->sh", g, torch.relu(z))
        gz = (g[:, None, :] * weights[s0:s1].float()[:, :, None]) * (z > 0)
        dq[s0:s1] = torch.einsum("shn,nd->shd", gz, k32)
        dk += torch.einsum("shn,shd->nd", gz, qc)
    return dq.to(q_idx.dtype), dk.to(k_idx.dtype), dw.to(weights.dtype)


def reduce_loss(loss_rows: torch.Tensor, reduction: str) -> torch.Tensor:
    """Apply ``reduction`` (``"mean"``, ``"sum"`` or ``"none"``) to per-query losses ``[s_q]``; the mean of
    no query (``s_q = 0``) is 0."""
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    if reduction == "mean":  # over no query at all: 0 (not NaN), still differentiable
        return loss_rows.mean() if loss_rows.numel() else loss_rows.sum()
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def indexer_kl_loss_ref(
    indexer_logits_at_topk: torch.Tensor, attn_sum: torch.Tensor, *, reduction: str = "mean"
) -> torch.Tensor:
    """Row-by-row float64 reference of :func:`sparse_mla_attn.indexer_kl_loss` (slow; for tests).

    Args:
        indexer_logits_at_topk: ``[s_q, topk]`` floating, the indexer's logits at the selected slots
            (``-inf`` at invalid slots, which are left out).
        attn_sum: ``[s_q, topk]`` floating, the attention mass per slot (:func:`attn_dist_ref`); each row
            is normalised over its valid slots into the target distribution.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` over the rows.

    Returns:
        float64 ``KL(target || softmax(logits))`` over each row's valid slots, per row (``"none"``:
        ``[s_q]``; a row without a valid slot or mass gives 0) or reduced.
    """
    losses = []
    for lg, a in zip(indexer_logits_at_topk.double(), attn_sum.double(), strict=False):
        m = torch.isfinite(lg)
        total = a[m].sum()
        if not bool(m.any()) or float(total) <= 0:
            losses.append(lg.new_zeros(()) + 0.0 * lg[m].sum())
            continue
        p = a[m] / total
        logq = lg[m] - torch.logsumexp(lg[m], 0)
        nz = p > 0
        losses.append((p[nz] * (torch.log(p[nz]) - logq[nz])).sum() + 0.0 * logq.sum())
    # No query: an empty [0] loss that is still connected to the logits (its gradient is empty).
    out = torch.stack(losses) if losses else 0.0 * indexer_logits_at_topk.double().sum(-1)
    return reduce_loss(out, reduction)
