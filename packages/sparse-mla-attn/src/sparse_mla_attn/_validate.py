"""Input validation of every op, and the causal limit they all share.

Every public function of this package calls these checks before launching anything, so a wrong shape,
dtype, device or layout fails with a :class:`ValueError` (or :class:`TypeError`) that names the argument
and says what was expected, instead of a kernel reading the wrong memory.

* :func:`check_sparse_inputs` — ``q [s_q, h_q, d_qk]``, ``kv [s_kv, 1, d_qk]``, ``indices [s_q, 1, topk]``
  and ``d_v``; returns a :class:`SparseDims`.
* :func:`check_optional_vectors` — ``attn_sink [h_q]`` fp32 and ``topk_length [s_q]`` int32.
* :func:`check_causal_args` — ``q_start_index >= 0``, ``k_stride >= 1``.
* :func:`check_lse` — ``lse [s_q, h_q]`` fp32.
* :func:`check_kernel_dims` — the head dims the Triton kernels are built for.
* :func:`check_decode_inputs`, :func:`check_bwd_inputs`, :func:`check_indexer_inputs` — the other ops.
* :func:`causal_limit` — the largest KV index a query position may see (C integer division).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparse_mla_attn.fp8_cache import FP8_CACHE_DTYPES, FP8_D_NOPE, FP8_D_ROPE, FP8_TOKEN_BYTES

#: Activation dtypes the Triton kernels accept for ``q`` and ``kv``.
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
#: Head dims the Triton kernels are built for: 512 latent channels, optionally + 64 rope channels.
KERNEL_D_QK = (512, 576)
KERNEL_D_V = 512
MAX_H_Q = 128
#: How ``sparse_mla_decode`` reads its indices: sequence positions, or rows of the paged cache.
DECODE_INDEX_KINDS = ("positions", "cache_rows")


@dataclass(frozen=True)
class SparseDims:
    """Problem sizes read off validated inputs."""

    s_q: int
    h_q: int
    d_qk: int
    s_kv: int
    topk: int
    d_v: int


def _need(cond: bool, exc: type[Exception], msg: str) -> None:
    if not cond:
        raise exc(msg)


def need(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless ``cond``."""
    _need(cond, ValueError, msg)


