"""``backend="triton"``: the fast intra-node path, and its remote path for ranks on other nodes (NVSHMEM
host-side put-with-signal, nvshmem heap only).

Dispatch sends each token once per destination rank (with its top-k ids, positions and weights) into
the peer's heap; the receiver expands it into the rows of its local experts in the reference order.
Combine sums, in float32 on the expert side, the rows of each (token, source rank) and sends one row
back per pair; the source adds the rows of the ranks its token went to.

A dispatch runs one of three flows:

* counts-first (:meth:`TritonBackend._dispatch_counts_first`): the layout kernel, the receive layout in
  a kernel of its own, one device-to-host copy of the counts, outputs of exactly the received rows,
  then the row kernel. Large layers' first call, groups with remote peers and copy-engine dispatch.
* speculative (:meth:`TritonBackend._dispatch_speculative`): the row kernel is launched before the
  host knows the counts (its program 0 builds the receive layout and copies the counts to pinned host
  memory, which the host polls), into outputs allocated ahead: worst-case ones for layers whose worst
  case fits in ``TritonTuning.overlap_bytes``, else sized from the last calls' counts (a call that
  receives more gets exact outputs and a second writing pass).
* static (:meth:`TritonBackend.dispatch_static`): CUDA-graph mode, worst-case outputs, no host wait.

The exact-shape flows take their outputs but the rows from the current stream's ring of workspaces
(:mod:`.workspace`: reused once nothing refers to them) and allocate the rows per call (the layer's
common case on a large layer: into the rows the workspace kept from its last call); after a kernel
variant's first launch its launches skip Triton's argument binding (:meth:`.engine.TritonEPEngine._launch`).
"""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ep_a2a._dist import EPProtocolError, EPTimeoutError, OpBoard, RankMonitor
from ep_a2a.backends.base import A2ABackend, BackendOptions, DispatchResult, register_backend
from ep_a2a.backends.triton import engine as _engine
from ep_a2a.backends.triton.engine import (
    FP8_ROW_DTYPE,
    BoundLaunch,
    DispatchBuffers,
    EPTimeoutFromDevice,
    HeapLayout,
    QuantizeOnSend,
    TritonEPEngine,
    _launch_hooks_set,
    compile_threads,
    fp8_row_bytes,
    heap_row_bytes,
    pack_fp8_rows,
    unpack_fp8_rows,
)
from ep_a2a.backends.triton.heaps import NvshmemHeap, NvshmemTransport, make_heap
from ep_a2a.backends.triton.low_latency import LowLatencyDispatch, LowLatencyEngine, LowLatencyLayout
from ep_a2a.backends.triton.resolve import engine_options, remote_plan, resolve_heap
from ep_a2a.backends.triton.workspace import (
    RING_ROWS_BYTES,
    DispatchWorkspace,
    LaunchGraph,
    OutputRing,
    WorkspaceRing,
)
from ep_a2a.config import EPConfig
from ep_a2a.layout import EPAllToAllLayoutDesc

#: the current raw CUDA stream of a device index, and whether the current stream captures a graph: the
#: C functions themselves where this torch has them (one Python call fewer each on the eager path)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _engine._raw_stream)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
#: exact-shape calls whose received rows size the speculative flow's outputs
SPECULATIVE_WINDOW = 8
#: CUDA graphs of eager dispatches kept per workspace (``TritonTuning.eager_graphs``)
GRAPHS_PER_WORKSPACE = 64
#: sets of input addresses a workspace remembers while waiting for their second call
SIGHTINGS_PER_WORKSPACE = 1024
#: row dtypes of the combines :meth:`TritonBackend.combine_plain` takes (others go step by step)
_PLAIN_COMBINE_DTYPES = frozenset((torch.bfloat16, torch.float16, torch.float32))


# (its host reads the counts: under capture no kernel runs, so the poll could only time out)
_EXACT_UNDER_CAPTURE = (
    "dispatch: the exact-shape call reads its counts on the host and cannot be captured in a CUDA graph; "
    "capture dispatch_static / combine_static instead"
)


@dataclass
class _TritonState:
    owner: int  # id() of the backend that produced the descriptor
    tab: torch.Tensor  # [W, T, K] int32 output row of every received slot (-1: not here)
    n_src: torch.Tensor  # [W] int64 on the device: tokens of every source in this dispatch
    remote: dict[str, torch.Tensor] | None = None  # remote path: the dispatch's pk / rtok / pinfo
    npk_recv: list[int] | None = None  # remote path: records received from each rank (sizes the puts back)
    addresses: tuple[int, int] = field(init=False)  # of tab and n_src (in a combine's graph key)

    def __post_init__(self) -> None:
        self.addresses = (self.tab.data_ptr(), self.n_src.data_ptr())


