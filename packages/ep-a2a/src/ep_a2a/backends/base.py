"""The interface every ep-a2a backend implements, and the registry the layer consults.

A backend moves rows between the ranks of one expert-parallel group. The layer
(:class:`ep_a2a.EPLayer`) owns argument checking, autograd and the ``backend=`` choice; a
backend only implements the data movement, with exactly the semantics of :mod:`ep_a2a.reference`:

* ``dispatch``: rank ``d`` receives one row per kept slot ``(t, k)`` of every source rank ``s`` whose
  expert ``exp_indices[t, k]`` lives on ``d`` (``expert // num_experts_per_rank == d``). Rows are
  ordered by local expert, then source rank, then token index, then slot -- unless
  ``full_scatter_indices`` is given, in which case slot ``(t, k)`` lands at row
  ``full_scatter_indices[t, k]`` of the receiver's output. ``weights[row]`` is ``weight[t, k]``.
* ``combine``: rank ``s`` gets ``out[t] = sum_k rows[token_dst_scatter_idx[t, k]]`` over the kept slots,
  the rows read on the rank hosting the slot's expert; accumulated in float32, returned in the row dtype.
  Tokens with no kept slot get zeros.

What the layer guarantees before calling a backend (backends need not re-check):

* ``input``: ``[n, hidden]`` contiguous, ``dtype == config.token_dtype`` (for ``dispatch``; ``combine``
  and the autograd pass may hand float32 or other float dtypes), on the group's device, ``0 <= n <= max_tokens``.
* ``exp_indices``: ``[n, topk]`` contiguous, with a dtype in the backend's ``expert_id_dtypes`` (int32,
  unless it lists more: then as the caller gave them), every value in ``[-1, num_tot_experts)`` (unless the
  backend sets ``checks_expert_ids``: then values may be anything and the backend raises ``ValueError``).
* ``weight``: ``None`` or ``[n, topk]`` contiguous ``config.weight_dtype``.
* ``full_scatter_indices``: ``None`` or ``[n, topk]`` contiguous int32 (-1 where the slot is dropped).
* ``combine`` receives a descriptor produced by this same backend instance and ``input`` of shape
  ``[layout_desc.num_recv_rows, hidden]``.

Registering a backend::

    from ep_a2a.backends import A2ABackend, register_backend

    class MyBackend(A2ABackend):
        name = "mine"
        ...

    register_backend(MyBackend)

``backend="triton"`` imports :mod:`ep_a2a.backends.triton`, which must call
``register_backend(<its class>)`` at import time. ``backend="auto"`` tries that import; if it succeeds
and ``<class>.is_available(config, group)`` returns ``(True, ...)`` on every rank, the layer uses it,
otherwise the torch backend; the layer records the reason in ``EPLayer.backend_reason``.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from ep_a2a._dist import RankMonitor
from ep_a2a.config import EPConfig
from ep_a2a.layout import EPAllToAllLayoutDesc
from ep_a2a.tuning import TritonTuning

DispatchResult = tuple[torch.Tensor, "torch.Tensor | None", EPAllToAllLayoutDesc]


@dataclass(frozen=True)
class BackendOptions:
    """What the layer hands every backend besides the group's shape.

    Attributes:
        tuning: the Triton backend's knobs (other backends ignore them).
        enable_local_combine: pre-reduce on the expert side, per (token, source rank), before sending
            the combine rows back.
        use_aot: compile every kernel variant at construction so the first call has no compile stall.
        timeout_s: bound on every wait; a wait that runs out raises :class:`ep_a2a.EPTimeoutError`
            naming the step and, where it can be found, the missing rank.
        monitor: the layer's check-in channel (store keys and a gloo side group over the same ranks).
        validate: raise on expert ids outside ``[-1, num_tot_experts)`` (a backend that sets
            ``checks_expert_ids``); when False such slots are dropped.
    """

    tuning: TritonTuning = field(default_factory=TritonTuning)
    enable_local_combine: bool = False
    use_aot: bool = False
    timeout_s: float = 300.0
    monitor: RankMonitor | None = None
    validate: bool = True


class A2ABackend(abc.ABC):
    """Data movement of one layer.

    Construction is collective (every rank of ``ep_group`` constructs its backend in the same order).
    Buffers sized from ``config.max_tokens`` are allocated once, in ``__init__``, and reused.

    Args:
        config: the group's static shape (identical on every rank except ``rank``; the layer checks).
        ep_group: the expert-parallel process group.
        options: see :class:`BackendOptions`.
    """

    #: the name given to ``backend=``.
    name: ClassVar[str] = ""
    #: True when ``dispatch`` itself rejects expert ids outside ``[-1, num_tot_experts)`` (without a
    #: device synchronisation of its own): the layer then skips its host-side check.
    checks_expert_ids: ClassVar[bool] = False
    #: dtypes of ``exp_indices`` the backend takes as they are (the layer converts any other to int32)
    expert_id_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.int32,)

    def __init__(self, config: EPConfig, ep_group: dist.ProcessGroup, options: BackendOptions) -> None:
        self.config = config
        self.ep_group = ep_group
        self.options = options
        self.enable_local_combine = options.enable_local_combine
        self.timeout_s = options.timeout_s

    @classmethod
    def is_available(cls, config: EPConfig, ep_group: dist.ProcessGroup) -> tuple[bool, str]:
        """Whether this backend can run for ``config`` on ``ep_group`` here.

        Local, cheap and non-collective (the layer all-gathers the answers itself).

        Returns:
            ``(ok, reason)``: ``reason`` says why not (or what was found) in words.
        """
        return True, "always available"

    @abc.abstractmethod
    def dispatch(
        self, input: Tensor, exp_indices: Tensor, weight: Tensor | None, full_scatter_indices: Tensor | None
    ) -> DispatchResult:
        """Send each kept slot's token row to the rank hosting its expert.

        Args:
            input: ``[n, hidden]`` token rows.
            exp_indices: ``[n, topk]`` int32 global expert per slot, -1 = dropped.
            weight: ``[n, topk]`` routing weights or ``None``.
            full_scatter_indices: ``[n, topk]`` int32 caller-given receiver rows, or ``None``.

        Returns:
            ``(output [R, hidden] input.dtype, weights [R] weight_dtype or None, layout_desc)``.
        """

    def dispatch_plain(self, input: Tensor, exp_indices: Tensor, weight: Tensor) -> DispatchResult:
        """``dispatch(input, exp_indices, weight, None)`` of the layer's common case, which it checked in
        one pass: ``input`` of ``config.token_dtype`` ``[n, hidden]``, a ``weight`` of
        ``config.weight_dtype``, ids of a dtype in ``expert_id_dtypes``, every tensor contiguous on the
        group's device. A backend may take it through a leaner host path; the default calls
        :meth:`dispatch`."""
        return self.dispatch(input, exp_indices, weight, None)

    def dispatch_fp8_plain(
        self, x_fp8: Tensor, scales: Tensor, exp_indices: Tensor, weight: Tensor
    ) -> tuple[tuple[Tensor, Tensor], Tensor | None, EPAllToAllLayoutDesc]:
        """An FP8 dispatch of the layer's common case, which it checked in one pass: ``x_fp8 [n, hidden]``
        float8_e4m3fn and ``scales [n, hidden / 128]`` float32, contiguous, on a layer whose rows hold
        packed FP8 rows, with ``exp_indices`` and ``weight`` as :meth:`dispatch_plain` takes them.
        Returns ``((rows, scales), weights, layout_desc)`` as the layer's FP8 dispatch does. A backend
        may take it through a leaner host path; the default packs the rows (:meth:`pack_fp8`), calls
        :meth:`dispatch` and unpacks what it received (:meth:`unpack_fp8`)."""
        rows, out_w, desc = self.dispatch(self.pack_fp8(x_fp8, scales), exp_indices, weight, None)
        return self.unpack_fp8(rows), out_w, desc

    def dispatch_quantize_plain(
        self, input: Tensor, exp_indices: Tensor, weight: Tensor
    ) -> tuple[tuple[Tensor, Tensor], Tensor | None, EPAllToAllLayoutDesc]:
        """``dispatch(..., fp8=True)`` of the layer's common case, which it checked in one pass: ``input``
        ``[n, hidden]`` of a dtype the layer quantizes, contiguous and aligned to its pairs of channels,
        with ``exp_indices`` and ``weight`` as :meth:`dispatch_plain` takes them. Returns ``((rows,
        scales), weights, layout_desc)`` as the layer's FP8 dispatch does. A backend may take it through
        a leaner host path; the default quantizes (:meth:`quantize_fp8`), calls :meth:`dispatch` and
        unpacks what it received (:meth:`unpack_fp8`)."""
        rows, out_w, desc = self.dispatch(self.quantize_fp8(input), exp_indices, weight, None)
        return self.unpack_fp8(rows), out_w, desc

    def combine_plain(self, input: Tensor, layout_desc: EPAllToAllLayoutDesc) -> Tensor:
        """``combine(input, layout_desc)`` of the layer's common case, which it checked in one pass:
        ``input`` a floating ``[layout_desc.num_recv_rows, hidden]`` tensor, contiguous on the group's
        device, outside autograd. A backend may take it through a leaner host path; the default calls
        :meth:`combine`."""
        return self.combine(input, layout_desc)

    @abc.abstractmethod
    def combine(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        """Send expert output rows back and sum them per original token.

        Args:
            input: ``[R, hidden]`` rows in the dispatch output's order.
            layout_desc: the descriptor ``dispatch`` returned.

        Returns:
            ``[layout_desc.num_dispatch_token_cur_rank, hidden]`` in ``input.dtype``.
        """

    def pack_fp8(self, x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """FP8 rows in DeepEP's format (``x_fp8 [n, H] float8_e4m3fn``, ``scales [n, H / 128] float32``) as
        the rows ``dispatch`` moves. Default: ``[n, H + 4 * H / 128]`` uint8, the FP8 bytes then the scale
        bytes of each row.

        Raises:
            ValueError: this backend's buffers cannot hold such rows (naming the layer argument).
        """
        # (through a flat copy: an empty or broadcast tensor may have a last stride other than 1)
        scale_bytes = scales.reshape(-1).view(torch.uint8).view(scales.shape[0], 4 * scales.shape[1])
        return torch.cat([x_fp8.view(torch.uint8), scale_bytes], 1)

    def quantize_fp8(self, x: torch.Tensor) -> Any:
        """bf16 / fp16 / fp32 rows ``x [n, H]`` (``H`` a multiple of 128) as the rows ``dispatch`` moves for
        an FP8 dispatch of them (``fp8=True``): their FP8 rows and scales by the rule of
        :func:`ep_a2a.reference.quantize_fp8`, bit for bit. Default: quantized here with torch operations
        (that function), then :meth:`pack_fp8`; a backend that quantizes inside its send overrides it.

        Raises:
            ValueError: as :meth:`pack_fp8`.
        """
        from ep_a2a.reference import quantize_fp8

        return self.pack_fp8(*quantize_fp8(x))

    def unpack_fp8(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows received by an FP8 dispatch (:meth:`pack_fp8`'s format) as ``(x_fp8 [R, H]
        float8_e4m3fn, scales [R, H / 128] float32)``. Default: contiguous copies."""
        h = self.config.hidden
        return rows[:, :h].contiguous().view(torch.float8_e4m3fn), rows[:, h:].contiguous().view(
            torch.float32
        )

    def combine_per_slot(self, input: torch.Tensor, layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        """Send rows back without summing: ``[n, topk, C]``, zeros for dropped slots.

        Used for the gradient of the routing weights (``C == 1``). Optional: the default raises.
        """
        raise NotImplementedError(f"backend {self.name!r} cannot return per-slot rows (weight gradients)")

    @abc.abstractmethod
    def barrier(self, *, intra_node_only: bool = False, stream: torch.cuda.Stream | None = None) -> None:
        """Wait until every rank (or every rank of this node) reaches this point, bounded by ``timeout_s``."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Release buffers and side groups. Called once, collectively; the backend is unusable after."""


_REGISTRY: dict[str, type[A2ABackend]] = {}

#: module imported on demand for a backend name that is not registered yet.
_LAZY_MODULES: dict[str, str] = {"triton": "ep_a2a.backends.triton", "torch": "ep_a2a.backends.torch"}


def register_backend(cls: type[A2ABackend]) -> type[A2ABackend]:
    """Register ``cls`` under ``cls.name`` (usable as a class decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no `name`")
    _REGISTRY[cls.name] = cls
    return cls


def get_backend_class(name: str) -> type[A2ABackend]:
    """The class registered as ``name``, importing its module on first use.

    Raises:
        ValueError: unknown name.
        ImportError: the backend's module failed to import (message kept).
    """
    if name not in _REGISTRY:
        module = _LAZY_MODULES.get(name)
        if module is None:
            raise ValueError(
                f"backend must be one of 'auto', {sorted(set(_LAZY_MODULES) | set(_REGISTRY))}, got {name!r}"
            )
        importlib.import_module(module)
        if name not in _REGISTRY:
            raise ImportError(f"{module} imported but registered no backend named {name!r}")
    return _REGISTRY[name]


def registered_backends() -> dict[str, type[A2ABackend]]:
    """Backends registered so far (name -> class)."""
    return dict(_REGISTRY)


def probe_backend(name: str, config: EPConfig, ep_group: dist.ProcessGroup) -> tuple[bool, str]:
    """``(available, reason)`` for ``name`` here, never raising (import errors become the reason)."""
    try:
        cls = get_backend_class(name)
    except Exception as exc:  # an optional backend may fail to import for many reasons
        return False, f"{name} backend not importable: {type(exc).__name__}: {exc}"
    try:
        return cls.is_available(config, ep_group)
    except Exception as exc:
        return False, f"{name}.is_available raised {type(exc).__name__}: {exc}"
