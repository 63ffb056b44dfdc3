"""``triton_masked_flash_decoding``: compatible with the Triton masked flash-decoding function of that name.

It keeps that function's signature (flat ``k``, ``v``, ``mask`` buffers, ``valid_length``,
``num_k_heads``) and its return order ``(lse, out)``, and runs on :func:`masked_decode`.
"""

from __future__ import annotations

import torch

from triton_masked_decode.masked_decode import masked_decode

__all__ = ["triton_masked_flash_decoding"]


def triton_masked_flash_decoding(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    valid_length: int,
    num_k_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked decode over flat buffers, with the positional signature and return order users know.

    The first ``B * Hkv * valid_length * D`` elements of ``k``/``v`` are read as a contiguous
    ``[B, Hkv, valid_length, D]`` cache, and the first ``B * Hkv * valid_length`` of ``mask`` as
    ``[B, Hkv, valid_length]`` (``True`` = excluded). The scale is ``D ** -0.5``.

    Args:
        q: ``[B, Hq, 1, D]`` float16/bfloat16.
        k: flat ``[>= B*Hkv*valid_length*D]`` keys.
        v: flat values, like ``k``.
        mask: flat ``[>= B*Hkv*valid_length]`` bool.
        valid_length: positions per sequence.
        num_k_heads: ``Hkv``.

    Returns:
        ``(lse [B, Hq, 1] float32, out [B, Hq, 1, D] q.dtype)``. Fully excluded rows give ``lse = -inf``
        and ``out = 0`` (where a ``-1e6`` fill would average the excluded values).

    Raises:
        ValueError: ``q`` is not ``[B, Hq, 1, D]`` or a buffer is shorter than the shapes need; the errors
            of :func:`masked_decode`.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(
            f"triton_masked_flash_decoding: q must be [B, Hq, 1, D], got {getattr(q, 'shape', q)}"
        )
    bsz, hq, _, dim = q.shape
    n_kv = bsz * num_k_heads * valid_length
    for name, t, need in (("k", k, n_kv * dim), ("v", v, n_kv * dim), ("mask", mask, n_kv)):
        if t.numel() < need:
            raise ValueError(
                f"triton_masked_flash_decoding: {name} has {t.numel()} elements, needs >= {need} "
                f"(B={bsz}, Hkv={num_k_heads}, valid_length={valid_length})"
            )
    k4 = k.reshape(-1)[: n_kv * dim].view(bsz, num_k_heads, valid_length, dim)
    v4 = v.reshape(-1)[: n_kv * dim].view(bsz, num_k_heads, valid_length, dim)
    m3 = mask.reshape(-1)[:n_kv].view(bsz, num_k_heads, valid_length)
    out, lse = masked_decode(q.view(bsz, hq, dim), k4, v4, m3, check_values=False)
    return lse.view(bsz, hq, 1), out.view(bsz, hq, 1, dim)
