"""The exact-shape dispatch's small outputs, carved from one allocation and reused once nothing refers
to them.

A dispatch returns, besides its rows, tensors that the kernels write and the caller keeps: the slot
table, the per-slot scatter and skip indices, the call's counts (``info``) and the per-row weights and
local experts. They take a few hundred KB at most; allocating them afresh on every call costs more host
time than the kernels take at decode sizes. A :class:`DispatchWorkspace` holds them all in one buffer,
with views made once; a :class:`WorkspaceRing` hands out, per CUDA stream, a workspace that no tensor of
an earlier call refers to any more.

Lifetime rule: a workspace is reused only when nothing outside the ring refers to it: no view of its
buffer besides the ring's own (counted on the buffer's storage, as ``torch.compile``'s CUDA-graph trees
check their outputs) and no reference to the views it hands out as they are (counted on those tensors).
So a tensor a dispatch returned is never overwritten while the caller holds it, or anything viewing it,
or the descriptor holding it. Reuse is in stream order on the stream the workspace was handed out on
(one ring per stream), as PyTorch's caching allocator reuses freed memory: a caller that reads these
tensors on another stream keeps them referenced until that stream's work is done (``record_stream``
does not apply to them). The rows themselves are allocated per call, so that their memory goes back to
PyTorch's allocator when the caller drops them.
"""

from __future__ import annotations

import sys
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


class DispatchWorkspace:
    """One exact-shape dispatch's outputs but the rows, as views of one buffer on the engine's device.

    Attributes:
        info: ``[info_len]`` int64, the call's counts (:meth:`~.engine.TritonEPEngine.info_fields`).
        n_src: ``info``'s tokens per source ``[W]``; ``rows_exp``: its rows per local expert ``[L]``.
        tab: ``[W, max_tokens, topk]`` int32 slot table.
        skip, scat: ``[n, topk]`` int32 of the call's ``n`` tokens (:meth:`for_tokens`).
        out_w: ``[worst-case rows]`` weight dtype; ``out_e``: the same int32 (the caller gets their first
            rows).
    """

    def __init__(self, engine: TritonEPEngine) -> None:
        W, T, K, rows = engine.world_size, engine.max_tokens, engine.topk, engine.worst_case_rows()
        regions = (
            ("info", engine.info_len, torch.int64),
            ("tab", W * T * K, torch.int32),
            ("skip", T * K, torch.int32),
            ("scat", T * K, torch.int32),
            ("out_w", rows, engine.weight_dtype),
            ("out_e", rows, torch.int32),
        )
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
        self.n = -1  # (no views for a token count yet: for_tokens makes them)
        self.skip = self.scat = self._skip_all[:0].view(0, K)
        self._storage = buf.untyped_storage()
        #: ``_refs()`` while only the ring refers to the workspace (taken by for_tokens, once this
        #: constructor's locals are gone)
        self._idle: tuple[int, ...] = ()

    def for_tokens(self, n: int) -> DispatchWorkspace:
        """``skip`` and ``scat`` viewed for ``n`` tokens (new views when ``n`` changed); returns ``self``.
        Call only on a workspace just taken from the ring (nothing else refers to it)."""
        if n != self.n:
            K = self.topk
            self.skip = self._skip_all[: n * K].view(n, K)
            self.scat = self._scat_all[: n * K].view(n, K)
            self.n = n
            self._idle = self._refs()
        return self

    def _refs(self) -> tuple[int, ...]:
        """Tensors sharing the buffer, and references to each view handed out as it is."""
        count = _storage_use_count(self._storage._cdata) if _storage_use_count is not None else 0
        return (
            count, sys.getrefcount(self.info), sys.getrefcount(self.n_src), sys.getrefcount(self.rows_exp),
            sys.getrefcount(self.tab), sys.getrefcount(self.skip), sys.getrefcount(self.scat),
        )  # fmt: skip

    def idle(self) -> bool:
        """Whether nothing outside the ring refers to this workspace (it may be written again)."""
        return _storage_use_count is not None and self._refs() == self._idle


class WorkspaceRing:
    """Per CUDA stream (its raw handle), up to :data:`RING_SIZE` :class:`DispatchWorkspace`\\ s, handed out
    under the lifetime rule of this module."""

    def __init__(self, engine: TritonEPEngine) -> None:
        self.engine = engine
        self._rings: dict[int, list[DispatchWorkspace]] = {}
        #: workspaces allocated (kept in a ring or not)
        self.allocated = 0

    def take(self, stream: int, n: int) -> DispatchWorkspace:
        """An idle workspace of ``stream``'s ring for a call of ``n`` tokens, else a new one (kept in the
        ring while it has room)."""
        ring = self._rings.get(stream)
        if ring is None:
            if len(self._rings) >= MAX_STREAMS:
                self._rings.clear()
            ring = self._rings[stream] = []
        for ws in ring:
            if ws.idle():
                return ws.for_tokens(n)
        ws = DispatchWorkspace(self.engine)
        self.allocated += 1
        if len(ring) < RING_SIZE and _storage_use_count is not None:
            ring.append(ws)
        return ws.for_tokens(n)

    def clear(self) -> None:
        self._rings.clear()