def check_tensor(t: object, name: str) -> torch.Tensor:
    """Raise TypeError unless ``t`` is a tensor."""
    _need(isinstance(t, torch.Tensor), TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    return t


def check_arg_types(
    tensors: dict[str, object], ints: dict[str, object], *, optional: dict[str, object] | None = None
) -> None:
    """Raise TypeError unless each of ``tensors`` is a tensor, each of ``optional`` a tensor or ``None`` and
    each of ``ints`` an int (not a bool): the types an op's schema needs, checked before dispatch."""
    for name, t in tensors.items():
        check_tensor(t, name)
    for name, t in (optional or {}).items():
        if t is not None:
            check_tensor(t, name)
    for name, v in ints.items():
        _need(isinstance(v, int) and not isinstance(v, bool), TypeError, f"{name} must be an int, got {v!r}")


def check_sparse_inputs(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, *, float_ok: bool = True
) -> SparseDims:
    """Validate ``q [s_q, h_q, d_qk]``, ``kv [s_kv, 1, d_qk]``, ``indices [s_q, 1, topk]`` int32.

    Args:
        q: queries, floating point, last dim contiguous.
        kv: latent KV rows (``h_kv = 1``), same dtype and device as ``q``, last dim contiguous.
        indices: int32 top-k KV indices per query, last dim contiguous.
        d_v: value dim, ``1 <= d_v <= d_qk``.
        float_ok: accept float32 ``q``/``kv`` (references do; kernels check dtypes separately).

    Returns:
        The problem sizes.
    """
    check_tensor(q, "q")
    check_tensor(kv, "kv")
    check_tensor(indices, "indices")
    _need(q.dim() == 3, ValueError, f"q must be [s_q, h_q, d_qk], got shape {tuple(q.shape)}")
    s_q, h_q, d_qk = q.shape
    _need(
        kv.dim() == 3 and kv.shape[1] == 1 and kv.shape[2] == d_qk,
        ValueError,
        f"kv must be [s_kv, 1, d_qk={d_qk}] (one latent KV head), got shape {tuple(kv.shape)}",
    )
    _need(
        indices.dim() == 3 and indices.shape[0] == s_q and indices.shape[1] == 1,
        ValueError,
        f"indices must be [s_q={s_q}, 1, topk], got shape {tuple(indices.shape)}",
    )
    _need(indices.dtype == torch.int32, TypeError, f"indices must be int32, got {indices.dtype}")
    allowed = (*KERNEL_DTYPES, torch.float32) if float_ok else KERNEL_DTYPES
    _need(q.dtype in allowed, TypeError, f"q must have dtype in {allowed}, got {q.dtype}")
    _need(kv.dtype == q.dtype, TypeError, f"kv must have q's dtype {q.dtype}, got {kv.dtype}")
    _need(
        kv.device == q.device and indices.device == q.device,
        ValueError,
        f"q, kv and indices must be on one device, got {q.device}, {kv.device}, {indices.device}",
    )
    for name, t in (("q", q), ("kv", kv), ("indices", indices)):
        _need(
            t.stride(-1) == 1, ValueError, f"{name} must be contiguous in its last dim (stride {t.stride()})"
        )
    _need(h_q >= 1 and s_q >= 0, ValueError, f"q must have at least one head, got shape {tuple(q.shape)}")
    _need(indices.shape[2] >= 1, ValueError, "indices must hold at least one index per query (topk >= 1)")
    _need(
        isinstance(d_v, int) and 1 <= d_v <= d_qk,
        ValueError,
        f"d_v must be an int in [1, d_qk={d_qk}], got {d_v!r}",
    )
    return SparseDims(s_q, h_q, d_qk, kv.shape[0], indices.shape[2], d_v)


def check_kernel_dims(dims: SparseDims, dtype: torch.dtype, what: str, *, check_d_v: bool = True) -> None:
    """Raise ValueError unless the Triton kernels support these sizes and dtype (``d_v`` too if asked)."""
    _need(dtype in KERNEL_DTYPES, TypeError, f"{what}: q/kv must be bf16 or fp16 for the kernel, got {dtype}")
    _need(
        dims.d_qk in KERNEL_D_QK,
        ValueError,
        f"{what}: d_qk must be one of {KERNEL_D_QK} (512 latent [+ 64 rope]), got {dims.d_qk}",
    )
    _need(
        not check_d_v or dims.d_v == KERNEL_D_V,
        ValueError,
        f"{what}: d_v must be {KERNEL_D_V}, got {dims.d_v}",
    )
    _need(1 <= dims.h_q <= MAX_H_Q, ValueError, f"{what}: h_q must be in [1, {MAX_H_Q}], got {dims.h_q}")


def check_optional_vectors(
    attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None, dims: SparseDims, device: torch.device
) -> None:
    """Validate ``attn_sink [h_q]`` float32 and ``topk_length [s_q]`` int32 when given."""
    for name, t, size, dtype in (
        ("attn_sink", attn_sink, ("h_q", dims.h_q), torch.float32),
        ("topk_length", topk_length, ("s_q", dims.s_q), torch.int32),
    ):
        if t is None:
            continue
        check_tensor(t, name)
        want = f"{str(dtype).removeprefix('torch.')} [{size[0]}={size[1]}]"
        need(
            t.shape == (size[1],) and t.dtype == dtype,
            f"{name} must be {want}, got {t.dtype} {tuple(t.shape)}",
        )
        need(t.device == device, f"{name} must be on {device}, got {t.device}")


def check_causal_args(q_start_index: int, k_stride: int) -> None:
    """Raise ValueError unless ``q_start_index >= 0`` and ``k_stride >= 1`` (both ints)."""
    _need(
        isinstance(q_start_index, int) and q_start_index >= 0,
        ValueError,
        f"q_start_index must be an int >= 0, got {q_start_index!r}",
    )
    _need(
        isinstance(k_stride, int) and k_stride >= 1,
        ValueError,
        f"k_stride must be an int >= 1, got {k_stride!r}",
    )


def check_sm_scale(sm_scale: float) -> float:
    """Return ``sm_scale`` as a float; raise ValueError if it is not finite."""
    _need(
        isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale),
        ValueError,
        f"sm_scale must be a finite float, got {sm_scale!r}",
    )
    return float(sm_scale)


