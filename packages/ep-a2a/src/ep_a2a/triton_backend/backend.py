"""``backend="triton"``: the fast intra-node path behind :class:`ep_a2a.EPAll2AllLayer`, and its remote
path for ranks on other nodes (NVSHMEM host-side put-with-signal, nvshmem heap only)."""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ep_a2a._dist import EPTimeoutError
from ep_a2a.backend import A2ABackend, DispatchResult, register_backend
from ep_a2a.config import EPConfig
from ep_a2a.layout import EPAllToAllLayoutDesc
from ep_a2a.triton_backend.engine import EPTimeoutFromDevice, HeapLayout, TritonEPEngine, _raw_stream
from ep_a2a.triton_backend.heaps import HEAP_KINDS, NvshmemHeap, NvshmemTransport, make_heap

#: exact-shape dispatches whose worst case (``world_size x max_tokens x topk`` rows) fits in this many
#: bytes run without a host wait before the row kernel (see ``TritonBackend``'s ``overlap_bytes``)
DEFAULT_OVERLAP_BYTES = 256 << 20
#: token rows at least this wide get work stealing with the dispatch split by default (``steal``)
STEAL_MIN_ROW_BYTES = 8192
#: exact-shape calls whose received rows size the speculative flow's outputs (``speculative_rows``)
SPECULATIVE_WINDOW = 8

#: environment variable choosing the heap when the layer constructs the backend (``torch`` or ``nvshmem``)
HEAP_ENV = "EP_A2A_TRITON_HEAP"

#: environment variable choosing copy-engine dispatch when the layer constructs the backend (``1`` / ``0``:
#: the ``copy_engine`` argument)
COPY_ENGINE_ENV = "EP_A2A_TRITON_COPY_ENGINE"

#: pieces of a copy-engine dispatch (each a copy of its token rows and an 8-byte flag copy per peer)
DEFAULT_CE_PIECES = 4

#: environment variable forcing the remote path (the ``force_remote`` argument when the layer constructs the
#: backend): an integer node size
FORCE_REMOTE_ENV = "EP_A2A_TRITON_FORCE_REMOTE"


