"""Autograd for dispatch and combine: each one's backward is the other one.

* ``dispatch`` copies token ``t`` into one row per kept slot, so ``d input[t]`` is the sum of the row
  gradients of its slots: a ``combine`` of the output gradient. The routing-weight gradient returns
  each row's weight gradient to its slot (``combine_per_slot``).
* ``combine`` sums rows per token, so each row's gradient is its token's output gradient: a ``dispatch``
  of the output gradient with the same routing, which reproduces the forward's row order.

Both backward passes are collectives: every rank must run backward through the same dispatch/combine
calls in the same order (as with any expert-parallel layer).
"""

from __future__ import annotations

from typing import Any

import torch

from ep_a2a.backends.base import A2ABackend
from ep_a2a.layout import EPAllToAllLayoutDesc


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        backend: A2ABackend,
        holder: list,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        exp_indices: torch.Tensor,
        full_scatter_indices: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        output, out_weights, desc = backend.dispatch(input, exp_indices, weight, full_scatter_indices)
        holder.append(desc)
        ctx.backend, ctx.desc = backend, desc
        ctx.weight_meta = (weight.dtype, weight.shape) if weight is not None else None
        if out_weights is not None:
            return output, out_weights
        return output, None

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor | None, grad_weights: torch.Tensor | None) -> tuple:  # type: ignore[override]
        backend: A2ABackend = ctx.backend
        desc: EPAllToAllLayoutDesc = ctx.desc
        grad_input = grad_weight = None
        if ctx.needs_input_grad[2]:
            if grad_output is None:
                grad_output = torch.zeros(
                    desc.num_recv_rows, backend.config.hidden, device=desc.recv_expert_indices.device
                )
            grad_input = backend.combine(grad_output.contiguous(), desc)
        if ctx.needs_input_grad[3] and ctx.weight_meta is not None:
            dtype, shape = ctx.weight_meta
            if grad_weights is None:
                grad_weights = torch.zeros(
                    desc.num_recv_rows, dtype=dtype, device=desc.recv_expert_indices.device
                )
            grad_weight = (
                backend.combine_per_slot(grad_weights.contiguous()[:, None], desc)[..., 0]
                .to(dtype)
                .view(shape)
            )
        return None, None, grad_input, grad_weight, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, backend: A2ABackend, desc: EPAllToAllLayoutDesc, input: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.backend, ctx.desc = backend, desc
        return backend.combine(input, desc)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:  # type: ignore[override]
        backend: A2ABackend = ctx.backend
        desc: EPAllToAllLayoutDesc = ctx.desc
        fsi = desc.token_dst_scatter_idx.to(torch.int32).contiguous() if desc.caller_scatter else None
        rows, _, _ = backend.dispatch(grad_output.contiguous(), desc.topk_indices_tensor, None, fsi)
        return None, None, rows


def dispatch_with_grad(
    backend: A2ABackend,
    input: torch.Tensor,
    exp_indices: torch.Tensor,
    weight: torch.Tensor | None,
    full_scatter_indices: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, EPAllToAllLayoutDesc]:
    """``backend.dispatch`` recorded on the autograd tape."""
    holder: list[EPAllToAllLayoutDesc] = []
    output, out_weights = _Dispatch.apply(backend, holder, input, weight, exp_indices, full_scatter_indices)
    return output, out_weights, holder[0]


def combine_with_grad(backend: A2ABackend, input: torch.Tensor, desc: EPAllToAllLayoutDesc) -> torch.Tensor:
    """``backend.combine`` recorded on the autograd tape."""
    return _Combine.apply(backend, desc, input)
