"""Portable backend: ``torch.distributed`` collectives only (NCCL on GPUs, gloo on CPUs).

Dispatch sends each token once per destination rank (not once per expert). It opens with a fixed-size
exchange of counts (which also carries the number of out-of-range expert ids, so a bad call stops on
every rank before any row moves), then makes one ``all_to_all_single`` of packed byte rows, one per
(token, destination rank): the token row, the expert of each of its slots and its weights. The receiver
expands them locally: one stable sort of the received slots by local expert gives its output order
(local expert, source rank, token, slot), and one gather of rows gives the output. The host waits once,
for the counts, which size the payload; everything the counts do not decide is queued before that wait
(the token order per destination, the packed rows) and everything the payload does not need after the
payload (the descriptor's indices, the order combine returns rows in). The host computes what the
counts decide (per-expert counts, receive boundaries and, up to ``_HOST_ORDER_ROWS`` output rows, the
order combine sends rows back in: blocks of (local expert, source rank) taken by source) and one upload
carries it; the per-device constants and the exchange buffers are built once.

Combine returns rows grouped by source rank in the order each source's stable sort of its slots by
expert (or by the caller's row) gives, and sums each token's rows in slot order in float32, rounded
once to the row dtype: one embedding bag over the returned rows, each slot pointing at its row (a
dropped slot at a padding row the bag skips); rows of another dtype go through a dense ``[tokens,
topk]`` grid (zeros for dropped slots). The bag's index is each slot's place in dispatch's sort, built
there before the counts' wait; when a slot was dropped (or with the caller's rows) combine builds it
after its exchange is queued (ahead of it, its launch would delay the rows). With ``enable_local_combine=True`` the expert side
first sums, the same way, the rows that belong to one (source rank, token) and sends one row per
(token, destination rank) in the row dtype (fewer bytes, one extra rounding of each partial sum).

On one host every operation records on the operation board (a few words per rank in host shared
memory, as the Triton backend keeps them) which operation it starts, and before its first message
waits until every peer started the same one, so ranks that call operations in different orders all
raise :class:`ep_a2a.EPProtocolError` before any message, and combine needs no exchange of its own.
There dispatch's counts need no collective either: each rank copies its row to the host and publishes
it on the counts board (:class:`_CountsBoard`, host shared memory) as soon as it is there (the rest of
its local work queued after, unless the device is still busy), checks the operation board, and reads
the peers' rows. Across hosts dispatch and barrier (and combine) open with the same fixed-size
exchange headed by the operation and its call number (dispatch's counts ride in it), so that
misordered ranks see each other's headers and raise the same error before any variable-sized message.
On an NCCL group that exchange is one all-gather on the device (one row per rank, no per-peer
messages); its host copy is awaited (bounded by ``timeout_s``) where the host needs it: at once in
dispatch (the counts size the payload), and only after everything else is queued in combine. On a gloo
group every exchange runs on a gloo side group with the layer's timeout. ``tuning`` and ``use_aot`` are
ignored here: there are no kernels to compile, and NCCL picks its own channels.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ep_a2a._dist import (
    EPProtocolError,
    EPTimeoutError,
    OpBoard,
    RankMonitor,
    create_shared_words,
    group_device,
    poll_until,
)
from ep_a2a.backends.base import A2ABackend, BackendOptions, DispatchResult, register_backend
from ep_a2a.config import EPConfig
from ep_a2a.layout import EPAllToAllLayoutDesc

#: operation codes in the header of every operation's first message
_OPS = {"dispatch": 1, "combine": 2, "combine_per_slot": 3, "barrier": 4}
_OP_NAMES = {code: name for name, code in _OPS.items()}
_HOT_POLL_S = 0.02
_COLD_POLL_S = 5e-5
#: low bits of a counts-board word that hold the value; the bits above hold the operation's number
_VALUE_BITS = 24
_VALUE_MASK = (1 << _VALUE_BITS) - 1
_COUNT_SLOTS = 8
#: row dtypes whose sums torch accumulates in float32 (on CPUs and GPUs) and rounds once
_FLOAT32_SUMS = (torch.bfloat16, torch.float16, torch.float32)
#: output rows up to which dispatch builds combine's row order on the host (it rides in the counts'
#: upload; numpy's cost grows with the rows, a device sort's barely does at these sizes)
_HOST_ORDER_ROWS = 4096


@dataclass
class _TorchState:
    owner: int
    send_pos: torch.Tensor | None  # [S] int64: token * world + dest rank of each row sent (local combine)
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    slot_flat: torch.Tensor  # [M] int64: t * topk + k of each kept slot, in the order combine returns them
    slot_counts: list[int]  # kept slots sent to each rank
    back_flat: torch.Tensor  # [R] int64: received row * topk + slot of each output row
    out_row: torch.Tensor  # [R] int64: received row of each output row
    recv_bounds: torch.Tensor  # [world - 1] int64: first received row of each source rank after the first
    back_counts: list[int]  # output rows per source rank
    bag_index: torch.Tensor | None = None  # [tokens * topk] int64: each slot's place among the rows
    # combine returns (its embedding bag's index), when dispatch kept every slot
    back_row: torch.Tensor | None = None  # [R] int64: output rows by (source rank, then as the source
    # sorted them); dispatch computes it unless combine sends partial sums (computed when first needed)


@dataclass
class _Header:
    """A header exchange queued on the device; :meth:`TorchBackend._check` awaits and checks it."""

    op: str
    step: str
    call: int
    host: np.ndarray  # [world, 2 + width] int64: every rank's row, once awaited
    done: torch.cuda.Event | None  # recorded after the copy to the host (None: nothing to await)


@dataclass
class _Tables:
    """Per-device constants and buffers of the bookkeeping (built once: no allocation per call)."""

    bounds: dict[torch.dtype, torch.Tensor]  # [E + 2] per id dtype: bin edges -2, -1, 0, .., E - 1
    dest: torch.Tensor  # [E + 3] int64: destination rank of each slot bin (world: none)
    key: torch.Tensor  # [E + 3] int32: local expert of each bin on this rank (E_local: another rank's)
    first: torch.Tensor  # [max_tokens, world + 1] int32: topk per rank, -1 for "no rank"
    krange: torch.Tensor  # [max_tokens, topk] int32: the slot number
    iota: torch.Tensor  # [world * max_tokens * topk] int64
    iota32: torch.Tensor  # [max_tokens * topk] int32
    ones: torch.Tensor  # [max_tokens * topk] int64
    zeros: torch.Tensor  # [max_tokens, 8] uint8: row padding
    sends: torch.Tensor  # [(world + 1) * max_tokens] int64: token t has a slot on rank d, by rank (int64:
    # the count's dtype, so summing needs no cast)
    row: torch.Tensor  # [2 + width] int64: this rank's header on the device
    row_counts: torch.Tensor  # its rows for each rank (a view)
    row_bins: torch.Tensor  # its slots per bin (a view)
    rows: torch.Tensor  # [world * (2 + width)] int64: every rank's header on the device
    row_host: torch.Tensor  # [2 + width] int64 on the host (pinned on CUDA), its numpy view below
    row_np: np.ndarray
    rows_host: torch.Tensor  # [world * (2 + width)] int64 on the host (pinned on CUDA)
    rows_np: np.ndarray  # [world, 2 + width] its numpy view
    mine_host: torch.Tensor  # [2 + width] this rank's row of rows_host (a view)
    no_bins: torch.Tensor  # [E + 3] int64 zeros on the device
    up_host: torch.Tensor  # [upload] int64 on the host (pinned on CUDA), numpy view below
    up_np: np.ndarray
    arange_np: np.ndarray  # [_HOST_ORDER_ROWS] int64 0, 1, ..
    done: torch.cuda.Event | None  # recorded after each header's copy to the host (CUDA)
    low: int  # header column of the ids below -1
    high: int  # header column of the ids of num_tot_experts or more
    per_n: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    offsets: dict[int, torch.Tensor] = field(default_factory=dict)

    def bag_offsets(self, n: int, topk: int) -> torch.Tensor:
        """``[n]`` int64 ``0, topk, 2 * topk, ..``: each token's first slot (kept per ``n``)."""
        got = self.offsets.get(n)
        if got is None:
            got = self.offsets[n] = self.iota[: n * topk : topk].contiguous()
        return got

    layouts: dict[tuple, tuple[list[int], list[int]]] = field(default_factory=dict)