def check_lse(lse: torch.Tensor, dims: SparseDims, device: torch.device) -> None:
    """Validate ``lse [s_q, h_q]`` float32 (last dim contiguous)."""
    check_tensor(lse, "lse")
    _need(
        lse.shape == (dims.s_q, dims.h_q) and lse.dtype == torch.float32,
        ValueError,
        f"lse must be float32 [s_q={dims.s_q}, h_q={dims.h_q}], got {lse.dtype} {tuple(lse.shape)}",
    )
    _need(lse.device == device, ValueError, f"lse must be on {device}, got {lse.device}")
    _need(lse.stride(-1) == 1, ValueError, f"lse must be contiguous in its last dim (stride {lse.stride()})")


def causal_limit(q_pos: torch.Tensor, k_stride: int) -> torch.Tensor:
    """Largest KV index visible from query position ``q_pos >= 0``: ``(q_pos + 1 - k_stride) / k_stride``.

    The division truncates toward zero, as the C integer division of DeepSeek's CUDA kernels does, so
    positions ``q_pos < k_stride - 1`` get limit 0 (KV entry 0 stays visible). The kernels compute the
    same value as ``max(q_pos + 1 - k_stride, 0) // k_stride``.
    """
    return torch.div(q_pos + 1 - k_stride, k_stride, rounding_mode="trunc")


def causal_keep(n_q: int, n_k: int, q_start_index: int, k_stride: int, device: torch.device) -> torch.Tensor:
    """``[n_q, n_k]`` bool: key ``n`` is visible from query ``t`` (position ``q_start_index + t``)."""
    q_pos = q_start_index + torch.arange(n_q, device=device)
    return torch.arange(n_k, device=device)[None, :] <= causal_limit(q_pos, k_stride)[:, None]


