"""Static configuration of an expert-parallel group."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EPConfig:
    """Shape of an expert-parallel group.

    Experts are split evenly across ranks: expert ``e`` lives on rank ``e // num_experts_per_rank``.
    """

    max_tokens: int
    hidden: int
    topk: int
    num_tot_experts: int
    rank: int
    world_size: int
    local_world_size: int

    def __post_init__(self) -> None:
        for name in ("max_tokens", "hidden", "topk", "num_tot_experts", "world_size", "local_world_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
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

    @property
    def num_experts_per_rank(self) -> int:
        return self.num_tot_experts // self.world_size

    @property
    def is_intra_node(self) -> bool:
        return self.world_size == self.local_world_size

    def expert_rank(self, expert: int) -> int:
        """Rank that hosts global expert ``expert``."""
        return expert // self.num_experts_per_rank
