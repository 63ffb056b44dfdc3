"""``EPLayer``: dispatch tokens to the ranks hosting their experts, combine the results back."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ep_a2a._dist import EPConfigMismatchError, EPError, RankMonitor, group_device
from ep_a2a.autograd import combine_with_grad, dispatch_with_grad
from ep_a2a.backends.base import A2ABackend, BackendOptions, get_backend_class, probe_backend
from ep_a2a.config import EPConfig
from ep_a2a.layout import EPAllToAllLayoutDesc
from ep_a2a.tuning import TritonTuning

if TYPE_CHECKING:
    from ep_a2a.backends.triton import StaticDispatch

_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
#: dtypes ``dispatch(..., fp8=True)`` quantizes on a layer of FP8 rows
_QUANTIZE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_DTYPES = (torch.float8_e4m3fn,)


_COMPILE_ERROR = (
    "ep_a2a: {what}() is a collective whose sizes the host reads: it cannot be traced by torch.compile. "
    "Call it outside the compiled region (e.g. from a function wrapped in torch.compiler.disable)"
)


_Tensor = torch.Tensor
#: ``torch.compiler.is_compiling`` (the function itself: torch.compile recognises it by identity)
_is_compiling = torch.compiler.is_compiling


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()`` (asked first: the cheaper call when ``t`` already is)."""
    return t if t.is_contiguous() else t.contiguous()


def _eager_only(fn: Callable) -> Callable:
    """``fn`` refusing to be traced by ``torch.compile`` with an error that says why (checked by
    ``torch.compiler.is_compiling``, so importing the package does not import the compiler)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            raise RuntimeError(_COMPILE_ERROR.format(what=fn.__name__))
        return fn(*args, **kwargs)

    return call


_ARGUMENT_FIELDS = (
    "(max_tokens, hidden, topk, num_tot_experts, world_size, local_world_size, dtype, weight_dtype, "
    "offset_dtype)",
    "backend",
    "enable_local_combine",
    "use_aot",
    "tuning",
    "timeout_s",
)


def _probe_fast_path(backend: str, config: EPConfig, group: dist.ProcessGroup) -> tuple[bool, str]:
    """Whether the Triton backend is usable here, for ``backend`` ``"auto"`` or ``"triton"``."""
    if backend not in ("auto", "triton"):
        return False, "not requested"
    ok, reason = probe_backend("triton", config, group)
    if backend == "auto" and ok and not config.is_intra_node:
        # the Triton backend's remote path (NVSHMEM puts to other nodes) has run in the CPU simulation
        # and forced on one host, never across nodes: auto keeps such groups on torch until it has
        return False, (
            "inter-node group: auto uses the torch backend (the Triton remote path has not run across "
            "nodes yet; backend='triton' selects it)"
        )
    return ok, reason


def _check_same_arguments(rank: int, mine: str, theirs: list[str]) -> None:
    bad = [r for r, v in enumerate(theirs) if v != mine]
    if bad:
        raise EPConfigMismatchError(
            f"layer arguments differ across ranks: rank {rank} has {mine}, "
            + "; ".join(f"rank {r} has {theirs[r]}" for r in bad)
            + f" (fields: {', '.join(_ARGUMENT_FIELDS)})"
        )


@dataclass
class DispatchCombineContext:
    """Per-layer state: configuration, the chosen backend (which owns the buffers) and lifecycle.

    Attributes:
        ep_config: the group's static shape.
        ep_group: the expert-parallel process group.
        backend: the backend instance moving the rows.
        backend_reason: why this backend was chosen (what ``backend="auto"`` found).
        device: device of every tensor the layer takes and returns.
        finalized: True once :meth:`finalize` ran.
    """

    ep_config: EPConfig
    ep_group: dist.ProcessGroup
    backend: A2ABackend
    backend_reason: str
    device: torch.device
    monitor: RankMonitor = field(repr=False)
    finalized: bool = False

    @classmethod
    def create(
        cls,
        ep_config: EPConfig,
        ep_group: dist.ProcessGroup,
        *,
        backend: str = "auto",
        options: BackendOptions | None = None,
    ) -> DispatchCombineContext:
        """Collective: check every rank's arguments agree, pick the backend, build it.

        Raises:
            EPConfigMismatchError: ranks passed different arguments (names the ranks and values).
            EPTimeoutError: a rank did not arrive within ``options.timeout_s``.
            ValueError: unknown backend, or ``backend="triton"`` not usable here (reason given).
        """
        options = options if options is not None else BackendOptions()
        monitor = RankMonitor(ep_group, options.timeout_s)
        options = dataclasses.replace(options, monitor=monitor)
        if backend not in ("auto", "torch", "triton"):
            get_backend_class(backend)  # raises ValueError naming the choices for an unknown name
        fast_ok, fast_reason = _probe_fast_path(backend, ep_config, ep_group)
        args = (
            ep_config.fingerprint(),
            backend,
            bool(options.enable_local_combine),
            bool(options.use_aot),
            options.tuning.fingerprint(),
            float(options.timeout_s),
        )
        values = monitor.checkin("construct", repr(args) + "\x00" + ("1" if fast_ok else "0") + fast_reason)
        _check_same_arguments(ep_config.rank, repr(args), [v.split("\x00", 1)[0] for v in values])
        fast = {r: v.split("\x00", 1)[1] for r, v in enumerate(values)}
        everyone_fast = all(v[:1] == "1" for v in fast.values())
        if backend == "triton" and not everyone_fast:
            reasons = {r: v[1:] for r, v in fast.items() if v[:1] != "1"}
            raise ValueError(f"backend='triton' is not usable on every rank: {reasons}")
        if backend == "auto":
            chosen = "triton" if everyone_fast else "torch"
            reason = (
                f"auto: {fast_reason}"
                if everyone_fast
                else f"auto fell back to torch: triton not usable on every rank ({fast_reason} here)"
            )
        else:
            chosen, reason = backend, f"requested: {fast_reason if backend == 'triton' else 'torch'}"
        instance = get_backend_class(chosen)(ep_config, ep_group, options)
        return cls(
            ep_config=ep_config,
            ep_group=ep_group,
            backend=instance,
            backend_reason=reason,
            device=group_device(ep_group),
            monitor=monitor,
        )

    def finalize(self) -> None:
        """Release the backend's buffers and side groups (idempotent)."""
        if not self.finalized:
            self.finalized = True
            self.backend.finalize()
            self.monitor.destroy()