class _CountsBoard:
    """Every rank's dispatch counts (the opening row), in host shared memory, for the ranks of one host.

    One file, ``[8 slots, world, width]`` int64: for the operation numbered ``call`` on the operation
    board, rank ``r`` writes its row into row ``r`` of slot ``call % 8``, each word ``(call << 24) |
    value``. A reader takes the slot once every word carries the call it waits for. Each word is 8
    aligned bytes, stored and loaded whole (single-copy atomic on x86-64 and AArch64, element by element
    in vector accesses too), so a half-written row is never taken whatever order the words become
    visible in, and no fence is needed. A slot is written again 8 operations later, when every peer has
    read it (no rank starts an operation on the board before every peer started the one before).

    Construction is collective; :attr:`ready` says (the same on every rank) whether every rank mapped
    the file.
    """

    def __init__(self, monitor: RankMonitor, width: int) -> None:
        self.rank, self.world, self.timeout_s = monitor.rank, monitor.world_size, monitor.timeout_s
        shape = (_COUNT_SLOTS, self.world, width)
        self.table: np.ndarray | None = None
        path = ""
        if self.rank == 0:
            name = f"ep_a2a{monitor.prefix.replace('/', '_')}-counts-p{os.getpid()}-{uuid.uuid4().hex[:12]}"
            with contextlib.suppress(OSError):
                path, table = create_shared_words(name, shape)
                self.table = table.view(np.ndarray)
        path = monitor.checkin("torch/counts", path)[0]
        if self.rank and path:
            with contextlib.suppress(OSError, ValueError):
                self.table = np.memmap(path, dtype=np.int64, mode="r+", shape=shape).view(np.ndarray)
        self.ready = all(
            v == "1" for v in monitor.checkin("torch/counts-ok", "1" if self.table is not None else "0")
        )
        if self.rank == 0 and path:  # every rank mapped it or gave up: the mappings outlive the name
            with contextlib.suppress(OSError):
                os.unlink(path)

    def write(self, call: int, values: np.ndarray) -> None:
        """Publish this rank's row ``values`` ``[width]`` (each in ``[0, 2**24)``) for ``call``."""
        assert self.table is not None
        np.bitwise_or(values, call << _VALUE_BITS, out=self.table[call % _COUNT_SLOTS, self.rank])

    def read(self, call: int, out: np.ndarray, step: str) -> None:
        """Wait until every rank published its row for ``call`` and copy them into ``out`` ``[world,
        width]``.

        Raises:
            EPTimeoutError: a rank did not publish within ``timeout_s`` (named).
        """
        assert self.table is not None
        rows = self.table[call % _COUNT_SLOTS]
        # every word of the slot carries this call once none is below it: the words of earlier calls
        # (and the initial -1) are smaller, and no rank writes the slot's next call before all read it
        fresh = call << _VALUE_BITS
        if not poll_until(lambda: rows.min() >= fresh, time.monotonic() + self.timeout_s):
            arrived = (np.right_shift(rows, _VALUE_BITS) == call).all(1)
            missing = [r for r in range(self.world) if not arrived[r]]
            raise EPTimeoutError(
                f"ep_a2a: rank {self.rank} waited {self.timeout_s:g}s at step {step!r} (call #{call}) "
                f"for the counts of rank(s) {missing}",
                step=step,
                missing_ranks=missing,
            )
        np.bitwise_and(rows, _VALUE_MASK, out=out)

    def close(self) -> None:
        self.table = None


