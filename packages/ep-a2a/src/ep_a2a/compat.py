"""``EPAll2AllLayer``: compatible with Triton-distributed's ``EPAll2AllLayer``.

Same name, same positional constructor arguments, same ``dispatch(input, exp_indices, weight,
full_scatter_indices)`` / ``combine(input, ep_a2a_layout_desc)`` calls and the same
``EPAllToAllLayoutDesc`` fields, over :class:`ep_a2a.EPLayer`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ep_a2a.layer import EPLayer
from ep_a2a.tuning import TritonTuning


class EPAll2AllLayer(EPLayer):
    """:class:`ep_a2a.EPLayer` constructed with Triton-distributed's positional arguments.

    Args:
        ep_group: expert-parallel process group (``None`` = the default group).
        max_tokens, hidden, topk: as :class:`~ep_a2a.EPLayer`.
        rank: this process's rank in ``ep_group`` (checked against the group).
        num_tot_experts: experts in the group (``num_experts`` of :class:`~ep_a2a.EPLayer`).
        local_world_size: ranks per node.
        world_size: ranks in ``ep_group`` (checked).
        dtype, weight_dtype: as :class:`~ep_a2a.EPLayer`.
        num_sm: ``TritonTuning.num_sm`` (``None``: the tuning object's; by default every SM).
        enable_local_combine, use_aot: as :class:`~ep_a2a.EPLayer`.
        backend, tuning, timeout_s, validate: keyword-only, as :class:`~ep_a2a.EPLayer`.

    Raises:
        ValueError: ``rank`` or ``world_size`` disagree with ``ep_group``, ``num_sm`` is not a positive
            int, or ``num_sm`` and ``tuning.num_sm`` are both given and differ.
    """

    def __init__(
        self,
        ep_group: dist.ProcessGroup | None,
        max_tokens: int,
        hidden: int,
        topk: int,
        rank: int,
        num_tot_experts: int,
        local_world_size: int,
        world_size: int,
        dtype: torch.dtype = torch.bfloat16,
        weight_dtype: torch.dtype = torch.float32,
        num_sm: int | None = None,
        enable_local_combine: bool = False,
        use_aot: bool = False,
        *,
        backend: str = "auto",
        tuning: TritonTuning | None = None,
        timeout_s: float = 300.0,
        validate: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "EPAll2AllLayer needs torch.distributed to be initialized (init_process_group)"
            )
        group = ep_group if ep_group is not None else dist.group.WORLD
        assert group is not None
        if dist.get_world_size(group) != world_size:
            raise ValueError(f"world_size={world_size} but ep_group has {dist.get_world_size(group)} ranks")
        if dist.get_rank(group) != rank:
            raise ValueError(f"rank={rank} but this process is rank {dist.get_rank(group)} of ep_group")
        if num_sm is not None:
            if not isinstance(num_sm, int) or isinstance(num_sm, bool) or num_sm <= 0:
                raise ValueError(f"num_sm must be a positive int, got {num_sm!r}")
            if tuning is not None and tuning.num_sm != num_sm:
                raise ValueError(f"num_sm={num_sm} and tuning.num_sm={tuning.num_sm} differ: give one")
            tuning = tuning if tuning is not None else TritonTuning(num_sm=num_sm)
        super().__init__(
            group,
            max_tokens=max_tokens,
            hidden=hidden,
            topk=topk,
            num_experts=num_tot_experts,
            dtype=dtype,
            weight_dtype=weight_dtype,
            local_world_size=local_world_size,
            backend=backend,
            tuning=tuning,
            enable_local_combine=enable_local_combine,
            use_aot=use_aot,
            timeout_s=timeout_s,
            validate=validate,
        )
