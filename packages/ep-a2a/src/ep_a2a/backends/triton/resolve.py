"""From a :class:`ep_a2a.TritonTuning` and the layer's shape to the engine's launch options.

The defaults documented on :class:`~ep_a2a.TritonTuning` are applied here, in one place: the Triton
backend builds its engine from :func:`engine_options`, and the sm_90 compile test compiles the kernel
variants of the same options.
"""

from __future__ import annotations

from typing import Any

from ep_a2a.config import EPConfig
from ep_a2a.tuning import HEAP_KINDS, TritonTuning

#: token rows at least this wide get work stealing with the dispatch split by default (``steal``)
STEAL_MIN_ROW_BYTES = 8192
#: from this many SMs the dispatch of large layers of rows at least ``WIDE_ROW`` wide keeps 8-token
#: chunks (with 16 warps); narrower rows keep 16
MANY_SM = 96
WIDE_ROW = 4096
#: below this many CTAs, or at decode-sized layers, the CTA split is off by default
SPLIT_MIN_SM = 64
SPLIT_MIN_TOKENS = 1024


def remote_plan(config: EPConfig, force_remote: int | None = None) -> tuple[int, list[int]]:
    """``(node size, ranks this rank reaches by host puts)``.

    Nodes are blocks of ``local_world_size`` consecutive ranks (torchrun's node-major order), or of
    ``force_remote`` ranks when given: ``force_remote=1`` makes every peer remote, ``2`` on 4 ranks gives
    each rank one peer by stores and two by puts.

    Raises:
        ValueError: ``force_remote`` does not divide ``world_size`` or exceeds ``local_world_size``
            (forcing can only split real nodes).
    """
    node = config.local_world_size
    if force_remote is not None:
        if not 1 <= force_remote <= node or config.world_size % force_remote:
            raise ValueError(
                f"force_remote must divide world_size={config.world_size} and be in [1, local_world_size="
                f"{node}], got {force_remote}"
            )
        node = force_remote
    return node, [r for r in range(config.world_size) if r // node != config.rank // node]


def resolve_heap(heap: str | None, config: EPConfig, node: int) -> str:
    """The heap to use: ``heap``, else ``"nvshmem"`` when some ranks are remote (``node < world_size``)
    and ``"torch"`` otherwise.

    Raises:
        ValueError: an unknown heap, or remote ranks with a heap other than ``"nvshmem"``.
    """
    heap = heap or ("nvshmem" if node < config.world_size else "torch")
    if heap not in HEAP_KINDS:
        raise ValueError(f"heap must be one of {HEAP_KINDS}, got {heap!r}")
    if node < config.world_size and heap != "nvshmem":
        why = "forced remote by force_remote" if node < config.local_world_size else "on other nodes"
        raise ValueError(
            f"heap={heap!r}: ranks {why} are reached by NVSHMEM put-with-signal, which needs "
            "TritonTuning(heap='nvshmem')"
        )
    return heap


def _default_chunk(hidden: int, max_tokens: int) -> int:
    # tokens per work item: enough bytes per flag to amortise the signal, enough items to keep every CTA
    # busy at small batches
    if hidden >= 1024:
        return 8 if max_tokens > 1024 else (1 if max_tokens <= 256 else 2)
    return 16 if max_tokens > 1024 else 4


def _default_tiles(hidden: int, max_tokens: int, num_sm: int) -> tuple[dict, dict]:
    """Default ``(chunk, num_warps, block_h)`` of the dispatch and combine kernels (``None``: the
    engine's own default). For large layers (``hidden >= 1024``, ``max_tokens > 1024``) the fewer the
    SMs, the more bytes each CTA must keep in flight: larger chunks and 16 warps."""
    dispatch: dict = {"chunk": _default_chunk(hidden, max_tokens), "num_warps": None, "block_h": None}
    combine: dict = {"chunk": None, "num_warps": None, "block_h": None}
    if hidden >= 1024 and max_tokens > SPLIT_MIN_TOKENS:
        if num_sm < SPLIT_MIN_SM:
            dispatch = {"chunk": 32, "num_warps": 16, "block_h": 512}
        else:
            chunk = 16 if num_sm < MANY_SM or hidden < WIDE_ROW else 8
            dispatch = {"chunk": chunk, "num_warps": 16, "block_h": 1024}
        combine = {"chunk": 8, "num_warps": 16, "block_h": None}
    return dispatch, combine


def _default_split(num_sm: int, max_tokens: int, fraction: int) -> int:
    """Default sending CTAs: ``num_sm // fraction`` for large layers on many SMs, else 0 (no split)."""
    if num_sm < SPLIT_MIN_SM or max_tokens <= SPLIT_MIN_TOKENS:
        return 0
    return num_sm // fraction


def _split(requested: int | None, num_sm: int, default: int = 0) -> int:
    """Sending CTAs of a split kernel: the request, or ``default`` when none (0: every CTA both)."""
    if requested is None:
        return default
    if requested and not 0 < requested < num_sm:
        raise ValueError(
            f"send_ctas / combine_send_ctas must be 0 or in [1, num_sm={num_sm}), got {requested}"
        )
    return requested


def engine_options(tuning: TritonTuning, config: EPConfig, num_sm: int, *, remote: bool) -> dict[str, Any]:
    """Keyword arguments of :class:`~ep_a2a.backends.triton.engine.TritonEPEngine` for ``tuning`` on a
    layer of ``config`` running ``num_sm`` CTAs (``tuning.num_sm`` capped at the device's SMs).

    The tuned tile defaults apply to the kernels whose three tile fields are all left unset.

    Raises:
        ValueError: ``copy_engine`` with remote peers, or a CTA split outside ``[0, num_sm)``.
    """
    t = tuning
    tiles, ctiles = _default_tiles(config.hidden, config.max_tokens, num_sm)
    chunk, num_warps, block_h = t.chunk, t.num_warps, t.block_h
    if chunk is None and num_warps is None and block_h is None:
        chunk, num_warps, block_h = tiles["chunk"], tiles["num_warps"], tiles["block_h"]
    chunk = chunk or _default_chunk(config.hidden, config.max_tokens)
    cchunk, cwarps, cblock = t.combine_chunk, t.combine_warps, t.combine_block_h
    if cchunk is None and cwarps is None and cblock is None:
        cchunk, cwarps, cblock = ctiles["chunk"], ctiles["num_warps"], ctiles["block_h"]
    if t.copy_engine and remote:
        raise ValueError(
            "TritonTuning.copy_engine=True is for groups without remote peers (other nodes or force_remote)"
        )
    split = 0 if t.copy_engine else _split(t.send_ctas, num_sm, _default_split(num_sm, config.max_tokens, 3))
    steal = (
        t.steal if t.steal is not None else config.hidden * config.token_dtype.itemsize >= STEAL_MIN_ROW_BYTES
    )
    return dict(
        chunk=chunk,
        block_h=block_h,
        num_warps=num_warps,
        combine_chunk=cchunk,
        combine_warps=cwarps,
        combine_block_h=cblock,
        combine_maxnreg=t.combine_maxnreg,
        send_ctas=split,
        combine_send_ctas=_split(t.combine_send_ctas, num_sm, _default_split(num_sm, config.max_tokens, 2)),
        steal=steal,
        ce_pieces=t.ce_pieces if t.copy_engine else 0,
        pdl=t.pdl,
        early_send=t.early_send,
    )