class _Deferred:
    """An attribute of :class:`_TorchLayoutDesc` computed by its :class:`_Recipe` the first time it is read."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_deferred_{name}"

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.slot]
        if isinstance(value, _Recipe):
            value = obj.__dict__[self.slot] = value()
        return value

    def __set__(self, obj: object, value: Any) -> None:
        obj.__dict__[self.slot] = value


class _Recipe:
    """``fn(*args)``, called once by :class:`_Deferred`."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., torch.Tensor], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __call__(self) -> torch.Tensor:
        return self.fn(*self.args)


class _TorchLayoutDesc(EPAllToAllLayoutDesc):
    """The torch backend's descriptor: ``token_dst_scatter_idx`` and ``skipped_token_topk_mapping_indices``
    are computed (one gather or scatter each, from tensors the descriptor keeps) when first read;
    combine needs neither."""

    token_dst_scatter_idx = _Deferred()  # type: ignore[assignment]
    skipped_token_topk_mapping_indices = _Deferred()  # type: ignore[assignment]


def _bin_bases(counts: np.ndarray, me: int, e_local: int) -> np.ndarray:
    """Each bin's first row at its receiver minus my first slot of that bin, int32 ``[num_tot_experts +
    3]`` (-1 for the bins of no expert), from every rank's slots per bin ``counts`` ``[world, E + 3]``.
    A receiver's rows run by (local expert, source rank): a bin's first row there counts the rows of
    its earlier experts from every source and of its expert from the sources before me."""
    world = counts.shape[0]
    per_expert = counts[:, 2 : 2 + world * e_local].reshape(world, world, e_local)  # [src, dest, local]
    first = np.zeros((world, e_local), dtype=np.int64)
    np.cumsum(per_expert.sum(0)[:, :-1], axis=1, out=first[:, 1:])
    first += per_expert[:me].sum(0)
    mine = counts[me]
    base = np.full(mine.shape[0], -1, dtype=np.int32)
    base[2 : 2 + world * e_local] = first.reshape(-1) - (np.cumsum(mine) - mine)[2 : 2 + world * e_local]
    return base


