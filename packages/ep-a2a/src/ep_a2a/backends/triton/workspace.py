"""The exact-shape dispatch's outputs, carved from one allocation and reused once nothing refers to them.

A dispatch returns, besides its rows, tensors that the kernels write and the caller keeps: the slot
table, the per-slot scatter and skip indices, the call's counts (``info``) and the per-row weights and
local experts. They take a few hundred KB at most; allocating them afresh on every call costs more host
time than the kernels take at decode sizes. A :class:`DispatchWorkspace` holds them all in one buffer,
with views made once (the views of a call's first ``R`` rows are kept for the next call of ``R`` rows),
and for decode-sized layers the worst-case rows too (:data:`RING_ROWS_BYTES`); a :class:`WorkspaceRing`
hands out, per CUDA stream, a workspace that no tensor of an earlier call refers to any more.

Lifetime rule: a workspace is reused only when nothing outside the ring refers to it: no view of its
buffer besides the ring's own (counted on the buffer's storage, as ``torch.compile``'s CUDA-graph trees
check their outputs) and no reference to the views it hands out as they are (counted on those tensors).
So a tensor a dispatch returned is never overwritten while the caller holds it, or anything viewing it,
or the descriptor holding it. Reuse is in stream order on the stream the workspace was handed out on
(one ring per stream), as PyTorch's caching allocator reuses freed memory: a caller that reads these
tensors on another stream keeps them referenced until that stream's work is done (``record_stream``
does not apply to them).

Rows of larger layers are allocated per call; those of the layer's common case on a layer whose
rows are sized from the last calls' counts (the backend's speculative flow) are kept by the workspace
the call took (:meth:`DispatchWorkspace.keep_rows`): a later such call into that workspace writes
them again, under the same rule, when they hold its rows and at most a third more
(:meth:`DispatchWorkspace.spare_rows`); else it allocates new ones, and the old ones go back to
PyTorch's allocator once the caller drops them. So between calls a stream's ring holds the rows of as
many calls as the caller held at once (at most :data:`RING_SIZE`, each of at most the worst case's
rows), until the backend is finalized.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ep_a2a.backends.triton.engine import TritonEPEngine

#: the number of C++ tensors sharing a storage (``None`` where this torch lacks it: no reuse then)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
#: workspaces one stream's ring keeps (more held at once are allocated per call and not kept)
RING_SIZE = 4
#: streams whose rings are kept (more: the table starts over)
MAX_STREAMS = 16
_ALIGN = 256  # regions start on 256-byte boundaries, like fresh allocations
#: worst-case rows of at most this many bytes live in the workspaces (larger: allocated per call)
RING_ROWS_BYTES = 64 << 20
#: combine outputs of at most this many bytes are reused (:class:`OutputRing`; larger: allocated per call)
RING_OUTPUT_BYTES = 16 << 20
#: bytes of the combine outputs one stream's rings keep, over every shape
RING_OUTPUT_STREAM_BYTES = RING_SIZE * RING_OUTPUT_BYTES


#: ``(dtype, width, count)`` of the received rows a workspace holds
RowsSpec = tuple[torch.dtype, int, int]
#: builds a workspace's :attr:`DispatchWorkspace.state`
MakeState = Callable[["DispatchWorkspace"], object]


@functools.cache
def _cu_graph_launch() -> Callable[[int, int], int] | None:
    """The CUDA driver's ``cuGraphLaunch(exec, stream)`` (``None`` where the driver cannot be loaded)."""
    try:
        launch = ctypes.CDLL("libcuda.so.1").cuGraphLaunch
    except (OSError, AttributeError):
        return None
    launch.argtypes, launch.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    return launch


class LaunchGraph:
    """A captured CUDA graph of a dispatch's or a combine's launches, launched on a given stream by the driver's
    ``cuGraphLaunch`` (what ``CUDAGraph.replay`` calls, without its random-number bookkeeping, which
    a graph of these kernels does not use), or by ``replay`` where the driver cannot be loaded."""

    __slots__ = ("exec", "graph", "launcher")

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.launcher = graph, _cu_graph_launch()
        self.exec = graph.raw_cuda_graph_exec() if self.launcher is not None else 0

    def launch(self, stream: int) -> None:
        """Run the graph on ``stream`` (a raw handle; the current stream of the graph's device)."""
        if self.launcher is None:
            self.graph.replay()
            return
        err = self.launcher(self.exec, stream)
        if err:
            raise RuntimeError(f"cuGraphLaunch of an eager call's CUDA graph failed: CUDA error {err}")


