"""Portable backend: ``torch.distributed.all_to_all_single`` only (NCCL on GPUs, gloo on CPUs).

Dispatch sends each token once per destination rank (not once per expert): one exchange of counts,
then one packed byte payload per row holding the token, its top-k expert indices, its weights and, when
given, its ``full_scatter_indices``. The receiver expands each row to one output row per slot whose
expert it hosts and orders them (local expert, source rank, token, slot).

Combine sends back one row per (token, expert) pair and the source sums them in float32; with
``enable_local_combine=True`` the expert side first sums, in float32, the rows that belong to the same
(source rank, token) and sends one row per (token, destination rank) in the row dtype (fewer bytes, one
extra rounding of each partial sum).

Counts travel on a gloo side group with the layer's timeout (host values are needed anyway to size the
payload exchange); when the expert-parallel group itself is gloo, the payload uses the side group too,
so every wait is bounded. ``tuning`` and ``use_aot`` are ignored here: there are no kernels to compile,
and NCCL picks its own channels.
"""

from __future__ import annotations

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
    send_token: torch.Tensor  # [S] int64: token of each dispatched row (rows ordered by dest rank, token)
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    slot_token: torch.Tensor  # [M] int64: token of each kept slot, slots ordered by (dest rank, token, slot)
    slot_flat: torch.Tensor  # [M] int64: t * topk + k of each kept slot in that order
    slot_counts: list[int]  # kept slots sent to each rank
    back_row: torch.Tensor  # [Mr] int64: output row of each received (row, slot), in (src, token, slot) order
    back_counts: list[int]  # received (row, slot) pairs per source rank
    back_recv_row: torch.Tensor  # [Mr] int64: received row of each of those pairs


def _split_sizes(counts: torch.Tensor) -> list[int]:
    return [int(c) for c in counts.tolist()]