def remote_plan(config: EPConfig, force_remote: int | None = None) -> tuple[int, list[int]]:
    """``(node size, ranks this rank reaches by host puts)``.

    Nodes are blocks of ``local_world_size`` consecutive ranks (torchrun's node-major order), or of
    ``force_remote`` ranks when given: ``force_remote=1`` makes every peer remote, ``2`` on 4 ranks gives
    each rank one peer by stores and two by puts. It must divide ``world_size`` and be at most
    ``local_world_size`` (forcing can only split real nodes).
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
    """The heap to use: ``heap``, else ``$EP_A2A_TRITON_HEAP``, else ``"nvshmem"`` when some ranks are
    remote (``node < world_size``) and ``"torch"`` otherwise. Remote ranks need ``"nvshmem"``."""
    heap = heap or os.environ.get(HEAP_ENV) or ("nvshmem" if node < config.world_size else "torch")
    if heap not in HEAP_KINDS:
        raise ValueError(f"heap must be one of {HEAP_KINDS}, got {heap!r}")
    if node < config.world_size and heap != "nvshmem":
        why = "forced remote by force_remote" if node < config.local_world_size else "on other nodes"
        raise ValueError(
            f"heap={heap!r}: ranks {why} are reached by NVSHMEM put-with-signal, which needs "
            f"heap='nvshmem' (argument heap, or ${HEAP_ENV})"
        )
    return heap


@dataclass
class _TritonState:
    owner: int  # id() of the backend that produced the descriptor
    tab: torch.Tensor  # [W, T, K] int32 output row of every received slot (-1: not here)
    n_src: torch.Tensor  # [W] int64 on the device: tokens of every source in this dispatch
    remote: dict[str, torch.Tensor] | None = None  # remote path: the dispatch's pk / rtok / pinfo
    npk_recv: list[int] | None = None  # remote path: records received from each rank (sizes the puts back)


@dataclass
class StaticDispatch:
    """Result of :meth:`TritonBackend.dispatch_static` (CUDA-graph mode: fixed shapes, counts on device).

    Attributes:
        output: ``[W * max_tokens * topk, hidden]`` rows; the first ``num_recv_rows`` are valid.
        weights: ``[same rows]`` or ``None``.
        recv_expert_indices: ``[same rows]`` int32 local expert of each valid row.
        num_recv_tokens_per_expert: ``[E_local]`` int64 on the device.
        num_recv_rows: ``[]`` int64 on the device.
        token_dst_scatter_idx: ``[n, topk]`` int32.
        num_invalid_ids: ``[]`` int64 on the device: slots whose expert id was outside
            ``[-1, num_tot_experts)`` (dropped).
    """

    output: torch.Tensor
    weights: torch.Tensor | None
    recv_expert_indices: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    num_recv_rows: torch.Tensor
    token_dst_scatter_idx: torch.Tensor
    exp_indices: torch.Tensor
    state: _TritonState
    num_invalid_ids: torch.Tensor


def _default_chunk(hidden: int, max_tokens: int) -> int:
    # tokens per work item: enough bytes per flag to amortise the signal, enough items to keep every CTA
    # busy at small batches (measured on 2x H200: 8 best at 4096 tokens, 1-2 at 128; on 2x H100 with
    # whole-row tiles: 1 at 128 tokens, 31 us against 35 with 2)
    if hidden >= 1024:
        return 8 if max_tokens > 1024 else (1 if max_tokens <= 256 else 2)
    return 16 if max_tokens > 1024 else 4


#: from this many SMs the dispatch of large layers of rows at least ``WIDE_ROW`` wide keeps 8-token
#: chunks (with 16 warps); narrower rows keep 16
MANY_SM = 96
WIDE_ROW = 4096


def _default_tiles(hidden: int, max_tokens: int, num_sm: int) -> tuple[dict, dict]:
    """Default ``(chunk, num_warps, block_h)`` of the dispatch and combine kernels (``None``: the
    engine's own default).

    For large layers (``hidden >= 1024``, ``max_tokens > 1024``) the fewer the SMs, the more bytes each
    CTA must keep in flight: larger chunks and 16 warps. Measured on 2x H100 (4096 tokens, graph mode,
    ``docs/benchmarks/ep-a2a-h100x2/tiles``): at ``num_sm=32`` dispatch 377-379 against 550-557 us at the
    DeepSeek-V3 shape and 161 against 260 us at the Qwen3 shape with chunks of 32 tokens, 16 warps and
    512-wide tiles; at 64 SMs dispatch 318 against 394 us and 133 against 168 us with chunks of 16 and 16
    warps; at 96 and 132 SMs dispatch 290 against 322 us and 289-301 against 304-308 us with 16 warps
    (DeepSeek-V3). On 2x H200 with 132 SMs (``docs/benchmarks/ep-a2a-h200x2/tiles``) 8-token chunks
    stayed best at DeepSeek-V3 (240 us, against 245-266 us for chunks of 4 and 16, 8 and 32 warps,
    2048-wide tiles), while rows of 2048 (Qwen3) took 97-102 us with 16-token chunks against 111-112 us
    with 8. Combine (which gathers a tile's slots at once, ``docs/benchmarks/ep-a2a-h100x2/
    combine-gather``): 8 tokens with 16 warps and the engine's 512-wide tiles took 541 us at 32 SMs and
    269 us at 132 at the DeepSeek-V3 shape, against 546 / 287 us with 16 tokens and 256-wide tiles, 587 /
    267 with 4 tokens and 1024-wide tiles and 780 / 313 with 8 warps.
    """
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


#: below this many CTAs, or at decode-sized layers, the split is off by default (measured slower at 32
#: SMs; unmeasured at small batches)
SPLIT_MIN_SM = 64
SPLIT_MIN_TOKENS = 1024


def _default_split(num_sm: int, max_tokens: int, fraction: int) -> int:
    """Default sending CTAs: ``num_sm // fraction`` for large layers on many SMs, else 0 (no split).

    Measured on 2x H200 at 4096 tokens with 132 SMs (graph mode): a third of the dispatch CTAs sending
    and half of the combine CTAs sending were the fastest of the splits tried; at 32 SMs every split
    was slower than none.
    """
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


def _rows_to_allocate_ahead(rows: int, worst_case: int) -> int:
    """Rows of the outputs an exact-shape dispatch of a large layer allocates before its counts arrive,
    guessed from a call of ``rows``: an eighth of headroom, at most the worst case."""
    return min(rows + rows // 8, worst_case)


def _speculative_rows_guess(recent_rows: collections.deque[int], worst_case: int) -> int:
    """Rows of the outputs a speculative exact-shape dispatch writes into: the most rows of the last
    ``SPECULATIVE_WINDOW`` calls plus an eighth, at most the worst case. The maximum, not the last call,
    so batch sizes that vary from call to call (a serving engine's) rarely outgrow them."""
    return _rows_to_allocate_ahead(max(recent_rows), worst_case)


def _rows_fit_ahead(rows: int, ahead: int) -> bool:
    """Whether outputs allocated ahead for ``ahead`` rows serve a call of ``rows``: they hold them, and
    at most a quarter of them (a third of ``rows``) goes unused while the views live."""
    return ahead - ahead // 4 <= rows <= ahead


@register_backend
class TritonBackend(A2ABackend):
    """Triton kernels over a symmetric heap (intra-node, NVLink / PCIe peer access).

    Dispatch sends each token once per destination rank (with its top-k ids, positions and weights)
    into the peer's heap; the receiver expands it into the rows of its local experts in the reference
    order. Combine sums, in float32 on the expert side, the rows of each (token, source rank) and sends
    one row back per pair; the source adds the rows of the ranks its token went to.

    Keyword Args:
        heap: ``"torch"`` (``torch.distributed._symmetric_memory``, default) or ``"nvshmem"``
            (nvshmem4py); default taken from ``$EP_A2A_TRITON_HEAP`` when set.
        chunk: tokens per work item and ready flag of the dispatch row kernel (default: 8 for
            hidden >= 1024 and max_tokens > 1024, 1 for hidden >= 1024 and at most 256 tokens, 2 up to
            1024 tokens, 16 / 4 for narrower rows; for large layers see below).
        block_h: tile width along hidden of the row kernel (default 1024, or the whole row for chunks of
            at most 2 tokens).
        num_warps: warps per CTA of the row kernel (default 8; 4 for one-token chunks).
        combine_chunk, combine_warps, combine_block_h: the same for the combine kernel (default: the
            dispatch kernel's). When all three dispatch (or combine) arguments are left unset, large
            layers (``hidden >= 1024``, ``max_tokens > 1024``) take tiles tuned on 2x H100 and 2x H200:
            dispatch chunks of 32 tokens, 16 warps and 512-wide tiles below 64 SMs, 16 tokens and 16 warps
            below 96, from 96 8 tokens and 16 warps (16 tokens for rows narrower than 4096); combine chunks
            of 8 tokens with 16 warps (and the engine's default tile width for them: 512).
        combine_maxnreg: register limit per thread of the combine kernel (tuning; default: ptxas's
            choice, already 128 registers for the default 16-warp combine tile); on 2x H200 128 measured
            the same as the default.
        overlap_bytes: exact-shape dispatch of a layer whose worst-case output
            (``world_size * max_tokens * topk`` rows) is at most this many bytes (default 256 MiB:
            decode-sized layers) launches the row kernel before waiting for the counts, into freshly
            allocated worst-case buffers, and returns views of their first ``R`` rows (so the output's
            storage is larger than the output while it lives). Larger layers do the same from their
            second call on (``speculative_rows``); their first call, and every call with
            ``speculative_rows=False``, waits for the counts before the row kernel, into outputs of ``R``
            rows: views of outputs allocated before the wait, sized from the last calls' counts plus an
            eighth, when ``R`` fills at least three quarters of them; else allocated after the wait. All
            give the same results.
        speculative_rows: the large layers' exact-shape dispatch runs as the small layers' does after
            the first call: the receive layout inside the row kernel, launched before the host has the
            counts, into outputs of the most rows of the last 8 calls plus an eighth (not the worst
            case), so the GPU no longer idles while the host waits, allocates and launches. A call whose
            ``R`` rows fit gets views of the first ``R`` (the output's storage is larger than the output
            while it lives); one that receives more gets exact outputs and a second writing pass (the
            same results, later; counted in :attr:`speculative_overflows` out of
            :attr:`speculative_calls`). Default on; not with remote peers or ``copy_engine`` (their
            counts size the host's puts and copies).
        send_ctas: CTAs of the dispatch row kernel that only send to the peers while the others only
            write this rank's output; 0: every CTA does both, in turn. Default (``None``): ``num_sm // 3``
            when ``num_sm >= 64`` and ``max_tokens > 1024``, else 0 (measured on 2x H200 at 4096 tokens
            with 132 SMs, graph mode: 11 % faster than no split at the DeepSeek-V3 shape; at 32 SMs
            splitting was slower, at 128 tokens it was not measured).
        steal: with the dispatch split, the CTAs claim chunks from a shared counter per role and take
            the other role's chunks once their own queue is empty (work stealing), instead of a fixed
            share each (no effect without the split). Default: on for token rows of at least
            ``STEAL_MIN_ROW_BYTES`` (8 KB). Measured on 2x H200 in graph mode at 4096 tokens
            (interleaved): DeepSeek-V3 shape (14 KB rows) 8 % faster dispatch under skewed routing,
            the same under uniform routing (on 2x H100 5 % faster under both); Qwen3-30B-A3B shape
            (4 KB rows) 7 % slower under uniform routing, the same under skew.
        combine_send_ctas: the same for the combine kernel; default ``num_sm // 2`` under the same
            conditions (measured 7-18 % faster than no split at 132 SMs).
        copy_engine: dispatch moves this rank's token rows (and their ids, positions and weights) to
            the peers with copy-engine copies (``cudaMemcpyAsync`` into the peer's heap) on a side
            stream, in ``ce_pieces`` pieces each followed by a flag copy, instead of SM stores: the row
            kernel's CTAs only write rows (their own first, then each piece as its flag arrives), so
            the NVLink transfer takes no SM time. Every token row goes to every peer, needed or not:
            on 2 ranks with top-8 routing nearly every token has an expert on the other rank, on more
            ranks NVLink bytes are wasted. Default (``None``):
            ``$EP_A2A_TRITON_COPY_ENGINE`` when set (``1`` / ``0``), else off: on 2x H100 at the
            DeepSeek-V3 shape (4096 tokens, CUDA graph, commit 197cb5d) it took 537 against 559 us at
            ``num_sm=32`` and 310 against 319 us (302 without the CTA split) at 132 SMs, where HBM
            traffic, not NVLink, bounds dispatch; its eager calls pay about 15 us of host time per
            copy (see the package docs). Not with remote peers, not with ``send_ctas`` > 0 (nothing
            left to send). Combine is unchanged.
        ce_pieces: pieces of a copy-engine dispatch (default 4).
        force_remote: treat ranks outside this rank's block of ``force_remote`` consecutive ranks as on
            another node (the remote path on one node, for testing); default from
            ``$EP_A2A_TRITON_FORCE_REMOTE``, else the real nodes (blocks of ``local_world_size``).

    The exact-shape flows that launch the row kernel before the counts are known read them from a
    pinned host copy of the call's ``info`` that the row kernel's program 0 writes once the receive
    layout is built (the host polls it, bounded by ``2 * timeout_s + 10`` s), not by synchronizing the
    stream: the call returns while the rows still move, and a device-side timeout inside that row
    kernel is raised by the next call (or :meth:`check_errors`), as the other flows' are.

    Ranks on other nodes (``world_size > local_world_size``, or forced): every transfer to them is staged
    in this rank's heap, one record per (token, destination rank), and moved by an NVSHMEM host-side
    put-with-signal on the current stream; the receiver waits for the signal (the same epochs and bounded
    waits) and expands the records as the intra-node receiver does. Needs ``heap="nvshmem"`` (the default
    then); ``heap="torch"`` raises ``ValueError``. The exact-shape flow always waits for the counts
    before the row kernel (its sizes size the puts), and the CUDA-graph mode (``dispatch_static``) is not
    available. Run on GPUs forced on one host (2x H100), never across nodes: see the package docs.

    These come on top of :class:`~ep_a2a.backend.A2ABackend`'s arguments.

    ``enable_local_combine`` is always on here (the expert side always pre-reduces per (token, rank)).
    Each combine must follow a dispatch (dispatch, combine, dispatch, combine...; several dispatches in a
    row are fine): a second combine without a dispatch in between raises, since the peers' receive
    buffers are only known to be free after the next dispatch's count exchange.
    """

    name = "triton"
    checks_expert_ids = True  # counted in the layout kernel, raised at the call's one host sync
    expert_id_dtypes = (torch.int32, torch.int64)  # int64 read in place: no conversion kernel

    def __init__(
        self,
        config: EPConfig,
        ep_group: dist.ProcessGroup,
        *,
        num_sm: int,
        enable_local_combine: bool,
        use_aot: bool,
        timeout_s: float,
        heap: str | None = None,
        chunk: int | None = None,
        block_h: int | None = None,
        num_warps: int | None = None,
        combine_chunk: int | None = None,
        combine_warps: int | None = None,
        combine_block_h: int | None = None,
        combine_maxnreg: int | None = None,
        overlap_bytes: int = DEFAULT_OVERLAP_BYTES,
        speculative_rows: bool = True,
        send_ctas: int | None = None,
        combine_send_ctas: int | None = None,
        steal: bool | None = None,
        force_remote: int | None = None,
        copy_engine: bool | None = None,
        ce_pieces: int | None = None,
        **_: object,
    ) -> None:
        super().__init__(
            config,
            ep_group,
            num_sm=num_sm,
            enable_local_combine=enable_local_combine,
            use_aot=use_aot,
            timeout_s=timeout_s,
        )
        ok, why = self.is_available(config, ep_group)
        if not ok:
            raise RuntimeError(f"backend='triton' unavailable: {why}")
        if force_remote is None and os.environ.get(FORCE_REMOTE_ENV):
            force_remote = int(os.environ[FORCE_REMOTE_ENV])
        node, remote = remote_plan(config, force_remote)
        heap = resolve_heap(heap, config, node)
        if num_sm < 1:
            raise ValueError(f"num_sm must be >= 1, got {num_sm}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        # more CTAs than SMs would only queue behind each other
        num_sm = min(num_sm, torch.cuda.get_device_properties(self.device).multi_processor_count)
        self.num_sm = num_sm
        # the tuned defaults apply to the kernels whose three tile arguments are all left unset
        tiles, ctiles = _default_tiles(config.hidden, config.max_tokens, num_sm)
        if chunk is None and num_warps is None and block_h is None:
            chunk, num_warps, block_h = tiles["chunk"], tiles["num_warps"], tiles["block_h"]
        chunk = chunk or _default_chunk(config.hidden, config.max_tokens)
        if combine_chunk is None and combine_warps is None and combine_block_h is None:
            combine_chunk, combine_warps, combine_block_h = (
                ctiles["chunk"],
                ctiles["num_warps"],
                ctiles["block_h"],
            )
        self.layout = HeapLayout.build(
            world_size=config.world_size,
            max_tokens=config.max_tokens,
            hidden=config.hidden,
            topk=config.topk,
            experts_per_rank=config.num_experts_per_rank,
            token_bytes=config.token_dtype.itemsize,
            chunk=chunk,
            combine_chunk=combine_chunk,
            remote=node < config.world_size,
        )
        if copy_engine is None and os.environ.get(COPY_ENGINE_ENV):
            copy_engine = os.environ[COPY_ENGINE_ENV].strip().lower() not in ("0", "false", "off", "")
        copy_engine = bool(copy_engine)  # (off by default: see the argument's note)
        if copy_engine and remote:
            raise ValueError(
                "copy_engine=True is for groups without remote peers (other nodes or force_remote)"
            )
        if copy_engine and send_ctas:
            raise ValueError(
                f"copy_engine=True leaves nothing for sending CTAs: send_ctas must be 0, got {send_ctas}"
            )
        if ce_pieces is not None and ce_pieces < 1:
            raise ValueError(f"ce_pieces must be >= 1, got {ce_pieces}")
        #: whether dispatch moves the token rows by copy-engine copies (see ``copy_engine``)
        self.copy_engine = copy_engine
        local = [r for r in range(config.world_size) if r not in remote]
        self.heap = make_heap(
            heap,
            self.layout.nbytes,
            ep_group,
            self.device,
            peers=local if remote else None,
            single_node=config.is_intra_node,
        )
        transport = NvshmemTransport(self.heap) if isinstance(self.heap, NvshmemHeap) and remote else None
        self.engine = TritonEPEngine(
            rank=config.rank,
            world_size=config.world_size,
            max_tokens=config.max_tokens,
            hidden=config.hidden,
            topk=config.topk,
            num_tot_experts=config.num_tot_experts,
            token_dtype=config.token_dtype,
            weight_dtype=config.weight_dtype,
            heap_local=self.heap.local,
            ptr_table=self.heap.ptr_table,
            layout=self.layout,
            num_sm=num_sm,
            timeout_s=timeout_s,
            chunk=chunk,
            block_h=block_h,
            num_warps=num_warps,
            combine_chunk=combine_chunk,
            combine_warps=combine_warps,
            combine_block_h=combine_block_h,
            combine_maxnreg=combine_maxnreg,
            send_ctas=0
            if copy_engine
            else _split(send_ctas, num_sm, _default_split(num_sm, config.max_tokens, 3)),
            combine_send_ctas=_split(combine_send_ctas, num_sm, _default_split(num_sm, config.max_tokens, 2)),
            steal=(config.hidden * config.token_dtype.itemsize >= STEAL_MIN_ROW_BYTES)
            if steal is None
            else steal,
            remote_ranks=remote,
            transport=transport,
            ce_pieces=(ce_pieces or DEFAULT_CE_PIECES) if copy_engine else 0,
            peer_heaps=self.heap.peers,
        )
        self.heap_kind = heap
        #: ranks reached by NVSHMEM puts (other nodes, or forced) and the node size used
        self.remote_ranks, self.node_size = tuple(remote), node
        self._info_host = torch.empty_like(self.engine.info, device="cpu").pin_memory()
        #: stream objects by (id, device, type) of the current stream: the exact-shape call waits on it
        #: once per dispatch, and building a ``torch.cuda.Stream`` costs more host time than the lookup
        self._streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}
        worst_bytes = self.engine.worst_case_rows() * config.hidden * config.token_dtype.itemsize
        #: exact-shape dispatch into worst-case buffers, no host wait before the row kernel (small layers;
        #: never with remote peers: the counts size their puts)
        self.overlap_exact = worst_bytes <= overlap_bytes and not remote
        W = config.world_size
        self._pinfo_host = torch.zeros(2 * W, dtype=torch.int64).pin_memory() if remote else None
        self._combine_allowed = False
        #: rows of the exact-shape flow's row-sized outputs allocated before the host waits for the
        #: counts (0: none yet), from the last calls' counts with headroom (see :meth:`dispatch`)
        self._rows_ahead = 0
        #: whether the large layers' exact-shape dispatch launches its row kernel before the counts
        #: arrive (see ``speculative_rows``)
        self.speculative_rows = bool(speculative_rows) and not (self.overlap_exact or remote or copy_engine)
        #: speculative exact-shape dispatches, and those whose rows outgrew the outputs allocated ahead
        self.speculative_calls = self.speculative_overflows = 0
        #: rows received by the last exact-shape calls of a large layer (they size the speculative flow)
        self._recent_rows: collections.deque[int] = collections.deque(maxlen=SPECULATIVE_WINDOW)
        # the flows without a host wait before the row kernel read its counts from this pinned host
        # copy of info (program 0 writes it, then the epoch in the last element), not by a stream sync
        self._mirror = torch.zeros(self.engine.info_len + 1, dtype=torch.int64).pin_memory()
        self._mirror_np = self._mirror.numpy()
        self._mirror_wait_s = 2.0 * timeout_s + 10.0
        self._finalized = False
        #: set when the host gave up polling the mirror: a late write could then land in a later call's
        #: poll, so the backend refuses further calls
        self._mirror_lost: str | None = None
        #: the next exact-shape call's small outputs (all but the rows), allocated ahead by the call
        #: before it, keyed by (stream, rows, weights): see :meth:`_prepare_small_outputs`
        self._next_small: tuple[tuple, dict[str, torch.Tensor]] | None = None
        self._static: dict[str, torch.Tensor] | None = None
        #: diagnostics: when a list, the exact-shape dispatch appends ``(phase, time.perf_counter())``
        #: at each step of its host path (``bench_triton.py --host-profile``)
        self.trace: list[tuple[str, float]] | None = None
        self.aot_seconds = 0.0
        if use_aot:
            t0 = time.perf_counter()
            self.aot_variants = self.engine.precompile(
                dtypes=(torch.float32,),
                dispatch_counts=(True,) if self.overlap_exact else (True, False),
                rewrite=self.speculative_rows,
                mirror=self.overlap_exact or self.speculative_rows,
            )
            self.aot_seconds = time.perf_counter() - t0

    @classmethod
    def is_available(cls, config: EPConfig, ep_group: dist.ProcessGroup) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        if dist.get_backend(ep_group) != "nccl":
            return (
                False,
                f"ep_group backend is {dist.get_backend(ep_group)!r}, need 'nccl' (one GPU per rank)",
            )
        if not config.is_intra_node:
            try:
                import nvshmem.core  # noqa: F401
            except Exception:
                return False, 'inter-node groups need nvshmem4py (pip install "ep-a2a[nvshmem]")'
            if os.environ.get(HEAP_ENV, "nvshmem") != "nvshmem":
                return (
                    False,
                    f"inter-node groups need the nvshmem heap (${HEAP_ENV} is {os.environ[HEAP_ENV]!r})",
                )
        if config.weight_dtype.itemsize > 4:
            return False, f"weight_dtype {config.weight_dtype} wider than 4 bytes"
        dev = torch.cuda.current_device()
        if torch.cuda.get_device_capability(dev)[0] < 8:
            return False, "needs compute capability >= 8.0"
        where = (
            "intra-node"
            if config.is_intra_node
            else f"{config.nnodes} nodes (remote path over NVSHMEM puts, not run across nodes yet)"
        )
        return True, f"{where}, {config.world_size} ranks on {torch.cuda.get_device_name(dev)}"

    # ------------------------------------------------------------------ helpers
    def _raise_device_error(self, exc: EPTimeoutFromDevice) -> None:
        raise EPTimeoutError(str(exc), step=exc.step, missing_ranks=[exc.peer]) from None

    def _check_usable(self) -> None:
        if self._finalized:
            raise RuntimeError("TritonBackend used after finalize()")
        if self._mirror_lost is not None:
            raise RuntimeError(f"TritonBackend unusable after an earlier failure: {self._mirror_lost}")

    def check_errors(self) -> None:
        """Synchronise and raise :class:`ep_a2a.EPTimeoutError` if a device-side wait ran out."""
        try:
            self.engine.check_error()
        except EPTimeoutFromDevice as exc:
            self._raise_device_error(exc)

    # ------------------------------------------------------------------ exact-shape mode
    def dispatch(
        self,
        input: torch.Tensor,
        exp_indices: torch.Tensor,
        weight: torch.Tensor | None,
        full_scatter_indices: torch.Tensor | None,
    ) -> DispatchResult:
        self._check_usable()
        if torch.cuda.is_current_stream_capturing():
            # (its host reads the counts: under capture no kernel runs, so the poll could only time out)
            raise RuntimeError(
                "dispatch: the exact-shape call reads its counts on the host and cannot be captured in a "
                "CUDA graph; capture dispatch_static / combine_static instead"
            )
        if input.dtype.itemsize > self.config.token_dtype.itemsize:
            raise ValueError(
                f"input: the triton backend's receive buffers hold {self.config.token_dtype} rows; got "
                f"{input.dtype} (e.g. the backward of a combine over float32 expert outputs: cast them to "
                f"{self.config.token_dtype}, or use backend='torch')"
            )
        eng = self.engine
        caller = full_scatter_indices is not None
        n = input.shape[0]
        W = self.config.world_size
        has_w = weight is not None
        src = full_scatter_indices if full_scatter_indices is not None else eng.pos
        mark = self.trace.append if self.trace is not None else None
        if mark:
            mark(("start", time.perf_counter()))
        # (from the second call on, on every rank alike: a guess of 0 rows speculates too, so a rank
        # that receives nothing does not fall back to the flow with a host wait)
        speculate = self.speculative_rows and len(self._recent_rows) > 0
        if self.overlap_exact or speculate:
            # rows the outputs hold: worst-case for small layers; for large ones sized from the last
            # calls' counts. Everything but the rows comes from the last call when it matches.
            cap = eng.worst_case_rows() if self.overlap_exact else self._rows_guess()
            bufs = self._take_small_outputs(n, cap, has_w)
            info = bufs["info"]
        else:
            info = torch.empty(eng.info_len, dtype=torch.int64, device=self.device)
        # (info is per call: the combine of this dispatch reads its token counts after later dispatches)
        rb = eng.alloc_remote()
        eng.launch_layout(exp_indices, caller_scatter=caller, info=info, remote=rb)
        if mark:
            mark(("layout launched", time.perf_counter()))
        if self.overlap_exact or speculate:
            # the receive layout inside the row kernel and no host wait before it: the rows land in
            # buffers allocated before the counts are known, and the caller gets views of their first R
            self.speculative_calls += speculate
            bufs["out"] = eng.alloc_rows(cap, dtype=input.dtype)
            if mark:
                mark(("buffers allocated", time.perf_counter()))
            if eng.ce_pieces:  # (the copies start after the receive layout, in its own launch)
                eng.launch_counts(info)
            mirror = self._mirror if not eng.ce_pieces else None
            if mirror is not None:
                self._mirror_np[-1] = 0  # (program 0 writes the epoch there once info is copied)
            eng.launch_dispatch(
                input, exp_indices, weight, src, bufs["out"], bufs["out_w"], bufs["out_e"], bufs["tab"],
                bufs["skip"], bufs["scat"], caller_scatter=caller, info=info, counts=not eng.ce_pieces,
                mirror=mirror,
            )  # fmt: skip
            if mark:
                mark(("rows launched", time.perf_counter()))
            vals, npk = (self._read_mirror(), None) if mirror is not None else self._read_info(info)
            if mark:
                mark(("counts read", time.perf_counter()))
            rows = vals[0]
            if speculate:
                self._recent_rows.append(rows)
                self._fit_speculative_rows(rows, input, exp_indices, weight, src, info, bufs, caller=caller)
                if mark:
                    mark(("rows fitted", time.perf_counter()))
            self._prepare_small_outputs(n, has_w)
            out, out_w, out_e = bufs["out"][:rows], bufs["out_w"][:rows], bufs["out_e"][:rows]
        else:
            eng.launch_counts(info, remote=rb)
            if mark:
                mark(("counts launched", time.perf_counter()))
            # what does not depend on the counts is allocated while the GPU works them out, and the
            # row-sized outputs too when the last calls' counts predict them (views of their first
            # rows are returned, as the worst-case flow does): then nothing is allocated between the
            # host's wait and the row kernel's launch
            bufs = eng.alloc_dispatch_fixed(n)
            ahead = self._rows_ahead
            spec = eng.alloc_dispatch_rows(ahead, with_weights=has_w, dtype=input.dtype) if ahead else None
            # the one small device-to-host copy: receive counts (and the error word) size the output
            # (with remote peers also the records to send and receive, which size the puts)
            vals, npk = self._read_info(info, rb, bad_ids=False)  # (raised after the row kernel below)
            rows = vals[0]
            self._recent_rows.append(rows)
            if spec is not None and _rows_fit_ahead(rows, ahead):
                bufs.update(
                    out=spec["out"][:rows], out_w=spec["out_w"][:rows] if has_w else spec["out_w"],
                    out_e=spec["out_e"][:rows],
                )  # fmt: skip
            else:
                bufs.update(eng.alloc_dispatch_rows(rows, with_weights=has_w, dtype=input.dtype))
                self._rows_ahead = _rows_to_allocate_ahead(rows, eng.worst_case_rows())
            if mark:
                mark(("buffers allocated", time.perf_counter()))
            out, out_w, out_e = bufs["out"], bufs["out_w"], bufs["out_e"]
            eng.launch_dispatch(
                input, exp_indices, weight, src, out, out_w, out_e, bufs["tab"], bufs["skip"], bufs["scat"],
                caller_scatter=caller, info=info, remote=rb, npk_send=npk[:W] if npk is not None else None,
            )  # fmt: skip
            if mark:
                mark(("rows launched", time.perf_counter()))
            if self.speculative_rows:  # (the next call speculates)
                self._prepare_small_outputs(n, has_w)
            # (the peers' row kernels need this rank's, so invalid ids raise only once it is launched)
            self._raise_bad_ids(vals)
        self._combine_allowed = True
        scat = (
            bufs["scat"]
            if self.config.offset_dtype == torch.int32
            else bufs["scat"].to(self.config.offset_dtype)
        )
        desc = EPAllToAllLayoutDesc(
            num_dispatch_token_cur_rank=n,
            num_input_tokens_per_rank=torch.tensor(vals[2 : 2 + W], dtype=torch.int64),
            send_reqs_recv_tensor=None,
            topk_indices_tensor=exp_indices,
            token_dst_scatter_idx=scat,
            skipped_token_mapping_indices=None,
            skipped_token_topk_mapping_indices=bufs["skip"],
            num_recv_tokens_per_expert=info[2 + 2 * W : -1],
            num_recv_tokens_per_rank=torch.tensor(vals[2 + W : 2 + 2 * W], dtype=torch.int64),
            num_recv_rows=rows,
            recv_expert_indices=out_e,
            caller_scatter=caller,
            backend_state=_TritonState(
                owner=id(self),
                tab=bufs["tab"],
                n_src=info[2 : 2 + W],
                remote=rb,
                npk_recv=npk[W:] if npk is not None else None,
            ),
        )
        if mark:
            mark(("descriptor built", time.perf_counter()))
        return out, (out_w if has_w else None), desc

    def _rows_guess(self) -> int:
        """Rows of the outputs of this call's speculative flow (see ``speculative_rows``)."""
        return _speculative_rows_guess(self._recent_rows, self.engine.worst_case_rows())

    def _take_small_outputs(self, n: int, rows: int, has_w: bool) -> dict[str, torch.Tensor]:
        """:meth:`~.engine.TritonEPEngine.alloc_dispatch_small` of this call: the ones the last call
        allocated ahead when they match (rows, weights, and the current stream, on which they were
        allocated and are not yet used; the per-token ones are allocated anew for another token count),
        else new ones."""
        ahead, self._next_small = self._next_small, None
        if ahead is None or ahead[0] != (_raw_stream(self.device.index), rows, has_w):
            return self.engine.alloc_dispatch_small(n, rows, with_weights=has_w)
        bufs = ahead[1]
        if bufs["skip"].shape[0] != n:
            bufs.update(self.engine.alloc_token_slots(n))
        return bufs

    def _prepare_small_outputs(self, n: int, has_w: bool) -> None:
        """After this call's row kernel is launched (the GPU busy with it): allocate the next call's
        small outputs, guessing it has as many tokens, so that only the rows are allocated before the next
        call's row kernel (six allocations fewer there)."""
        rows = self.engine.worst_case_rows() if self.overlap_exact else self._rows_guess()
        key = (_raw_stream(self.device.index), rows, has_w)
        self._next_small = (key, self.engine.alloc_dispatch_small(n, rows, with_weights=has_w))

    def _read_info(
        self, info: torch.Tensor, remote: dict[str, torch.Tensor] | None = None, *, bad_ids: bool = True
    ) -> tuple[list[int], list[int] | None]:
        """Copy a dispatch's ``info`` to the host (waits for it); raise if a device wait ran out, and with
        ``bad_ids`` if expert ids were out of range. Returns ``info``'s values, and with ``remote`` its
        ``pinfo``'s (records sent to, then received from, each rank; copied in the same wait), else
        ``None``."""
        self._info_host.copy_(info, non_blocking=True)
        if remote is not None:
            assert self._pinfo_host is not None
            self._pinfo_host.copy_(remote["pinfo"], non_blocking=True)
        if self.trace is not None:
            self.trace.append(("copy issued", time.perf_counter()))
        self._current_stream().synchronize()
        if self.trace is not None:
            self.trace.append(("wait returned", time.perf_counter()))
        vals = self._info_host.tolist()
        npk = None
        if remote is not None:
            assert self._pinfo_host is not None
            npk = self._pinfo_host.tolist()
        self._raise_device_error_word(vals[1])
        if bad_ids:
            self._raise_bad_ids(vals)
        return vals, npk

    def _raise_device_error_word(self, err: int) -> None:
        """Raise :class:`EPTimeoutError` for a nonzero device error word (from a dispatch's ``info``)."""
        if err:
            try:
                self.engine.check_error(err)
            except EPTimeoutFromDevice as exc:
                self._raise_device_error(exc)

    def _read_mirror(self) -> list[int]:
        """``info``'s values from the host mirror the row kernel's program 0 writes (polled, bounded: a
        device-side wait runs out first and is reported through the error word). Raises as
        :meth:`_read_info` does."""
        m = self._mirror_np
        if m[-1] == 0:
            deadline = time.monotonic() + self._mirror_wait_s
            while m[-1] == 0:
                if time.monotonic() > deadline:
                    self._mirror_lost = (
                        f"dispatch: rank {self.config.rank}'s row kernel did not publish its receive "
                        f"counts within {self._mirror_wait_s:.0f} s (the GPU is stuck or far behind the host)"
                    )
                    raise EPTimeoutError(
                        self._mirror_lost, step="dispatch/counts", missing_ranks=[self.config.rank]
                    )
        vals = m[:-1].tolist()
        self._raise_device_error_word(vals[1])
        self._raise_bad_ids(vals)
        return vals

    def _fit_speculative_rows(
        self,
        rows: int,
        input: torch.Tensor,
        exp_indices: torch.Tensor,
        weight: torch.Tensor | None,
        src: torch.Tensor,
        info: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        *,
        caller: bool,
    ) -> None:
        """After a speculative dispatch of ``rows`` rows into ``bufs``: when they outgrew the outputs
        (the kernel dropped the rows past their end), new outputs of exactly ``rows`` rows replace them in
        ``bufs`` and a second writing pass fills them."""
        eng = self.engine
        ahead = bufs["out"].shape[0]
        if rows > ahead:
            # it rewrites every row, the slot table and the scatter indices (the received rows stay in
            # the heap until this rank's next dispatch starts)
            self.speculative_overflows += 1
            bufs.update(eng.alloc_dispatch_rows(rows, with_weights=weight is not None, dtype=input.dtype))
            eng.launch_dispatch(
                input, exp_indices, weight, src, bufs["out"], bufs["out_w"], bufs["out_e"], bufs["tab"],
                bufs["skip"], bufs["scat"], caller_scatter=caller, info=info, send=False, rewrite=True,
            )  # fmt: skip

    def _current_stream(self) -> torch.cuda.Stream:
        """This device's current stream (``torch.cuda.current_stream``, without building a new object
        each call)."""
        key = torch._C._cuda_getCurrentStream(self.device.index)
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= 16:  # (streams come and go: keep the table small)
                self._streams.clear()
            stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._streams[key] = stream
        return stream

    def _raise_bad_ids(self, vals: list[int]) -> None:
        if vals[-1]:
            cfg = self.config
            raise ValueError(
                f"exp_indices on rank {cfg.rank}: {vals[-1]} slot(s) outside [-1, num_tot_experts="
                f"{cfg.num_tot_experts}) (-1 drops a slot). The dispatch completed on every rank with those "
                "slots dropped; combine it (or rebuild the layer) before dispatching again"
            )

    def combine(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        self._check_usable()
        state = layout_desc.backend_state
        if not isinstance(state, _TritonState) or state.owner != id(self):
            raise ValueError("layout_desc was not produced by this triton backend's dispatch")
        return self._combine(
            input, state, layout_desc.topk_indices_tensor, layout_desc.num_dispatch_token_cur_rank
        )

    def combine_per_slot(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        """Rows back without summing: ``[n, topk, C]`` (zeros for dropped slots); ``input``: ``[R, C]``.

        Used by the layer for routing-weight gradients (``C == 1``). Runs ``topk`` combines of the rows
        of one slot each, with a device-side barrier before each (so back-to-back combines never
        overwrite rows a peer is still reading): correct, not fast.
        """
        self._check_usable()
        state = layout_desc.backend_state
        if not isinstance(state, _TritonState) or state.owner != id(self):
            raise ValueError("layout_desc was not produced by this triton backend's dispatch")
        if input.dim() != 2 or input.shape[1] > self.config.hidden:
            raise ValueError(
                f"input must be [rows, C] with C <= {self.config.hidden}, got {tuple(input.shape)}"
            )
        if not input.dtype.is_floating_point or input.dtype.itemsize > 4:
            raise ValueError(f"input dtype must be a float type of at most 4 bytes, got {input.dtype}")
        n = layout_desc.num_dispatch_token_cur_rank
        outs = []
        for y_k in self.engine.per_slot_rows(input.contiguous(), state.tab, state.n_src):
            self.engine.launch_barrier()
            out = torch.empty(n, input.shape[1], dtype=input.dtype, device=self.device)
            self.engine.launch_combine(
                y_k, state.tab, layout_desc.topk_indices_tensor, state.n_src, out,
                remote=state.remote, npk_recv=state.npk_recv,
            )  # fmt: skip
            outs.append(out)
        self._combine_allowed = False
        return torch.stack(outs, dim=1)

    def _combine(
        self, input: torch.Tensor, state: _TritonState, exp_indices: torch.Tensor, n: int
    ) -> torch.Tensor:
        if not self._combine_allowed:
            raise RuntimeError(
                "triton backend: combine must follow a dispatch (a second combine without a dispatch in "
                "between could overwrite rows a peer is still reading)"
            )
        if input.dim() != 2 or input.shape[1] != self.config.hidden:
            raise ValueError(f"input must be [rows, {self.config.hidden}], got {tuple(input.shape)}")
        if not input.dtype.is_floating_point or input.dtype.itemsize > 4:
            raise ValueError(f"input dtype must be a float type of at most 4 bytes, got {input.dtype}")
        input = input.contiguous()
        out = torch.empty(n, self.config.hidden, dtype=input.dtype, device=self.device)
        self.engine.launch_combine(
            input, state.tab, exp_indices, state.n_src, out, remote=state.remote, npk_recv=state.npk_recv
        )
        self._combine_allowed = False
        return out

    # ------------------------------------------------------------------ CUDA-graph mode
    def dispatch_static(
        self, input: torch.Tensor, exp_indices: torch.Tensor, weight: torch.Tensor | None = None
    ) -> StaticDispatch:
        """Dispatch with fixed shapes and no host synchronisation (capturable in a CUDA graph).

        Args:
            input: ``[n, hidden]`` token dtype (``n`` fixed for the graph, ``<= max_tokens``).
            exp_indices: ``[n, topk]`` int32 or int64 (-1 = dropped).
            weight: ``[n, topk]`` weight dtype or ``None`` (fixed for the graph).

        Returns:
            :class:`StaticDispatch`; its buffers are reused by the next static call.
        """
        self._check_usable()
        if self.remote_ranks:
            raise NotImplementedError(
                "dispatch_static (CUDA-graph mode) is not built for groups with remote peers (the host sizes "
                "their puts from the counts); use dispatch / combine"
            )
        eng = self.engine
        n = input.shape[0]
        W = self.config.world_size
        b = self._static
        if b is None or b["skip"].shape[0] != n:
            b = eng.alloc_dispatch_outputs(n, eng.worst_case_rows(), with_weights=True)
            b["info"] = torch.zeros(eng.info_len, dtype=torch.int64, device=self.device)
            self._static = b
        eng.launch_layout(exp_indices, caller_scatter=False, info=b["info"])
        if eng.ce_pieces:
            eng.launch_counts(b["info"])
        eng.launch_dispatch(
            input, exp_indices, weight, eng.pos, b["out"], b["out_w"], b["out_e"], b["tab"], b["skip"],
            b["scat"], caller_scatter=False, info=b["info"], counts=not eng.ce_pieces,
        )  # fmt: skip
        self._combine_allowed = True
        info = b["info"]
        return StaticDispatch(
            output=b["out"],
            weights=b["out_w"] if weight is not None else None,
            recv_expert_indices=b["out_e"],
            num_recv_tokens_per_expert=info[2 + 2 * W : -1],
            num_recv_rows=info[0],
            token_dst_scatter_idx=b["scat"],
            exp_indices=exp_indices,
            state=_TritonState(owner=id(self), tab=b["tab"], n_src=info[2 : 2 + W]),
            num_invalid_ids=info[-1],
        )

    def combine_static(self, input: torch.Tensor, dispatched: StaticDispatch) -> torch.Tensor:
        """Combine for :meth:`dispatch_static` (``input``: ``[worst-case rows, hidden]``; rows past the
        valid count are never read). Returns ``[n, hidden]``."""
        self._check_usable()
        return self._combine(input, dispatched.state, dispatched.exp_indices, dispatched.exp_indices.shape[0])

    # ------------------------------------------------------------------ the rest
    def barrier(self, *, intra_node_only: bool = False, stream: torch.cuda.Stream | None = None) -> None:
        self._check_usable()
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            self.engine.launch_barrier()
        (stream or torch.cuda.current_stream()).synchronize()
        self.check_errors()

    def finalize(self) -> None:
        if self._finalized:
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.ep_group)
        self._next_small = None
        self.heap.free()
        self._finalized = True