class EPLayer:
    """Expert-parallel dispatch and combine over one process group.

    Construction is collective: every rank of ``ep_group`` builds its layer with the same arguments
    (checked; a mismatch raises :class:`ep_a2a.EPConfigMismatchError` on every rank). Buffers are sized
    from ``max_tokens`` once, here.

    Args:
        ep_group: expert-parallel process group (``None`` = the default group). NCCL groups take CUDA
            tensors, gloo groups CPU tensors.
        max_tokens: most tokens one rank dispatches per call.
        hidden: token width.
        topk: experts per token (slots per token).
        num_experts: experts in the group; must be divisible by the group's size. Expert ``e`` lives on
            rank ``e // (num_experts // world_size)``.
        dtype: dtype of the token rows given to :meth:`dispatch`. ``torch.float8_e4m3fn``: a layer of FP8
            rows in DeepEP's format (``hidden`` a multiple of 128), its buffers sized for an FP8 row and
            its scales (about half a bfloat16 layer's); its :meth:`dispatch` takes ``(x_fp8, scales)`` or
            bf16 / fp16 / fp32 rows with ``fp8=True``, its :meth:`combine` the expert outputs in
            bf16 (any floating dtype). A layer of a dtype of 2 bytes or more takes FP8 dispatches too.
        weight_dtype: dtype of the routing weights.
        local_world_size: ranks per node (default: every rank of the group on one node).
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (the Triton backend when it imports and reports
            itself usable on every rank, else torch; see :attr:`backend_reason`).
        tuning: the Triton backend's knobs (:class:`ep_a2a.TritonTuning`; default ``TritonTuning()``).
            The torch backend ignores them.
        enable_local_combine: pre-reduce on the expert side before sending combine rows back: one row per
            (token, destination rank) instead of one per (token, expert), summed in float32 and rounded
            to the row dtype once more before the final float32 sum. Always on with the Triton backend.
        use_aot: compile every kernel variant at construction (Triton backend), several at once, so
            that the first calls do not compile (the concepts page's "Compilation" gives the times).
        timeout_s: bound on every wait for another rank; a rank that never arrives makes the others raise
            :class:`ep_a2a.EPTimeoutError` naming it and the step.
        validate: check index values; shapes, dtypes and devices are always checked. See "Errors and
            guarantees" in the package docs for what ``validate=False`` skips.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
        ValueError: an argument out of range (named in the message).
        EPConfigMismatchError: ranks passed different arguments.
    """

    def __init__(
        self,
        ep_group: dist.ProcessGroup | None = None,
        *,
        max_tokens: int,
        hidden: int,
        topk: int,
        num_experts: int,
        dtype: torch.dtype = torch.bfloat16,
        weight_dtype: torch.dtype = torch.float32,
        local_world_size: int | None = None,
        backend: str = "auto",
        tuning: TritonTuning | None = None,
        enable_local_combine: bool = False,
        use_aot: bool = False,
        timeout_s: float = 300.0,
        validate: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("the layer needs torch.distributed to be initialized (init_process_group)")
        group = ep_group if ep_group is not None else dist.group.WORLD
        assert group is not None
        if tuning is None:
            tuning = TritonTuning()
        if not isinstance(tuning, TritonTuning):
            raise TypeError(f"tuning must be an ep_a2a.TritonTuning, got {type(tuning).__name__}")
        if torch.cuda.is_available():  # (resolved here, so that ranks on different GPUs are told apart)
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            tuning = tuning.for_device(sms)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if dtype == torch.float8_e4m3fn and hidden % 128:
            raise ValueError(
                f"dtype=torch.float8_e4m3fn (FP8 rows, one scale per 128 channels) needs hidden to be a "
                f"multiple of 128, got hidden={hidden}"
            )
        world_size = dist.get_world_size(group)
        self.config = EPConfig(
            max_tokens=max_tokens,
            hidden=hidden,
            topk=topk,
            num_tot_experts=num_experts,
            rank=dist.get_rank(group),
            world_size=world_size,
            local_world_size=world_size if local_world_size is None else local_world_size,
            token_dtype=dtype,
            weight_dtype=weight_dtype,
        )
        self.tuning = tuning
        self.enable_local_combine = enable_local_combine
        self.use_aot = use_aot
        self.validate = validate
        options = BackendOptions(
            tuning=tuning,
            enable_local_combine=enable_local_combine,
            use_aot=use_aot,
            timeout_s=timeout_s,
            validate=validate,
        )
        self.ctx = DispatchCombineContext.create(self.config, group, backend=backend, options=options)
        #: the layer's CUDA device index (-1: a layer of CPU tensors)
        self._cuda_index = self.ctx.device.index if self.ctx.device.type == "cuda" else -1
        chosen = self.ctx.backend
        #: expert-id dtypes a dispatch passes to the backend as they are, with no check of the values
        #: on the host (none where the layer checks them: a backend that does not, with ``validate``)
        self._ids_as_is = chosen.expert_id_dtypes if chosen.checks_expert_ids or not validate else ()
        cfg = self.config
        #: what :meth:`_plain_dispatch_args` compares a dispatch's tensors with: ``hidden``, ``max_tokens``,
        #: ``topk``, the token, id and weight dtypes, the device index (-2 on a CPU layer: no tensor's
        #: ``get_device()`` equals it, so its dispatches are checked one tensor at a time)
        self._plain_spec = (
            cfg.hidden, cfg.max_tokens, cfg.topk, cfg.token_dtype, self._ids_as_is, cfg.weight_dtype,
            self._cuda_index if self._cuda_index >= 0 else -2,
        )  # fmt: skip
        #: whether an FP8 dispatch's tuple may take the one-pass check (:meth:`_plain_fp8_args`): FP8
        #: dispatches are possible on this layer (``hidden`` a multiple of 128, a dtype that takes them)
        self._fp8_plain = cfg.hidden % 128 == 0 and (
            cfg.token_dtype == torch.float8_e4m3fn or cfg.token_dtype.itemsize >= 2
        )
        #: dtypes of rows ``dispatch(..., fp8=True)`` quantizes on this layer
        self._quantize_dtypes = (
            _QUANTIZE_DTYPES if cfg.token_dtype == torch.float8_e4m3fn else (cfg.token_dtype,)
        )

    @property
    def num_sm(self) -> int | None:
        """``tuning.num_sm``: most SMs the Triton backend's kernels use (``None`` without a GPU)."""
        return self.tuning.num_sm

    # -- properties ------------------------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        """Name of the backend in use (``"torch"`` or ``"triton"``)."""
        return self.ctx.backend.name

    @property
    def backend_reason(self) -> str:
        """Why that backend was chosen."""
        return self.ctx.backend_reason

    @property
    def device(self) -> torch.device:
        """Device of the tensors this layer takes and returns."""
        return self.ctx.device

    # -- checks ----------------------------------------------------------------------------------------
    def _check_alive(self, what: str) -> None:
        if self.ctx.finalized:
            raise RuntimeError(f"{type(self).__name__}.{what}() called after finalize()")

    def _check_tensor(
        self, name: str, t: Any, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...] | None
    ) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
        if dtypes is not None and t.dtype not in dtypes:
            want = (
                f"dtype {dtypes[0]}"
                if len(dtypes) == 1
                else "an integer dtype"
                if dtypes == _INT_DTYPES
                else f"a dtype in {[str(d) for d in dtypes]}"
            )
            raise TypeError(f"{name} must have {want}, got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} must be on {self.device} (the ep_group's device), got {t.device}")

    def _plain_dispatch_args(
        self, input: Any, exp_indices: Any, weight: Any, dtypes: tuple[torch.dtype, ...] | None = None
    ) -> bool:
        """Whether a dispatch's tensors are the common case, checked in one pass: plain contiguous tensors
        on the layer's device, ``input`` ``[n <= max_tokens, hidden]`` of the layer's dtype (of one of
        ``dtypes`` where given),
        ``exp_indices`` ``[n, topk]`` of a dtype the backend takes as it is (:meth:`_expert_ids` would
        return them), ``weight`` ``[n, topk]`` of the weight dtype. Anything else is checked one tensor
        at a time (the messages name what is wrong)."""
        hidden, max_tokens, topk, token_dtype, ids_dtypes, weight_dtype, cuda = self._plain_spec
        if type(input) is not _Tensor or type(exp_indices) is not _Tensor or type(weight) is not _Tensor:
            return False
        try:
            n, width = input.shape
        except ValueError:  # (not 2-d)
            return False
        return (
            width == hidden
            and n <= max_tokens
            and (input.dtype is token_dtype if dtypes is None else input.dtype in dtypes)  # (singletons)
            and exp_indices.dtype in ids_dtypes
            and weight.dtype is weight_dtype
            and exp_indices.shape == weight.shape == (n, topk)
            and input.get_device() == exp_indices.get_device() == weight.get_device() == cuda
            and input.is_contiguous()
            and exp_indices.is_contiguous()
            and weight.is_contiguous()
        )

    def _plain_fp8_args(self, input: tuple, exp_indices: Any, weight: Any) -> bool:
        """Whether an FP8 dispatch's tuple is the common case, checked in one pass: ``(x_fp8 [n, hidden]
        float8_e4m3fn, scales [n, hidden / 128] float32)``, both contiguous on the layer's device, with
        ``exp_indices`` and ``weight`` as :meth:`_plain_dispatch_args` takes them. Anything else is
        checked one tensor at a time."""
        if not self._fp8_plain or len(input) != 2:
            return False
        x, scales = input
        return (
            self._plain_dispatch_args(x, exp_indices, weight, _FP8_DTYPES)
            and type(scales) is _Tensor
            and scales.dtype is torch.float32
            and scales.shape == (x.shape[0], self.config.hidden // 128)
            and scales.get_device() == x.get_device()
            and scales.is_contiguous()
        )

    def _check_dispatch_args(
        self, input: Any, exp_indices: Any, weight: Any, *, dtypes: tuple[torch.dtype, ...] | None = None
    ) -> int:
        """Shapes, dtypes and devices of a dispatch's tensors (``input`` of one of ``dtypes``, default the
        layer's dtype); returns the number of tokens."""
        cfg = self.config
        if dtypes is None and weight is not None and self._plain_dispatch_args(input, exp_indices, weight):
            return input.shape[0]
        if not isinstance(input, torch.Tensor) or input.dim() != 2:
            raise ValueError(
                f"input must be a [num_tokens, hidden={cfg.hidden}] tensor, got {getattr(input, 'shape', type(input))}"
            )
        n = input.shape[0]
        if n > cfg.max_tokens:
            refuse = getattr(self.ctx.backend, "refuse_dispatch", None)
            if refuse is not None:  # (low-latency mode: the peers are told, and raise naming this rank)
                refuse()
            raise ValueError(f"input has {n} tokens, more than max_tokens={cfg.max_tokens}")
        self._check_tensor("input", input, (n, cfg.hidden), dtypes or (cfg.token_dtype,))
        self._check_tensor("exp_indices", exp_indices, (n, cfg.topk), _INT_DTYPES)
        if weight is not None:
            self._check_tensor("weight", weight, (n, cfg.topk), (cfg.weight_dtype,))
        return n

    # -- public API ------------------------------------------------------------------------------------
    def _fp8_rows(
        self, input: Any, exp_indices: Any, weight: Any, quantize: bool
    ) -> tuple[torch.Tensor, int]:
        """An FP8 dispatch's token rows as the backend moves them (``backend.pack_fp8``: the FP8 row and
        its float32 scales in one row of bytes), after checking the tuple; or ``input``'s rows as the
        backend quantizes them (``backend.quantize_fp8``: inside the Triton backend's send, with torch
        operations first on the torch backend); returns them and ``n``."""
        from ep_a2a.reference import FP8_BLOCK

        cfg = self.config
        if cfg.hidden % FP8_BLOCK:
            raise ValueError(f"FP8 dispatch needs hidden to be a multiple of {FP8_BLOCK}, got {cfg.hidden}")
        if cfg.token_dtype.itemsize == 1 and cfg.token_dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"FP8 dispatch needs a layer of dtype=torch.float8_e4m3fn or of a dtype of at least 2 bytes, "
                f"got dtype={cfg.token_dtype}"
            )
        if quantize:
            n = self._check_dispatch_args(input, exp_indices, weight, dtypes=self._quantize_dtypes)
            return self.ctx.backend.quantize_fp8(input), n
        if len(input) != 2:
            raise ValueError(f"input as a tuple must be (x_fp8, scales), got {len(input)} items")
        x_fp8, scales = input
        n = self._check_dispatch_args(x_fp8, exp_indices, weight, dtypes=(torch.float8_e4m3fn,))
        self._check_tensor("scales", scales, (n, cfg.hidden // FP8_BLOCK), (torch.float32,))
        return self.ctx.backend.pack_fp8(x_fp8, scales), n

    def dispatch(
        self,
        input: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        exp_indices: torch.Tensor,
        weight: torch.Tensor | None = None,
        full_scatter_indices: torch.Tensor | None = None,
        *,
        fp8: bool = False,
    ) -> tuple[Any, torch.Tensor | None, EPAllToAllLayoutDesc]:
        """Send every kept slot's token row to the rank hosting its expert (collective).

        Args:
            input: ``[num_tokens, hidden]`` ``dtype``, ``0 <= num_tokens <= max_tokens`` (may differ by rank
                and by call); or FP8 rows in DeepEP's format, a tuple ``(x_fp8 [num_tokens, hidden]
                float8_e4m3fn, scales [num_tokens, hidden / 128] float32)`` (one scale per 128 channels;
                ``hidden`` a multiple of 128), moved bit for bit.
            exp_indices: ``[num_tokens, topk]`` integer global expert per slot in ``[0, num_tot_experts)``;
                -1 drops the slot.
            weight: ``[num_tokens, topk]`` ``weight_dtype`` routing weights, or ``None``.
            full_scatter_indices: ``[num_tokens, topk]`` integer, the row of slot ``(t, k)`` in the receiving
                rank's output (ignored where the slot is dropped). Every receiver must get exactly the rows
                ``0 .. R-1``; a receiver whose rows are not a permutation raises ``ValueError``.
            fp8: quantize ``input`` (the layer's dtype; bf16, fp16 or fp32 on a layer of
                ``dtype=torch.float8_e4m3fn``) and dispatch the FP8 rows and scales, bit for bit those of
                :func:`ep_a2a.reference.quantize_fp8`. The Triton backend quantizes inside the kernel that
                sends the rows (no FP8 copy of ``input`` first), except with copy-engine dispatch
                (``TritonTuning(copy_engine=True)``), which quantizes with torch operations before the
                copies; the torch backend quantizes with torch operations before the send.

        Returns:
            ``(output, weights, layout_desc)``: ``output`` ``[R, hidden]`` ``dtype``, one row per received
            (token, expert) pair, ordered by local expert, source rank, token, slot (unless
            ``full_scatter_indices`` placed them) -- for FP8 input (or ``fp8=True``) the tuple
            ``(rows [R, hidden] float8_e4m3fn, scales [R, hidden / 128] float32)`` in that order (on
            the Triton backend views of one buffer of packed rows, row stride ``hidden + 4 * hidden /
            128`` bytes rounded up to 16: ``.contiguous()`` them where a kernel needs dense rows);
            ``weights`` ``[R]`` ``weight_dtype`` (``None`` without ``weight``); ``layout_desc`` for
            :meth:`combine` (per-local-expert counts included), which takes rows of the layer's dtype
            whatever the dispatch carried. Differentiable in ``input`` and ``weight`` (not in FP8 rows).

        Raises:
            ValueError, TypeError: a bad argument (named), before any communication; an expert id out of
                range (``validate=True``; the torch backend raises it on every rank after its counts
                exchange, before any row moves; the Triton backend on the offending rank after the call
                completed on every rank, with the slot dropped).
            EPProtocolError: the ranks called the layer's collectives in different orders.
            EPTimeoutError: a rank did not arrive within ``timeout_s`` (named).
            RuntimeError: called after :meth:`finalize`.
        """
        if _is_compiling():
            raise RuntimeError(_COMPILE_ERROR.format(what="dispatch"))
        ctx = self.ctx
        if ctx.finalized:
            self._check_alive("dispatch")
        if (
            full_scatter_indices is None
            and not fp8
            and self._plain_dispatch_args(input, exp_indices, weight)
            # (input and weight are tensors here: the check above)
            and not ((input.requires_grad or weight.requires_grad) and torch.is_grad_enabled())  # type: ignore[union-attr]
        ):
            # (the common case, checked in one pass: the tensors go to the backend as they are)
            return ctx.backend.dispatch_plain(input, exp_indices, weight)  # type: ignore[arg-type]
        if full_scatter_indices is None and not (
            type(weight) is _Tensor and weight.requires_grad and torch.is_grad_enabled()
        ):  # (FP8 rows carry no gradient; the weights' takes the path below)
            if type(input) is tuple and not fp8 and self._plain_fp8_args(input, exp_indices, weight):
                # (the FP8 common case, checked in one pass)
                return ctx.backend.dispatch_fp8_plain(input[0], input[1], exp_indices, weight)  # type: ignore[arg-type]
            if (
                fp8
                and self._fp8_plain
                and self._plain_dispatch_args(input, exp_indices, weight, self._quantize_dtypes)
                and input.data_ptr() % (2 * input.element_size()) == 0  # type: ignore[union-attr]
            ):  # (bf16 / fp16 / fp32 rows to quantize, aligned to their pairs of channels)
                return ctx.backend.dispatch_quantize_plain(input, exp_indices, weight)  # type: ignore[arg-type]
        cfg = self.config
        packed = None
        if isinstance(input, tuple) or fp8:
            packed, n = self._fp8_rows(input, exp_indices, weight, quantize=not isinstance(input, tuple))
        else:
            n = self._check_dispatch_args(input, exp_indices, weight)
        if full_scatter_indices is not None:
            self._check_tensor("full_scatter_indices", full_scatter_indices, (n, cfg.topk), _INT_DTYPES)
        backend = self.ctx.backend
        # a backend that checks the ids itself (both built-in ones, without a sync of their own) spares
        # the host sync here
        # (checked in the caller's dtype: an int64 id would wrap into range as int32)
        if not backend.checks_expert_ids and self.validate and exp_indices.numel():
            lo, hi = torch.aminmax(exp_indices)
            if int(lo) < -1 or int(hi) >= cfg.num_tot_experts:
                raise ValueError(
                    f"exp_indices must be in [-1, num_tot_experts={cfg.num_tot_experts}) (-1 drops a slot), "
                    f"got values in [{int(lo)}, {int(hi)}]"
                )
        idx = self._expert_ids(exp_indices)
        fsi = None
        if full_scatter_indices is not None:
            fsi = torch.where(idx >= 0, full_scatter_indices.to(torch.int32), -1).contiguous()
            if self.validate and fsi.numel() and int(torch.where(idx >= 0, fsi, 0).min()) < 0:
                raise ValueError("full_scatter_indices must be >= 0 for every kept slot")
        x = packed if packed is not None else _dense(input)  # type: ignore[arg-type]
        w = _dense(weight) if weight is not None else None
        if (x.requires_grad or (w is not None and w.requires_grad)) and torch.is_grad_enabled():
            rows, out_w, desc = dispatch_with_grad(backend, x, idx, w, fsi)
        else:
            rows, out_w, desc = backend.dispatch(x, idx, w, fsi)
        if packed is None:
            return rows, out_w, desc
        return backend.unpack_fp8(rows), out_w, desc

    def combine(self, input: torch.Tensor, ep_a2a_layout_desc: EPAllToAllLayoutDesc) -> torch.Tensor:
        """Send expert-output rows back and sum them per original token (collective).

        Args:
            input: ``[R, hidden]`` floating rows in the order of the dispatch output (``R`` =
                ``ep_a2a_layout_desc.num_recv_rows``). Routing weights are *not* applied here: scale
                rows by ``weights`` in the expert computation if the model wants a weighted sum.
            ep_a2a_layout_desc: the descriptor returned by this layer's :meth:`dispatch`.

        Returns:
            ``[num_tokens, hidden]`` in ``input.dtype``: per token, the sum of its kept slots' rows,
            accumulated in float32 (the Triton backend sends each expert rank's partial sum of a token's
            rows in ``input.dtype``: one more rounding); zeros for a token whose slots were all dropped.
            Differentiable in ``input``.

        Raises:
            ValueError, TypeError: a bad argument (named), before any communication.
            EPProtocolError: the ranks called the layer's collectives in different orders.
            EPTimeoutError: a rank did not arrive within ``timeout_s`` (named).
            RuntimeError: called after :meth:`finalize`.
        """
        if _is_compiling():
            raise RuntimeError(_COMPILE_ERROR.format(what="combine"))
        ctx = self.ctx
        if ctx.finalized:
            self._check_alive("combine")
        desc = ep_a2a_layout_desc
        if not isinstance(desc, EPAllToAllLayoutDesc):
            raise TypeError(f"ep_a2a_layout_desc must be an EPAllToAllLayoutDesc, got {type(desc).__name__}")
        backend = ctx.backend
        owner = getattr(desc.backend_state, "owner", None)
        if owner is not None and owner != id(backend):
            raise ValueError(f"ep_a2a_layout_desc was produced by a different {type(self).__name__}")
        if not isinstance(input, torch.Tensor) or not input.dtype.is_floating_point:
            raise TypeError(f"input must be a floating tensor, got {getattr(input, 'dtype', type(input))}")
        cuda = self._cuda_index
        if (
            cuda >= 0
            and input.get_device() == cuda
            and input.shape == (desc.num_recv_rows, self.config.hidden)
            and input.is_contiguous()
            and not (input.requires_grad and torch.is_grad_enabled())
        ):  # (the common case, checked in one pass)
            return backend.combine_plain(input, desc)
        # (else one check at a time, with messages)
        self._check_tensor("input", input, (desc.num_recv_rows, self.config.hidden), None)
        x = _dense(input)
        if x.requires_grad and torch.is_grad_enabled():
            return combine_with_grad(backend, x, desc)
        return backend.combine(x, desc)

    def _expert_ids(self, exp_indices: torch.Tensor) -> torch.Tensor:
        """``exp_indices`` contiguous, in a dtype the backend takes as is (both backends: int32 and
        int64, so ``torch.topk``'s ids need no conversion kernel), else converted to int32: as they are
        for a backend that checks the ids itself (int8, int16 and uint8 fit), else with every id outside
        ``[-1, num_tot_experts)`` made -1 first (so none wraps onto an expert)."""
        backend = self.ctx.backend
        if exp_indices.dtype not in backend.expert_id_dtypes and backend.checks_expert_ids:
            exp_indices = exp_indices.to(torch.int32)
        elif exp_indices.dtype not in backend.expert_id_dtypes:
            valid = (exp_indices >= 0) & (exp_indices < self.config.num_tot_experts)
            exp_indices = torch.where(valid, exp_indices, -1).to(torch.int32)
        return _dense(exp_indices)

    # -- CUDA-graph mode -------------------------------------------------------------------------------
    def _static_backend(self, what: str) -> Any:
        self._check_alive(what)
        backend = self.ctx.backend
        if not hasattr(backend, "dispatch_static"):
            raise NotImplementedError(
                f"{type(self).__name__}.{what}() (CUDA-graph mode) needs backend='triton'; this layer runs the "
                f"{self.backend_name} backend ({self.backend_reason}). Use dispatch / combine"
            )
        return backend

    @_eager_only
    def dispatch_static(
        self,
        input: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        exp_indices: torch.Tensor,
        weight: torch.Tensor | None = None,
        *,
        fp8: bool = False,
    ) -> StaticDispatch:
        """CUDA-graph mode: dispatch with worst-case shapes and no host synchronisation (collective).

        Capturable in a CUDA graph (every rank captures and replays the same sequence); only the Triton
        backend has it (``NotImplementedError`` otherwise). Run :meth:`dispatch_static` and
        :meth:`combine_static` once eagerly (or build the layer with ``use_aot=True``) before capturing,
        so that nothing compiles inside the capture. No autograd. The result's buffers are reused by the
        next static call.

        Expert ids outside ``[-1, num_tot_experts)`` are dropped and counted on the device
        (``num_invalid_ids``): there is no host sync to raise on; check it outside the graph.
        :meth:`check_errors` raises a device-side wait that ran out (a rank that never arrived).

        Args:
            input: ``[n, hidden]`` ``dtype``, ``n <= max_tokens`` (fixed for a graph); or FP8 rows, the
                tuple ``(x_fp8, scales)`` of :meth:`dispatch`.
            exp_indices: ``[n, topk]`` integer global expert per slot (int32 or int64 need no conversion);
                -1 drops the slot.
            weight: ``[n, topk]`` ``weight_dtype`` routing weights, or ``None``.
            fp8: quantize ``input`` as :meth:`dispatch` does: inside the row kernel (with copy-engine
                dispatch: torch operations first, inside the graph when captured).

        Returns:
            :class:`ep_a2a.backends.triton.StaticDispatch`: ``output`` ``[world_size * max_tokens * topk,
            hidden]`` of which the first ``num_recv_rows`` (a device scalar) are valid, in the order of
            :meth:`dispatch` (FP8 rows: the tuple ``(rows, scales)``, views of one buffer of packed rows);
            ``weights``, ``recv_expert_indices`` the same rows; ``num_recv_tokens_per_expert``
            ``[num_tot_experts // world_size]`` int64 on the device. The buffers of FP8 rows and of the
            layer's rows are separate: a graph of each may be captured on one layer.
        """
        backend = self._static_backend("dispatch_static")
        if isinstance(input, tuple) or fp8:
            packed, _ = self._fp8_rows(input, exp_indices, weight, quantize=not isinstance(input, tuple))
            if weight is not None:
                weight = weight.contiguous()
            res = backend.dispatch_static(packed, self._expert_ids(exp_indices), weight)
            return dataclasses.replace(res, output=backend.unpack_fp8(res.output))
        self._check_dispatch_args(input, exp_indices, weight)
        if weight is not None:
            weight = weight.contiguous()
        return backend.dispatch_static(input.contiguous(), self._expert_ids(exp_indices), weight)

    @_eager_only
    def combine_static(self, input: torch.Tensor, dispatched: StaticDispatch) -> torch.Tensor:
        """CUDA-graph mode: combine the rows of a :meth:`dispatch_static` (collective).

        Args:
            input: ``[world_size * max_tokens * topk, hidden]`` floating rows in the order of
                ``dispatched.output`` (only the first ``num_recv_rows`` are read; bf16 or any floating
                dtype after an FP8 dispatch).
            dispatched: the result of this layer's latest :meth:`dispatch_static`.

        Returns:
            ``[n, hidden]`` in ``input.dtype``: per token, the float32 sum of its kept slots' rows.
        """
        backend = self._static_backend("combine_static")
        owner = getattr(getattr(dispatched, "state", None), "owner", None)
        if owner is None:
            raise TypeError(
                f"dispatched must be the result of dispatch_static, got {type(dispatched).__name__}"
            )
        if owner != id(backend):
            raise ValueError(f"dispatched was produced by a different {type(self).__name__}")
        if not isinstance(input, torch.Tensor) or not input.dtype.is_floating_point:
            raise TypeError(f"input must be a floating tensor, got {getattr(input, 'dtype', type(input))}")
        rows = dispatched.recv_expert_indices.shape[0]
        self._check_tensor("input", input, (rows, self.config.hidden), None)
        return backend.combine_static(input, dispatched)

    def check_errors(self) -> None:
        """Synchronise and raise :class:`ep_a2a.EPTimeoutError` if a device-side wait of the Triton
        backend ran out (graph-mode users call it outside the graph; eager calls check by themselves).
        Nothing to check on the torch backend."""
        self._check_alive("check_errors")
        check = getattr(self.ctx.backend, "check_errors", None)
        if check is not None:
            check()

    def ep_barrier_all(self, stream: torch.cuda.Stream | None = None, intra_node_only: bool = False) -> None:
        """Wait for every rank (or every rank of this node), after ``stream``'s queued work finished.

        Raises:
            EPTimeoutError: naming the ranks that did not arrive within ``timeout_s``.
        """
        self._check_alive("ep_barrier_all")
        self.ctx.backend.barrier(intra_node_only=intra_node_only, stream=stream)

    def finalize(self) -> None:
        """Release buffers and side groups. Idempotent; the layer raises on any later call."""
        self.ctx.finalize()

    def __enter__(self) -> EPLayer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with contextlib.suppress(EPError) if exc_type is not None else contextlib.nullcontext():
            self.finalize()