class DispatchWorkspace:
    """One exact-shape dispatch's outputs (the rows too when ``rows`` is given), as views of one buffer
    on the engine's device.

    Args:
        engine: the engine whose dispatches write it.
        rows: ``(dtype, width, count)`` of the received rows it holds (``None``: none).
        make_state: builds :attr:`state` from the workspace (``None``: an inert object).
        fp8_hidden: with ``rows`` of packed FP8 rows of this many channels: the workspace also holds
            ``max_tokens`` packed input rows (:attr:`packed_in`) and the ``(x_fp8, scales)`` views of
            the first rows (:meth:`first_fp8_rows`); 0: neither.

    Attributes:
        info: ``[info_len]`` int64, the call's counts (:meth:`~.engine.TritonEPEngine.info_fields`).
        n_src: ``info``'s tokens per source ``[W]``; ``rows_exp``: its rows per local expert ``[L]``.
        tab: ``[W, max_tokens, topk]`` int32 slot table.
        skip, scat: ``[n, topk]`` int32 of the call's ``n`` tokens (:meth:`for_tokens`).
        out_w: ``[worst-case rows]`` weight dtype; ``out_e``: the same int32 (the caller gets their first
            rows).
        out: ``[count, width]`` rows of ``rows``' dtype, or ``None``; ``out_ptr``: its address (0 without).
        host_counts: ``[2 * W]`` int64 on the host, the call's tokens per source rank then rows per source
            rank (``info[2 : 2 + 2 * W]``), written by the backend; ``n_in_host``, ``n_recv_host``: its
            halves, as the descriptors hold them; ``host_counts_mv``: a memoryview of them.
        state: the backend's record of this workspace that its descriptors carry (one object for
            every call, handed out and counted as the views are).
        bound: the launches bound to this workspace's tensors (filled by the backend).
        plain_key: the part of a graph key fixed for this workspace (filled by the backend).
        graphs, sightings: CUDA graphs of those launches by the call's addresses, and how often each
            set of addresses came (filled by the backend).
        plain_graphs: those of ``graphs`` whose key's rest is ``plain_key``, by the key's first part
            (filled by the backend).
        fp8_graphs, fp8_sightings: as ``graphs`` and ``sightings``, for calls that pack FP8 rows into
            ``packed_in`` (filled by the backend).
        last_rows: the row count of the views :meth:`first_rows` keeps (the last call's).
        packed_in: ``[n, width]`` rows of ``rows``' dtype (:meth:`for_tokens`), where a call packs its
            FP8 rows and scales before they are sent (``fp8_hidden``; else ``None``).
        kept: rows allocated for a call into a workspace without ``out``, kept for its later calls
            (:meth:`keep_rows`, :meth:`spare_rows`), or ``None``; ``kept_ptr``, ``kept_rows``: the
            address and row count of the rows :meth:`keep_rows` was given last.
    """

    def __init__(
        self,
        engine: TritonEPEngine,
        rows: RowsSpec | None = None,
        make_state: MakeState | None = None,
        fp8_hidden: int = 0,
    ) -> None:
        W, T, K, worst = engine.world_size, engine.max_tokens, engine.topk, engine.worst_case_rows()
        regions = [
            ("info", engine.info_len, torch.int64),
            ("tab", W * T * K, torch.int32),
            ("skip", T * K, torch.int32),
            ("scat", T * K, torch.int32),
            ("out_w", worst, engine.weight_dtype),
            ("out_e", worst, torch.int32),
        ]
        if rows is not None:
            regions.append(("out", rows[1] * rows[2], rows[0]))
            if fp8_hidden:
                regions.append(("packed_in", rows[1] * T, rows[0]))
        at, spans = 0, []
        for _, numel, dtype in regions:
            spans.append(at)
            at += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
        buf = torch.empty(at, dtype=torch.uint8, device=engine.device)
        views = {
            name: buf[start : start + numel * dtype.itemsize].view(dtype)
            for (name, numel, dtype), start in zip(regions, spans, strict=True)
        }
        self.topk = K
        self.info = views["info"]
        self.n_src = self.info[2 : 2 + W]
        self.rows_exp = self.info[2 + 2 * W : -1]
        self.tab = views["tab"].view(W, T, K)
        self._skip_all, self._scat_all = views["skip"], views["scat"]
        self.out_w, self.out_e = views["out_w"], views["out_e"]
        self.out = views["out"].view(rows[2], rows[1]) if rows is not None else None
        self.out_ptr = self.out.data_ptr() if self.out is not None else 0
        self.fp8_hidden = fp8_hidden if rows is not None else 0
        self._packed_all = views["packed_in"] if self.fp8_hidden else None
        self._packed_width = rows[1] if rows is not None else 0
        self.packed_in = None if self._packed_all is None else self._packed_all[:0]
        self.host_counts = torch.zeros(2 * W, dtype=torch.int64)
        self.host_counts_np = self.host_counts.numpy()
        self.host_counts_mv = self.host_counts_np.data
        self.n_in_host, self.n_recv_host = self.host_counts[:W], self.host_counts[W:]
        self._host_cdata = self.host_counts.untyped_storage()._cdata
        self.n = -1  # (no views for a token count yet: for_tokens makes them)
        self.skip = self.scat = self._skip_all[:0].view(0, K)
        # the views of the last call's first R rows (replaced, never added: the idle references stay)
        self.last_rows = 0
        self._w_rows, self._e_rows = self.out_w[:0], self.out_e[:0]
        self._out_rows = self.out[:0] if self.out is not None else self.out_e[:0]
        # (the FP8 views of those rows: two views of out_e where there are none, whose counts stay put)
        self._x_rows, self._s_rows = (
            self._fp8_views() if self.fp8_hidden else (self.out_e[:0], self.out_e[:0])
        )
        self.state = make_state(self) if make_state is not None else object()
        self.bound: dict[tuple, object] = {}
        self.plain_key: tuple = ()
        #: CUDA graphs of dispatches into this workspace, by their inputs' addresses (the backend's),
        #: and how often each set of addresses was seen
        self.graphs: dict[tuple, LaunchGraph] = {}
        self.sightings: dict[tuple, int] = {}
        self.plain_graphs: dict[tuple, LaunchGraph] = {}
        #: CUDA graphs of FP8 dispatches that pack into ``packed_in`` first, and their sightings
        self.fp8_graphs: dict[tuple, LaunchGraph] = {}
        self.fp8_sightings: dict[tuple, int] = {}
        self._storage = buf.untyped_storage()
        self._cdata = self._storage._cdata
        #: ``_refs()`` while only the ring refers to the workspace (taken by for_tokens, once this
        #: constructor's locals are gone)
        self._idle: tuple[int, ...] = ()
        self._idle_views: tuple[int, ...] = ()
        #: rows allocated for a call into this workspace when it holds none (``rows`` ``None``), kept
        #: for its later calls (:meth:`keep_rows`, :meth:`spare_rows`), and their row count
        self.kept: torch.Tensor | None = None
        self.kept_ptr = self.kept_rows = 0
        self._kept_storage: torch.UntypedStorage | None = None
        self._kept_cdata = 0
        self._kept_idle = (-1, -1)

    def for_tokens(self, n: int) -> DispatchWorkspace:
        """``skip`` and ``scat`` viewed for ``n`` tokens (new views when ``n`` changed); returns ``self``.
        Call only on a workspace just taken from the ring (nothing else refers to it)."""
        if n != self.n:
            K = self.topk
            self.skip = self._skip_all[: n * K].view(n, K)
            self.scat = self._scat_all[: n * K].view(n, K)
            if self._packed_all is not None:
                width = self._packed_width
                self.packed_in = self._packed_all[: n * width].view(n, width)
            self.n = n
            self._idle = self._refs()
            self._idle_views = self._idle[3:]
        return self

    def first_rows(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Views of the first ``rows`` of ``out_w``, ``out_e`` and ``out`` (``None`` without rows), kept
        for the next call of as many rows. Call only on a workspace taken from the ring for this call."""
        # (views that autograd recorded as a function's outputs are not handed out again)
        if rows != self.last_rows or self._w_rows.requires_grad or self._out_rows.requires_grad:
            self._w_rows, self._e_rows = self.out_w[:rows], self.out_e[:rows]
            if self.out is not None:
                self._out_rows = self.out[:rows]
                if self.fp8_hidden:
                    self._x_rows, self._s_rows = self._fp8_views()
            self.last_rows = rows
        return self._w_rows, self._e_rows, self._out_rows if self.out is not None else None

    def first_fp8_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_fp8, scales)`` views of the rows :meth:`first_rows` returned last (a workspace of packed FP8
        rows: ``fp8_hidden``), kept with them."""
        return self._x_rows, self._s_rows

    def _fp8_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fp8_hidden
        b = self._out_rows.view(torch.uint8)
        return b[:, :h].view(torch.float8_e4m3fn), b[:, h : h + h // 32].view(torch.float32)

    def keep_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Keep ``rows`` (just allocated: nothing else refers to their memory) for the later calls into
        this workspace, in place of the rows it kept before; returns them (their address and row
        count in :attr:`kept_ptr`, :attr:`kept_rows`, also where this torch cannot count their users,
        and nothing is kept)."""
        self.kept_ptr, self.kept_rows = rows.data_ptr(), rows.shape[0]
        if _storage_use_count is not None:
            self.kept = rows
            self._kept_storage = rows.untyped_storage()
            self._kept_cdata = self._kept_storage._cdata
            # (the tensors sharing their memory, and references to their storage object, which is
            # the one every ``untyped_storage()`` of them returns; counted as spare_rows counts them)
            self._kept_idle = (_storage_use_count(self._kept_cdata), sys.getrefcount(self._kept_storage))
        return rows

    def spare_rows(self, rows: int) -> torch.Tensor | None:
        """The kept rows (:meth:`keep_rows`) where nothing but this workspace refers to their memory and
        they serve a call that would allocate ``rows``: they hold them, and at most a third more
        (``None`` otherwise). Call only on a workspace taken from the ring for this call."""
        kept = self.kept
        if kept is None:
            return None
        uses, refs = self._kept_idle
        have = self.kept_rows
        if (
            have - have // 4 <= rows <= have
            and _storage_use_count(self._kept_cdata) == uses  # type: ignore[misc]
            and sys.getrefcount(self._kept_storage) == refs
        ):
            return kept
        return None

    def _view_refs(self) -> tuple[int, ...]:
        """References to each view handed out as it is (the descriptor's record aside)."""
        g = sys.getrefcount  # (a local: eleven lookups fewer per call)
        return (
            g(self.n_in_host), g(self.n_recv_host), g(self.info), g(self.n_src), g(self.rows_exp), g(self.tab),
            g(self.skip), g(self.scat), g(self._w_rows), g(self._e_rows), g(self._out_rows), g(self._x_rows),
            g(self._s_rows),
        )  # fmt: skip

    def _refs(self) -> tuple[int, ...]:
        """Tensors sharing the buffer (and the host counts), references to the descriptor's record, and
        :meth:`_view_refs`."""
        use = _storage_use_count
        if use is None:
            return ()
        return (use(self._cdata), use(self._host_cdata), sys.getrefcount(self.state), *self._view_refs())


class WorkspaceRing:
    """Per CUDA stream (its raw handle), up to :data:`RING_SIZE` :class:`DispatchWorkspace`\\ s, handed out
    under the lifetime rule of this module; each holds ``rows`` and the state ``make_state`` builds, and
    with ``fp8_hidden`` packed input rows and FP8 views (see :class:`DispatchWorkspace`)."""

    def __init__(
        self,
        engine: TritonEPEngine,
        rows: RowsSpec | None = None,
        make_state: MakeState | None = None,
        fp8_hidden: int = 0,
    ) -> None:
        self.engine = engine
        self.rows = rows
        self.make_state = make_state
        self.fp8_hidden = fp8_hidden
        self._rings: dict[int, list[DispatchWorkspace]] = {}
        #: workspaces allocated (kept in a ring or not)
        self.allocated = 0

    def take(self, stream: int, n: int) -> DispatchWorkspace:
        """An idle workspace of ``stream``'s ring for a call of ``n`` tokens, else a new one (kept in the
        ring while it has room). Idle: nothing outside the ring refers to it (its ``_refs()`` are those
        measured when only the ring did)."""
        ring = self._rings.get(stream)
        if ring is None:
            if len(self._rings) >= MAX_STREAMS:
                self._rings.clear()
            ring = self._rings[stream] = []
        use, refs = _storage_use_count, sys.getrefcount
        for ws in ring:
            # (the cheap tests first: a held descriptor, then a held output or view of the buffer)
            idle = ws._idle
            if (
                refs(ws.state) == idle[2]
                and use(ws._cdata) == idle[0]  # type: ignore[misc]
                and use(ws._host_cdata) == idle[1]  # type: ignore[misc]
                and ws._view_refs() == ws._idle_views
            ):
                return ws if ws.n == n else ws.for_tokens(n)
        ws = DispatchWorkspace(self.engine, self.rows, self.make_state, self.fp8_hidden)
        self.allocated += 1
        if len(ring) < RING_SIZE and _storage_use_count is not None:
            ring.append(ws)
        return ws.for_tokens(n)

    def clear(self) -> None:
        self._rings.clear()


class _Output:
    """A combine output kept by an :class:`OutputRing`, with what tells whether it is idle."""

    __slots__ = ("idle_storage", "out", "storage")
    #: ``refs()`` of an output nothing else refers to (measured once, as the workspaces' are)
    idle_refs = -1

    def __init__(self, out: torch.Tensor) -> None:
        """``out``: a fresh output (no view of it exists)."""
        assert _storage_use_count is not None
        self.out, self.storage = out, out.untyped_storage()._cdata
        self.idle_storage = _storage_use_count(self.storage)
        if _Output.idle_refs < 0:
            alone = _Output.__new__(_Output)
            alone.out = torch.empty(0)
            _Output.idle_refs = alone.refs()

    def refs(self) -> int:
        return sys.getrefcount(self.out)


class OutputRing:
    """Per CUDA stream and per shape and dtype, up to :data:`RING_SIZE` combine outputs of at most
    :data:`RING_OUTPUT_BYTES`, handed out under the lifetime rule of this module: an output is reused
    once no tensor but the ring's own refers to its memory and nothing refers to it as it is (and
    never once it requires grad, as autograd's functions mark their outputs). A stream keeps at most
    :data:`RING_OUTPUT_STREAM_BYTES` of outputs: the shapes kept first are dropped first to make room,
    so that batch sizes that alternate keep their outputs (and their combines' CUDA graphs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: stream -> {(rows, width, dtype): its outputs}, the shapes in the order they were kept
        self._rings: dict[int, dict[tuple, list[_Output]]] = {}
        #: stream -> bytes of the outputs its rings keep
        self._kept: dict[int, int] = {}
        #: outputs allocated (kept in a ring or not)
        self.allocated = 0

    def take(self, stream: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """An idle ``[rows, width]`` output of ``stream``'s ring of that shape and dtype, else a new one
        (kept while that ring and the stream's bytes have room)."""
        shapes = self._rings.get(stream)
        if shapes is None:
            if len(self._rings) >= MAX_STREAMS:
                self.clear()
            shapes = self._rings[stream] = {}
            self._kept[stream] = 0
        shape = (rows, width, dtype)
        ring = shapes.get(shape)
        if ring is not None:
            use_count, idle_refs = _storage_use_count, _Output.idle_refs
            for held in ring:
                assert use_count is not None  # (outputs are kept only where it exists)
                if held.out.requires_grad:  # (recorded by autograd as a function's output: forgotten)
                    ring.remove(held)
                    self._kept[stream] -= held.out.nbytes
                    break
                # (idle: no other tensor refers to its memory, nothing but the ring to it)
                if use_count(held.storage) == held.idle_storage and sys.getrefcount(held.out) == idle_refs:
                    return held.out
        out = torch.empty(rows, width, dtype=dtype, device=self.device)
        self.allocated += 1
        nbytes = out.nbytes
        if not 0 < nbytes <= RING_OUTPUT_BYTES or _storage_use_count is None:
            return out
        if ring is None:
            ring = shapes[shape] = []
        if len(ring) < RING_SIZE and self._room(stream, shape, nbytes):
            ring.append(_Output(out))
            self._kept[stream] += nbytes
        return out

    def _room(self, stream: int, shape: tuple, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit ``stream``'s bytes, once the rings of the shapes kept first (other
        than ``shape``) are dropped as needed."""
        shapes, cap = self._rings[stream], RING_OUTPUT_STREAM_BYTES
        for other in list(shapes):
            if self._kept[stream] + nbytes <= cap:
                break
            if other != shape:
                self._kept[stream] -= sum(held.out.nbytes for held in shapes.pop(other))
        return self._kept[stream] + nbytes <= cap

    def clear(self) -> None:
        self._rings.clear()
        self._kept.clear()
