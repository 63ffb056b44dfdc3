"""Sparse MLA decode over a paged KV cache: the forward kernel, with indices mapped through a block table.

``q [b, s_q, h_q, d_qk]`` is flattened to ``b * s_q`` tokens; token ``t`` belongs to sequence
``t // s_q``. Each of its top-k indices is a position ``p`` in that sequence, valid when
``0 <= p < cache_seqlens[b]`` (and inside the block table), and lives in cache row
``block_table[b, p // block_size] * block_size + p % block_size``. A small kernel maps the indices to
cache rows first (``-1`` where invalid, 4 bytes per index); the forward kernel then gathers those rows
straight from the cache, so no gathered copy of the cache is built, and its loop has no dependent
block-table load between an index and its gather. With ``index_kind="cache_rows"`` the indices already
are cache rows (FlashMLA's convention) and the forward kernel reads them directly. Small batches split
each token's top-k list over several programs (split-K) to fill the GPU.

The cache is bf16 (or fp16) rows, or FlashMLA's FP8 layout (:mod:`sparse_mla_attn.fp8_cache`), which the
Triton forward kernel dequantizes as it gathers (``fp8 * scale`` in float32, then bf16 for the two
products) and, on sm_90, the Gluon kernel of ``backends/gluon_sm90_fp8.py`` in its producer warps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from sparse_mla_attn._runtime import (
    LaunchContext,
    LaunchReplay,
    cached,
    call_signature,
    check_kernel_device,
    define_op,
    eager_stream,
    keep_replay,
    launch_context,
    no_launch_hooks,
    plan_replay,
    record_launches,
    scratch,
)
from sparse_mla_attn._validate import (
    DECODE_INDEX_KINDS,
    check_arg_types,
    check_decode_inputs,
    check_empty_lse,
    check_kernel_dims,
    check_sm_scale,
    need,
)
from sparse_mla_attn.config import DEFAULT, Config, config_of
from sparse_mla_attn.forward import (
    LOG2E,
    MERGE_H,
    FwdPlan,
    RowsPlan,
    fwd_scratch,
    launch_rows,
    plan_fwd,
    plan_rows,
    run_fwd,
)
from sparse_mla_attn.fp8_cache import is_fp8_cache


def _decode_fake(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None, indices: torch.Tensor, sm_scale: float, d_v: int, backend: str,
    num_splits: int, split_merge: str, split_fill: float, index_kind: str, empty_lse: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    check_decode_inputs(q, kv_cache, block_table, cache_seqlens, indices, d_v, index_kind)
    b, s_q, h_q, _ = q.shape
    return q.new_empty(b, s_q, h_q, d_v), q.new_empty(b, s_q, h_q, dtype=torch.float32)


@dataclass
class DecodePlan:
    """Validated sizes and the launches of one decode call signature (its calls reuse their scratch buffers:
    :func:`sparse_mla_attn._runtime.scratch`). ``q_view`` / ``idx_view``: whether ``q`` and ``indices`` are
    views of ``[b * s_q, ...]`` tensors as they are (else each call copies them, as ``reshape`` does)."""

    rows: RowsPlan | None  # None: the indices are cache rows already
    fwd: FwdPlan
    batch_shape: tuple[int, int]
    out_shape: tuple[int, int, int, int]  # [b, s_q, h_q, d_v], q's dtype
    lse_shape: tuple[int, int, int]  # [b, s_q, h_q], float32
    dtype: torch.dtype  # q's
    device: torch.device  # q's
    q_view: bool
    idx_view: bool
    n_counters: int
    #: Key of the split-K merge counters in the scratch cache (kept apart from the other buffers).
    counters_key: object = field(default_factory=object)
    #: CUDA devices on which the split kernel + merge kernel path has run (compiled before any capture).
    kernel_merge_compiled: set[int] = field(default_factory=set)
    #: Recorded launches per (device, stream, thread), replayed by eager calls (who merges the split-K
    #: partials is the same for every eager call of a plan once its first call has run: ``_merge_last``).
    replays: dict[Any, LaunchReplay] = field(default_factory=dict)


def _flat_view_ok(t: torch.Tensor) -> bool:
    """Whether ``t [b, s_q, ...]`` reshapes to ``[b * s_q, ...]`` without a copy."""
    return t.shape[0] <= 1 or t.shape[1] <= 1 or t.stride(0) == t.shape[1] * t.stride(1)


def _plan_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None, indices: torch.Tensor, d_v: int, config: Config, index_kind: str,
) -> DecodePlan:  # fmt: skip
    dims = check_decode_inputs(q, kv_cache, block_table, cache_seqlens, indices, d_v, index_kind)
    check_kernel_dims(dims, q.dtype, "sparse_mla_decode")
    fp8 = is_fp8_cache(kv_cache)
    if fp8:
        need(kv_cache.data_ptr() % 16 == 0, "kv_cache (FP8 layout) must start at a 16-byte aligned address")
    check_kernel_device(q, "sparse_mla_decode")
    if dims.s_kv >= 2**31:
        raise ValueError(
            f"sparse_mla_decode: the cache holds {dims.s_kv} rows; at most 2**31 - 1 are supported"
        )
    b, s_q, h_q, d_qk = q.shape
    idx = indices.reshape(b * s_q, dims.topk)
    rows_plan = None
    if index_kind == "positions":
        assert block_table is not None
        rows_plan = plan_rows(idx, block_table, s_q, kv_cache.shape[1], dims.s_kv)
    # The forward reads the rows just computed ([b * s_q, topk], contiguous: row stride topk), or the
    # cache rows it is given (their flattened view's row stride).
    idx_stride = dims.topk if rows_plan is not None else idx.stride(0)
    q_rows = q.reshape(b * s_q, h_q, d_qk)
    if fp8:
        # The token rows as bytes (row stride 656); the kernel adds the blocks' stride itself.
        fwd_plan = plan_fwd(
            q_rows, kv_cache.view(torch.uint8)[:1, :, 0].reshape(-1, kv_cache.shape[3]), idx_stride, dims,
            has_sink=False, has_topk_length=False,
            q_start_index=0, k_stride=1, causal=False, config=config,
            fp8_paging=(kv_cache.shape[1], kv_cache.stride(0)),
        )  # fmt: skip
    else:
        fwd_plan = plan_fwd(
            q_rows, kv_cache.view(-1, d_qk), idx_stride, dims, has_sink=False, has_topk_length=False,
            q_start_index=0, k_stride=1, causal=False, config=config,
        )  # fmt: skip
    n_counters = dims.s_q * fwd_plan.ints[8]  # one per (token, head tile)
    return DecodePlan(
        rows_plan,
        fwd_plan,
        (b, s_q),
        (b, s_q, h_q, d_v),
        (b, s_q, h_q),
        q.dtype,
        q.device,
        _flat_view_ok(q),
        _flat_view_ok(indices),
        n_counters,
    )


_PLANS: dict[Any, DecodePlan] = {}


def _merge_last(plan: DecodePlan, split_merge: str, ctx: LaunchContext | None) -> bool:
    """Whether the last split program merges the partials (``Config.split_merge``; see there)."""
    if plan.fwd.n_splits == 1 or split_merge == "kernel":
        return False
    if split_merge == "last_program":
        return True
    # "auto": only where the merging program reads no more than a merge-kernel program does (one merge
    # step of MERGE_H heads), since it merges its whole head tile alone, after the other splits.
    if plan.fwd.consts["BLOCK_H"] > MERGE_H.value:
        return False
    if ctx is None:  # the interpreter: nothing is compiled
        return True
    if ctx.capturing:
        return False
    if ctx.device in plan.kernel_merge_compiled:
        return True
    plan.kernel_merge_compiled.add(ctx.device)  # this call takes the two-launch path, compiling it
    return False


def _call_key(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None, indices: torch.Tensor, ptrs: tuple[int, ...], d_v: int, index_kind: str,
    options: tuple[Any, ...],
) -> tuple[Any, ...]:  # fmt: skip
    """What a call's validation and launch plan depend on (``_runtime.call_signature`` of the tensors it
    reads, with their data pointers ``ptrs``, and the other arguments but the scales): the key of
    ``_PLANS``. The tables count only with ``index_kind="positions"``; a missing one is left to the plan's
    validation (which raises)."""
    if index_kind == "positions" and block_table is not None and cache_seqlens is not None:
        return (
            q.shape, q.stride(), q.dtype, q.device, not ptrs[0] % 16,
            kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device, not ptrs[1] % 16,
            block_table.shape, block_table.stride(), block_table.dtype, block_table.device, not ptrs[2] % 16,
            cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device, not ptrs[3] % 16,
            indices.shape, indices.stride(), indices.dtype, indices.device, not ptrs[4] % 16,
            d_v, options,
        )  # fmt: skip
    return (*call_signature(q, kv_cache, indices), index_kind, d_v, options)


@define_op("sparse_mla_decode", _decode_fake)
def _decode_op(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None, indices: torch.Tensor, sm_scale: float, d_v: int, backend: str,
    num_splits: int, split_merge: str, split_fill: float, index_kind: str, empty_lse: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    # Validation and launch plan depend only on the call signature (shapes, strides, dtypes, devices and
    # 16-byte alignment of the tensors, as _runtime.call_signature): made once per signature. The data
    # pointers are read once, for the signature and for the launches.
    tables = index_kind == "positions" and block_table is not None and cache_seqlens is not None
    ptrs = (
        q.data_ptr(),
        kv_cache.data_ptr(),
        block_table.data_ptr() if tables else 0,  # type: ignore[union-attr]
        cache_seqlens.data_ptr() if tables else 0,  # type: ignore[union-attr]
        indices.data_ptr(),
    )
    options = (backend, num_splits, split_merge, split_fill)
    key = _call_key(q, kv_cache, block_table, cache_seqlens, indices, ptrs, d_v, index_kind, options)
    plan = _PLANS.get(key)
    if plan is None:
        config = config_of(backend, num_splits, split_merge, split_fill=split_fill)
        plan = cached(
            _PLANS,
            key,
            lambda: _plan_decode(q, kv_cache, block_table, cache_seqlens, indices, d_v, config, index_kind),
        )
    if type(sm_scale) is not float or not math.isfinite(sm_scale):
        sm_scale = check_sm_scale(sm_scale)
    if empty_lse != -math.inf:
        empty_lse = check_empty_lse(empty_lse)
    fwd = plan.fwd
    dims = fwd.dims
    dev = q.device
    b, s_q = plan.batch_shape
    out = torch.empty(b, s_q, dims.h_q, d_v, dtype=q.dtype, device=dev)
    lse = torch.empty(b, s_q, dims.h_q, dtype=torch.float32, device=dev)
    if dims.s_q == 0:
        return out, lse
    _decode_run(plan, q, kv_cache, block_table, cache_seqlens, indices, sm_scale, out, lse, split_merge)
    if empty_lse > 0:  # FlashMLA's convention: +inf for a token with no valid index (one more launch)
        lse.nan_to_num_(nan=math.nan, posinf=math.inf, neginf=math.inf)
    return out, lse


def _decode_eager(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None, indices: torch.Tensor, sm_scale: float, d_v: int, index_kind: str,
    empty_lse: float, options: tuple[Any, ...],
) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """A repeated eager call on a CUDA stream: the launches its plan recorded on this device, stream and
    thread (``DecodePlan.replays``), replayed with this call's tensors; ``None`` where the call takes the
    op (a new signature or stream, tracing, graph capture, launch hooks, inputs that require grad).
    ``q``, ``kv_cache`` and ``indices`` are plain tensors and ``sm_scale`` a float (the caller checked)."""
    where = eager_stream(q)
    if where is None or (torch.is_grad_enabled() and (q.requires_grad or kv_cache.requires_grad)):
        return None
    T = torch.Tensor
    if index_kind == "positions" and type(block_table) is T and type(cache_seqlens) is T:
        ptrs = (q.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(), cache_seqlens.data_ptr(),
                indices.data_ptr())  # fmt: skip
    elif (index_kind != "positions" and (block_table is None or type(block_table) is T)
          and (cache_seqlens is None or type(cache_seqlens) is T)):  # fmt: skip
        ptrs = (q.data_ptr(), kv_cache.data_ptr(), 0, 0, indices.data_ptr())
    else:  # left to the op's checks
        return None
    plan = _PLANS.get(
        _call_key(q, kv_cache, block_table, cache_seqlens, indices, ptrs, d_v, index_kind, options)
    )
    replay = plan_replay(plan, where, sm_scale)
    if replay is None or plan is None:
        return None
    # (The sizes as separate ints: a shape tuple takes torch's argument parser a few microseconds longer.)
    out = torch.empty(*plan.out_shape, dtype=plan.dtype, device=plan.device)
    lse = torch.empty(*plan.lse_shape, dtype=torch.float32, device=plan.device)
    replay.run(*ptrs, out.data_ptr(), lse.data_ptr(), sm_scale * LOG2E)
    if empty_lse > 0:
        lse.nan_to_num_(nan=math.nan, posinf=math.inf, neginf=math.inf)
    return out, lse


def _decode_run(
    plan: DecodePlan, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None, indices: torch.Tensor, sm_scale: float, out: torch.Tensor,
    lse: torch.Tensor, split_merge: str,
) -> None:  # fmt: skip
    """The call's launches; an eager call on a GPU records them for later calls (:func:`_decode_eager`)."""
    dev = q.device
    ctx = launch_context(dev)
    merge_last = _merge_last(plan, split_merge, ctx)
    if ctx is None or ctx.capturing or not (plan.q_view and plan.idx_view and no_launch_hooks()):
        _decode_launches(
            plan, q, kv_cache, block_table, cache_seqlens, indices, sm_scale, out, lse, merge_last, ctx
        )
        return
    # Eager on a GPU: once this plan's launches all go through cached kernels on this stream, they are
    # recorded, and later calls replay them with their own tensors (as data pointers).
    _, records = record_launches(
        lambda: _decode_launches(
            plan, q, kv_cache, block_table, cache_seqlens, indices, sm_scale, out, lse, merge_last, ctx
        )
    )
    keep_replay(
        plan.replays,
        records,
        (q, kv_cache, block_table, cache_seqlens, indices, out, lse),
        sm_scale * LOG2E,
        ctx,
    )