def check_decode_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None, indices: torch.Tensor, d_v: int, index_kind: str = "positions",
) -> SparseDims:  # fmt: skip
    """Validate paged-decode inputs.

    Args:
        q: ``[b, s_q, h_q, d_qk]``, last dim contiguous.
        kv_cache: ``[num_blocks, block_size, 1, d_qk]``, contiguous, q's dtype; or the FP8 layout
            (:mod:`sparse_mla_attn.fp8_cache`): ``[num_blocks, block_size, 1, 656]`` float8_e4m3fn or uint8,
            ``d_qk = 576``, tokens 656 bytes apart, blocks any multiple of 16 bytes apart, 16-byte aligned.
        block_table: ``[b, max_blocks]`` int32, last dim contiguous (not read with ``"cache_rows"``).
        cache_seqlens: ``[b]`` int32, contiguous (not read with ``"cache_rows"``).
        indices: ``[b, s_q, topk]`` int32, last dim contiguous.
        d_v: value dim.
        index_kind: ``"positions"`` or ``"cache_rows"``.

    Returns:
        Sizes with ``s_q = b * s_q`` (flattened tokens) and ``s_kv = num_blocks * block_size``.
    """
    _need(
        index_kind in DECODE_INDEX_KINDS,
        ValueError,
        f"index_kind must be one of {DECODE_INDEX_KINDS}, got {index_kind!r}",
    )
    positions = index_kind == "positions"
    tables = {"block_table": block_table, "cache_seqlens": cache_seqlens}
    for name, t in (("q", q), ("kv_cache", kv_cache), *tables.items(), ("indices", indices)):
        if t is None and name in tables and not positions:
            continue
        if t is None:
            raise TypeError(f"{name} must be a torch.Tensor with index_kind='positions', got None")
        check_tensor(t, name)
        _need(t.device == q.device, ValueError, f"{name} must be on q's device {q.device}, got {t.device}")
    _need(q.dim() == 4, ValueError, f"q must be [b, s_q, h_q, d_qk], got shape {tuple(q.shape)}")
    b, s_q, h_q, d_qk = q.shape
    _need(
        q.dtype in (*KERNEL_DTYPES, torch.float32), TypeError, f"q must be bf16, fp16 or fp32, got {q.dtype}"
    )
    if kv_cache.dtype in FP8_CACHE_DTYPES:
        _check_fp8_cache(kv_cache, q)
    else:
        _need(
            kv_cache.dim() == 4 and kv_cache.shape[2] == 1 and kv_cache.shape[3] == d_qk,
            ValueError,
            f"kv_cache must be [num_blocks, block_size, 1, d_qk={d_qk}] (or the FP8 layout "
            f"[num_blocks, block_size, 1, {FP8_TOKEN_BYTES}] float8_e4m3fn / uint8), got shape "
            f"{tuple(kv_cache.shape)}",
        )
        _need(kv_cache.is_contiguous(), ValueError, "kv_cache must be contiguous")
        _need(
            kv_cache.dtype == q.dtype,
            TypeError,
            f"kv_cache must have q's dtype {q.dtype} (or be an FP8 cache: float8_e4m3fn / uint8), "
            f"got {kv_cache.dtype}",
        )
    if positions:
        assert block_table is not None
        assert cache_seqlens is not None
        _need(
            block_table.dim() == 2 and block_table.shape[0] == b and block_table.dtype == torch.int32,
            ValueError,
            f"block_table must be int32 [b={b}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}",
        )
        _need(
            cache_seqlens.shape == (b,) and cache_seqlens.dtype == torch.int32,
            ValueError,
            f"cache_seqlens must be int32 [b={b}], got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}",
        )
        _need(
            block_table.stride(-1) == 1,
            ValueError,
            f"block_table must be contiguous in its last dim (stride {block_table.stride()})",
        )
        # (The kernel reads the lengths as b consecutive int32: an expanded or strided view would be read
        # past its own elements.)
        _need(
            b <= 1 or cache_seqlens.stride(0) == 1,
            ValueError,
            f"cache_seqlens must be contiguous (stride 1), got stride {cache_seqlens.stride()}",
        )
    _need(
        indices.dim() == 3 and indices.shape[:2] == (b, s_q) and indices.dtype == torch.int32,
        ValueError,
        f"indices must be int32 [b={b}, s_q={s_q}, topk], got {indices.dtype} {tuple(indices.shape)}",
    )
    _need(indices.shape[2] >= 1, ValueError, "indices must hold at least one index per query (topk >= 1)")
    for name, t in (("q", q), ("indices", indices)):
        _need(
            t.stride(-1) == 1, ValueError, f"{name} must be contiguous in its last dim (stride {t.stride()})"
        )
    _need(
        isinstance(d_v, int) and 1 <= d_v <= d_qk,
        ValueError,
        f"d_v must be an int in [1, d_qk={d_qk}], got {d_v!r}",
    )
    return SparseDims(b * s_q, h_q, d_qk, kv_cache.shape[0] * kv_cache.shape[1], indices.shape[2], d_v)


def check_empty_lse(empty_lse: object) -> float:
    """``empty_lse`` (the decode's ``lse`` of a query with no valid index) as a float: ``-inf`` or ``+inf``."""
    _need(
        isinstance(empty_lse, (int, float)) and not isinstance(empty_lse, bool) and math.isinf(empty_lse),
        ValueError,
        f"empty_lse must be float('-inf') or float('inf'), got {empty_lse!r}",
    )
    return float(empty_lse)  # type: ignore[arg-type]


def _check_fp8_cache(kv_cache: torch.Tensor, q: torch.Tensor) -> None:
    """The FP8 cache layout (:mod:`sparse_mla_attn.fp8_cache`) as the decode kernel reads it."""
    _need(
        kv_cache.dim() == 4 and kv_cache.shape[2] == 1 and kv_cache.shape[3] == FP8_TOKEN_BYTES,
        ValueError,
        f"kv_cache (FP8 layout, {kv_cache.dtype}) must be [num_blocks, block_size, 1, {FP8_TOKEN_BYTES}], "
        f"got shape {tuple(kv_cache.shape)}",
    )
    _need(
        q.shape[-1] == FP8_D_NOPE + FP8_D_ROPE,
        ValueError,
        f"q must have d_qk = {FP8_D_NOPE + FP8_D_ROPE} with an FP8 kv_cache, got {q.shape[-1]}",
    )
    _need(
        q.dtype in (torch.bfloat16, torch.float32),
        TypeError,
        f"q must be bf16 (or fp32 for the reference) with an FP8 kv_cache, got {q.dtype}",
    )
    _need(
        kv_cache.stride(3) == 1 and kv_cache.stride(1) == FP8_TOKEN_BYTES and kv_cache.stride(0) % 16 == 0,
        ValueError,
        f"kv_cache (FP8 layout) must have its tokens {FP8_TOKEN_BYTES} bytes apart and its blocks a multiple "
        f"of 16 bytes apart (strides [k * 16, {FP8_TOKEN_BYTES}, any, 1]), got strides {kv_cache.stride()}",
    )