@register_backend
class TorchBackend(A2ABackend):
    """``backend="torch"``: packed ``all_to_all_single`` exchanges; see the module docstring."""

    name = "torch"

    def __init__(self, config: EPConfig, ep_group: dist.ProcessGroup, options: BackendOptions) -> None:
        super().__init__(config, ep_group, options)
        self.monitor = (
            options.monitor if options.monitor is not None else RankMonitor(ep_group, self.timeout_s)
        )
        self.monitor.create_side_group()
        self.device = group_device(ep_group)
        self.rank = config.rank
        self.world_size = config.world_size
        self.e_local = config.num_experts_per_rank
        #: operations this backend has run (every rank's count agrees while they call in the same order)
        self._calls = 0

    @classmethod
    def is_available(cls, config: EPConfig, ep_group: dist.ProcessGroup) -> tuple[bool, str]:
        return True, f"torch.distributed all_to_all_single over {dist.get_backend(ep_group)}"

    # -- helpers -------------------------------------------------------------------------------------
    def _message(self, op: str, step: str, body: torch.Tensor | None = None) -> torch.Tensor:
        """The first exchange of every operation: an all-to-all, on the CPU side group, of each rank's
        ``[world, 2 + 2 + num_experts]`` int64 rows headed by (operation, call number) and followed by
        ``body`` (zeros where ``None``). Returns the received bodies ``[world, 2 + num_experts]``.

        Raises:
            EPProtocolError: some rank is in another operation or call (every rank raises: each sees
                every header).
        """
        world, width = self.world_size, 2 + self.config.num_tot_experts
        op_code, call = _OPS[op], self._calls
        self._calls += 1
        send = torch.zeros(world, 2 + width, dtype=torch.int64)
        send[:, 0], send[:, 1] = op_code, call
        if body is not None:
            send[:, 2:] = body
        recv = torch.empty_like(send)
        with self.monitor.guard(step):
            self.monitor.all_to_all(recv, send)
        heads = recv[:, :2].tolist()
        if any(h != [op_code, call] for h in heads):
            ops = {r: f"{_OP_NAMES.get(o, f'operation {o}')} (call #{c})" for r, (o, c) in enumerate(heads)}
            raise EPProtocolError(
                "ep_a2a: ranks called the layer's collectives in different orders: "
                + ", ".join(f"rank {r} is in {what}" for r, what in ops.items())
                + f" (this is rank {self.rank}). Every rank must call dispatch, combine and barrier in the "
                "same order; nothing was exchanged and no rank returns data",
                operations=ops,
            )
        return recv[:, 2:]

    def _exchange(
        self, step: str, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        with self.monitor.guard(step):
            if (
                self.device.type == "cpu"
            ):  # a gloo expert group: the side group is the same transport, bounded
                self.monitor.all_to_all(recv, send, recv_counts, send_counts)
            else:
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
        n, hidden, topk, world = input.shape[0], cfg.hidden, cfg.topk, self.world_size
        dev = input.device
        num_experts = cfg.num_tot_experts
        # an id outside [-1, num_experts) (possible with validate=False) drops its slot, as -1 does
        exp_indices = exp_indices.masked_fill((exp_indices < 0) | (exp_indices >= num_experts), -1)
        idx = exp_indices.long()
        dest = torch.where(idx >= 0, idx // self.e_local, world)  # world = "dropped"
        present = torch.zeros(n, world + 1, dtype=torch.bool, device=dev)
        present.scatter_(1, dest, True)
        present = present[:, :world]
        _, send_token = torch.nonzero(present.t(), as_tuple=True)  # rows ordered by (dest, token)
        expert_counts = torch.bincount(idx.flatten() + 1, minlength=num_experts + 1)[1:]

        # counts first, on the CPU side group, under the call's header: to every rank (rows for it, my
        # token count, my count per expert); the per-expert matrix lets each source compute where its
        # slots land without a round trip
        body = torch.cat(
            [
                present.sum(0)[:, None],
                torch.full((world, 1), n, device=dev, dtype=torch.int64),
                expert_counts[None, :].expand(world, -1),
            ],
            1,
        )
        counts_send = body.cpu()
        counts_recv = self._message("dispatch", "dispatch/counts", counts_send)
        send_counts = _split_sizes(counts_send[:, 0])
        recv_counts = _split_sizes(counts_recv[:, 0])
        tokens_per_rank = counts_recv[:, 1].clone()
        count_matrix = counts_recv[:, 2:]  # [src rank, global expert] kept slots
        per_rank = count_matrix.view(world, world, self.e_local)  # [src, dest, local expert]
        slot_counts = _split_sizes(per_rank[self.rank].sum(1))
        back_counts = _split_sizes(per_rank[:, self.rank].sum(1))

        # one packed payload: token row | expert indices | weights | caller scatter indices
        x_bytes = hidden * input.element_size()
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

        # expand on the receiver: one output row per (received row, slot) whose expert lives here
        r_x = recv[:, : parts[0]].view(input.dtype)
        r_idx = recv[:, offsets[1] : offsets[1] + parts[1]].view(torch.int32).long()
        p = 2
        r_w = None
        if weight is not None:
            r_w = recv[:, offsets[p] : offsets[p] + parts[p]].view(weight.dtype)
            p += 1
        mine = (r_idx >= 0) & (r_idx // self.e_local == self.rank)
        recv_row, recv_slot = torch.nonzero(mine, as_tuple=True)  # (src, token, slot) order
        local_expert = r_idx[recv_row, recv_slot] % self.e_local
        num_rows = int(recv_row.numel())
        if full_scatter_indices is None:
            order = torch.sort(local_expert, stable=True).indices
            back_row = torch.empty_like(order)
            back_row[order] = torch.arange(num_rows, device=dev)
        else:
            r_fsi = recv[:, offsets[p] : offsets[p] + parts[p]].view(torch.int32)
            back_row = r_fsi[recv_row, recv_slot].long()
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
        src_row = recv_row[order]
        output = r_x[src_row]
        out_weights = r_w[src_row, recv_slot[order]].contiguous() if r_w is not None else None
        recv_expert = local_expert[order]

        # where each of my slots lands (for the caller and for combine's reverse path)
        flat_dest = dest.flatten()
        slot_flat = torch.sort(flat_dest, stable=True).indices[: int(sum(slot_counts))]
        slot_token = slot_flat // topk
        state = _TorchState(
            owner=id(self),
            send_token=send_token,
            send_counts=send_counts,
            recv_counts=recv_counts,
            slot_token=slot_token,
            slot_flat=slot_flat,
            slot_counts=slot_counts,
            back_row=back_row,
            back_counts=back_counts,
            back_recv_row=recv_row,
        )
        if full_scatter_indices is None:
            scatter = self._default_scatter(idx, count_matrix)
        else:
            scatter = torch.where(exp_indices >= 0, full_scatter_indices, -1)
        desc = EPAllToAllLayoutDesc(
            num_dispatch_token_cur_rank=n,
            num_input_tokens_per_rank=tokens_per_rank,
            send_reqs_recv_tensor=None,
            topk_indices_tensor=exp_indices,
            token_dst_scatter_idx=scatter.to(cfg.offset_dtype),
            skipped_token_mapping_indices=None,
            skipped_token_topk_mapping_indices=_first_slot_same_rank(dest, world),
            num_recv_tokens_per_expert=torch.bincount(local_expert, minlength=self.e_local),
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
        base = (expert_start + src_start[self.rank]).flatten().to(idx.device)  # [num_experts]
        mine = count_matrix[self.rank].to(idx.device)
        group_start = torch.cumsum(mine, 0) - mine
        flat = idx.flatten()
        kept = int(mine.sum())
        order = torch.sort(torch.where(flat >= 0, flat, self.config.num_tot_experts), stable=True).indices[
            :kept
        ]
        expert = flat[order]
        pos = base[expert] + torch.arange(kept, device=idx.device) - group_start[expert]
        scatter = torch.full_like(flat, -1)
        scatter[order] = pos
        return scatter.view(idx.shape).to(torch.int32)

    def _reverse(self, rows: torch.Tensor, state: _TorchState) -> torch.Tensor:
        """Send per-(received row, slot) values ``[Mr, C]`` back: ``[M, C]`` in ``slot_flat`` order."""
        send = rows.view(torch.uint8) if rows.dtype != torch.uint8 else rows
        recv = self._exchange("combine", send.contiguous(), state.back_counts, state.slot_counts)
        return recv.view(rows.dtype)

    # -- combine -------------------------------------------------------------------------------------
    def combine(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        self._message("combine", "combine")
        state: _TorchState = layout_desc.backend_state
        n = layout_desc.num_dispatch_token_cur_rank
        width = input.shape[1]
        acc = torch.zeros(n, width, dtype=torch.float32, device=input.device)
        if self.enable_local_combine:
            # expert side: sum the rows of one (source rank, token) in float32, send one row per token
            partial = torch.zeros(sum(state.recv_counts), width, dtype=torch.float32, device=input.device)
            partial.index_add_(0, state.back_recv_row, input[state.back_row].float())
            rows = self._exchange(
                "combine", partial.to(input.dtype).view(torch.uint8), state.recv_counts, state.send_counts
            )
            acc.index_add_(0, state.send_token, rows.view(input.dtype).float())
        else:
            rows = self._reverse(input[state.back_row], state)
            acc.index_add_(0, state.slot_token, rows.float())
        return acc.to(input.dtype)

    def combine_per_slot(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        self._message("combine_per_slot", "combine")
        state: _TorchState = layout_desc.backend_state
        n, topk, width = layout_desc.num_dispatch_token_cur_rank, self.config.topk, input.shape[1]
        rows = self._reverse(input[state.back_row], state)
        out = torch.zeros(n * topk, width, dtype=input.dtype, device=input.device)
        out[state.slot_flat] = rows
        return out.view(n, topk, width)

    # -- sync / teardown -------------------------------------------------------------------------------
    def barrier(self, *, intra_node_only: bool = False, stream: torch.cuda.Stream | None = None) -> None:
        if self.device.type == "cuda":
            (stream or torch.cuda.current_stream()).synchronize()
        if not intra_node_only:
            self._message("barrier", "barrier")
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
