"""Portable backend: ``torch.distributed.all_to_all_single`` only (NCCL on GPUs, gloo on CPUs).

Dispatch sends each token once per destination rank (not once per expert): one fixed-size exchange of
counts, then one packed byte payload per row holding the token, its top-k expert indices, its weights
and, when given, its ``full_scatter_indices``. The receiver expands each row to one output row per slot
whose expert it hosts and orders them (local expert, source rank, token, slot).

Combine sends back one row per (token, expert) pair; the source places them in a dense
``[tokens, topk]`` grid (zeros for dropped slots) and sums it in float32 in slot order. With
``enable_local_combine=True`` the expert side first sums, the same way, the rows that belong to one
(source rank, token) and sends one row per (token, destination rank) in the row dtype (fewer bytes,
one extra rounding of each partial sum).

Every operation opens with the same fixed-size exchange, headed by the operation and its call number
(dispatch's counts ride in it), so ranks that call operations in different orders all see each other's
headers and raise :class:`ep_a2a.EPProtocolError` before any variable-sized message. On an NCCL group
the exchange runs on the device; its host copy is awaited (bounded by ``timeout_s``) where the host
needs it: at once in dispatch (the counts size the payload), and only after the payload is queued in
combine and barrier, so the header costs one small collective but no host round trip in front of the
data. On a gloo group every exchange runs on a gloo side group with the layer's timeout. ``tuning`` and
``use_aot`` are ignored here: there are no kernels to compile, and NCCL picks its own channels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ep_a2a._dist import EPProtocolError, RankMonitor, group_device
from ep_a2a.backends.base import A2ABackend, BackendOptions, DispatchResult, register_backend
from ep_a2a.config import EPConfig
from ep_a2a.layout import EPAllToAllLayoutDesc

_ALIGN = 16
#: operation codes in the header of every operation's first message
_OPS = {"dispatch": 1, "combine": 2, "combine_per_slot": 3, "barrier": 4}
_OP_NAMES = {code: name for name, code in _OPS.items()}


@dataclass
class _TorchState:
    owner: int
    send_pos: (
        torch.Tensor
    )  # [S] int64: token * world + dest rank of each dispatched row (rows by dest, token)
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    slot_flat: (
        torch.Tensor
    )  # [M] int64: t * topk + k of each kept slot, slots ordered by (dest rank, token, slot)
    slot_counts: list[int]  # kept slots sent to each rank
    back_row: torch.Tensor  # [Mr] int64: output row of each received (row, slot), in (src, token, slot) order
    back_counts: list[int]  # received (row, slot) pairs per source rank
    back_flat: torch.Tensor  # [R] int64: received row * topk + slot of each output row


@dataclass
class _Header:
    """A header exchange queued on the device; :meth:`TorchBackend._check` awaits and checks it."""

    op: str
    step: str
    call: int
    host: torch.Tensor  # [world, 2 + width] int64 host copy (pinned on CUDA)
    done: torch.cuda.Event | None  # recorded after the copy (None: already on the host)


def _split_sizes(counts: torch.Tensor) -> list[int]:
    return [int(c) for c in counts.tolist()]


def _first_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the first ``count`` True entries of ``mask`` in row-major order, without a device
    sync (``count`` is their number, known on the host)."""
    flat = mask.reshape(-1)
    return torch.sort((~flat).to(torch.uint8), stable=True).indices[:count]