def check_bwd_inputs(
    q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, indices: torch.Tensor,
    lse: torch.Tensor, d_v: int, q_start_index: int, k_stride: int,
) -> SparseDims:  # fmt: skip
    """Validate the backward's inputs: those of the forward (any ``d_v`` that is a power of two >= 16 with
    ``d_qk - d_v`` 0 or a power of two >= 16; fp32 accepted), ``out`` / ``dout [s_q, h_q, d_v]`` in q's
    dtype and ``lse [s_q, h_q]`` fp32."""
    dims = check_sparse_inputs(q, kv, indices, d_v)
    check_causal_args(q_start_index, k_stride)
    s_q, h_q, d_qk = dims.s_q, dims.h_q, dims.d_qk
    need(dims.s_kv >= 1, "kv must have at least one row")
    for name, t in (("out", out), ("dout", dout)):
        check_tensor(t, name)
        need(t.shape == (s_q, h_q, d_v), f"{name} must be [{s_q}, {h_q}, {d_v}], got {tuple(t.shape)}")
        _need(t.dtype == q.dtype, TypeError, f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        need(t.device == q.device, f"{name} must be on q's device {q.device}, got {t.device}")
        need(t.stride(-1) == 1, f"{name} must be contiguous in its last dim (stride {t.stride()})")
    check_lse(lse, dims, q.device)
    need(
        d_v >= 16 and d_v & (d_v - 1) == 0,
        f"d_v must be a power of two >= 16 and <= d_qk ({d_qk}), got {d_v}",
    )
    d_rope = d_qk - d_v
    need(
        d_rope == 0 or (d_rope >= 16 and d_rope & (d_rope - 1) == 0),
        f"d_qk - d_v must be 0 or a power of two >= 16 (e.g. 576 - 512 = 64), got {d_rope}",
    )
    return dims


def check_indexer_inputs(
    q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, q_start_index: int, k_stride: int
) -> None:
    """Validate ``q_idx [s_q, h_idx, d_idx]``, ``k_idx [s_kv, d_idx]`` (same dtype, ``d_idx`` a power of two
    >= 16) and ``weights [s_q, h_idx]`` floating point, all on one device."""
    for name, t in (("q_idx", q_idx), ("k_idx", k_idx), ("weights", weights)):
        check_tensor(t, name)
    need(q_idx.dim() == 3, f"q_idx must be [s_q, h_idx, d_idx], got shape {tuple(q_idx.shape)}")
    s_q, h_idx, d_idx = q_idx.shape
    need(
        k_idx.dim() == 2 and k_idx.shape[1] == d_idx,
        f"k_idx must be [s_kv, {d_idx}], got shape {tuple(k_idx.shape)}",
    )
    need(weights.shape == (s_q, h_idx), f"weights must be [{s_q}, {h_idx}], got shape {tuple(weights.shape)}")
    need(q_idx.is_floating_point(), f"q_idx must be a floating dtype, got {q_idx.dtype}")
    need(k_idx.dtype == q_idx.dtype, f"k_idx dtype {k_idx.dtype} must match q_idx dtype {q_idx.dtype}")
    need(weights.is_floating_point(), f"weights must be floating point, got {weights.dtype}")
    need(d_idx >= 16 and d_idx & (d_idx - 1) == 0, f"d_idx must be a power of two >= 16, got {d_idx}")
    check_causal_args(q_start_index, k_stride)
    need(
        q_idx.device == k_idx.device == weights.device,
        f"q_idx, k_idx and weights must be on one device, got {q_idx.device}, {k_idx.device}, {weights.device}",
    )
