"""Portable backend: ``torch.distributed`` collectives only (NCCL on GPUs, gloo on CPUs).

Dispatch sends each token once per destination rank (not once per expert): one fixed-size exchange of
counts (which also carries the number of out-of-range expert ids, so a bad call stops on every rank
before any row moves), then one packed byte payload per row holding the token, the expert of each of
its slots, the row each slot takes at its receiver and its weights. Each sender computes those rows from
the exchanged per-expert counts (receivers order rows by local expert, source rank, token, slot), or
takes the caller's ``full_scatter_indices``; the receiver places each of its slots with one scatter of
slot indices and one gather of rows. The bookkeeping is a few dozen tensor operations: per-device lookup
tables replace arithmetic, the host computes what the counts decide, and one upload carries it.

Combine returns rows grouped by source rank in output order (what each source's stable sort of its
slots by expert, or by the caller's row, gives).

Combine sends back one row per (token, expert) pair in that order; the source places them in a dense
``[tokens, topk]`` grid (zeros for dropped slots) and sums it in float32 in slot order. With
``enable_local_combine=True`` the expert side first sums, the same way, the rows that belong to one
(source rank, token) and sends one row per (token, destination rank) in the row dtype (fewer bytes,
one extra rounding of each partial sum).

Every operation opens with the same fixed-size exchange, headed by the operation and its call number
(dispatch's counts ride in it), so ranks that call operations in different orders all see each other's
headers and raise :class:`ep_a2a.EPProtocolError` before any variable-sized message. On an NCCL group
the exchange is one all-gather on the device (one row per rank, no per-peer messages); its host copy is awaited (bounded by ``timeout_s``) where the host
needs it: at once in dispatch (the counts size the payload), and only after the payload is queued in
combine and barrier, so the header costs one small collective but no host round trip in front of the
data. On a gloo group every exchange runs on a gloo side group with the layer's timeout. ``tuning`` and
``use_aot`` are ignored here: there are no kernels to compile, and NCCL picks its own channels.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ep_a2a._dist import EPProtocolError, RankMonitor, group_device
from ep_a2a.backends.base import A2ABackend, BackendOptions, DispatchResult, register_backend
from ep_a2a.config import EPConfig
from ep_a2a.layout import EPAllToAllLayoutDesc

#: operation codes in the header of every operation's first message
_OPS = {"dispatch": 1, "combine": 2, "combine_per_slot": 3, "barrier": 4}
_OP_NAMES = {code: name for name, code in _OPS.items()}
_HOT_POLL_S = 0.02
_COLD_POLL_S = 5e-5


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
    back_row: torch.Tensor | None = None  # [R] int64: output rows by (source rank, output row); lazily


@dataclass
class _Header:
    """A header exchange queued on the device; :meth:`TorchBackend._check` awaits and checks it."""

    op: str
    step: str
    call: int
    host: torch.Tensor  # [world, 2 + width] int64 host copy (pinned on CUDA)
    done: torch.cuda.Event | None  # recorded after the copy (None: already on the host)


@dataclass
class _Tables:
    """Per-device constants of the dispatch bookkeeping (built once: no kernel per call)."""

    dest: torch.Tensor  # [E + 3] int64: destination rank of each slot bin (world: none)
    expert: torch.Tensor  # [E + 3] int32: global expert of each slot bin (E: none)
    krange: torch.Tensor  # [topk] int32
    earlier: torch.Tensor  # [topk, topk] bool: slot j comes before slot k
    mine: torch.Tensor  # [E + 1] bool: whether an expert (E: none) lives on this rank
    iota: torch.Tensor  # [world * max_tokens * topk] int64
    iota32: torch.Tensor  # [max_tokens * topk] int32
    ones: torch.Tensor  # [max_tokens * topk] int64


def _sum_slots(rows: torch.Tensor, pos: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """``rows[i]`` placed at flat position ``pos[i]`` of a zero ``[groups, width, C]`` grid, summed over
    ``width`` in float32 in order (what :func:`ep_a2a.reference.combine_ref` does per token)."""
    grid = rows.new_zeros(groups * width, rows.shape[1])
    grid.index_copy_(0, pos, rows)
    return grid.view(groups, width, rows.shape[1]).sum(1, dtype=torch.float32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous ``[n, k]`` tensor as ``[n, k * itemsize]`` uint8 (any strides of size-1
    dimensions)."""
    return t.reshape(-1).view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def _pack_rows(input: Tensor, experts: Tensor, rows: Tensor, weight: Tensor | None) -> Tensor:
    """``[n, bytes]`` uint8 rows: token row | expert of each slot | its row at the receiver | weights, each
    field padded to 8 bytes so that every field of the received bytes views as its dtype."""
    n, dev = input.shape[0], input.device
    xb = input.shape[1] * input.element_size()
    tail = (
        -(experts.shape[1] * 8 + (weight.shape[1] * weight.element_size() if weight is not None else 0)) % 8
    )
    parts = [input.view(torch.uint8)]
    if xb % 8:
        parts.append(torch.zeros(n, -xb % 8, dtype=torch.uint8, device=dev))
    parts += [_bytes(experts), _bytes(rows)]
    if weight is not None:
        parts.append(_bytes(weight))
    if tail:
        parts.append(torch.zeros(n, tail, dtype=torch.uint8, device=dev))
    return torch.cat(parts, 1)


