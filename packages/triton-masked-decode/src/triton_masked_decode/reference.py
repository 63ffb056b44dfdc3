"""Float32 torch references: masked decode attention and the LSE merge.

Both are written for clarity and bounded memory, not speed: the decode reference walks the cache in chunks
of positions with an online softmax, so it never holds more than ``[Hq, chunk]`` scores per sequence.
"""

from __future__ import annotations

import torch

from triton_masked_decode.masks import unpack_mask

_REF_CHUNK = 4096


def _gather_rows(
    cache: torch.Tensor, b: int, start: int, stop: int, block_table: torch.Tensor | None
) -> torch.Tensor:
    """Rows ``start:stop`` of sequence ``b`` as ``[Hkv, n, D]`` float32, dense or paged."""
    if block_table is None:
        return cache[b, :, start:stop].float()
    page_size = cache.shape[1]
    pos = torch.arange(start, stop, device=cache.device)
    pages = block_table[b].long()[pos // page_size]
    if cache.dtype == torch.float8_e4m3fn:  # gathered as bytes: older torch has no FP8 indexing on the CPU
        rows = cache.view(torch.uint8)[pages, pos % page_size].view(cache.dtype)  # [n, Hkv, D]
    else:
        rows = cache[pages, pos % page_size]
    return rows.permute(1, 0, 2).float()


def _dequantized_rows(
    cache: torch.Tensor,
    scale: float | torch.Tensor | None,
    token_scale: torch.Tensor | None,
    b: int,
    start: int,
    stop: int,
    block_table: torch.Tensor | None,
) -> torch.Tensor:
    """Rows ``start:stop`` of sequence ``b`` as ``[Hkv, n, D]`` float32, times the per-tensor scale and the
    per-(position, KV head) scales (``[B, Hkv, L]`` dense, ``[num_pages, page_size, Hkv]`` paged)."""
    rows = _gather_rows(cache, b, start, stop, block_table)
    if scale is not None:
        rows = rows * (scale.float().reshape(()) if isinstance(scale, torch.Tensor) else float(scale))
    if token_scale is not None:
        if block_table is None:
            ts = token_scale[b, :, start:stop].float()
        else:
            page_size = token_scale.shape[1]
            pos = torch.arange(start, stop, device=token_scale.device)
            ts = token_scale[block_table[b].long()[pos // page_size], pos % page_size].float().T
        rows = rows * ts[..., None]
    return rows


def masked_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    seqlens: torch.Tensor | int | None = None,
    block_table: torch.Tensor | None = None,
    sm_scale: float | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    k_token_scale: torch.Tensor | None = None,
    v_token_scale: torch.Tensor | None = None,
    chunk: int = _REF_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference masked decode attention, accumulated in float32.

    Same contract as :func:`triton_masked_decode.masked_decode`; excluded K/V rows are never used (they
    may hold NaN).

    Args:
        q: ``[B, Hq, D]`` (or ``[B, Hq, 1, D]``) query, any float dtype.
        k: ``[B, Hkv, L, D]`` keys, or paged ``[num_pages, page_size, Hkv, D]`` with ``block_table``.
        v: values, same layout as ``k``.
        mask: optional ``[B, Hkv, L]`` bool (``True`` = excluded) or bit-packed ``[B, Hkv, ceil(L/8)]``
            uint8 (bit ``j`` of byte ``i`` is position ``8*i + j``; a set bit = excluded).
        seqlens: valid length per sequence, ``[B]`` integer tensor or an int; default ``L``.
        block_table: ``[B, max_pages]`` integer page ids for a paged cache (``L = max_pages*page_size``).
        sm_scale: softmax scale, default ``D ** -0.5``.
        k_scale, v_scale: per-tensor dequantization scales (floats or one-element tensors), default 1; the
            rows used are ``K.float() * k_scale`` (an FP8 cache dequantized in float32).
        k_token_scale, v_token_scale: optional per-(position, KV head) scales, ``[B, Hkv, L]`` dense or
            ``[num_pages, page_size, Hkv]`` paged, multiplying the rows as well.
        chunk: positions processed at a time (bounds the memory used).

    Returns:
        ``out [B, Hq, D]`` in ``q.dtype`` and ``lse [B, Hq]`` float32 (natural log). A row with no visible
        position gives ``out = 0`` and ``lse = -inf``; a row with a NaN or ``+inf`` score (from non-finite
        values in ``q`` or a visible K row) gives ``out = NaN`` and ``lse = NaN``.
    """
    if q.dim() == 4:
        q = q.squeeze(2)
    b, hq, d = q.shape
    if block_table is None:
        hkv, length = k.shape[1], k.shape[2]
    else:
        hkv, length = k.shape[2], block_table.shape[1] * k.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k heads ({hkv})")
    g = hq // hkv
    scale = d**-0.5 if sm_scale is None else sm_scale
    if mask is not None and mask.dtype == torch.uint8:
        mask = unpack_mask(mask, length)
    if seqlens is None:
        lens = [length] * b
    elif isinstance(seqlens, int):
        lens = [seqlens] * b
    else:
        lens = [int(x) for x in seqlens.tolist()]

    out = torch.zeros(b, hkv, g, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hkv, g), float("-inf"), dtype=torch.float32, device=q.device)
    for bi in range(b):
        qb = q[bi].float().view(hkv, g, d)
        m = torch.full((hkv, g), float("-inf"), device=q.device)
        s = torch.zeros(hkv, g, device=q.device)
        acc = torch.zeros(hkv, g, d, device=q.device)
        poisoned = torch.zeros(hkv, g, dtype=torch.bool, device=q.device)
        for start in range(0, lens[bi], chunk):
            stop = min(start + chunk, lens[bi])
            kc = _dequantized_rows(k, k_scale, k_token_scale, bi, start, stop, block_table)
            vc = _dequantized_rows(v, v_scale, v_token_scale, bi, start, stop, block_table)
            if mask is not None:
                excl = mask[bi, :, start:stop]  # [Hkv, n]
                kc = kc.masked_fill(excl[..., None], 0.0)  # excluded rows may hold NaN
                vc = vc.masked_fill(excl[..., None], 0.0)
            scores = torch.einsum("hgd,hnd->hgn", qb, kc) * scale
            if mask is not None:
                scores = scores.masked_fill(excl[:, None, :], float("-inf"))
            poisoned |= (torch.isnan(scores) | torch.isposinf(scores)).any(-1)
            m_new = torch.maximum(m, scores.amax(-1))
            m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_use)
            p = torch.exp(scores - m_use[..., None])
            s = s * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("hgn,hnd->hgd", p, vc)
            m = m_new
        seen = s > 0
        out[bi] = torch.where(seen[..., None], acc / torch.where(seen, s, 1.0)[..., None], 0.0)
        lse[bi] = torch.where(seen, m + torch.log(torch.where(seen, s, 1.0)), float("-inf"))
        out[bi][poisoned] = float("nan")
        lse[bi][poisoned] = float("nan")
    return out.reshape(b, hq, d).to(q.dtype), lse.reshape(b, hq)


def merge_attention_states_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 reference for :func:`triton_masked_decode.merge_attention_states` (same contract: a NaN or
    ``+inf`` LSE on either side gives ``out = NaN``, ``lse = NaN``)."""
    m = torch.maximum(lse_a, lse_b)
    m_use = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa = torch.exp(lse_a.float() - m_use)
    wb = torch.exp(lse_b.float() - m_use)
    tot = wa + wb
    seen = tot > 0
    safe = torch.where(seen, tot, 1.0)
    oa = torch.where((wa > 0)[..., None], out_a.float(), 0.0)
    ob = torch.where((wb > 0)[..., None], out_b.float(), 0.0)
    out = (oa * wa[..., None] + ob * wb[..., None]) / safe[..., None]
    lse = torch.where(seen, m_use + torch.log(safe), float("-inf"))
    poisoned = torch.isnan(lse_a) | torch.isnan(lse_b) | torch.isposinf(lse_a) | torch.isposinf(lse_b)
    out = torch.where(poisoned[..., None], float("nan"), out)
    lse = torch.where(poisoned, float("nan"), lse)
    return out.to(out_a.dtype), lse
