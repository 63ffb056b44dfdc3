"""Mask layouts: boolean per position, or bit-packed 8 positions per byte (little-endian bit order)."""

from __future__ import annotations

import torch

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean exclusion mask into bytes, 8 positions per byte.

    Bit ``j`` (least significant first) of byte ``i`` holds position ``8*i + j``; a set bit means the
    position is excluded, like ``True`` in the boolean layout. This is ``numpy.packbits(...,
    bitorder="little")``. Trailing bits of the last byte are set (excluded).

    Args:
        mask: ``[..., L]`` bool.

    Returns:
        ``[..., ceil(L/8)]`` uint8 on the same device.

    Raises:
        TypeError: ``mask`` is not a bool tensor.
        ValueError: ``mask`` is 0-d.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"pack_mask: mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
    if mask.dim() == 0:
        raise ValueError("pack_mask: mask must have at least one dimension (the positions)")
    length = mask.shape[-1]
    pad = (-length) % 8
    if pad:
        mask = torch.cat([mask, mask.new_ones((*mask.shape[:-1], pad))], dim=-1)
    bits = mask.reshape(*mask.shape[:-1], mask.shape[-1] // 8, 8).to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: ``[..., ceil(L/8)]`` uint8 -> ``[..., L]`` bool (True = excluded).

    Raises:
        TypeError: ``packed`` is not uint8.
        ValueError: ``length`` is not an int in ``[0, 8 * packed.shape[-1]]``.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(
            f"unpack_mask: packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed))}"
        )
    if packed.dim() == 0:
        raise ValueError("unpack_mask: packed must have at least one dimension (the bytes)")
    n_bytes = packed.shape[-1]
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= 8 * n_bytes:
        raise ValueError(
            f"unpack_mask: length must be an int in [0, {8 * n_bytes}] for {n_bytes} bytes, got {length!r}"
        )
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed[..., None] & weights) != 0
    return bits.reshape(*packed.shape[:-1], 8 * n_bytes)[..., :length]