@register_backend
class TorchBackend(A2ABackend):
    """``backend="torch"``: a fixed-size header, then packed ``all_to_all_single`` exchanges; see the
    module docstring."""

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
        if not self._on_device:
            self.monitor.create_side_group()
        self.rank = config.rank
        self.world_size = config.world_size
        self.e_local = config.num_experts_per_rank
        self.validate = options.validate
        #: columns of the opening exchange after (operation, call): my token count, my rows for each rank
        #: and one spare, my slots per bin (an id below -1, -1, each expert, an id of num_tot_experts or more)
        self._width = 1 + (config.world_size + 1) + (config.num_tot_experts + 3)
        #: operations this backend has run (every rank's count agrees while they call in the same order)
        self._calls = 0
        self._tables: dict[torch.device, _Tables] = {}

    @classmethod
    def is_available(cls, config: EPConfig, ep_group: dist.ProcessGroup) -> tuple[bool, str]:
        return True, f"torch.distributed all_to_all_single over {dist.get_backend(ep_group)}"

    # -- helpers -------------------------------------------------------------------------------------
    def _consts(self, dev: torch.device) -> _Tables:
        tables = self._tables.get(dev)
        if tables is None:
            cfg, world, L = self.config, self.world_size, self.e_local
            E, K, T = cfg.num_tot_experts, cfg.topk, cfg.max_tokens
            experts = torch.arange(E)
            none = torch.tensor([world])
            tables = _Tables(
                dest=torch.cat([none, none, experts // L, none]).to(dev),
                expert=torch.cat([torch.tensor([E, E]), experts, torch.tensor([E])]).to(dev, torch.int32),
                krange=torch.arange(K, dtype=torch.int32, device=dev),
                earlier=torch.ones(K, K, dtype=torch.bool).tril(-1).to(dev),
                mine=(torch.arange(E + 1) // L == self.rank).to(dev),
                iota=torch.arange(world * T * K, device=dev),
                iota32=torch.arange(T * K, dtype=torch.int32, device=dev),
                ones=torch.ones(T * K, dtype=torch.int64, device=dev),
            )
            self._tables[dev] = tables
        return tables

    def _head(self, op: str, n: int = 0) -> torch.Tensor:
        """This rank's opening row ``[2 + width]`` int64 on the host (pinned on CUDA): operation, call
        number, ``n``, zeros."""
        row = torch.zeros(2 + self._width, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        a = row.numpy()
        a[0], a[1], a[2] = _OPS[op], self._calls, n
        self._calls += 1
        return row

    def _open(self, op: str, step: str, row: torch.Tensor) -> _Header:
        """Queue the opening exchange of an operation: every rank sends every rank its ``row`` ``[2 +
        width]`` (from :meth:`_head`, on the host or filled in on the device). On the device it is one
        all-gather; on the CPU it completes and is checked here."""
        world, call = self.world_size, self._calls - 1
        if not self._on_device:
            send = row.expand(world, -1).contiguous()
            recv = torch.empty_like(send)
            with self.monitor.guard(step):
                self.monitor.all_to_all(recv, send)
            header = _Header(op, step, call, recv, None)
            self._check(header)  # before any variable-sized message: gloo matches messages in order
            return header
        cuda = self.device.type == "cuda"
        if row.device != self.device:
            row = row.to(self.device, non_blocking=True)
        recv = torch.empty(world * row.numel(), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(recv, row, group=self.ep_group)
        host = torch.empty((world, row.numel()), dtype=torch.int64, pin_memory=cuda)
        host.copy_(recv.view(world, -1), non_blocking=True)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        return _Header(op, step, call, host, done)

    def _check(self, header: _Header) -> np.ndarray:
        """Await a header exchange (bounded by ``timeout_s``) and check every rank is in the same
        operation and call. Returns every rank's row ``[world, 2 + width]`` on the host.

        Raises:
            EPProtocolError: some rank is in another operation or call (every rank raises: each sees
                every header).
            EPTimeoutError: a rank did not arrive within ``timeout_s``.
        """
        if header.done is not None:
            with self.monitor.guard(header.step):
                _wait(header.done, self.timeout_s)
        rows = header.host.numpy()
        op_code, call = _OPS[header.op], header.call
        if (rows[:, 0] != op_code).any() or (rows[:, 1] != call).any():
            heads = rows[:, :2].tolist()
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

    def _exchange(
        self, step: str, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        if not self._on_device:  # a gloo expert group: the side group is the same transport, bounded
            with self.monitor.guard(step):
                self.monitor.all_to_all(recv, send, recv_counts, send_counts)
        else:  # queued on the device; the operation's header wait bounds it
            dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.ep_group)
        return recv

    def _raise_bad_ids(self, rows: np.ndarray, exp_indices: torch.Tensor) -> None:
        """``ValueError`` on every rank when some rank's ids left ``[-1, num_tot_experts)`` (its slot
        counts of the two out-of-range bins), before any payload moves."""
        E, bins = self.config.num_tot_experts, 4 + self.world_size
        bad = rows[:, bins] + rows[:, bins + E + 2]
        if not bad.any():
            return
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
        n, K, world, L, E = input.shape[0], cfg.topk, self.world_size, self.e_local, cfg.num_tot_experts
        dev = input.device
        c = self._consts(dev)
        # bin of each slot: 0 an id below -1, 1 dropped (-1), 2 + e expert e, E + 2 an id of E or more
        bins = (exp_indices.clamp(-2, E) + 2).long()
        dest = c.dest[bins]  # [n, K] destination rank, world where the slot is dropped
        # one row per (token, rank): a slot whose token sends an earlier slot to the same rank sorts last
        same = dest[:, :, None] == dest[:, None, :]
        flat_dest = torch.where((same & c.earlier).any(-1), world, dest).flatten()

        # the opening exchange, the same row to every rank: (op, call, my token count, my rows for each
        # rank, my slots per bin); the per-expert matrix lets each source place its slots without a
        # round trip, and the out-of-range bins stop a bad call on every rank before any payload
        row = self._head("dispatch", n).to(dev, non_blocking=True)
        row[3 : 4 + world].scatter_add_(0, flat_dest, c.ones[: n * K])
        row[4 + world :].scatter_add_(0, bins.flatten(), c.ones[: n * K])
        header = self._open("dispatch", "dispatch/counts", row)

        # what needs no counts runs while they travel: the first slot of each (token, rank), rows ordered
        # by (dest, token) (each (token, rank)'s first slot, stably sorted by rank), each kept slot's rank
        # among my slots of its expert, and the packed payload of every token but the receiver rows of
        # its slots: token row | expert of each slot | its row at the receiver | weights (8-byte aligned
        # fields, so that every field of the received bytes views as its dtype)
        kept = dest < world
        skip = torch.where(kept, torch.where(same, c.krange, K).amin(-1), -1)  # [n, K] int32
        row_dest, row_flat = torch.sort(flat_dest, stable=True)
        row_token = row_flat // K
        if full_scatter_indices is None:
            # receivers place rows by (local expert, source rank, token, slot): a stable sort by bin
            # ranks my slots inside each expert; the receiver row adds the expert's base (from counts)
            sorted_bins, order = torch.sort(bins.flatten(), stable=True)
            bin_counts = row[4 + world :]
            first = (torch.cumsum(bin_counts, 0) - bin_counts).to(torch.int32)  # my first slot of each bin
            rank_in_bin = torch.empty(n * K, dtype=torch.int32, device=dev)
            rank_in_bin.scatter_(0, order, c.iota32[: n * K] - first[sorted_bins])
            rank_in_bin = torch.where(kept, rank_in_bin.view(n, K), 0)
            scatter = None
        else:  # the caller's rows; combine returns my slots by (dest, row), so sort them that way
            scatter = torch.where(kept, full_scatter_indices, -1)
            key = torch.where(
                kept, dest * (world * cfg.max_tokens * K) + scatter, world * world * cfg.max_tokens * K
            )
            order = torch.sort(key.flatten(), stable=True).indices
        xb = input.shape[1] * input.element_size()
        mo = xb + -xb % 8  # offset of the slots' fields in a packed row
        packed = _pack_rows(input, c.expert[bins], scatter if scatter is not None else rank_in_bin, weight)

        rows = self._check(header)
        if self.validate:
            self._raise_bad_ids(rows, exp_indices)
        rows_matrix = rows[:, 3 : 3 + world].tolist()  # [src rank][dest rank] rows (tokens) sent
        send_counts = rows_matrix[me]
        recv_counts = [r[me] for r in rows_matrix]
        per_rank = rows[:, 6 + world : 6 + world + E].reshape(world, world, L)  # [src, dest, local expert]
        slot_matrix = per_rank.sum(2).tolist()  # [src rank][dest rank] kept slots
        slot_counts = slot_matrix[me]
        back_counts = [r[me] for r in slot_matrix]
        num_rows, num_slots, num_sent = sum(back_counts), sum(slot_counts), sum(send_counts)
        dropped_first = int(rows[me, 4 + world] + rows[me, 5 + world])  # bins sorted before the experts

        # what the host computes from the counts, in one upload: rows per local expert, receive
        # boundaries, and each expert's first row at its receiver (bin-indexed, -1 for the other bins):
        # its receiver's rows of earlier experts plus the rows of earlier sources in the same expert
        totals = per_rank.sum(0)  # [dest, local]
        nb = L + world - 1
        up_host = torch.empty(nb + (E + 4) // 2, dtype=torch.int64, pin_memory=dev.type == "cuda")
        up = up_host.numpy()
        up[:L] = totals[me]
        up[L:nb] = list(itertools.accumulate(recv_counts[:-1]))
        bins_base = up[nb:].view(np.int32)
        bins_base[:2] = bins_base[E + 2 :] = -1
        start = bins_base[2 : E + 2].reshape(world, L)
        start[:, 0] = 0
        start[:, 1:] = np.cumsum(totals[:, :-1], 1)
        if me:
            start += per_rank[:me].sum(0)
        up_dev = up_host.to(dev, non_blocking=True)
        per_expert, recv_bounds = up_dev[:L], up_dev[L:nb]

        if full_scatter_indices is None:  # the receiver rows of my slots: the expert's base + my rank
            packed_rows = packed[:, mo + 4 * K : mo + 8 * K].view(torch.int32)
            packed_rows.add_(up_dev[nb:].view(torch.int32)[bins])
            slot_flat = order[dropped_first : dropped_first + num_slots]
        else:
            slot_flat = order[:num_slots]
        send_token = row_token[:num_sent]
        recv = self._exchange("dispatch/payload", packed[send_token], send_counts, recv_counts)
        if scatter is None:
            scatter = packed_rows.clone(memory_format=torch.contiguous_format)

        # expand on the receiver: output row p is the (row, slot) whose sender placed it at p
        r_e = recv[:, mo : mo + 4 * K].view(torch.int32)
        r_pos = recv[:, mo + 4 * K : mo + 8 * K].view(torch.int32)
        mine = c.mine[r_e]
        target = torch.where(mine, r_pos, num_rows).flatten()
        if full_scatter_indices is not None:
            self._check_caller_rows(mine, r_pos, target, num_rows)
        inv = torch.empty(num_rows + 1, dtype=torch.int64, device=dev)
        inv.index_put_((target,), c.iota[: target.numel()])
        back_flat = inv[:num_rows]
        out_row = back_flat // K
        output = recv[:, :xb].view(input.dtype)[out_row]
        out_weights = None
        if weight is not None:
            wo = mo + 8 * K
            out_weights = torch.take(
                recv[:, wo : wo + K * weight.element_size()].view(weight.dtype), back_flat
            )
        recv_expert = torch.take(r_e, back_flat) % L
        back_row = None
        if full_scatter_indices is None and not self.enable_local_combine:
            back_row = self._back_row_default(per_rank[:, me], totals[me], num_rows, dev)

        state = _TorchState(
            owner=id(self),
            send_pos=send_token * world + row_dest[:num_sent] if self.enable_local_combine else None,
            send_counts=send_counts,
            recv_counts=recv_counts,
            slot_flat=slot_flat,
            slot_counts=slot_counts,
            back_flat=back_flat,
            out_row=out_row,
            recv_bounds=recv_bounds,
            back_counts=back_counts,
            back_row=back_row,
        )
        desc = EPAllToAllLayoutDesc(
            num_dispatch_token_cur_rank=n,
            num_input_tokens_per_rank=torch.from_numpy(rows[:, 2].copy()),
            send_reqs_recv_tensor=None,
            topk_indices_tensor=exp_indices,
            token_dst_scatter_idx=scatter.to(cfg.offset_dtype),
            skipped_token_mapping_indices=None,
            skipped_token_topk_mapping_indices=skip,
            num_recv_tokens_per_expert=per_expert,
            num_recv_tokens_per_rank=torch.tensor(back_counts, dtype=torch.int64),
            num_recv_rows=num_rows,
            recv_expert_indices=recv_expert,
            caller_scatter=full_scatter_indices is not None,
            backend_state=state,
        )
        return output, out_weights, desc

    def _back_row_default(
        self, mine: np.ndarray, totals: np.ndarray, num_rows: int, dev: torch.device
    ) -> torch.Tensor:
        """Output rows in the order combine sends them back, for the default row order (no sort):
        output rows run by (local expert, source rank), combine's by (source rank, local expert), so
        row ``q`` of segment ``(s, l)`` in combine's order is output row ``q + out_start[s, l] -
        back_start[s, l]``. ``mine``: ``[world, E_local]`` rows received per (source rank, local
        expert); ``totals``: ``[E_local]`` rows per local expert."""
        flat = mine.reshape(-1)
        back_start = np.cumsum(flat) - flat  # [world * E_local] (source, local)-major
        out_start = (np.cumsum(totals) - totals) + (np.cumsum(mine, 0) - mine)  # [world, E_local]
        segs = flat.size
        table = torch.empty(2 * segs - 1, dtype=torch.int64, pin_memory=dev.type == "cuda")
        t = table.numpy()
        t[:segs] = out_start.reshape(-1) - back_start
        t[segs:] = back_start[1:]
        table = table.to(dev, non_blocking=True)
        q = self._consts(dev).iota[:num_rows]
        return q + table[:segs][torch.bucketize(q, table[segs:], right=True)]

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
        header = self._open("combine", "combine", self._head("combine"))
        state: _TorchState = layout_desc.backend_state
        n, topk, world = layout_desc.num_dispatch_token_cur_rank, self.config.topk, self.world_size
        if self.enable_local_combine:
            # expert side: sum the rows of one (source rank, token) in float32, in slot order, and send
            # one row per (token, destination rank) in the row dtype
            partial = _sum_slots(input, state.back_flat, sum(state.recv_counts), topk).to(input.dtype)
            rows = self._exchange(
                "combine", partial.view(torch.uint8), state.recv_counts, state.send_counts
            ).view(input.dtype)
            assert state.send_pos is not None
            out = _sum_slots(rows, state.send_pos, n, world)
        else:
            rows = self._reverse(input[_back_row(state)], state)
            out = _sum_slots(rows, state.slot_flat, n, topk)
        self._check(header)
        return out.to(input.dtype)

    def _reverse(self, rows: torch.Tensor, state: _TorchState) -> torch.Tensor:
        """Send per-(received row, slot) values ``[Mr, C]`` back: ``[M, C]`` in ``slot_flat`` order."""
        send = rows.view(torch.uint8) if rows.dtype != torch.uint8 else rows
        recv = self._exchange("combine", send.contiguous(), state.back_counts, state.slot_counts)
        return recv.view(rows.dtype)

    def combine_per_slot(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        header = self._open("combine_per_slot", "combine", self._head("combine_per_slot"))
        state: _TorchState = layout_desc.backend_state
        n, topk, width = layout_desc.num_dispatch_token_cur_rank, self.config.topk, input.shape[1]
        rows = self._reverse(input[_back_row(state)], state)
        out = torch.zeros(n * topk, width, dtype=input.dtype, device=input.device)
        out[state.slot_flat] = rows
        self._check(header)
        return out.view(n, topk, width)

    # -- sync / teardown -------------------------------------------------------------------------------
    def barrier(self, *, intra_node_only: bool = False, stream: torch.cuda.Stream | None = None) -> None:
        if self.device.type == "cuda":
            (stream or torch.cuda.current_stream()).synchronize()
        if not intra_node_only:
            self._check(self._open("barrier", "barrier", self._head("barrier")))
            return
        node, lws = self.rank // self.config.local_world_size, self.config.local_world_size
        self.monitor.checkin("barrier/node", "1", ranks=range(node * lws, (node + 1) * lws))

    def finalize(self) -> None:
        self.monitor.destroy()


def _back_row(state: _TorchState) -> torch.Tensor:
    """Output rows in the order combine sends them back: by source rank, then output row (for each source,
    the order in which it sorted its slots: by expert, or by the caller's row); computed once (dispatch
    computes it for the default row order)."""
    if state.back_row is None:
        src = torch.bucketize(state.out_row, state.recv_bounds, right=True)
        state.back_row = torch.sort(src, stable=True).indices
    return state.back_row


def _wait(event: torch.cuda.Event, timeout_s: float) -> None:
    """Wait for ``event`` on the host, raising ``TimeoutError`` after ``timeout_s`` (a device wait cannot be
    bounded otherwise: a collective whose peer never comes stays queued). Polls hot for the first
    ``_HOT_POLL_S`` (an exchange's usual wait: a sleep would add its own latency to every call), then
    every ``_COLD_POLL_S``."""
    if event.query():
        return
    now = time.monotonic()
    hot, deadline = now + _HOT_POLL_S, now + timeout_s
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"the device did not finish the exchange within {timeout_s:g}s")
        if now > hot:
            time.sleep(_COLD_POLL_S)
