"""Static configuration of an expert-parallel group."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EPConfig:
    """Shape of an expert-parallel group.

    Experts are split evenly across ranks: expert ``e`` lives on rank ``e // num_experts_per_rank``
    and is that rank's local expert ``e % num_experts_per_rank``.

    Attributes:
        max_tokens: most tokens one rank may dispatch in one call.
        hidden: width of a token row.
        topk: experts chosen per token (slots per token).
        num_tot_experts: experts across the whole group (``num_experts`` is an alias).
        rank: this rank inside the expert-parallel group.
        world_size: ranks in the group.
        local_world_size: ranks per node.
        token_dtype: dtype of token rows.
        weight_dtype: dtype of routing weights.
        offset_dtype: dtype of the indices and offsets the layer produces.
    """

    max_tokens: int
    hidden: int
    topk: int
    num_tot_experts: int
    rank: int
    world_size: int
    local_world_size: int
    token_dtype: torch.dtype = torch.bfloat16
    weight_dtype: torch.dtype = torch.float32
    offset_dtype: torch.dtype = torch.int32

    def __post_init__(self) -> None:
        for name in ("max_tokens", "hidden", "topk", "num_tot_experts", "world_size", "local_world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.num_tot_experts % self.world_size != 0:
            raise ValueError(
                f"num_tot_experts ({self.num_tot_experts}) must be divisible by world_size ({self.world_size})"
            )
        if self.world_size % self.local_world_size != 0:
            raise ValueError(
                f"world_size ({self.world_size}) must be a multiple of local_world_size ({self.local_world_size})"
            )
        if not self.token_dtype.is_floating_point:
            raise ValueError(f"token_dtype must be a floating dtype, got {self.token_dtype}")
        if not self.weight_dtype.is_floating_point:
            raise ValueError(f"weight_dtype must be a floating dtype, got {self.weight_dtype}")
        if self.offset_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"offset_dtype must be torch.int32 or torch.int64, got {self.offset_dtype}")

    @property
    def num_experts(self) -> int:
        """Alias of ``num_tot_experts``."""
        return self.num_tot_experts

    @property
    def num_experts_per_rank(self) -> int:
        """Experts hosted by each rank."""
        return self.num_tot_experts // self.world_size

    @property
    def is_intra_node(self) -> bool:
        """True when the whole group sits on one node (``world_size == local_world_size``)."""
        return self.world_size == self.local_world_size

    @property
    def nnodes(self) -> int:
        """Nodes spanned by the group."""
        return self.world_size // self.local_world_size

    def expert_rank(self, expert: int) -> int:
        """Rank that hosts global expert ``expert``."""
        return expert // self.num_experts_per_rank

    def fingerprint(self) -> tuple[object, ...]:
        """Fields that must agree on every rank (everything but ``rank``)."""
        return (
            self.max_tokens,
            self.hidden,
            self.topk,
            self.num_tot_experts,
            self.world_size,
            self.local_world_size,
            str(self.token_dtype),
            str(self.weight_dtype),
            str(self.offset_dtype),
        )