def _sum_slots(rows: torch.Tensor, pos: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """``rows[i]`` placed at flat position ``pos[i]`` of a zero ``[groups, width, C]`` grid, summed over
    ``width`` in float32 in order (what :func:`ep_a2a.reference.combine_ref` does per token)."""
    grid = rows.new_zeros(groups * width, rows.shape[1])
    grid.index_copy_(0, pos, rows)
    return grid.view(groups, width, rows.shape[1]).sum(1, dtype=torch.float32)


@register_backend
class TorchBackend(A2ABackend):
    """``backend="torch"``: packed ``all_to_all_single`` exchanges; see the module docstring."""

    name = "torch"

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
        #: int64 columns of the opening exchange's body: (my token count, my rows for each rank, my kept
        #: slots per expert)
        self._width = 1 + config.world_size + config.num_tot_experts
        #: operations this backend has run (every rank's count agrees while they call in the same order)
        self._calls = 0

    @classmethod
    def is_available(cls, config: EPConfig, ep_group: dist.ProcessGroup) -> tuple[bool, str]:
        return True, f"torch.distributed all_to_all_single over {dist.get_backend(ep_group)}"

    # -- helpers -------------------------------------------------------------------------------------
    def _open(self, op: str, step: str, body: torch.Tensor | None = None) -> _Header:
        """Queue the opening exchange of an operation: every rank sends every rank a ``[2 + width]``
        int64 row headed by (operation, call number) and followed by its ``body`` row for that rank
        (zeros where ``None``). On the CPU it completes and is checked here."""
        world = self.world_size
        call = self._calls
        self._calls += 1
        head = torch.tensor([_OPS[op], call], dtype=torch.int64)
        if not self._on_device:
            send = torch.zeros(world, 2 + self._width, dtype=torch.int64)
            send[:, :2] = head
            if body is not None:
                send[:, 2:] = body
            recv = torch.empty_like(send)
            with self.monitor.guard(step):
                self.monitor.all_to_all(recv, send)
            header = _Header(op, step, call, recv, None)
            self._check(header)  # before any variable-sized message: gloo matches messages in order
            return header
        cuda = self.device.type == "cuda"
        if body is None:  # only the header: built on the host, one copy, no kernel
            rows = torch.zeros(world, 2 + self._width, dtype=torch.int64, pin_memory=cuda)
            rows[:, :2] = head
            send = rows.to(self.device, non_blocking=True)
        else:
            send = torch.cat([head.to(self.device, non_blocking=True).expand(world, 2), body], 1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        host = torch.empty(recv.shape, dtype=torch.int64, pin_memory=cuda)
        host.copy_(recv, non_blocking=True)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        return _Header(op, step, call, host, done)

    def _check(self, header: _Header) -> torch.Tensor:
        """Await a header exchange (bounded by ``timeout_s``) and check every rank is in the same
        operation and call. Returns the received bodies ``[world, width]`` on the host.

        Raises:
            EPProtocolError: some rank is in another operation or call (every rank raises: each sees
                every header).
            EPTimeoutError: a rank did not arrive within ``timeout_s``.
        """
        if header.done is not None:
            with self.monitor.guard(header.step):
                _wait(header.done, self.timeout_s)
        op_code, call = _OPS[header.op], header.call
        heads = header.host[:, :2].tolist()
        if any(h != [op_code, call] for h in heads):
            ops = {r: f"{_OP_NAMES.get(o, f'operation {o}')} (call #{c})" for r, (o, c) in enumerate(heads)}
            raise EPProtocolError(
                "ep_a2a: ranks called the layer's collectives in different orders: "
                + ", ".join(f"rank {r} is in {what}" for r, what in ops.items())
                + f" (this is rank {self.rank}). Every rank must call dispatch, combine and barrier in the "
                "same order; no rank returns data. The group's pending messages are undefined from here: "
                "finalize the layer",
                operations=ops,
            )
        return header.host[:, 2:]

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

    @staticmethod
    def _row_bytes(parts: list[int]) -> tuple[list[int], int]:
        offsets, off = [], 0
        for p in parts:
            offsets.append(off)
            off += (p + _ALIGN - 1) // _ALIGN * _ALIGN
        return offsets, off

    # -- dispatch ------------------------------------------------------------------------------------
    def dispatch(
        self,
        input: torch.Tensor,
        exp_indices: torch.Tensor,
        weight: torch.Tensor | None,
        full_scatter_indices: torch.Tensor | None,
    ) -> DispatchResult:
        cfg = self.config
        n, topk, world = input.shape[0], cfg.topk, self.world_size
        dev = input.device
        num_experts = cfg.num_tot_experts
        # an id outside [-1, num_experts) (possible with validate=False) drops its slot, as -1 does
        exp_indices = exp_indices.masked_fill((exp_indices < 0) | (exp_indices >= num_experts), -1)
        idx = exp_indices.long()
        dest = torch.where(idx >= 0, idx // self.e_local, world)  # world = "dropped"
        present = torch.zeros(n, world + 1, dtype=torch.bool, device=dev)
        present.scatter_(1, dest, True)
        present = present[:, :world]
        expert_counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
        expert_counts.scatter_add_(0, idx.flatten() + 1, torch.ones_like(idx.flatten()))

        # counts first, in the operation's opening exchange, the same row to every rank: my token count,
        # my rows for each rank, my kept slots per expert (the per-expert matrix lets each source compute
        # where its slots land without a round trip)
        body = torch.cat(
            [torch.full((1,), n, device=dev, dtype=torch.int64), present.sum(0), expert_counts[1:]]
        )
        counts = self._check(self._open("dispatch", "dispatch/counts", body.expand(world, -1)))
        tokens_per_rank = counts[:, 0].clone()
        rows_matrix = counts[:, 1 : 1 + world]  # [src rank, dest rank] rows (tokens) sent
        count_matrix = counts[:, 1 + world :]  # [src rank, global expert] kept slots
        send_counts = _split_sizes(rows_matrix[self.rank])
        recv_counts = _split_sizes(rows_matrix[:, self.rank])
        per_rank = count_matrix.view(world, world, self.e_local)  # [src, dest, local expert]
        slot_counts = _split_sizes(per_rank[self.rank].sum(1))
        back_counts = _split_sizes(per_rank[:, self.rank].sum(1))
        # rows ordered by (dest, token), found without a device sync: their number is known
        flat = _first_true(present.t(), sum(send_counts))
        send_token, send_dest = flat % max(n, 1), flat // max(n, 1)

        # one packed payload: token row | expert indices | weights | caller scatter indices
        x_bytes = input.shape[1] * input.element_size()  # (FP8 dispatch: the row and its scales, as bytes)
        parts = [x_bytes, topk * 4]
        if weight is not None:
            parts.append(topk * weight.element_size())
        if full_scatter_indices is not None:
            parts.append(topk * 4)
        offsets, row_bytes = self._row_bytes(parts)
        payload = torch.empty(len(send_token), row_bytes, dtype=torch.uint8, device=dev)
        payload[:, : parts[0]] = input.view(torch.uint8)[send_token]
        payload[:, offsets[1] : offsets[1] + parts[1]] = exp_indices.view(torch.uint8)[send_token]
        p = 2
        if weight is not None:
            payload[:, offsets[p] : offsets[p] + parts[p]] = weight.view(torch.uint8)[send_token]
            p += 1
        if full_scatter_indices is not None:
            payload[:, offsets[p] : offsets[p] + parts[p]] = full_scatter_indices.view(torch.uint8)[
                send_token
            ]
        recv = self._exchange("dispatch/payload", payload, send_counts, recv_counts)

        # expand on the receiver: one output row per (received row, slot) whose expert lives here,
        # found in (src, token, slot) order without a device sync (their number is known)
        r_x = recv[:, : parts[0]].view(input.dtype)
        r_idx = recv[:, offsets[1] : offsets[1] + parts[1]].view(torch.int32).long()
        p = 2
        r_w = None
        if weight is not None:
            r_w = recv[:, offsets[p] : offsets[p] + parts[p]].view(weight.dtype)
            p += 1
        num_rows = sum(back_counts)
        mine = (r_idx >= 0) & (r_idx // self.e_local == self.rank)
        recv_flat = _first_true(mine, num_rows)
        recv_row = recv_flat // topk
        local_expert = r_idx.flatten()[recv_flat] % self.e_local
        if full_scatter_indices is None:
            order = torch.sort(local_expert, stable=True).indices
            back_row = torch.empty_like(order)
            back_row[order] = torch.arange(num_rows, device=dev)
        else:
            r_fsi = recv[:, offsets[p] : offsets[p] + parts[p]].view(torch.int32)
            back_row = r_fsi.flatten()[recv_flat].long()
            if num_rows and (
                int(back_row.min()) < 0
                or int(back_row.max()) >= num_rows
                or not bool((torch.bincount(back_row, minlength=num_rows) == 1).all())
            ):
                raise ValueError(
                    f"full_scatter_indices must give rank {self.rank} exactly the rows 0..{num_rows - 1} "
                    "(each once); the senders' indices do not"
                )
            order = torch.empty_like(back_row)
            order[back_row] = torch.arange(num_rows, device=dev)
        output = r_x[recv_row[order]]
        out_weights = r_w.flatten()[recv_flat[order]].contiguous() if r_w is not None else None
        recv_expert = local_expert[order]

        # where each of my slots lands (for the caller and for combine's reverse path)
        slot_flat = torch.sort(dest.flatten(), stable=True).indices[: sum(slot_counts)]
        state = _TorchState(
            owner=id(self),
            send_pos=send_token * world + send_dest,
            send_counts=send_counts,
            recv_counts=recv_counts,
            slot_flat=slot_flat,
            slot_counts=slot_counts,
            back_row=back_row,
            back_counts=back_counts,
            back_flat=recv_flat[order],
        )
        if full_scatter_indices is None:
            scatter = self._default_scatter(idx, count_matrix)
        else:
            scatter = torch.where(exp_indices >= 0, full_scatter_indices, -1)
        per_expert = per_rank[:, self.rank].sum(0)
        desc = EPAllToAllLayoutDesc(
            num_dispatch_token_cur_rank=n,
            num_input_tokens_per_rank=tokens_per_rank,
            send_reqs_recv_tensor=None,
            topk_indices_tensor=exp_indices,
            token_dst_scatter_idx=scatter.to(cfg.offset_dtype),
            skipped_token_mapping_indices=None,
            skipped_token_topk_mapping_indices=_first_slot_same_rank(dest, world),
            num_recv_tokens_per_expert=per_expert.to(dev, non_blocking=True),
            num_recv_tokens_per_rank=torch.tensor(back_counts, dtype=torch.int64),
            num_recv_rows=num_rows,
            recv_expert_indices=recv_expert.to(torch.int32),
            caller_scatter=full_scatter_indices is not None,
            backend_state=state,
        )
        return output, out_weights, desc

    def _default_scatter(self, idx: torch.Tensor, count_matrix: torch.Tensor) -> torch.Tensor:
        """``[n, topk]`` int32 row of each of my slots in its receiver's output (-1 dropped), from counts.

        Receiver ``d`` orders rows by (local expert, source rank, token, slot), so my slots for global
        expert ``e`` start at: rows of ``d``'s earlier experts + rows of ``e`` from lower source ranks.
        """
        world, e_local = self.world_size, self.e_local
        per_dest = count_matrix.view(world, world, e_local)  # [src, dest, local]
        totals = per_dest.sum(0)  # [dest, local]
        expert_start = torch.cumsum(totals, 1) - totals  # exclusive, inside each dest
        src_start = torch.cumsum(per_dest, 0) - per_dest  # exclusive over source ranks
        mine = count_matrix[self.rank]
        group_start = torch.cumsum(mine, 0) - mine
        # per global expert: receiver row of my first slot of it, minus my slots of earlier experts
        base = (expert_start + src_start[self.rank]).flatten() - group_start
        base = base.to(idx.device, non_blocking=True)
        flat = idx.flatten()
        kept = int(mine.sum())
        order = torch.sort(torch.where(flat >= 0, flat, self.config.num_tot_experts), stable=True).indices[
            :kept
        ]
        pos = base[flat[order]] + torch.arange(kept, device=idx.device)
        scatter = torch.full_like(flat, -1)
        scatter[order] = pos
        return scatter.view(idx.shape).to(torch.int32)

    # -- combine -------------------------------------------------------------------------------------
    def combine(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        header = self._open("combine", "combine")
        state: _TorchState = layout_desc.backend_state
        n, topk, world = layout_desc.num_dispatch_token_cur_rank, self.config.topk, self.world_size
        if self.enable_local_combine:
            # expert side: sum the rows of one (source rank, token) in float32, in slot order, and send
            # one row per (token, destination rank) in the row dtype
            partial = _sum_slots(input, state.back_flat, sum(state.recv_counts), topk).to(input.dtype)
            rows = self._exchange(
                "combine", partial.view(torch.uint8), state.recv_counts, state.send_counts
            ).view(input.dtype)
            out = _sum_slots(rows, state.send_pos, n, world)
        else:
            rows = self._reverse(input[state.back_row], state)
            out = _sum_slots(rows, state.slot_flat, n, topk)
        self._check(header)
        return out.to(input.dtype)

    def _reverse(self, rows: torch.Tensor, state: _TorchState) -> torch.Tensor:
        """Send per-(received row, slot) values ``[Mr, C]`` back: ``[M, C]`` in ``slot_flat`` order."""
        send = rows.view(torch.uint8) if rows.dtype != torch.uint8 else rows
        recv = self._exchange("combine", send.contiguous(), state.back_counts, state.slot_counts)
        return recv.view(rows.dtype)

    def combine_per_slot(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        header = self._open("combine_per_slot", "combine")
        state: _TorchState = layout_desc.backend_state
        n, topk, width = layout_desc.num_dispatch_token_cur_rank, self.config.topk, input.shape[1]
        rows = self._reverse(input[state.back_row], state)
        out = torch.zeros(n * topk, width, dtype=input.dtype, device=input.device)
        out[state.slot_flat] = rows
        self._check(header)
        return out.view(n, topk, width)

    # -- sync / teardown -------------------------------------------------------------------------------
    def barrier(self, *, intra_node_only: bool = False, stream: torch.cuda.Stream | None = None) -> None:
        if self.device.type == "cuda":
            (stream or torch.cuda.current_stream()).synchronize()
        if not intra_node_only:
            self._check(self._open("barrier", "barrier"))
            return
        node, lws = self.rank // self.config.local_world_size, self.config.local_world_size
        self.monitor.checkin("barrier/node", "1", ranks=range(node * lws, (node + 1) * lws))

    def finalize(self) -> None:
        self.monitor.destroy()


def _first_slot_same_rank(dest: torch.Tensor, world: int) -> torch.Tensor:
    """``[n, topk]`` int32: first slot k' <= k of the token with the same destination rank, -1 if dropped."""
    _n, topk = dest.shape
    k = torch.arange(topk, device=dest.device)
    same = dest[:, :, None] == dest[:, None, :]  # [n, k, k']
    earlier = k[None, :] <= k[:, None]  # k' <= k
    first = torch.where(same & earlier[None], k[None, None, :], topk).amin(-1)
    return torch.where(dest < world, first, -1).to(torch.int32)


def _wait(event: torch.cuda.Event, timeout_s: float) -> None:
    """Wait for ``event`` on the host, raising ``TimeoutError`` after ``timeout_s`` (a device wait cannot be
    bounded otherwise: a collective whose peer never comes stays queued)."""
    if event.query():
        return
    deadline = time.monotonic() + timeout_s
    spins = 0
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the device did not finish the exchange within {timeout_s:g}s")
        spins += 1
        if spins > 2000:  # past ~a few ms: stop spinning hot
            time.sleep(1e-4)