def _receiver_rows(
    counts: np.ndarray,
    me: int,
    e_local: int,
    bins: torch.Tensor,
    slot_flat: torch.Tensor,
    iota: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Each slot's row at its receiver ``[n, topk]``: its bin's first row there minus my first slot of
    the bin (:func:`_bin_bases` of every rank's slots per bin ``counts``), plus its place among my slots
    sorted by bin (``slot_flat``: my kept slots in that order, ``iota``: their places)."""
    base = torch.from_numpy(_bin_bases(counts, me, e_local)).to(bins.device)
    scatter = base[bins]
    scatter.view(-1).index_add_(0, slot_flat, iota)
    return scatter if dtype == torch.int32 else scatter.to(dtype)


def _first_same_rank(none: torch.Tensor, krange: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """The first slot of each slot's token on the slot's rank ``[n, topk]``, from each slot's rank ``dest``
    (``none``: ``[n, world + 1]`` topk, -1 in the last column; ``krange``: ``[n, topk]`` slot numbers)."""
    return none.scatter_reduce(1, dest, krange, "amin").gather(1, dest)


def _sum_slots(
    rows: torch.Tensor, pos: torch.Tensor, groups: int, width: int, grid: torch.Tensor | None = None
) -> torch.Tensor:
    """``rows[i]`` placed at flat position ``pos[i]`` of a zero ``[groups, width, C]`` grid (``grid``: that
    grid from :func:`_grid`), summed over ``width`` in float32 in order and rounded to the rows' dtype
    (what :func:`ep_a2a.reference.combine_ref` does per token)."""
    if grid is None:
        grid = _grid(rows, pos, groups * width)
    grid.index_copy_(0, pos, rows)
    grid = grid.view(groups, width, rows.shape[1])
    if rows.dtype in _FLOAT32_SUMS:  # (accumulated in float32 and rounded once: no float32 copy)
        return grid.sum(1)
    return grid.sum(1, dtype=torch.float32).to(rows.dtype)


def _grid(like: torch.Tensor, pos: torch.Tensor, size: int) -> torch.Tensor:
    """``[size, C]`` rows of ``like``'s dtype for ``pos`` (distinct positions) to fill: zeros, or left
    unset where ``pos`` covers every row (no zero fill to pay)."""
    if pos.numel() == size:
        return like.new_empty(size, like.shape[1])
    return like.new_zeros(size, like.shape[1])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous ``[n, k]`` tensor as ``[n, k * itemsize]`` uint8 (any strides of size-1
    dimensions)."""
    return t.reshape(-1).view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def _row_layout(fields: list[tuple[int, int]]) -> tuple[list[int], list[int], int]:
    """Byte offsets of ``fields`` (``(bytes, alignment)`` each) in a packed row, the padding in front of
    each, and the row's length (a multiple of 8, so that every field of a received row views as its
    dtype)."""
    offsets, pads, at = [], [], 0
    for size, align in fields:
        pads.append(-at % align)
        at += pads[-1]
        offsets.append(at)
        at += size
    pads.append(-at % 8)
    return offsets, pads, at + pads[-1]


@register_backend
class TorchBackend(A2ABackend):
    """``backend="torch"``: a fixed-size header, then one packed ``all_to_all_single``; see the module
    docstring."""

    name = "torch"
    checks_expert_ids = True  # counted into the opening exchange, raised on every rank before the payload
    expert_id_dtypes = (torch.int32, torch.int64)

    def __init__(self, config: EPConfig, ep_group: dist.ProcessGroup, options: BackendOptions) -> None:
        super().__init__(config, ep_group, options)
        self.monitor = (
            options.monitor if options.monitor is not None else RankMonitor(ep_group, self.timeout_s)
        )
        self.device = group_device(ep_group)
        #: exchanges on the expert-parallel group itself, the header awaited after the data is queued
        #: (NCCL); else every exchange on the bounded gloo side group, each awaited in turn
        self._on_device = self.device.type != "cpu"
        self._a2a_options = dist.AllToAllOptions()
        self._a2a_options.asyncOp = False  # (on the current stream, as a blocking all_to_all_single)
        if not self._on_device:
            self.monitor.create_side_group()
        self.rank = config.rank
        self.world_size = config.world_size
        self.e_local = config.num_experts_per_rank
        self.validate = options.validate
        #: columns of the opening exchange after (operation, call): my token count, my rows for each
        #: rank, my slots per bin (an id below -1, -1, each expert, an id of num_tot_experts or more)
        self._width = 1 + config.world_size + (config.num_tot_experts + 3)
        #: operations this backend has run (every rank's count agrees while they call in the same order)
        self._calls = 0
        self._tables: dict[torch.device, _Tables] = {}
        #: on one host, the operation board: every operation first checks there that every peer is in
        #: the same operation (EPProtocolError before any message otherwise), so combine needs no header
        self.board: OpBoard | None = None
        if config.is_intra_node and self.world_size > 1:
            board = OpBoard(self.monitor)
            sees_all = len(board.peers) == self.world_size - 1  # (the same answer on every rank, checked)
            if all(v == "1" for v in self.monitor.checkin("torch/board", "1" if sees_all else "0")):
                self.board = board
            else:
                board.close()
        #: whether combine can go without a header (every peer checked on the board, or no peer)
        self._no_combine_header = self.board is not None or self.world_size == 1
        #: on one host, dispatch's counts travel through host shared memory (no header exchange): the
        #: board's wait for them is the only one; each count must fit the board's 24-bit values
        self.counts: _CountsBoard | None = None
        if self.board is not None and config.max_tokens * config.topk <= _VALUE_MASK:
            counts = _CountsBoard(self.monitor, self._width)
            if counts.ready:
                self.counts = counts
            else:
                counts.close()

    @classmethod
    def is_available(cls, config: EPConfig, ep_group: dist.ProcessGroup) -> tuple[bool, str]:
        return True, f"torch.distributed all_to_all_single over {dist.get_backend(ep_group)}"

    # -- helpers -------------------------------------------------------------------------------------
    def _consts(self, dev: torch.device) -> _Tables:
        tables = self._tables.get(dev)
        if tables is None:
            cfg, world, L = self.config, self.world_size, self.e_local
            E, K, T = cfg.num_tot_experts, cfg.topk, cfg.max_tokens
            cuda = dev.type == "cuda"
            experts = torch.arange(E)
            none = torch.tensor([world])
            local = torch.where(experts // L == self.rank, experts % L, L)
            bounds = torch.arange(-2, E)
            first = torch.full((T, world + 1), K, dtype=torch.int32)
            first[:, world] = -1
            width = 2 + self._width
            # per-expert counts, receive bounds
            up = L + (world - 1)
            row_host = torch.zeros(width, dtype=torch.int64, pin_memory=cuda)
            rows_host = torch.zeros(world * width, dtype=torch.int64, pin_memory=cuda)
            up_host = torch.zeros(up + _HOST_ORDER_ROWS, dtype=torch.int64, pin_memory=cuda)
            row = torch.zeros(width, dtype=torch.int64, device=dev)
            tables = _Tables(
                bounds={torch.int64: bounds.to(dev), torch.int32: bounds.to(dev, torch.int32)},
                dest=torch.cat([none, none, experts // L, none]).to(dev),
                key=torch.cat([torch.tensor([L, L]), local, torch.tensor([L])]).to(dev, torch.int32),
                first=first.to(dev),
                krange=torch.arange(K, dtype=torch.int32).expand(T, K).contiguous().to(dev),
                iota=torch.arange(world * T * K, device=dev),
                iota32=torch.arange(T * K, dtype=torch.int32, device=dev),
                ones=torch.ones(T * K, dtype=torch.int64, device=dev),
                zeros=torch.zeros(T, 8, dtype=torch.uint8, device=dev),
                sends=torch.zeros((world + 1) * T, dtype=torch.int64, device=dev),
                row=row,
                row_counts=row[3 : 3 + world],
                row_bins=row[3 + world :],
                rows=torch.zeros(world * width, dtype=torch.int64, device=dev),
                row_host=row_host,
                row_np=row_host.numpy(),
                rows_host=rows_host,
                rows_np=rows_host.numpy().reshape(world, width),
                mine_host=rows_host[self.rank * width : (self.rank + 1) * width],
                no_bins=torch.zeros(E + 3, dtype=torch.int64, device=dev),
                up_host=up_host,
                up_np=up_host.numpy(),
                arange_np=np.arange(_HOST_ORDER_ROWS, dtype=np.int64),
                done=torch.cuda.Event() if cuda else None,
                low=3 + world,
                high=3 + world + E + 2,
            )
            self._tables[dev] = tables
        return tables

    def _head(self, c: _Tables, op: str, n: int = 0) -> torch.Tensor:
        """This rank's opening row ``[2 + width]`` int64 on the device: operation, call number, ``n``,
        zeros (one copy from the host; only its first three entries are ever written). The host row is
        rewritten only after the previous operation awaited its own header, which the device copied after
        this row's last copy."""
        a = c.row_np
        a[0], a[1], a[2] = _OPS[op], self._calls, n
        self._calls += 1
        return c.row.copy_(c.row_host, non_blocking=True)

    @torch.compiler.disable  # (shared-memory reads: never traced, whatever region calls them)
    def _start(self, op: str, step: str) -> None:
        """On the board, publish that this rank starts ``op`` and wait until every peer started it too.

        Raises:
            EPProtocolError: a peer is in another operation (every rank raises, before any message).
            EPTimeoutError: a peer did not start an operation within ``timeout_s`` (named).
        """
        if self.board is not None:
            self.board.wait(self._publish(op), op, step)

    @torch.compiler.disable
    def _publish(self, op: str) -> int:
        """Record on the board that this rank starts ``op``; returns the operation's number there."""
        assert self.board is not None
        return self.board.publish(op)

    def _open(self, c: _Tables, op: str, step: str, row: torch.Tensor) -> _Header:
        """Queue the opening exchange of an operation: every rank sends every rank its ``row`` ``[2 +
        width]`` (from :meth:`_head`, filled in on the device). On the device it is one all-gather; on
        the CPU it completes and is checked here."""
        world, call = self.world_size, self._calls - 1
        if not self._on_device:
            send = row.expand(world, -1).contiguous()
            recv = torch.empty_like(send)
            self.monitor.run(step, self.monitor.all_to_all, recv, send)
            header = _Header(op, step, call, recv.numpy(), None)
            self._check(header)  # before any variable-sized message: gloo matches messages in order
            return header
        dist.all_gather_into_tensor(c.rows, row, group=self.ep_group)
        c.rows_host.copy_(c.rows, non_blocking=True)
        if c.done is not None:
            c.done.record()
        return _Header(op, step, call, c.rows_np, c.done)

    def _check(self, header: _Header) -> np.ndarray:
        """Await a header exchange (bounded by ``timeout_s``) and check every rank is in the same
        operation and call. Returns every rank's row ``[world, 2 + width]`` on the host (valid until the
        next operation opens).

        Raises:
            EPProtocolError: some rank is in another operation or call (every rank raises: each sees
                every header).
            EPTimeoutError: a rank did not arrive within ``timeout_s``.
        """
        if header.done is not None:
            self.monitor.run(header.step, _wait, header.done, self.timeout_s)
        else:
            _wait(None, self.timeout_s)  # (the exchange completed on the host: nothing left to await)
        rows = header.host
        heads = rows[:, :2].tolist()
        if heads != [[_OPS[header.op], header.call]] * self.world_size:
            ops = {r: f"{_OP_NAMES.get(o, f'operation {o}')} (call #{c})" for r, (o, c) in enumerate(heads)}
            raise EPProtocolError(
                "ep_a2a: ranks called the layer's collectives in different orders: "
                + ", ".join(f"rank {r} is in {what}" for r, what in ops.items())
                + f" (this is rank {self.rank}). Every rank must call dispatch, combine and barrier in the "
                "same order; no rank returns data. The group's pending messages are undefined from here: "
                "finalize the layer",
                operations=ops,
            )
        return rows

    def _post_counts(self, c: _Tables, call: int, n: int) -> None:
        """Dispatch's opening exchange on one host, its first half: wait for this rank's counts on the
        host and publish them on the counts board (:meth:`_board_counts` reads the peers')."""
        assert self.counts is not None
        if c.done is not None:
            self.monitor.run("dispatch/counts", _wait, c.done, self.timeout_s)
        else:
            _wait(None, self.timeout_s)  # (the counts are on the host already)
        rows = c.rows_np
        rows[self.rank, 2] = n
        self.counts.write(call, rows[self.rank, 2:])

    def _board_counts(self, c: _Tables, call: int) -> np.ndarray:
        """Dispatch's opening exchange on one host, once this rank's counts are published
        (:meth:`_post_counts`): check on the operation board that every peer is in this dispatch (before
        any message) and wait for the peers' counts. Returns every rank's row ``[world, 2 + width]``
        (columns after the first two, as the header exchange gives them).

        Raises:
            EPProtocolError: a peer is in another operation (every rank raises, before any message).
            EPTimeoutError: a peer did not arrive within ``timeout_s`` (named).
        """
        assert self.counts is not None
        assert self.board is not None
        step = "dispatch/counts"
        self.board.wait(call, "dispatch", step)
        rows = c.rows_np
        self.counts.read(call, rows[:, 2:], step)
        return rows

    def _exchange(
        self,
        step: str,
        send: torch.Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        recv = send.new_empty((sum(recv_counts), *send.shape[1:])) if out is None else out
        if not self._on_device:  # a gloo expert group: the side group is the same transport, bounded
            self.monitor.run(step, self.monitor.all_to_all, recv, send, recv_counts, send_counts)
        else:  # queued on the device (its peers checked in on the board or in the header); the group's
            # own call, as all_to_all_single makes it, without that wrapper's checks on the hot path
            work = self.ep_group.alltoall_base(recv, send, recv_counts, send_counts, self._a2a_options)
            if work is not None:
                work.wait()  # (stream-ordered: the host does not block)
        return recv

    def _raise_bad_ids(self, rows: np.ndarray, exp_indices: torch.Tensor) -> None:
        """``ValueError`` on every rank when some rank's ids left ``[-1, num_tot_experts)`` (its slot
        counts of the two out-of-range bins), before any payload moves."""
        E, bins = self.config.num_tot_experts, 3 + self.world_size
        bad = rows[:, bins] + rows[:, bins + E + 2]
        what = f"exp_indices must be in [-1, num_tot_experts={E}) (-1 drops a slot)"
        if bad[self.rank]:  # (the offending rank reads its range: a sync, on this error path only)
            lo, hi = torch.aminmax(exp_indices)
            raise ValueError(f"{what}, got values in [{int(lo)}, {int(hi)}]")
        ranks = [r for r in range(self.world_size) if bad[r]]
        raise ValueError(
            f"{what}: rank(s) {ranks} passed {int(bad.sum())} slot(s) outside; no rank sent data"
        )

    # -- dispatch ------------------------------------------------------------------------------------
    def dispatch(
        self, input: Tensor, exp_indices: Tensor, weight: Tensor | None, full_scatter_indices: Tensor | None
    ) -> DispatchResult:
        cfg, me = self.config, self.rank
        n, K, world, L = input.shape[0], cfg.topk, self.world_size, self.e_local
        dev = input.device
        c = self._consts(dev)
        # on one host: tell the peers at once which operation this is (they check it before any message)
        call = self._publish("dispatch") if self.counts is not None else -1
        fsi = full_scatter_indices
        caller_rows = fsi is not None
        # bin of each slot: 0 an id below -1, 1 dropped (-1), 2 + e expert e, E + 2 an id of E or more
        # (int64: the receiver looks its bins up with one take, which an int32 index would first convert)
        bins = torch.bucketize(exp_indices, c.bounds[exp_indices.dtype])
        flat_bins = bins.view(-1)
        # [n, K] int64 destination rank, world where the slot is dropped (index_select: a lighter launch
        # than indexing)
        dest = c.dest.index_select(0, flat_bins).view(n, K)
        per_n = c.per_n.get(n)
        if per_n is None:
            per_n = c.per_n[n] = (
                c.first[:n],
                c.krange[:n],
                c.ones[: n * K],
                c.sends[: (world + 1) * n].view(world + 1, n),
            )
        # [world, n] token t sends a row to rank d, rank-major (the row lists read it in that order):
        # flags [world + 1, n] set per slot (the last row: dropped slots)
        present = per_n[3]
        present.zero_()
        present.scatter_(0, dest.t(), 1)
        sends = present[:world]

        # the opening exchange, the same row from every rank: (op, call, my token count, my rows for
        # each rank, my slots per bin); the per-expert matrix lets each source place its slots without
        # a round trip, and the out-of-range bins stop a bad call on every rank before any payload. On
        # one host the counts go to the host and through shared memory; else in a header exchange
        header = None
        if self.counts is not None:
            self._calls += 1
            torch.sum(sends, 1, out=c.row_counts)
            torch.index_add(c.no_bins, 0, flat_bins, per_n[2], out=c.row_bins)
            c.mine_host.copy_(c.row, non_blocking=True)
            if c.done is not None:
                c.done.record()
        else:
            self._start("dispatch", "dispatch/counts")
            row = self._head(c, "dispatch", n)
            torch.sum(sends, 1, out=c.row_counts)
            c.row_bins.index_add_(0, flat_bins, per_n[2])
            header = self._open(c, "dispatch", "dispatch/counts", row)

        # what the payload needs and the counts do not decide runs while they travel: the token of each
        # row, by (destination rank, token), and every token's packed row: token | expert bin of each
        # slot | weights | (the caller's rows), each field aligned to its dtype
        pairs = torch.nonzero_static(sends, size=world * n)  # [world * n, 2] (rank, token), -1 pads
        # on one host, this rank's counts go to the board as soon as they are on the host (the peers
        # wait for them, not for the rest of this rank's queuing); a busy device queues the rest first
        posted = self.counts is not None and (c.done is None or c.done.query())
        if posted:
            self._post_counts(c, call, n)
        scatter = torch.where(dest < world, fsi, -1) if fsi is not None else None
        offsets, pads = self._layout(c, input, weight, caller_rows)
        parts = [input.view(torch.uint8), bins.view(torch.uint8)]
        if weight is not None:
            parts.append(weight.view(torch.uint8) if weight.stride(-1) == 1 else _bytes(weight))
        if scatter is not None:
            parts.append(scatter.view(torch.uint8))
        if any(pads):
            for i in range(len(pads) - 1, -1, -1):
                if pads[i]:
                    parts.insert(i, c.zeros[:n, : pads[i]])
        packed = torch.cat(parts, 1)
        # (local work the counts do not decide, queued before their wait as well) my slots in the order
        # combine returns them, before the cut at the counts: by bin, or by (receiver, caller's row);
        # the first slot of each slot's token on its rank
        ranks = None
        if scatter is None:
            slot_order = torch.sort(flat_bins, stable=True).indices
            if not self.enable_local_combine:
                # each slot's place in that order: combine's bag index when no slot is dropped (built
                # here, before the counts' wait: in combine, ahead of the exchange, it delays the rows)
                ranks = c.iota.new_empty(n * K)
                ranks.scatter_(0, slot_order, c.iota[: n * K])
        else:
            key = torch.where(
                dest < world,
                dest * (world * cfg.max_tokens * K) + scatter,
                world * world * cfg.max_tokens * K,
            )
            slot_order = torch.sort(key.flatten(), stable=True).indices

        if header is not None:
            rows = self._check(header)
        else:
            if not posted:
                self._post_counts(c, call, n)
            rows = self._board_counts(c, call)
        if self.validate and rows[:, c.low : c.high + 1 : c.high - c.low].any():
            self._raise_bad_ids(rows, exp_indices)
        send_counts = rows[me, 3 : 3 + world].tolist()
        recv_counts = rows[:, 3 + me].tolist()
        num_sent = sum(send_counts)
        send_token = pairs[:num_sent, 1]
        recv = self._exchange("dispatch/payload", packed[send_token], send_counts, recv_counts)

        # what the counts decide, computed on the host while the payload travels and uploaded at once
        # (see _plan): rows per local expert, receive boundaries and (up to _HOST_ORDER_ROWS output
        # rows) the order combine sends rows back in
        order = scatter is None and not self.enable_local_combine  # (lc: combine sends partial sums)
        back, slot_counts, dropped_first, size = self._plan(c, rows, recv_counts, order=order)
        up_dev = c.up_host[:size].to(dev, non_blocking=True, copy=True)
        back_counts = back.tolist()
        num_rows, num_slots = sum(back_counts), sum(slot_counts)

        # expand on the receiver: received slots in (source, token, slot) order, stably sorted by local
        # expert, give the output order (local expert, source rank, token, slot)
        ob = offsets[1]
        r_key = torch.take(c.key, recv[:, ob : ob + 8 * K].view(torch.int64))  # [rows in, K] expert or L
        if not caller_rows:
            sorted_key, order_in = torch.sort(r_key.view(-1), stable=True)
            back_flat = order_in[:num_rows]
            recv_expert = sorted_key[:num_rows]
        else:
            of = offsets[-1]
            r_pos = recv[:, of : of + 4 * K].view(torch.int32)
            held = r_key < L
            target = torch.where(held, r_pos, num_rows).flatten()
            self._check_caller_rows(held, r_pos, target, num_rows)
            inv = torch.empty(num_rows + 1, dtype=torch.int64, device=dev)
            inv.index_put_((target,), c.iota[: target.numel()])
            back_flat = inv[:num_rows]
            recv_expert = torch.take(r_key, back_flat)
        out_row = torch.floor_divide(back_flat, K)
        output = recv[:, : input.shape[1] * input.element_size()].view(input.dtype)[out_row]
        out_weights = None
        if weight is not None:
            wo = offsets[2]
            out_weights = torch.take(
                recv[:, wo : wo + K * weight.element_size()].view(weight.dtype), back_flat
            )

        # my side of the descriptor: each slot's row at its receiver (from a copy of the counts, when
        # first read), the first slot of each token on each rank, and the order combine returns my
        # slots in (by bin, or by the caller's row)
        # (copies: ``rows`` is rewritten by the next operation)
        tokens_per_rank = rows[:, 2].copy()  # [world]
        if scatter is None:
            slot_flat = slot_order[dropped_first : dropped_first + num_slots]
            receiver_rows: torch.Tensor | _Recipe = _Recipe(
                _receiver_rows,
                rows[:, 3 + world :].copy(),  # [world, E + 3]: every rank's slots per bin
                me,
                L,
                bins,
                slot_flat,
                c.iota32[dropped_first : dropped_first + num_slots],
                cfg.offset_dtype,
            )
        else:
            slot_flat = slot_order[:num_slots]
            receiver_rows = scatter if cfg.offset_dtype == torch.int32 else scatter.to(cfg.offset_dtype)
        send_pos = None
        if self.enable_local_combine:
            send_pos = torch.add(pairs[:num_sent, 0], send_token, alpha=world)

        state = _TorchState(
            owner=id(self),
            send_pos=send_pos,
            send_counts=send_counts,
            recv_counts=recv_counts,
            slot_flat=slot_flat,
            slot_counts=slot_counts,
            back_flat=back_flat,
            out_row=out_row,
            recv_bounds=up_dev[L : L + world - 1],
            back_counts=back_counts,
        )
        if size > L + world - 1:
            state.back_row = up_dev[L + world - 1 :]
        elif order:
            _back_row(state)
        if ranks is not None and dropped_first == 0 and num_slots == n * K:
            state.bag_index = ranks
        desc = _TorchLayoutDesc(
            num_dispatch_token_cur_rank=n,
            num_input_tokens_per_rank=torch.from_numpy(tokens_per_rank),
            send_reqs_recv_tensor=None,
            topk_indices_tensor=exp_indices,
            token_dst_scatter_idx=receiver_rows,  # type: ignore[arg-type]
            skipped_token_mapping_indices=None,
            skipped_token_topk_mapping_indices=_Recipe(_first_same_rank, per_n[0], per_n[1], dest),  # type: ignore[arg-type]
            num_recv_tokens_per_expert=up_dev[:L],
            num_recv_tokens_per_rank=torch.from_numpy(back),
            num_recv_rows=num_rows,
            recv_expert_indices=recv_expert,
            caller_scatter=caller_rows,
            backend_state=state,
        )
        return output, out_weights, desc

    def _layout(
        self, c: _Tables, input: Tensor, weight: Tensor | None, caller_rows: bool
    ) -> tuple[list[int], list[int]]:
        """Byte offsets and padding of the fields of a packed dispatch row (see :func:`_row_layout`), per
        row signature."""
        key = (input.dtype, input.shape[1], weight.dtype if weight is not None else None, caller_rows)
        layout = c.layouts.get(key)
        if layout is None:
            K = self.config.topk
            fields = [(input.shape[1] * input.element_size(), input.element_size()), (8 * K, 8)]
            if weight is not None:
                fields.append((K * weight.element_size(), weight.element_size()))
            if caller_rows:
                fields.append((4 * K, 4))
            offsets, pads, _ = _row_layout(fields)
            layout = c.layouts[key] = (offsets, pads)
        return layout

    def _plan(
        self, c: _Tables, rows: np.ndarray, recv_counts: list[int], *, order: bool
    ) -> tuple[np.ndarray, list[int], int, int]:
        """What the counts decide that dispatch needs at once, written into the upload buffer: rows per
        local expert ``[E_local]``, the first received row of each source after the first ``[world -
        1]`` (from ``recv_counts``, the rows received from each source) and, with ``order`` and at most
        ``_HOST_ORDER_ROWS`` output rows, the output rows in the order combine sends them back ``[R]``
        (see :func:`_back_row`). Returns the output rows from each source ``[world]``, my kept slots for
        each rank, my slots in the bins before the experts and the number of words to upload."""
        world, L, me = self.world_size, self.e_local, self.rank
        slots = rows[me, 3 + world :]  # [bin]: my slots
        mine = rows[:, 5 + world + me * L : 5 + world + (me + 1) * L]  # [src, local]: the rows I receive
        up = c.up_np
        np.add.reduce(mine, 0, out=up[:L])
        size = L + world - 1
        if world > 1:
            up[L:size] = list(itertools.accumulate(recv_counts[:-1]))
        back = np.add.reduce(mine, 1)
        total = int(back.sum())
        if order and total <= _HOST_ORDER_ROWS:
            # output rows run in blocks (local expert, source); combine sends each source its blocks by
            # local expert: block (s, e) holds the output rows from the block's start onwards
            lens = mine.ravel()  # [world * L] by (source, local expert)
            by_expert = mine.T.ravel()  # by (local expert, source)
            start = (np.cumsum(by_expert) - by_expert).reshape(L, world).T.ravel()
            out = up[size : size + total]
            out[:] = np.repeat(start - (np.cumsum(lens) - lens), lens)
            out += c.arange_np[:total]
            size += total
        return (
            back,
            slots[2 : 2 + world * L].reshape(world, L).sum(1).tolist(),
            int(slots[0]) + int(slots[1]),
            size,
        )

    def _check_caller_rows(
        self, mine: torch.Tensor, r_pos: torch.Tensor, target: torch.Tensor, num_rows: int
    ) -> None:
        """The caller's rows of my slots must be ``0 .. num_rows - 1``, each once (two host reads: only
        with ``full_scatter_indices``)."""
        bad = bool((mine & ((r_pos < 0) | (r_pos >= num_rows))).any())
        if not bad and num_rows:
            hits = torch.zeros(num_rows + 1, dtype=torch.int64, device=target.device)
            hits.scatter_add_(0, target.long(), torch.ones_like(target, dtype=torch.int64))
            bad = not bool((hits[:num_rows] == 1).all())
        if bad:
            raise ValueError(
                f"full_scatter_indices must give rank {self.rank} exactly the rows 0..{num_rows - 1} "
                "(each once); the senders' indices do not"
            )

    # -- combine -------------------------------------------------------------------------------------
    def combine(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        call, header = self._open_combine("combine")
        state: _TorchState = layout_desc.backend_state
        n, topk, world = layout_desc.num_dispatch_token_cur_rank, self.config.topk, self.world_size
        if self.enable_local_combine:
            # expert side: sum the rows of one (source rank, token) in float32, in slot order, and send
            # one row per (token, destination rank) in the row dtype
            partial = _sum_slots(input, state.back_flat, sum(state.recv_counts), topk)
            self._opened("combine", call)
            rows = self._exchange(
                "combine", partial.view(torch.uint8), state.recv_counts, state.send_counts
            ).view(input.dtype)
            assert state.send_pos is not None
            out = _sum_slots(rows, state.send_pos, n, world)
        elif input.dtype in _FLOAT32_SUMS:
            # the returned rows summed per token by one embedding bag: each slot's index is its place
            # among them (a dropped slot's: the padding row after them), read in slot order and summed
            # in float32, rounded once (what _sum_slots computes, without a grid of rows)
            send = input[_back_row(state)]
            kept = state.slot_flat.shape[0]
            back = input.new_empty(kept + 1, input.shape[1])
            self._opened("combine", call)
            self._reverse(send, state, back[:kept])
            c = self._consts(input.device)
            place = state.bag_index
            if place is None:  # (built here, after the exchange: ahead of it, its launch would delay
                # the rows; with no slot dropped the scatter sets every place, no fill first)
                size = n * topk
                place = c.iota.new_empty(size) if kept == size else c.iota.new_full((size,), kept)
                place.scatter_(0, state.slot_flat, c.iota[:kept])
            out = torch.embedding_bag(
                back, place, c.bag_offsets(n, topk), False, 0, False, None, False, kept
            )[0]
        else:
            send = input[_back_row(state)]
            grid = _grid(input, state.slot_flat, n * topk)  # (local work, before the peers' check)
            self._opened("combine", call)
            rows = self._reverse(send, state)
            out = _sum_slots(rows, state.slot_flat, n, topk, grid)
        if header is not None:
            self._check(header)  # (after everything is queued: the wait holds up no device work)
        return out

    def _open_combine(self, op: str) -> tuple[int, _Header | None]:
        """A combine's protocol check: on the board (one host), published here and awaited by
        :meth:`_opened` before the first message (the call number is returned; -1 with no peer); else
        the header exchange, awaited once everything is queued (returned)."""
        if self._no_combine_header:
            self._calls += 1
            return (self._publish(op) if self.board is not None else -1), None
        c = self._consts(self.device)
        return -1, self._open(c, op, "combine", self._head(c, op))

    def _opened(self, op: str, call: int) -> None:
        """Before a combine's first message: every peer started the same operation (on the board)."""
        if call >= 0:
            assert self.board is not None
            self.board.wait(call, op, "combine")

    def _reverse(
        self, rows: torch.Tensor, state: _TorchState, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Send per-(received row, slot) values ``[Mr, C]`` back: ``[M, C]`` in ``slot_flat`` order (into
        ``out``, contiguous rows of their dtype, where given)."""
        send = rows.view(torch.uint8) if rows.dtype != torch.uint8 else rows
        into = out.view(torch.uint8) if out is not None and out.dtype != torch.uint8 else out
        recv = self._exchange("combine", send.contiguous(), state.back_counts, state.slot_counts, into)
        return recv.view(rows.dtype)

    def combine_per_slot(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        call, header = self._open_combine("combine_per_slot")
        state: _TorchState = layout_desc.backend_state
        n, topk, width = layout_desc.num_dispatch_token_cur_rank, self.config.topk, input.shape[1]
        send = input[_back_row(state)]
        self._opened("combine_per_slot", call)
        rows = self._reverse(send, state)
        out = torch.zeros(n * topk, width, dtype=input.dtype, device=input.device)
        out[state.slot_flat] = rows
        if header is not None:
            self._check(header)
        return out.view(n, topk, width)

    # -- sync / teardown -------------------------------------------------------------------------------
    def barrier(self, *, intra_node_only: bool = False, stream: torch.cuda.Stream | None = None) -> None:
        if self.device.type == "cuda":
            (stream or torch.cuda.current_stream()).synchronize()
        if not intra_node_only:
            self._start("barrier", "barrier")
            c = self._consts(self.device)
            self._check(self._open(c, "barrier", "barrier", self._head(c, "barrier")))
            return
        node, lws = self.rank // self.config.local_world_size, self.config.local_world_size
        self.monitor.checkin("barrier/node", "1", ranks=range(node * lws, (node + 1) * lws))

    def finalize(self) -> None:
        if self.counts is not None:
            self.counts.close()
        if self.board is not None:
            self.board.close()
        self.monitor.destroy()


def _back_row(state: _TorchState) -> torch.Tensor:
    """Output rows in the order combine sends them back: by source rank, then output row (for each source,
    the order in which it sorted its slots: by expert, or by the caller's row); computed once."""
    if state.back_row is None:
        src = torch.bucketize(state.out_row, state.recv_bounds, out_int32=True, right=True)
        state.back_row = torch.sort(src, stable=True).indices
    return state.back_row


def _wait(event: torch.cuda.Event | None, timeout_s: float) -> None:
    """Wait for ``event`` on the host (None: nothing to wait for), raising ``TimeoutError`` after
    ``timeout_s`` (a device wait cannot be bounded otherwise: a collective whose peer never comes stays
    queued). Polls hot for the first ``_HOT_POLL_S`` (an exchange's usual wait: a sleep would add its
    own latency to every call), then every ``_COLD_POLL_S``."""
    if event is None or event.query():
        return
    now = time.monotonic()
    hot, deadline = now + _HOT_POLL_S, now + timeout_s
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"the device did not finish the exchange within {timeout_s:g}s")
        if now > hot:
            time.sleep(_COLD_POLL_S)
