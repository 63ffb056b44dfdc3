"""What ``dispatch`` hands to ``combine``: the routing of one dispatch call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class EPAllToAllLayoutDesc:
    """Routing metadata of one ``dispatch`` call, consumed by the matching ``combine``.

    ``R`` below is the number of rows this rank received (``num_recv_rows``), ``n`` the number of
    tokens this rank dispatched, ``E_local`` the experts per rank.

    Attributes:
        num_dispatch_token_cur_rank: ``n``, tokens dispatched by this rank.
        num_input_tokens_per_rank: ``[world_size]`` int64 on CPU, tokens dispatched by every rank.
        send_reqs_recv_tensor: inter-node send requests of Triton-distributed's NVSHMEM design; ``None`` for the
            intra-node and torch backends (nothing in this package reads it).
        topk_indices_tensor: ``[n, topk]`` int32 or int64 (the dtype given), the expert indices given to
            ``dispatch`` (-1 = dropped).
        token_dst_scatter_idx: ``[n, topk]`` int32 (the layer's ``offset_dtype``), row of slot
            ``(t, k)`` in the dispatch output of the rank hosting expert ``topk_indices_tensor[t, k]``;
            -1 for a dropped slot. Equal to ``full_scatter_indices`` when the caller gave them.
        skipped_token_mapping_indices: ``None`` (Triton-distributed's per-token intra-node shortcut; the
            per-slot mapping below carries the same information).
        skipped_token_topk_mapping_indices: ``[n, topk]`` int32; for slot ``k`` of token ``t``, the first
            slot ``k' <= k`` of the same token whose expert lives on the same rank (``k`` itself when it is
            the first), -1 for a dropped slot. Slots with ``k' != k`` need no extra copy of the token on
            the wire: backends send each token once per destination rank.
        num_recv_tokens_per_expert: ``[E_local]`` int64 on the data device, rows received per local
            expert. With the default ordering the rows of local expert ``e`` are contiguous and start at
            ``cumsum(num_recv_tokens_per_expert)[e-1]`` -- what a grouped GEMM needs.
        num_recv_tokens_per_rank: ``[world_size]`` int64 on CPU, rows received from each source rank.
        num_recv_rows: ``R``, rows in the dispatch output.
        recv_expert_indices: ``[R]`` int32 on the data device, the local expert of each received row.
        caller_scatter: True when ``full_scatter_indices`` decided the row positions.
        backend_state: private data of the backend that produced the descriptor (opaque to callers;
            a descriptor can only be combined by the layer that produced it).
    """

    num_dispatch_token_cur_rank: int
    num_input_tokens_per_rank: torch.Tensor
    send_reqs_recv_tensor: torch.Tensor | None
    topk_indices_tensor: torch.Tensor
    token_dst_scatter_idx: torch.Tensor
    skipped_token_mapping_indices: torch.Tensor | None
    skipped_token_topk_mapping_indices: torch.Tensor | None
    num_recv_tokens_per_expert: torch.Tensor
    num_recv_tokens_per_rank: torch.Tensor
    num_recv_rows: int
    recv_expert_indices: torch.Tensor
    caller_scatter: bool = False
    backend_state: Any = field(default=None, repr=False)

    @property
    def expert_offsets(self) -> torch.Tensor:
        """``[E_local + 1]`` int64: start row of each local expert (exclusive prefix sum), then ``R``."""
        counts = self.num_recv_tokens_per_expert
        return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
