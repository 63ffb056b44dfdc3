"""FP8 latent KV cache in FlashMLA's sparse-decode layout, and its quantizer.

Each token of the cache is 656 bytes (``FP8_TOKEN_BYTES``):

* bytes ``[0, 512)``: the 512 latent ("nope") channels as ``float8_e4m3fn``;
* bytes ``[512, 528)``: 4 float32 scales, one per 128 latent channels (channel ``c`` dequantizes to
  ``fp8[c] * scale[c // 128]``);
* bytes ``[528, 656)``: the 64 rope channels as bf16, not quantized.

A paged cache is ``[num_blocks, block_size, 1, 656]`` (``float8_e4m3fn`` as FlashMLA passes it, or
``uint8``); :func:`~sparse_mla_attn.sparse_mla_decode` reads it when given one in place of a bf16 cache,
and :func:`~sparse_mla_attn.reference.dequantize_fp8_kv_cache` is its float32 reference.
"""

from __future__ import annotations

import torch

#: Latent channels, stored as float8_e4m3fn.
FP8_D_NOPE = 512
#: Rope channels, stored as bf16.
FP8_D_ROPE = 64
#: Latent channels per float32 scale.
FP8_TILE = 128
#: Bytes per token: 512 fp8 values, 4 float32 scales, 64 bf16 values.
FP8_TOKEN_BYTES = FP8_D_NOPE + 4 * (FP8_D_NOPE // FP8_TILE) + 2 * FP8_D_ROPE
#: Cache dtypes read as the FP8 layout (same bytes).
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0


def quantize_fp8_kv_cache(kv: torch.Tensor) -> torch.Tensor:
    """Quantize latent KV rows to the FP8 cache layout (656 bytes per token).

    Each 128-channel tile of the 512 latent channels gets the scale ``2 ** ceil(log2(max(amax / 448,
    1e-4)))`` (``amax``: the tile's largest magnitude; a power of two, so dequantizing is exact), and its
    values ``(x / scale)`` rounded to ``float8_e4m3fn``; the 64 rope channels are stored as bf16. This
    is the rule of FlashMLA's cache quantizer, so caches written here and there hold the same bytes.

    Args:
        kv: ``[..., 576]`` float tensor (bf16, fp16 or fp32) of finite values, e.g. a bf16 paged cache
            ``[num_blocks, block_size, 1, 576]`` or the rows of new tokens.

    Returns:
        ``[..., 656]`` ``float8_e4m3fn`` on ``kv``'s device: write it into a cache of that layout (e.g.
        ``cache[block, offset] = quantize_fp8_kv_cache(new_rows)``), or pass it as the cache.

    Raises:
        TypeError: ``kv`` is not a floating-point tensor.
        ValueError: ``kv``'s last dim is not 576.
    """
    if not isinstance(kv, torch.Tensor) or not kv.is_floating_point():
        raise TypeError(f"kv must be a floating-point torch.Tensor, got {getattr(kv, 'dtype', type(kv))}")
    d_qk = FP8_D_NOPE + FP8_D_ROPE
    if kv.dim() < 1 or kv.shape[-1] != d_qk:
        raise ValueError(f"kv must be [..., {d_qk}] (512 latent + 64 rope channels), got {tuple(kv.shape)}")
    lead = kv.shape[:-1]
    tiles = kv[..., :FP8_D_NOPE].float().reshape(*lead, FP8_D_NOPE // FP8_TILE, FP8_TILE)
    amax = tiles.abs().amax(dim=-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax / E4M3_MAX, 1e-4))))
    nope = (tiles / scale[..., None]).to(torch.float8_e4m3fn).reshape(*lead, FP8_D_NOPE)
    out = torch.empty(*lead, FP8_TOKEN_BYTES, dtype=torch.uint8, device=kv.device)
    out[..., :FP8_D_NOPE] = nope.view(torch.uint8)
    out[..., FP8_D_NOPE : FP8_D_NOPE + 16] = scale.contiguous().view(torch.uint8)
    out[..., FP8_D_NOPE + 16 :] = kv[..., FP8_D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out.view(torch.float8_e4m3fn)


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache`` is read as the FP8 layout: a ``float8_e4m3fn`` or ``uint8`` tensor."""
    return kv_cache.dtype in FP8_CACHE_DTYPES