@dataclass
class StaticDispatch:
    """Result of :meth:`TritonBackend.dispatch_static` (CUDA-graph mode: fixed shapes, counts on device).

    Attributes:
        output: ``[W * max_tokens * topk, hidden]`` rows; the first ``num_recv_rows`` are valid. For an FP8
            dispatch through :meth:`ep_a2a.EPLayer.dispatch_static`, the tuple ``(rows [same,
            hidden] float8_e4m3fn, scales [same, hidden / 128] float32)`` (views of one buffer).
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


class _Call:
    """The arguments of one exact-shape dispatch (``src``: the caller's scatter indices, or the
    engine's slot positions)."""

    __slots__ = ("caller", "exp_indices", "has_w", "input", "n", "src", "weight")

    def __init__(
        self, input: torch.Tensor | QuantizeOnSend, exp_indices: torch.Tensor, weight: torch.Tensor | None,
        full_scatter_indices: torch.Tensor | None, pos: torch.Tensor,
    ) -> None:  # fmt: skip
        self.input, self.exp_indices, self.weight = input, exp_indices, weight
        self.caller = full_scatter_indices is not None
        self.src = full_scatter_indices if full_scatter_indices is not None else pos
        self.has_w, self.n = weight is not None, input.shape[0]


def _combine_graph_key(y: Tensor, state: _TritonState, ids: Tensor, n: int, out: Tensor) -> tuple:
    """What a combine's CUDA graph bakes in: the addresses of the rows ``y``, the dispatch's table, the
    ids, the scatter source and the output, the token count ``n``, and the variant (rows ``hidden`` wide,
    by the combine's checks, into an output of their dtype)."""
    tp, sp = state.addresses
    return (y.data_ptr(), tp, ids.data_ptr(), sp, n, out.data_ptr(), y.dtype, ids.dtype)


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
    """Triton kernels over a symmetric heap (intra-node, NVLink / PCIe peer access; remote peers by
    NVSHMEM host-side puts). Its knobs are the fields of :class:`ep_a2a.TritonTuning`.

    ``enable_local_combine`` is always on here (the expert side always pre-reduces per (token, rank)).
    Ranks on other nodes (``world_size > local_world_size``, or ``TritonTuning.force_remote``) need the
    nvshmem heap; with them only the counts-first flow exists and ``dispatch_static`` raises.
    """

    name = "triton"
    checks_expert_ids = True  # counted in the layout kernel, raised at the call's one host sync
    expert_id_dtypes = (torch.int32, torch.int64)  # int64 read in place: no conversion kernel
    #: the low-latency mode's engine (``TritonTuning(low_latency=True)``), else ``None``
    low_latency: LowLatencyEngine | None = None

    def __init__(self, config: EPConfig, ep_group: dist.ProcessGroup, options: BackendOptions) -> None:
        super().__init__(config, ep_group, options)
        ok, why = self.is_available(config, ep_group)
        if not ok:
            raise RuntimeError(f"backend='triton' unavailable: {why}")
        tuning = options.tuning
        node, remote = remote_plan(config, tuning.force_remote)
        heap = resolve_heap(tuning.heap, config, node)
        self.device = torch.device("cuda", torch.cuda.current_device())
        # more CTAs than SMs would only queue behind each other
        device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_sm = min(tuning.num_sm or device_sms, device_sms)
        opts = engine_options(tuning, config, self.num_sm, remote=bool(remote))
        self.layout = HeapLayout.build(
            world_size=config.world_size, max_tokens=config.max_tokens, hidden=config.hidden, topk=config.topk,
            experts_per_rank=config.num_experts_per_rank, token_bytes=config.token_dtype.itemsize,
            chunk=opts["chunk"], combine_chunk=opts["combine_chunk"], remote=node < config.world_size,
            row_bytes=heap_row_bytes(config.hidden, config.token_dtype),
        )  # fmt: skip
        local = [r for r in range(config.world_size) if r not in remote]
        self.heap = make_heap(
            heap, self.layout.nbytes, ep_group, self.device, peers=local if remote else None,
            single_node=config.is_intra_node,
        )  # fmt: skip
        transport = NvshmemTransport(self.heap) if isinstance(self.heap, NvshmemHeap) and remote else None
        self.engine = TritonEPEngine(
            rank=config.rank, world_size=config.world_size, max_tokens=config.max_tokens, hidden=config.hidden,
            topk=config.topk, num_tot_experts=config.num_tot_experts, token_dtype=config.token_dtype,
            weight_dtype=config.weight_dtype, heap_local=self.heap.local, ptr_table=self.heap.ptr_table,
            layout=self.layout, num_sm=self.num_sm, timeout_s=self.timeout_s, remote_ranks=remote,
            transport=transport, peer_heaps=self.heap.peers, **opts,
        )  # fmt: skip
        self.heap_kind = heap
        #: low-latency mode (``TritonTuning.low_latency``): its engine over a heap of its own
        self.low_latency = self._build_low_latency(heap, tuning.low_latency, bool(remote))
        #: whether dispatch moves the token rows by copy-engine copies
        self.copy_engine = tuning.copy_engine
        #: ranks reached by NVSHMEM puts (other nodes, or forced) and the node size used
        self.remote_ranks, self.node_size = tuple(remote), node
        worst_bytes = self.engine.worst_case_rows() * self.layout.row_bytes
        #: speculative flow into worst-case outputs from the first call (never with remote peers: the
        #: counts size their puts)
        self.overlap_exact = worst_bytes <= tuning.overlap_bytes and not remote
        #: speculative flow into outputs sized from the last calls, from the second call on
        self.speculative_rows = tuning.speculative_rows and not (
            self.overlap_exact or remote or self.copy_engine
        )
        #: eager dispatches replay CUDA graphs of their launches when their inputs repeat
        self.eager_graphs = tuning.eager_graphs
        self._init_host_state()
        self._own_monitor = options.monitor is None
        monitor = options.monitor if options.monitor is not None else RankMonitor(ep_group, self.timeout_s)
        #: every rank's operations (host shared memory): misordered calls raise EPProtocolError
        self.board = OpBoard(monitor)
        self._monitor = monitor
        self.aot_variants, self.aot_seconds = 0, 0.0
        if options.use_aot:
            t0 = time.perf_counter()
            fp8 = config.token_dtype == torch.float8_e4m3fn  # (its dispatch rows: packed, its combine: bf16)
            threads = compile_threads(config.local_world_size)
            self.aot_variants = self.engine.precompile(
                threads=threads,
                dtypes=(torch.float32,),
                row_dtypes=(config.token_dtype, FP8_ROW_DTYPE) if fp8 else None,
                combine_dtypes=(torch.bfloat16,) if fp8 else None,
                quantize_from=(torch.bfloat16,) if fp8 else (),
                dispatch_counts=(True,) if self.overlap_exact else (True, False),
                rewrite=self.speculative_rows,
                mirror=self.overlap_exact or self.speculative_rows,
            )
            if self.low_latency is not None:
                quantize = (torch.bfloat16,) if config.hidden % 128 == 0 else ()
                self.aot_variants += self.low_latency.precompile(
                    threads=threads,
                    row_dtypes=(FP8_ROW_DTYPE,)
                    if fp8
                    else (config.token_dtype, *((FP8_ROW_DTYPE,) if quantize else ())),
                    quantize_from=quantize,
                    combine_dtypes=(torch.bfloat16,)
                    if config.token_dtype.itemsize <= 2
                    else (config.token_dtype,),
                )
            self.aot_seconds = time.perf_counter() - t0

    def _build_low_latency(self, heap: str, on: bool, remote: bool) -> LowLatencyEngine | None:
        """The low-latency engine and its heap (collective), when ``on``."""
        if not on:
            return None
        cfg = self.config
        if remote:
            raise ValueError(
                "TritonTuning(low_latency=True) needs every rank on this node (its kernels store into every "
                "peer's heap); groups with remote peers use the normal mode"
            )
        layout = LowLatencyLayout.build(
            world_size=cfg.world_size, max_tokens=cfg.max_tokens, hidden=cfg.hidden, topk=cfg.topk,
            experts_per_rank=cfg.num_experts_per_rank, row_bytes=heap_row_bytes(cfg.hidden, cfg.token_dtype),
            comb_bytes=4 if cfg.token_dtype.itemsize >= 4 else 2,
        )  # fmt: skip
        self._ll_heap = make_heap(heap, layout.nbytes, self.ep_group, self.device, single_node=True)
        self._ll_host = torch.zeros(3 + 2 * cfg.world_size + cfg.num_experts_per_rank + 1, dtype=torch.int64)
        self._ll_host = self._ll_host.pin_memory()
        return LowLatencyEngine(
            rank=cfg.rank, world_size=cfg.world_size, max_tokens=cfg.max_tokens, hidden=cfg.hidden, topk=cfg.topk,
            num_tot_experts=cfg.num_tot_experts, weight_dtype=cfg.weight_dtype, heap_local=self._ll_heap.local,
            ptr_table=self._ll_heap.ptr_table, layout=layout, num_sm=self.num_sm, timeout_s=self.timeout_s,
        )  # fmt: skip

    def _init_host_state(self) -> None:
        """Host buffers and counters of the dispatch flows."""
        W = self.config.world_size
        self._info_host = torch.empty_like(self.engine.info, device="cpu").pin_memory()
        self._pinfo_host = torch.zeros(2 * W, dtype=torch.int64).pin_memory() if self.remote_ranks else None
        #: stream objects by (id, device, type) of the current stream: building a ``torch.cuda.Stream``
        #: costs more host time than the lookup
        self._streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}
        self._combine_allowed = False
        #: rows of the counts-first flow's outputs allocated before the host waits for the counts (0: none)
        self._rows_ahead = 0
        #: speculative dispatches, and those whose rows outgrew the outputs allocated ahead
        self.speculative_calls = self.speculative_overflows = 0
        #: rows received by the last exact-shape calls (they size the speculative flow's outputs)
        self._recent_rows: collections.deque[int] = collections.deque(maxlen=SPECULATIVE_WINDOW)
        # the speculative flow reads its counts from this pinned host copy of info (program 0 writes it,
        # then the epoch in the last element), not by a stream sync
        self._mirror = torch.zeros(self.engine.info_len + 1, dtype=torch.int64).pin_memory()
        self._mirror_np = self._mirror.numpy()
        self._mirror_wait_s = 2.0 * self.timeout_s + 10.0
        self._info_event = torch.cuda.Event()
        #: (call number, operation) this rank is in (see :class:`ep_a2a._dist.OpBoard`)
        self._op: tuple[int, str] = (-1, "")
        self._finalized = False
        #: set when the host gave up polling the mirror: a late write could then land in a later call's
        #: poll, so the backend refuses further calls
        self._mirror_lost: str | None = None
        #: the exact-shape calls' outputs, with the worst-case rows for decode-sized layers (see
        #: :mod:`.workspace` for when one is reused)
        # (the states name the backend by its id, not through ``self``: no reference cycle keeps a
        # dropped backend, and its heap, alive until garbage collection runs)
        owner = id(self)
        rows = self._ring_rows()
        self.workspaces = WorkspaceRing(
            self.engine,
            rows,
            lambda ws: _TritonState(owner=owner, tab=ws.tab, n_src=ws.n_src),
            # (a layer of FP8 rows: its workspaces hold the packed input rows of the FP8 common case)
            fp8_hidden=self.config.hidden if rows is not None and rows[0] == FP8_ROW_DTYPE else 0,
        )
        #: the exact-shape combines' outputs (decode-sized ones reused, as the workspaces are)
        self.combine_outputs = OutputRing(self.device)
        #: combine launches bound per variant and stream (:meth:`.engine.TritonEPEngine.bind_combine`)
        self._bound_combines: dict[tuple, BoundLaunch] = {}
        self._dummy_w_address = self.engine._dummy_w.data_ptr()
        #: eager dispatches captured as CUDA graphs, and replays of them (``TritonTuning.eager_graphs``)
        self.graph_captures = self.graph_replays = 0
        self._capture_stream: torch.cuda.Stream | None = None
        #: the combines' CUDA graphs by their addresses, and how often each set of addresses came
        self._combine_graphs: dict[tuple, LaunchGraph] = {}
        self._combine_sightings: dict[tuple, int] = {}
        self._static: DispatchBuffers | None = None
        self._static_fp8: DispatchBuffers | None = None  # (packed FP8 rows: a graph of each may coexist)
        self._init_eager_path()

    def _init_eager_path(self) -> None:
        """What the eager calls keep at hand: the mirror's view of ``info``, and what :meth:`dispatch_plain`
        takes from the layer's checks and the workspaces instead of the call's tensors (the parts of a
        speculative dispatch's graph key that the common case fixes)."""
        cfg, eng, rows = self.config, self.engine, self.workspaces.rows
        #: ``id(self)``, as the descriptors' states name their backend
        self._id = id(self)
        self._mirror_info = self._mirror_np[:-1]
        #: the mirror's tokens, then rows, per source rank (the host counts of a dispatch's descriptor)
        self._mirror_counts = self._mirror_np[2 : 2 + 2 * cfg.world_size]
        # (the mirror as a memoryview too: its items read and written as Python ints, cheaper than numpy's)
        self._mirror_mv = self._mirror_np.data
        self._mirror_counts_mv = self._mirror_mv[2 : 2 + 2 * cfg.world_size]
        #: the mirror's indices of the epoch and of the invalid-id count
        self._epoch_at, self._bad_at = len(self._mirror_np) - 1, len(self._mirror_np) - 2
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._offsets_int32 = cfg.offset_dtype == torch.int32
        #: the common case goes through the speculative flow into the workspaces' rows
        self._plain_rows = (
            self.overlap_exact
            and not eng.ce_pieces
            and self.low_latency is None
            and rows is not None
            and rows[:2] == (cfg.token_dtype, cfg.hidden)
        )
        #: the FP8 common case (:meth:`dispatch_fp8_plain`) packs into the workspaces' input rows and goes
        #: through the speculative flow into their rows (a layer of FP8 rows)
        self._fp8_plain = (
            self.overlap_exact
            and not eng.ce_pieces
            and self.low_latency is None
            and rows is not None
            and self.workspaces.fp8_hidden > 0
        )
        #: the part of a common-case call's graph key that the layer's checks fix, after the slot
        #: positions' address and the workspace's rows' (:meth:`_plain_key`; that of the packed rows
        #: on a layer of FP8 rows, whose dispatch_plain never takes the workspaces' rows)
        self._plain_variant: tuple = (
            (False, FP8_ROW_DTYPE, rows[1], cfg.weight_dtype, eng.pos.dtype)
            if self._fp8_plain and rows is not None
            else (False, cfg.token_dtype, cfg.hidden, cfg.weight_dtype, eng.pos.dtype)
        )
        if rows is not None:
            self._plain_variant += (rows[0], rows[2])
        #: the common case of a layer whose rows are allocated per call goes through the speculative
        #: flow from the second call on (:meth:`dispatch_plain`)
        self._plain_large = (
            self.speculative_rows and not eng.ce_pieces and self.low_latency is None and rows is None
        )
        self._worst_rows = eng.worst_case_rows()
        #: rows of the next speculative call's outputs (:meth:`_record_rows` keeps it up to date)
        self._rows_next = (
            _speculative_rows_guess(self._recent_rows, self._worst_rows) if self._recent_rows else 0
        )

    def _ring_rows(self) -> tuple[torch.dtype, int, int] | None:
        """The rows each workspace holds: the worst case of the layer's rows when the speculative flow
        writes into worst-case outputs and they take at most :data:`.workspace.RING_ROWS_BYTES`."""
        eng = self.engine
        dtype = FP8_ROW_DTYPE if self.config.token_dtype == torch.float8_e4m3fn else self.config.token_dtype
        width, rows = eng.row_width(dtype), eng.worst_case_rows()
        if not self.overlap_exact or eng.ce_pieces or rows * width * dtype.itemsize > RING_ROWS_BYTES:
            return None
        return dtype, width, rows

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

    # ------------------------------------------------------------------ errors
    def _raise_device_error(self, exc: EPTimeoutFromDevice) -> None:
        raise EPTimeoutError(str(exc), step=exc.step, missing_ranks=[exc.peer]) from None

    def _check_usable(self) -> None:
        if self._finalized:
            raise RuntimeError("TritonBackend used after finalize()")
        if self._mirror_lost is not None:
            raise RuntimeError(f"TritonBackend unusable after an earlier failure: {self._mirror_lost}")

    def _start(self, op: str, *, check: bool = True) -> int:
        """Publish that this rank starts ``op`` (its call number on the board) and, with ``check``, raise
        :class:`EPProtocolError` if a peer is already in another operation at that call."""
        call = self.board.publish(op)
        self._op = (call, op)
        if check:
            self._guard_protocol(call, op)
        return call

    def _guard_protocol(self, call: int, op: str, step: str | None = None) -> None:
        """Check the operation board at ``call`` (a peer in another operation raises
        :class:`EPProtocolError`) and, with ``step``, wait there for the peers not arrived yet
        (:class:`EPTimeoutError` names the missing ones). Either error leaves the backend unusable:
        kernels already launched keep waiting for signals that never come, until their own timeout."""
        board = self.board
        try:
            if not board.check(call, op) and step is not None:
                board.wait(call, op, step)
        except (EPProtocolError, EPTimeoutError) as exc:
            self._mirror_lost = str(exc)
            raise

    def _wait_event(self, event: torch.cuda.Event) -> None:
        """Wait on the host for ``event``, checking the board for a peer in another operation meanwhile."""
        call, op = self._op
        spins = 0
        while not event.query():
            spins += 1
            if spins % 64 == 0:
                self._guard_protocol(call, op)

    def check_errors(self) -> None:
        """Synchronise and raise :class:`ep_a2a.EPTimeoutError` if a device-side wait ran out."""
        try:
            self.engine.check_error()
            if self.low_latency is not None:
                self.low_latency.check_error()
        except EPTimeoutFromDevice as exc:
            self._raise_device_error(exc)

    def _raise_device_error_word(self, err: int) -> None:
        """Raise :class:`EPTimeoutError` for a nonzero device error word (from a dispatch's ``info``)."""
        if err:
            try:
                self.engine.check_error(err)
            except EPTimeoutFromDevice as exc:
                self._raise_device_error(exc)

    def _raise_bad_ids(self, vals: np.ndarray) -> None:
        if vals[-1]:
            cfg = self.config
            raise ValueError(
                f"exp_indices on rank {cfg.rank}: {vals[-1]} slot(s) outside [-1, num_tot_experts="
                f"{cfg.num_tot_experts}) (-1 drops a slot). The dispatch completed on every rank with those "
                "slots dropped; combine it (or rebuild the layer) before dispatching again"
            )

    # ------------------------------------------------------------------ exact-shape mode
    def dispatch_plain(self, input: Tensor, exp_indices: Tensor, weight: Tensor) -> DispatchResult:
        """:meth:`dispatch` of the layer's common case (see the base class): a call whose tensors repeat
        the addresses of an earlier one replays its CUDA graph, found by those addresses alone (the
        rest of its key is fixed by the layer's checks and the workspace: :meth:`_plain_key`), and is
        published on the operation board once launched. With the worst-case rows in the workspaces
        the rows are theirs; else (a layer whose rows are sized from the last calls, from its second
        call on) they are the rows the workspace kept from its last call where they are free and fit
        the call's guess (:meth:`.workspace.DispatchWorkspace.spare_rows`), else new ones it keeps,
        and their address and row count are part of the key."""
        if self._finalized or self._mirror_lost is not None or _launch_hooks_set():
            return self._dispatch(input, exp_indices, weight, None)
        large = not self._plain_rows
        if large and not (self._plain_large and self._recent_rows):
            return self._dispatch(input, exp_indices, weight, None)
        if _capturing():
            raise RuntimeError(_EXACT_UNDER_CAPTURE)
        stream = _raw_stream(self._device_index)
        n = input.shape[0]
        ws = self.workspaces.take(stream, n)
        if large:
            # (no allocation before the launch where the kept rows serve)
            out = ws.spare_rows(self._rows_next)
            if out is None:
                out = ws.keep_rows(self.engine.alloc_rows(self._rows_next, dtype=input.dtype))
            # (the key _launch_merged_bound builds, less what the layer's checks fix; the rows' address
            # and count as the workspace recorded them)
            key = (input.data_ptr(), exp_indices.data_ptr(), weight.data_ptr(), n, exp_indices.dtype, ws.kept_ptr,
                   ws.kept_rows)  # fmt: skip
            graph = ws.plain_graphs.get(key) if self.eager_graphs else None
            if graph is None:
                return self._dispatch_speculative(
                    input, exp_indices, weight, None, ws=ws, out=out, plain_at=key
                )
            self._mirror_mv[self._epoch_at] = 0  # (program 0 writes the epoch there once info is copied)
            graph.launch(stream)
            self.engine.merged_replayed()
            self.graph_replays += 1
            return self._speculative_done(n, input, exp_indices, weight, None, ws, out)
        at = (input.data_ptr(), exp_indices.data_ptr(), weight.data_ptr(), n, exp_indices.dtype)
        graph = ws.plain_graphs.get(at) if self.eager_graphs else None
        if graph is None:
            return self._dispatch_speculative(input, exp_indices, weight, None, plain=True, ws=ws)
        return self._replay_plain(graph, stream, ws, n, exp_indices)

    def _replay_plain(
        self, graph: LaunchGraph, stream: int, ws: DispatchWorkspace, n: int, exp_indices: Tensor
    ) -> DispatchResult:
        """A common-case dispatch of ``n`` tokens into ``ws``'s rows by a replay of its CUDA ``graph`` on
        ``stream``, and its result."""
        m = self._mirror_mv
        m[self._epoch_at] = 0  # (program 0 writes the epoch there once info is copied)
        graph.launch(stream)
        self.engine.merged_replayed()
        self.graph_replays += 1
        # (the GPU works from here on: what the host does next, up to the counts, overlaps it)
        board = self.board
        call = board.publish("dispatch")
        self._op = (call, "dispatch")
        if board.peers:
            self._guard_protocol(call, "dispatch")
        desc = self._descriptor(n, exp_indices, False, ws)
        # (the views of as many rows as the last call into this workspace received, while the GPU works:
        # batches repeat their counts)
        w_rows, e_rows, ring_rows = ws.first_rows(ws.last_rows)
        self._wait_mirror()
        # (from here to the return the host is behind the GPU: _result's steps, on the memoryview)
        if m[1] or m[self._bad_at]:
            self._raise_mirror_words()
        rows = m[0]
        if rows != ws.last_rows:
            w_rows, e_rows, ring_rows = ws.first_rows(rows)
        assert ring_rows is not None  # (the workspaces hold the rows: _plain_rows)
        self._combine_allowed = True
        ws.host_counts_mv[:] = self._mirror_counts_mv
        desc.num_recv_rows, desc.recv_expert_indices = rows, e_rows
        return ring_rows, w_rows, desc

    def _fp8_workspace(self, n: int) -> tuple[int, DispatchWorkspace] | None:
        """The current stream and the workspace an FP8 common-case call of ``n`` tokens takes, or ``None``
        where it takes the base class's path (a layer without FP8 rows in its workspaces, a profiler's
        launch hooks, a finalized backend)."""
        if not self._fp8_plain or self._finalized or self._mirror_lost is not None or _launch_hooks_set():
            return None
        if _capturing():
            raise RuntimeError(_EXACT_UNDER_CAPTURE)
        stream = _raw_stream(self._device_index)
        return stream, self.workspaces.take(stream, n)

    def dispatch_fp8_plain(
        self, x_fp8: Tensor, scales: Tensor, exp_indices: Tensor, weight: Tensor
    ) -> tuple[tuple[Tensor, Tensor], Tensor | None, EPAllToAllLayoutDesc]:
        """The base class's FP8 common case. On a layer of FP8 rows whose workspaces hold the worst-case
        rows, the rows and scales are packed into the workspace's input rows and dispatched as
        :meth:`dispatch_plain` dispatches; a call whose four tensors repeat the addresses of an earlier
        one replays a CUDA graph of the packing and the launches, and the result's ``(x_fp8, scales)``
        are views the workspace keeps with its rows. Other layers take the base class's path."""
        n = x_fp8.shape[0]
        taken = self._fp8_workspace(n)
        if taken is None:
            return super().dispatch_fp8_plain(x_fp8, scales, exp_indices, weight)
        stream, ws = taken
        at = (
            x_fp8.data_ptr(),
            scales.data_ptr(),
            exp_indices.data_ptr(),
            weight.data_ptr(),
            n,
            exp_indices.dtype,
        )
        graph = ws.fp8_graphs.get(at) if self.eager_graphs else None
        if graph is None and self.eager_graphs and n and self._graph_due(ws.fp8_graphs, ws.fp8_sightings, at):
            graph = self._capture_fp8(ws, at, x_fp8, scales, exp_indices, weight)
        if graph is not None:
            _, out_w, desc = self._replay_plain(graph, stream, ws, n, exp_indices)
        else:
            assert ws.packed_in is not None
            pack_fp8_rows(x_fp8, scales, out=ws.packed_in)
            _, out_w, desc = self._dispatch_speculative(
                ws.packed_in, exp_indices, weight, None, plain=True, ws=ws
            )
        return ws.first_fp8_rows(), out_w, desc

    def dispatch_quantize_plain(
        self, input: Tensor, exp_indices: Tensor, weight: Tensor
    ) -> tuple[tuple[Tensor, Tensor], Tensor | None, EPAllToAllLayoutDesc]:
        """The base class's quantizing common case. On a layer of FP8 rows whose workspaces hold the
        worst-case rows, the row kernel quantizes ``input`` into the workspace's rows
        (:class:`~.engine.QuantizeOnSend`); a call whose three tensors repeat the addresses of an earlier
        one replays the CUDA graph of its launches, found by those addresses alone, and the result's
        ``(x_fp8, scales)`` are views the workspace keeps with its rows. Other layers take the base
        class's path (copy-engine dispatch among them: its copies need the FP8 rows first)."""
        n = input.shape[0]
        taken = self._fp8_workspace(n)
        if taken is None:
            return super().dispatch_quantize_plain(input, exp_indices, weight)
        stream, ws = taken
        # (the class marks the key apart from those of dispatch_plain's packed rows)
        at = (
            input.data_ptr(),
            exp_indices.data_ptr(),
            weight.data_ptr(),
            n,
            exp_indices.dtype,
            QuantizeOnSend,
        )
        graph = ws.plain_graphs.get(at) if self.eager_graphs else None
        if graph is not None:
            _, out_w, desc = self._replay_plain(graph, stream, ws, n, exp_indices)
        else:
            _, out_w, desc = self._dispatch_speculative(
                QuantizeOnSend(input), exp_indices, weight, None, ws=ws, plain_at=at
            )
        return ws.first_fp8_rows(), out_w, desc

    def _capture_fp8(
        self, ws: DispatchWorkspace, at: tuple, x_fp8: Tensor, scales: Tensor, exp_indices: Tensor,
        weight: Tensor,
    ) -> LaunchGraph | None:  # fmt: skip
        """A CUDA graph of :meth:`dispatch_fp8_plain`'s packing and launches for the call ``at`` (its key in
        ``ws.fp8_graphs``)."""
        packed, out, src = ws.packed_in, ws.out, self.engine.pos
        assert packed is not None
        assert out is not None
        tensors = (packed, exp_indices, weight, src)
        addresses = (packed.data_ptr(), exp_indices.data_ptr(), weight.data_ptr(), src.data_ptr(), at[4],
                     out.data_ptr())  # fmt: skip

        def bind(stream: int) -> tuple[BoundLaunch, BoundLaunch] | None:
            return self.engine.bind_merged_dispatch(
                stream,
                self._speculative_buffers(ws, out),
                ws.info,
                self._mirror,
                tensors,
                caller_scatter=False,
            )

        def launch(launches: tuple[BoundLaunch, BoundLaunch]) -> None:
            pack_fp8_rows(x_fp8, scales, out=packed)  # (on the capture stream: part of the graph)
            self.engine.launch_merged_bound(launches, *addresses, capturing=True)

        return self._capture(bind, launch, ws.fp8_graphs, at)

    def dispatch(
        self,
        input: Tensor | QuantizeOnSend,  # type: ignore[override]
        exp_indices: Tensor,
        weight: Tensor | None,
        full_scatter_indices: Tensor | None,
    ) -> DispatchResult:
        cfg = self.config
        if (
            full_scatter_indices is None
            and weight is not None
            and type(input) is Tensor
            and input.dtype is cfg.token_dtype
            and weight.dtype is cfg.weight_dtype
            and input.shape[1] == cfg.hidden
            and exp_indices.dtype in self.expert_id_dtypes
            and input.is_contiguous()
            and exp_indices.is_contiguous()
            and weight.is_contiguous()
        ):  # (the layer's common case, which its checks would hand to dispatch_plain)
            return self.dispatch_plain(input, exp_indices, weight)
        return self._dispatch(input, exp_indices, weight, full_scatter_indices)

    def _dispatch(
        self,
        input: Tensor | QuantizeOnSend,
        exp_indices: Tensor,
        weight: Tensor | None,
        full_scatter_indices: Tensor | None,
    ) -> DispatchResult:
        """:meth:`dispatch` of every case."""
        if self._finalized or self._mirror_lost is not None:
            self._check_usable()
        if _capturing():
            raise RuntimeError(_EXACT_UNDER_CAPTURE)
        if input.shape[1] * input.element_size() > self.layout.row_bytes:
            raise ValueError(
                f"input: the triton backend's receive buffers hold {self.config.token_dtype} rows; got "
                f"{input.dtype} (e.g. the backward of a combine over float32 expert outputs: cast them to "
                f"{self.config.token_dtype}, or use backend='torch')"
            )
        if self.low_latency is not None:
            return self._ll_dispatch_exact(input, exp_indices, weight, full_scatter_indices)
        # (from the second call on, on every rank alike: a guess of 0 rows speculates too, so a rank
        # that receives nothing does not fall back to the flow with a host wait)
        if self.overlap_exact or (self.speculative_rows and len(self._recent_rows) > 0):
            return self._dispatch_speculative(input, exp_indices, weight, full_scatter_indices)
        self._start("dispatch")
        return self._dispatch_counts_first(
            _Call(input, exp_indices, weight, full_scatter_indices, self.engine.pos)
        )

    def _dispatch_counts_first(self, call: _Call) -> DispatchResult:
        """Layout, receive layout, one host wait for the counts, outputs of the exact rows, row kernel."""
        eng, W, has_w = self.engine, self.config.world_size, call.has_w
        input, exp_indices = call.input, call.exp_indices
        # (info is per call: the combine of this dispatch reads its token counts after later dispatches)
        ws = self._workspace(call.n)
        info = ws.info
        bufs = DispatchBuffers(tab=ws.tab, skip=ws.skip, scat=ws.scat, info=info)
        rb = eng.alloc_remote()
        eng.launch_layout(exp_indices, caller_scatter=call.caller, info=info, remote=rb)
        eng.launch_counts(info, remote=rb)
        # the row-sized outputs are allocated while the GPU works out the counts when the last calls'
        # counts predict them: then nothing is allocated between the host's wait and the row kernel
        ahead = self._rows_ahead
        spec = eng.alloc_dispatch_rows(ahead, with_weights=has_w, dtype=input.dtype) if ahead else None
        # the one small device-to-host copy: receive counts (and the error word) size the output (with
        # remote peers also the records to send and receive, which size the puts)
        vals, npk = self._read_info(info, rb, bad_ids=False)  # (raised after the row kernel below)
        rows = int(vals[0])
        self._record_rows(rows)
        if spec is not None and _rows_fit_ahead(rows, ahead):
            bufs.out, bufs.out_w, bufs.out_e = (
                spec[0][:rows],
                spec[1][:rows] if has_w else spec[1],
                spec[2][:rows],
            )
        else:
            bufs.out, bufs.out_w, bufs.out_e = eng.alloc_dispatch_rows(
                rows, with_weights=has_w, dtype=input.dtype
            )
            self._rows_ahead = _rows_to_allocate_ahead(rows, eng.worst_case_rows())
        eng.launch_dispatch(
            input, exp_indices, call.weight, call.src, bufs, caller_scatter=call.caller, info=info, remote=rb,
            npk_send=npk[:W] if npk is not None else None,
        )  # fmt: skip
        # (the peers' row kernels need this rank's, so invalid ids raise only once it is launched)
        self._raise_bad_ids(vals)
        assert bufs.out is not None
        assert bufs.out_w is not None
        assert bufs.out_e is not None
        desc = self._descriptor(call.n, call.exp_indices, call.caller, ws, rb, npk)
        return self._result(desc, (bufs.out, bufs.out_w, bufs.out_e), call.has_w, ws, vals[2:], rows)

    def _dispatch_speculative(
        self, input: Tensor | QuantizeOnSend, exp_indices: Tensor, weight: Tensor | None,
        full_scatter_indices: Tensor | None, *, plain: bool = False, ws: DispatchWorkspace | None = None,
        out: Tensor | None = None, plain_at: tuple | None = None,
    ) -> DispatchResult:  # fmt: skip
        """The receive layout inside the row kernel and no host wait before it: the rows land in outputs
        allocated before the counts are known (worst-case ones for small layers, sized from the last
        calls for large ones), and the caller gets views of their first ``R`` rows. The call is
        published on the operation board and the board checked once the kernels are launched (they
        would wait for a peer in another operation until their timeout either way, and the host
        raises in this call). ``plain``: the layer's common case into the workspaces' rows
        (:meth:`dispatch_plain`); ``ws``: the workspace it took, where it took one; ``out``: the rows
        it allocated, and ``plain_at`` the key under which :meth:`dispatch_plain` looks for
        the graph of these launches (recorded there once captured)."""
        eng = self.engine
        stream = _raw_stream(self._device_index)
        n = input.shape[0]
        if ws is None:
            ws = self.workspaces.take(stream, n)
        # (decode-sized layers: the worst-case rows of the workspace, else rows allocated per call)
        if out is None:
            out = ws.out
        if out is None or (not plain and out.dtype != input.dtype):
            cap = eng.worst_case_rows() if self.overlap_exact else self._rows_next
            out = eng.alloc_rows(cap, dtype=input.dtype)
        src = full_scatter_indices if full_scatter_indices is not None else eng.pos
        mirror = self._mirror if not eng.ce_pieces else None
        if mirror is not None:
            self._mirror_np[-1] = 0  # (program 0 writes the epoch there once info is copied)
        graph = None
        if plain and self.eager_graphs and n:
            # (the key _launch_merged_bound builds: the call's part, then the part the layer's checks fix)
            at = (input.data_ptr(), exp_indices.data_ptr(), weight.data_ptr(), n, exp_indices.dtype)  # type: ignore[union-attr]
            graph = ws.graphs.get(at + (ws.plain_key or self._plain_key(ws)))
            if graph is not None:  # (dispatch_plain finds it by the call's part alone from now on)
                ws.plain_graphs[at] = graph
        if graph is not None:
            graph.launch(stream)
            eng.merged_replayed()
            self.graph_replays += 1
        elif mirror is None or not self._launch_merged_bound(
            stream, ws, out, mirror, input, exp_indices, weight, src, full_scatter_indices is not None, plain_at
        ):  # fmt: skip
            bufs = self._speculative_buffers(ws, out)
            eng.launch_layout(exp_indices, caller_scatter=full_scatter_indices is not None, info=ws.info)
            if eng.ce_pieces:  # (the copies start after the receive layout, in its own launch)
                eng.launch_counts(ws.info)
            eng.launch_dispatch(
                input, exp_indices, weight, src, bufs, caller_scatter=full_scatter_indices is not None,
                info=ws.info, counts=not eng.ce_pieces, mirror=mirror,
            )  # fmt: skip
        return self._speculative_done(n, input, exp_indices, weight, full_scatter_indices, ws, out)

    def _speculative_done(
        self, n: int, input: Tensor | QuantizeOnSend, exp_indices: Tensor, weight: Tensor | None,
        full_scatter_indices: Tensor | None, ws: DispatchWorkspace, out: Tensor,
    ) -> DispatchResult:  # fmt: skip
        """The host's part of a speculative dispatch once its kernels are launched: publish the call, wait
        for the counts (the mirror), a second writing pass where the rows outgrew ``out``, the result."""
        eng = self.engine
        mirror = self._mirror if not eng.ce_pieces else None
        # (the GPU works from here on: what the host does next overlaps it)
        board_call = self._start("dispatch", check=False)
        if self.board.peers:
            self._guard_protocol(board_call, "dispatch")
        speculate = not self.overlap_exact
        self.speculative_calls += speculate
        desc = self._descriptor(n, exp_indices, full_scatter_indices is not None, ws)
        vals = self._read_mirror() if mirror is not None else self._read_info(ws.info)[0]
        rows = int(vals[0])
        if speculate:
            self._record_rows(rows)
            if rows > out.shape[0]:  # (exact outputs and a second writing pass)
                call = _Call(input, exp_indices, weight, full_scatter_indices, eng.pos)
                bufs = self._speculative_buffers(ws, out)
                self._fit_speculative_rows(rows, call, ws.info, bufs)
                assert bufs.out is not None
                assert bufs.out_w is not None
                assert bufs.out_e is not None
                return self._result(
                    desc, (bufs.out, bufs.out_w, bufs.out_e), weight is not None, ws, vals[2:], rows
                )
        w_rows, e_rows, ring_rows = ws.first_rows(rows)
        out = ring_rows if ring_rows is not None and out is ws.out else out[:rows]
        return self._result(desc, (out, w_rows, e_rows), weight is not None, ws, vals[2:], rows)

    def _plain_key(self, ws: DispatchWorkspace) -> tuple:
        """The part of the graph key of a common-case call into ``ws`` that does not come from the call
        (kept in ``ws.plain_key``): what :meth:`_launch_merged_bound` reads from the scatter source
        (the slot positions), the rows (the workspace's) and the tensors the layer checked."""
        ws.plain_key = (self.engine.pos.data_ptr(), ws.out_ptr, *self._plain_variant)
        return ws.plain_key

    @staticmethod
    def _speculative_buffers(ws: DispatchWorkspace, out: Tensor) -> DispatchBuffers:
        """A speculative dispatch's outputs: the workspace's, with the rows ``out``."""
        return DispatchBuffers(
            tab=ws.tab, skip=ws.skip, scat=ws.scat, out=out, out_w=ws.out_w, out_e=ws.out_e, info=ws.info
        )

    def _launch_merged_bound(
        self, stream: int, ws: DispatchWorkspace, out: Tensor, mirror: Tensor, inp: Tensor | QuantizeOnSend,
        ids: Tensor, w: Tensor | None, src: Tensor, caller: bool, plain_at: tuple | None = None,
    ) -> bool:  # fmt: skip
        """The layout and row kernel launches of a speculative dispatch of ``inp`` into the rows ``out``
        on ``stream`` through the launches bound to ``ws`` (:meth:`.engine.TritonEPEngine.bind_merged_dispatch`;
        bound on the first call of a variant and row capacity, after its launches through the
        specifications left plans), or a CUDA graph of them once the same addresses came a second
        time (kept in ``ws.plain_graphs`` under ``plain_at`` too, where given); ``False`` (nothing
        launched) where there are none."""
        if _launch_hooks_set():  # (a profiler's hooks see every launch through Triton)
            return False
        x = inp.x if isinstance(inp, QuantizeOnSend) else inp
        xp, ip, sp = x.data_ptr(), ids.data_ptr(), src.data_ptr()
        wp = w.data_ptr() if w is not None else self._dummy_w_address
        n, width = x.shape
        op = out.data_ptr()
        # what a graph bakes in: the addresses and token count (the alignments with them), the variant
        # (first what the layer's common case takes from the call: dispatch_plain builds the rest)
        at = (
            xp, ip, wp, n, ids.dtype, sp, op, caller, x.dtype, width, None if w is None else w.dtype, src.dtype,
            out.dtype, out.shape[0],
        )  # fmt: skip
        graph = ws.graphs.get(at) if self.eager_graphs else None
        if graph is None:
            key = (*at[7:], ids.dtype, xp % 16, ip % 16, wp % 16, sp % 16)
            launches = ws.bound.get(key)
            if launches is None:
                launches = self.engine.bind_merged_dispatch(
                    stream, self._speculative_buffers(ws, out), ws.info, mirror, (x, ids, w, src),
                    caller_scatter=caller,
                )  # fmt: skip
                if launches is None:
                    return False
                ws.bound[key] = launches
            if self.eager_graphs and self._graph_due(ws.graphs, ws.sightings, at):
                graph = self._capture_merged(
                    ws, at, (xp, ip, wp, sp, n, op), out, mirror, (x, ids, w, src), caller
                )
            if graph is None:
                self.engine.launch_merged_bound(launches, xp, ip, wp, sp, n, op)  # type: ignore[arg-type]
                return True
        if plain_at is not None:
            ws.plain_graphs[plain_at] = graph
        graph.launch(stream)
        self.engine.merged_replayed()
        self.graph_replays += 1
        return True

    @staticmethod
    def _graph_due(graphs: dict, sightings: dict[tuple, int], at: tuple) -> bool:
        """Whether a call at the addresses ``at`` gets a CUDA graph now: at their second sighting, while
        ``graphs`` holds fewer than :data:`GRAPHS_PER_WORKSPACE`."""
        seen = sightings.get(at, 0) + 1
        if seen == 1:
            if len(sightings) >= SIGHTINGS_PER_WORKSPACE:
                sightings.clear()
            sightings[at] = 1
            return False
        return len(graphs) < GRAPHS_PER_WORKSPACE

    def _capture(
        self, bind: Callable[[int], Any], launch: Callable[[Any], None], graphs: dict, at: tuple
    ) -> LaunchGraph | None:
        """A CUDA graph of ``launch(bind(stream))``, the launches bound by ``bind`` to the raw ``stream``
        it is given (a side stream, under capture; ``None``: nothing to launch), kept in ``graphs``
        under ``at``; ``None`` (and no graphs from now on, with a warning) where the capture fails."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        stream = self._capture_stream
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    bound = bind(stream.cuda_stream)
                    if bound is not None:
                        launch(bound)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            self.eager_graphs = False
            warnings.warn(
                f"ep_a2a: capturing an eager call in a CUDA graph failed ({exc}); eager calls launch their "
                "kernels one by one from now on (TritonTuning(eager_graphs=False) skips the attempt)",
                RuntimeWarning,
                stacklevel=5,
            )
            return None
        if bound is None:
            return None
        self.graph_captures += 1
        graphs[at] = kept = LaunchGraph(graph)
        return kept

    def _capture_merged(
        self,
        ws: DispatchWorkspace,
        at: tuple,
        addresses: tuple[int, int, int, int, int, int],
        out: Tensor,
        mirror: Tensor,
        tensors: tuple[Tensor, Tensor, Tensor | None, Tensor],
        caller_scatter: bool,
    ) -> LaunchGraph | None:
        """A CUDA graph of a speculative dispatch's two launches for the call ``at`` (its key in
        ``ws.graphs``) at ``addresses`` (what :meth:`launch_merged_bound` takes)."""

        def bind(stream: int) -> tuple[BoundLaunch, BoundLaunch] | None:
            buffers = self._speculative_buffers(ws, out)
            return self.engine.bind_merged_dispatch(
                stream, buffers, ws.info, mirror, tensors, caller_scatter=caller_scatter
            )

        def launch(launches: tuple[BoundLaunch, BoundLaunch]) -> None:
            self.engine.launch_merged_bound(launches, *addresses, capturing=True)

        return self._capture(bind, launch, ws.graphs, at)

    def _descriptor(
        self, n: int, exp_indices: Tensor, caller: bool, ws: DispatchWorkspace,
        rb: dict[str, torch.Tensor] | None = None, npk: list[int] | None = None,
    ) -> EPAllToAllLayoutDesc:  # fmt: skip
        """The descriptor of an exact-shape dispatch of ``n`` tokens into ``ws`` but what its counts
        decide (``num_recv_rows``, ``recv_expert_indices``; the host counts): :meth:`_result` completes
        it. Built while the GPU works out the counts."""
        W = self.config.world_size
        return EPAllToAllLayoutDesc(
            num_dispatch_token_cur_rank=n,
            num_input_tokens_per_rank=ws.n_in_host,
            send_reqs_recv_tensor=None,
            topk_indices_tensor=exp_indices,
            token_dst_scatter_idx=ws.scat if self._offsets_int32 else ws.scat.to(self.config.offset_dtype),
            skipped_token_mapping_indices=None,
            skipped_token_topk_mapping_indices=ws.skip,
            num_recv_tokens_per_expert=ws.rows_exp,
            num_recv_tokens_per_rank=ws.n_recv_host,
            num_recv_rows=0,
            recv_expert_indices=ws.out_e,
            caller_scatter=caller,
            backend_state=ws.state
            if rb is None
            else _TritonState(
                owner=id(self),
                tab=ws.tab,
                n_src=ws.n_src,
                remote=rb,
                npk_recv=npk[W:] if npk is not None else None,
            ),
        )

    def _result(
        self,
        desc: EPAllToAllLayoutDesc,
        outs: tuple[Tensor, Tensor, Tensor],
        has_w: bool,
        ws: DispatchWorkspace,
        counts: np.ndarray,
        rows: int,
    ) -> DispatchResult:
        """``(output, weights, descriptor)`` of an exact-shape dispatch into ``ws`` whose counts are in
        (``counts``: ``info``'s values from index 2 on, the tokens and rows per source rank first),
        ``desc`` completed (:meth:`_descriptor`); ``outs``: its rows, their weights and local experts, of
        exactly ``rows`` rows (the weights: one element without weights)."""
        out, out_w, out_e = outs
        self._combine_allowed = True
        ws.host_counts_np[:] = counts[: 2 * self.config.world_size]
        desc.num_recv_rows, desc.recv_expert_indices = rows, out_e
        return out, (out_w if has_w else None), desc

    def _workspace(self, n: int) -> DispatchWorkspace:
        """This call's outputs but the rows, from the current stream's ring (see :mod:`.workspace`)."""
        return self.workspaces.take(_raw_stream(self._device_index), n)

    def _record_rows(self, rows: int) -> None:
        """Record the rows an exact-shape call received, and the rows the next speculative call's outputs
        get from them (computed here, off the next call's path to its launch)."""
        self._recent_rows.append(rows)
        self._rows_next = _speculative_rows_guess(self._recent_rows, self._worst_rows)

    def _read_info(
        self, info: torch.Tensor, remote: dict[str, torch.Tensor] | None = None, *, bad_ids: bool = True
    ) -> tuple[np.ndarray, list[int] | None]:
        """Copy a dispatch's ``info`` to the host (waits for it); raise if a device wait ran out, and with
        ``bad_ids`` if expert ids were out of range. Returns ``info``'s values (an int64 array of the
        call's own), and with ``remote`` its ``pinfo``'s (records sent to, then received from, each rank;
        copied in the same wait), else ``None``."""
        self._info_host.copy_(info, non_blocking=True)
        if remote is not None:
            assert self._pinfo_host is not None
            self._pinfo_host.copy_(remote["pinfo"], non_blocking=True)
        self._info_event.record(self._current_stream())
        self._wait_event(self._info_event)
        vals = self._info_host.numpy().copy()
        npk = self._pinfo_host.tolist() if remote is not None and self._pinfo_host is not None else None
        self._raise_device_error_word(int(vals[1]))
        if bad_ids:
            self._raise_bad_ids(vals)
        return vals, npk

    def _read_mirror(self) -> np.ndarray:
        """``info``'s values in the host mirror the row kernel's program 0 writes (:meth:`_wait_mirror`); a
        view of the mirror, valid until the next dispatch's launch. Raises as :meth:`_read_info` does."""
        self._wait_mirror()
        m = self._mirror_mv
        if m[1] or m[self._bad_at]:
            self._raise_mirror_words()
        return self._mirror_info

    def _wait_mirror(self) -> None:
        """Poll the host mirror until the row kernel's program 0 wrote this dispatch's epoch into it
        (bounded: a device-side wait runs out first and is reported through the error word)."""
        m, at = self._mirror_mv, self._epoch_at
        if m[at]:
            return
        deadline = time.monotonic() + self._mirror_wait_s
        call, op = self._op
        spins = 0
        while m[at] == 0:
            spins += 1
            if spins % 64 == 0:  # (the board and the clock every 64 polls: a poll stays a few reads)
                self._guard_protocol(call, op)
                if time.monotonic() > deadline:
                    self._mirror_lost = (
                        f"dispatch: rank {self.config.rank}'s row kernel did not publish its receive "
                        f"counts within {self._mirror_wait_s:.0f} s (the GPU is stuck or far behind the host)"
                    )
                    raise EPTimeoutError(
                        self._mirror_lost, step="dispatch/counts", missing_ranks=[self.config.rank]
                    )

    def _raise_mirror_words(self) -> None:
        """Raise for the mirror's nonzero error word or invalid-id count."""
        vals = self._mirror_info
        if vals[1]:
            self._raise_device_error_word(int(vals[1]))
        if vals[-1]:
            self._raise_bad_ids(vals)

    def _fit_speculative_rows(
        self, rows: int, call: _Call, info: torch.Tensor, bufs: DispatchBuffers
    ) -> None:
        """After a speculative dispatch of ``rows`` rows into ``bufs``: when they outgrew the outputs
        (the kernel dropped the rows past their end), new outputs of exactly ``rows`` rows replace them in
        ``bufs`` and a second writing pass fills them."""
        eng = self.engine
        assert bufs.out is not None
        if rows > bufs.out.shape[0]:
            # it rewrites every row, the slot table and the scatter indices (the received rows stay in
            # the heap until this rank's next dispatch starts)
            self.speculative_overflows += 1
            bufs.out, bufs.out_w, bufs.out_e = eng.alloc_dispatch_rows(
                rows, with_weights=call.has_w, dtype=call.input.dtype
            )
            eng.launch_dispatch(
                call.input, call.exp_indices, call.weight, call.src, bufs, caller_scatter=call.caller,
                info=info, send=False, rewrite=True,
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

    def combine(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        shape = input.shape
        if len(shape) == 2 and shape[1] == self.config.hidden and input.is_contiguous():
            return self.combine_plain(input, layout_desc)
        return self._combine_checked(input, layout_desc)

    def _combine_checked(self, input: Tensor, layout_desc: EPAllToAllLayoutDesc) -> Tensor:
        """:meth:`combine` one step at a time (every case; :meth:`combine_plain` takes the common one)."""
        if self._finalized or self._mirror_lost is not None:
            self._check_usable()
        state = layout_desc.backend_state
        if type(state) is not _TritonState or state.owner != id(self):
            if isinstance(state, LowLatencyDispatch) and state.state.owner == id(self):
                return self._ll_combine(input, state)
            raise ValueError("layout_desc was not produced by this triton backend's dispatch")
        call = self._start("combine", check=False)
        out = self._combine(
            input, state, layout_desc.topk_indices_tensor, layout_desc.num_dispatch_token_cur_rank, reuse=True
        )
        # (launched first: the GPU is busy while the host checks that every peer combines too, and
        # that none is in another operation)
        if self.board.peers:
            self._guard_protocol(call, "combine", "combine")
        return out

    def combine_plain(self, input: Tensor, layout_desc: EPAllToAllLayoutDesc) -> Tensor:
        """:meth:`combine` of the layer's common case (see the base class; :meth:`combine` takes it too
        for ``[rows, hidden]`` contiguous rows): the steps of :meth:`_combine_checked` for a dispatch
        not combined yet, with no per-step checks. Rows, descriptor and output at the addresses of an
        earlier combine replay its CUDA graph (``eager_graphs``); other addresses launch through the
        bound launch; the call is published on the operation board once launched. Anything else goes
        through :meth:`_combine_checked`."""
        state = layout_desc.backend_state
        n, dtype = layout_desc.num_dispatch_token_cur_rank, input.dtype
        if (
            type(state) is not _TritonState
            or state.owner != self._id
            or not self._combine_allowed
            or n == 0
            or input.shape[0] == 0
            or dtype not in _PLAIN_COMBINE_DTYPES
            or state.remote is not None
            or self._finalized
            or self._mirror_lost is not None
            or _launch_hooks_set()
        ):
            return self._combine_checked(input, layout_desc)
        ids = layout_desc.topk_indices_tensor
        stream = _raw_stream(self._device_index)
        # (rows ``hidden`` wide: the layer's checks, or combine's)
        out = self.combine_outputs.take(stream, n, self.config.hidden, dtype)
        at = _combine_graph_key(input, state, ids, n, out)
        graph = self._combine_graphs.get(at) if self.eager_graphs else None
        if graph is not None:
            graph.launch(stream)
            self.engine.combine_replayed()
            self.graph_replays += 1
        elif not self._launch_combine_bound(stream, input, state, ids, n, out, graphs=True):
            self.engine.launch_combine(input, state.tab, ids, state.n_src, out)
        self._combine_allowed = False
        # (published once launched: the peers wait for this rank's kernel either way, and the board is
        # read only now)
        board = self.board
        call = board.publish("combine")
        self._op = (call, "combine")
        if board.peers:
            self._guard_protocol(call, "combine", "combine")
        return out

    def combine_per_slot(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        """Rows back without summing: ``[n, topk, C]`` (zeros for dropped slots); ``input``: ``[R, C]``.

        Used by the layer for routing-weight gradients (``C == 1``). Runs ``topk`` combines of the rows
        of one slot each, with a device-side barrier before each (so back-to-back combines never
        overwrite rows a peer is still reading): correct, not fast.
        """
        self._check_usable()
        state = layout_desc.backend_state
        if isinstance(state, LowLatencyDispatch):
            raise NotImplementedError(
                "the low-latency mode (TritonTuning(low_latency=True)) has no per-slot combine (no gradient "
                "of the routing weights): use the normal mode for training"
            )
        if not isinstance(state, _TritonState) or state.owner != id(self):
            raise ValueError("layout_desc was not produced by this triton backend's dispatch")
        if input.dim() != 2 or input.shape[1] > self.config.hidden:
            raise ValueError(
                f"input must be [rows, C] with C <= {self.config.hidden}, got {tuple(input.shape)}"
            )
        if not input.dtype.is_floating_point or input.dtype.itemsize > 4:
            raise ValueError(f"input dtype must be a float type of at most 4 bytes, got {input.dtype}")
        n = layout_desc.num_dispatch_token_cur_rank
        call = self._start("combine_per_slot")
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
        self._guard_protocol(call, "combine_per_slot", "combine")
        return torch.stack(outs, dim=1)

    def _combine(
        self, input: Tensor, state: _TritonState, exp_indices: Tensor, n: int, *, reuse: bool = False
    ) -> Tensor:
        """One combine into a new output, or with ``reuse`` one of :attr:`combine_outputs` (never while
        capturing: a graph keeps the output's address)."""
        shape, dtype, hidden = input.shape, input.dtype, self.config.hidden
        if len(shape) != 2 or shape[1] != hidden:
            raise ValueError(f"input must be [rows, {hidden}], got {tuple(shape)}")
        if not dtype.is_floating_point or dtype.itemsize > 4:
            raise ValueError(f"input dtype must be a float type of at most 4 bytes, got {dtype}")
        if not input.is_contiguous():
            input = input.contiguous()
        stream = _raw_stream(self._device_index)
        if reuse:
            out = self.combine_outputs.take(stream, n, hidden, dtype)
        else:
            out = torch.empty(n, hidden, dtype=dtype, device=self.device)
        if not self._combine_allowed:
            # another combine of a dispatch already combined (as DeepEP reuses a handle): a device-side
            # barrier first, so that no peer is still reading the rows the last combine sent it
            self.engine.launch_barrier()
        bound = (
            state.remote is None
            and shape[0] > 0
            and self._launch_combine_bound(stream, input, state, exp_indices, n, out, graphs=reuse)
        )
        if not bound:
            self.engine.launch_combine(
                input, state.tab, exp_indices, state.n_src, out, remote=state.remote, npk_recv=state.npk_recv
            )
        self._combine_allowed = False
        return out

    def _launch_combine_bound(
        self,
        stream: int,
        y: Tensor,
        state: _TritonState,
        ids: Tensor,
        n: int,
        out: Tensor,
        *,
        graphs: bool = False,
    ) -> bool:
        """The combine launch through the launch bound for its variant and stream
        (:meth:`.engine.TritonEPEngine.bind_combine`, bound after its launch through the specification
        left a plan), or with ``graphs`` (an exact-shape combine, never under a capture of the caller's)
        as a CUDA graph once the same addresses came a second time; ``False`` (nothing launched) where
        there is none. ``y``: rows ``hidden`` wide, at least one."""
        if n == 0 or _launch_hooks_set():
            return False
        n_src = state.n_src
        at = _combine_graph_key(y, state, ids, n, out)
        yp, ip, sp, dtype = at[0], at[2], at[3], at[6]  # (for the bound launch's key)
        graph = self._combine_graphs.get(at) if graphs and self.eager_graphs else None
        if graph is None:
            key = (stream, dtype, ids.dtype, yp % 16, ip % 16, sp % 16)
            launch = self._bound_combines.get(key)
            if launch is None:
                launch = self.engine.bind_combine(stream, y, ids, n_src, out)
                if launch is None:
                    return False
                if len(self._bound_combines) >= 64:  # (streams come and go)
                    self._bound_combines.clear()
                self._bound_combines[key] = launch
            if (
                graphs
                and self.eager_graphs
                and self._graph_due(self._combine_graphs, self._combine_sightings, at)
            ):
                graph = self._capture_combine(at, y, ids, n_src, out)
            if graph is None:
                self.engine.launch_combine_bound(launch, *at[:6])
                return True
        graph.launch(stream)
        self.engine.combine_replayed()
        self.graph_replays += 1
        return True

    def _capture_combine(
        self, at: tuple, y: Tensor, ids: Tensor, n_src: Tensor, out: Tensor
    ) -> LaunchGraph | None:
        """A CUDA graph of a combine's launch for the call ``at`` (the addresses and token count
        :meth:`.engine.TritonEPEngine.launch_combine_bound` takes, then the variant)."""

        return self._capture(
            lambda stream: self.engine.bind_combine(stream, y, ids, n_src, out),
            lambda bound: self.engine.launch_combine_bound(bound, *at[:6], capturing=True),
            self._combine_graphs,
            at,
        )

    # ------------------------------------------------------------------ CUDA-graph mode
    def dispatch_static(
        self,
        input: torch.Tensor | QuantizeOnSend,
        exp_indices: torch.Tensor,
        weight: torch.Tensor | None = None,
    ) -> StaticDispatch:
        """Dispatch with fixed shapes and no host synchronisation (capturable in a CUDA graph).

        Args:
            input: ``[n, hidden]`` token dtype, or packed FP8 rows (:meth:`pack_fp8`), or rows the row
                kernel quantizes to them (:meth:`quantize_fp8`) (``n`` fixed for the graph, ``<= max_tokens``).
            exp_indices: ``[n, topk]`` int32 or int64 (-1 = dropped).
            weight: ``[n, topk]`` weight dtype or ``None`` (fixed for the graph).

        Returns:
            :class:`StaticDispatch` (``output``: rows of ``input``'s dtype and width); its buffers are
            reused by the next static call of the same row dtype.
        """
        self._check_usable()
        self.engine.check_rows(input)
        if self.low_latency is not None:
            return self._ll_dispatch(input, exp_indices, weight)  # type: ignore[return-value]
        if self.remote_ranks:
            raise NotImplementedError(
                "dispatch_static (CUDA-graph mode) is not built for groups with remote peers (the host sizes "
                "their puts from the counts); use dispatch / combine"
            )
        if not _capturing():  # (graph replays do not pass the host)
            self._start("dispatch_static")
        eng, W = self.engine, self.config.world_size
        fp8 = input.dtype == FP8_ROW_DTYPE
        b = self._static_fp8 if fp8 else self._static
        if b is None or b.skip.shape[0] != input.shape[0] or b.out is None or b.out.dtype != input.dtype:
            b = eng.alloc_dispatch_outputs(
                input.shape[0], eng.worst_case_rows(), with_weights=True, dtype=input.dtype
            )
            b.info = torch.zeros(eng.info_len, dtype=torch.int64, device=self.device)
            if fp8:
                self._static_fp8 = b
            else:
                self._static = b
        info = b.info
        assert info is not None
        assert b.out is not None
        assert b.out_e is not None
        eng.launch_layout(exp_indices, caller_scatter=False, info=info)
        if eng.ce_pieces:
            eng.launch_counts(info)
        eng.launch_dispatch(
            input, exp_indices, weight, eng.pos, b, caller_scatter=False, info=info, counts=not eng.ce_pieces
        )
        self._combine_allowed = True
        return StaticDispatch(
            output=b.out,
            weights=b.out_w if weight is not None else None,
            recv_expert_indices=b.out_e,
            num_recv_tokens_per_expert=info[2 + 2 * W : -1],
            num_recv_rows=info[0],
            token_dst_scatter_idx=b.scat,
            exp_indices=exp_indices,
            state=_TritonState(owner=id(self), tab=b.tab, n_src=info[2 : 2 + W]),
            num_invalid_ids=info[-1],
        )

    def combine_static(self, input: torch.Tensor, dispatched: StaticDispatch) -> torch.Tensor:
        """Combine for :meth:`dispatch_static` (``input``: ``[worst-case rows, hidden]``; rows past the
        valid count are never read). Returns ``[n, hidden]``."""
        self._check_usable()
        if isinstance(dispatched, LowLatencyDispatch):
            return self._ll_combine(input, dispatched)
        if not _capturing():
            self._start("combine_static")
        return self._combine(input, dispatched.state, dispatched.exp_indices, dispatched.exp_indices.shape[0])

    # ------------------------------------------------------------------ low-latency mode
    def _ll_dispatch(
        self, input: torch.Tensor | QuantizeOnSend, exp_indices: torch.Tensor, weight: torch.Tensor | None
    ) -> LowLatencyDispatch:
        """One low-latency dispatch into the engine's fixed buffers (CUDA-graph safe: no host sync)."""
        ll = self.low_latency
        assert ll is not None
        if not _capturing():
            self._start("dispatch_static")  # (every low-latency dispatch is one operation on the board)
        res = ll.dispatch(input, exp_indices, weight)
        res.state = _TritonState(owner=id(self), tab=ll.tab, n_src=res.num_input_tokens_per_rank)
        self._combine_allowed = True
        return res

    def _ll_combine(self, input: torch.Tensor, dispatched: LowLatencyDispatch) -> torch.Tensor:
        ll = self.low_latency
        if ll is None or dispatched.state is None or dispatched.state.owner != id(self):
            raise ValueError("dispatched was not produced by this triton backend's low-latency dispatch")
        if not _capturing():
            self._start("combine_static")
        return ll.combine(input, dispatched)

    def _ll_dispatch_exact(
        self, input: torch.Tensor | QuantizeOnSend, exp_indices: torch.Tensor, weight: torch.Tensor | None,
        full_scatter_indices: torch.Tensor | None,
    ) -> DispatchResult:  # fmt: skip
        """An exact-shape dispatch in the low-latency mode: the kernel, then one wait for its counts;
        views of the first ``R`` rows of the fixed buffers (valid until the next dispatch)."""
        if full_scatter_indices is not None:
            raise NotImplementedError(
                "full_scatter_indices: the low-latency mode places the rows itself (in the usual order); use "
                "the normal mode to place them"
            )
        ll = self.low_latency
        assert ll is not None
        res = self._ll_dispatch(input, exp_indices, weight)
        host = self._ll_host
        host[:-1].copy_(res.info, non_blocking=True)
        host[-1:].copy_(ll.state[3:4], non_blocking=True)
        self._info_event.record(self._current_stream())
        self._wait_event(self._info_event)
        vals = host.numpy().copy()
        self._ll_raise(int(vals[-1]))
        vals = vals[:-1]
        self._raise_bad_ids(vals)
        W, rows = self.config.world_size, int(vals[0])
        n = int(exp_indices.shape[0])
        desc = EPAllToAllLayoutDesc(
            num_dispatch_token_cur_rank=n,
            num_input_tokens_per_rank=torch.from_numpy(vals[2 : 2 + W]),
            send_reqs_recv_tensor=None,
            topk_indices_tensor=exp_indices,
            # (the source never learns the receivers' rows in this mode)
            token_dst_scatter_idx=torch.full(
                (n, self.config.topk), -1, dtype=self.config.offset_dtype, device=self.device
            ),
            skipped_token_mapping_indices=None,
            skipped_token_topk_mapping_indices=None,
            num_recv_tokens_per_expert=res.num_recv_tokens_per_expert.clone(),
            num_recv_tokens_per_rank=torch.from_numpy(vals[2 + W : 2 + 2 * W]),
            num_recv_rows=rows,
            recv_expert_indices=res.recv_expert_indices[:rows],
            backend_state=res,
        )
        out_w = res.weights[:rows] if res.weights is not None else None
        return res.output[:rows], out_w, desc

    def refuse_dispatch(self) -> None:
        """Low-latency mode: this rank's dispatch was refused on the host (more tokens than ``max_tokens``):
        run the exchange with no rows and the refusal marked, so that every peer records an error naming
        this rank instead of waiting for its rows. Nothing in the normal mode (whose peers time out)."""
        ll = self.low_latency
        if ll is None or self._finalized or _capturing():
            return
        cfg = self.config
        self._start("dispatch_static", check=False)
        rows = torch.empty(0, cfg.hidden, dtype=cfg.token_dtype, device=self.device)
        ids = torch.empty(0, cfg.topk, dtype=torch.int32, device=self.device)
        ll.dispatch(rows, ids, None, refuse=True)

    def _ll_raise(self, err: int) -> None:
        """Raise for a nonzero error word of the low-latency engine."""
        if err:
            assert self.low_latency is not None
            try:
                self.low_latency.check_error(err)
            except EPTimeoutFromDevice as exc:
                self._raise_device_error(exc)

    # ------------------------------------------------------------------ FP8 rows
    def pack_fp8(self, x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """FP8 rows in DeepEP's format as the rows this backend moves: packed rows of
        :data:`~.engine.FP8_ROW_DTYPE` (:func:`~.engine.pack_fp8_rows`).

        Raises:
            ValueError: the layer's buffers hold narrower rows (a 1-byte ``dtype`` other than
                ``float8_e4m3fn``).
        """
        self._check_fp8_rows_fit()
        return pack_fp8_rows(x_fp8, scales)

    def quantize_fp8(self, x: torch.Tensor) -> torch.Tensor | QuantizeOnSend:
        """bf16 / fp16 / fp32 rows for an FP8 dispatch (``fp8=True``): a :class:`~.engine.QuantizeOnSend`,
        so that the row kernel quantizes each row as it sends and writes it (no FP8 copy first). With
        copy-engine dispatch (``TritonTuning(copy_engine=True)``), whose copies move rows as they are, the
        rows are quantized with torch operations first (the base class's :meth:`quantize_fp8`).

        Raises:
            ValueError: as :meth:`pack_fp8`.
        """
        if self.copy_engine:
            return super().quantize_fp8(x)
        self._check_fp8_rows_fit()
        return QuantizeOnSend(x)

    def _check_fp8_rows_fit(self) -> None:
        need, have = fp8_row_bytes(self.config.hidden), self.layout.row_bytes
        if need > have:
            raise ValueError(
                f"FP8 dispatch: a packed FP8 row takes {need} bytes, this layer's buffers hold {have} per "
                f"row (dtype={self.config.token_dtype}); build the layer with dtype=torch.float8_e4m3fn "
                "(or a dtype of at least 2 bytes)"
            )

    def unpack_fp8(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Received packed rows as ``(x_fp8, scales)`` views (:func:`~.engine.unpack_fp8_rows`)."""
        return unpack_fp8_rows(rows, self.config.hidden)

    # ------------------------------------------------------------------ the rest
    def barrier(self, *, intra_node_only: bool = False, stream: torch.cuda.Stream | None = None) -> None:
        self._check_usable()
        self._start("barrier")
        stream = stream or torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            self.engine.launch_barrier()
        done = torch.cuda.Event()
        done.record(stream)
        self._wait_event(done)
        self.check_errors()

    def finalize(self) -> None:
        if self._finalized:
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.ep_group)
        self.workspaces.clear()
        self.combine_outputs.clear()
        self.heap.free()
        if self.low_latency is not None:
            self._ll_heap.free()
        self.board.close()
        if self._own_monitor:
            self._monitor.destroy()
        self._finalized = True