def _decode_launches(
    plan: DecodePlan, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None, indices: torch.Tensor, sm_scale: float, out: torch.Tensor, lse: torch.Tensor,
    merge_last: bool, ctx: LaunchContext | None,
) -> None:  # fmt: skip
    """The decode's launches (rows, split kernel, merge kernel) through :func:`_runtime.launch`."""
    fwd = plan.fwd
    dims = fwd.dims
    dev = q.device
    idx = indices if plan.idx_view else indices.reshape(dims.s_q, dims.topk)
    if plan.rows is None:  # cache rows already
        rows, fwd_buffers = idx, list(scratch(plan, ctx, lambda: fwd_scratch(fwd, dev)))
    else:
        rows, *fwd_buffers = scratch(
            plan,
            ctx,
            lambda: (torch.empty(dims.s_q, dims.topk, dtype=torch.int32, device=dev), *fwd_scratch(fwd, dev)),
        )
    counters = None
    if merge_last:
        # Zeros, left zero by every launch (the merging program resets its counter).
        (counters,) = scratch(
            plan.counters_key, ctx, lambda: (torch.zeros(plan.n_counters, dtype=torch.int32, device=dev),)
        )
    # The kernels take the plan's strides: q, the cache and the indices are passed as they are.
    if plan.rows is not None:
        assert block_table is not None
        assert cache_seqlens is not None
        launch_rows(plan.rows, idx, block_table, cache_seqlens, rows, ctx=ctx)
    # dims.s_kv = the cache's rows: a row is valid when it lies in the cache.
    run_fwd(
        fwd, q if plan.q_view else q.reshape(dims.s_q, dims.h_q, dims.d_qk), kv_cache, rows, sm_scale, None,
        None, scratch=fwd_buffers, counters=counters, outputs=(out, lse), ctx=ctx,
    )  # fmt: skip


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    *,
    index_kind: str = "positions",
    empty_lse: float = -math.inf,
    config: Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode: each new token attends to its top-k positions of a paged latent cache.

    The cache is bf16 (q's dtype) or FlashMLA's FP8 sparse layout (:mod:`sparse_mla_attn.fp8_cache`:
    656 bytes per token, 512 float8_e4m3fn latent values, 4 float32 scales, 64 bf16 rope values; build
    one with :func:`~sparse_mla_attn.quantize_fp8_kv_cache`), chosen by ``kv_cache``'s dtype. An FP8
    cache is dequantized as it is read to bf16 for the products: ``fp8 * scale``, exact for power-of-two
    scales (as :func:`~sparse_mla_attn.quantize_fp8_kv_cache` and FlashMLA write them; the Triton kernel
    rounds the float32 product, the sm_90 Gluon kernel rounds other scales to bf16 first).

    Args:
        q: ``[b, s_q, h_q, d_qk]`` bf16 (or fp16 with a bf16/fp16 cache), ``d_qk`` 576 or 512
            (576 with an FP8 cache), ``1 <= h_q <= 128``.
        kv_cache: ``[num_blocks, block_size, 1, d_qk]`` q's dtype, contiguous; or an FP8 cache
            ``[num_blocks, block_size, 1, 656]`` float8_e4m3fn or uint8, tokens 656 bytes apart, blocks a
            multiple of 16 bytes apart (e.g. padded), 16-byte aligned.
        block_table: ``[b, max_blocks]`` int32; logical block ``j`` of sequence ``b`` is physical
            block ``block_table[b, j]``. Not read (may be ``None``) with ``index_kind="cache_rows"``.
        cache_seqlens: ``[b]`` int32 tokens in each sequence's cache, contiguous. Not read (may be
            ``None``) with ``index_kind="cache_rows"``.
        indices: ``[b, s_q, topk]`` int32, last dim contiguous, read as ``index_kind`` says.
        sm_scale: softmax scale applied to ``q · k``.
        d_v: value dim; must be 512.
        index_kind: ``"positions"`` (default): positions in the sequence (not cache rows); a position
            ``< 0``, ``>= cache_seqlens[b]`` or past the block table is invalid and never read, as is a
            block-table entry outside the cache. ``"cache_rows"``: FlashMLA's ``indices_in_kvcache``,
            rows ``block * block_size + offset`` of the cache; a row ``< 0`` (FlashMLA's ``-1``) or
            ``>= num_blocks * block_size`` is invalid and never read.
        empty_lse: the ``lse`` reported for a token with no valid index: ``-inf`` (default) or ``+inf``
            (FlashMLA's convention; costs one more elementwise launch). ``out`` is 0 either way.
        config: tuning options (:class:`~sparse_mla_attn.Config`: backend, split-K factor and its
            automatic rule ``split_fill``, who merges the split-K partials). An FP8 cache follows the
            same kernel rule (on sm_90 its Gluon kernel dequantizes in producer warps).

    Returns:
        ``out [b, s_q, h_q, d_v]`` q's dtype and ``lse [b, s_q, h_q]`` float32, natural log
        (``out = 0``, ``lse = empty_lse`` for a token with no valid index). FlashMLA returns its decode
        ``lse`` as ``[b, h_q, s_q]``: transpose if you need that layout.

    Raises:
        ValueError, TypeError: on a wrong shape, dtype, device or layout, an unknown ``index_kind`` or an
            ``empty_lse`` other than ``±inf`` (the message names the argument).
    """
    T = torch.Tensor
    options = (
        _DEFAULT_OPTIONS
        if config is None
        else (config.backend, config.num_splits, config.split_merge, float(config.split_fill))
    )
    # A repeated eager call replays its plan's launches (the checks below are those of its first call).
    if (type(q) is T and type(kv_cache) is T and type(indices) is T and type(sm_scale) is float
            and type(d_v) is int and (empty_lse == -math.inf or empty_lse == math.inf)):  # fmt: skip
        done = _decode_eager(
            q, kv_cache, block_table, cache_seqlens, indices, sm_scale, d_v, index_kind, empty_lse, options
        )
        if done is not None:
            return done
    if not (isinstance(q, T) and isinstance(kv_cache, T) and isinstance(block_table, T)
            and isinstance(cache_seqlens, T) and isinstance(indices, T) and type(d_v) is int):  # fmt: skip
        check_arg_types({"q": q, "kv_cache": kv_cache, "indices": indices}, {"d_v": d_v},
                        optional={"block_table": block_table, "cache_seqlens": cache_seqlens})  # fmt: skip
    if type(sm_scale) is not float or not math.isfinite(sm_scale):
        check_sm_scale(sm_scale)
    if index_kind not in DECODE_INDEX_KINDS:
        raise ValueError(f"index_kind must be one of {DECODE_INDEX_KINDS}, got {index_kind!r}")
    if empty_lse != -math.inf:
        empty_lse = check_empty_lse(empty_lse)
    return _decode_op(
        q, kv_cache, block_table, cache_seqlens, indices, sm_scale, d_v, *options, index_kind, empty_lse
    )


_DEFAULT_OPTIONS = (DEFAULT.backend, DEFAULT.num_splits, DEFAULT.split_merge, float(DEFAULT.split_fill))
