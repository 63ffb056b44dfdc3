"""Per-rank driver of the Triton kernels: heap layout, epochs, launches, error reporting.

:class:`TritonEPEngine` knows nothing about process groups: it is given a heap (its own base address
and the table of every rank's base address) and launches the kernels of :mod:`.kernels`. The backend
(:mod:`ep_a2a.backends.triton.backend`) builds it over a real symmetric heap; the CPU tests build several
over plain CPU buffers (:mod:`ep_a2a.backends.triton.simulate`).

A dispatch has three steps: ``_layout_kernel`` (per-expert slot positions, counts pushed to the expert
owners), the receive layout (wait for every source's counts; either ``_counts_kernel`` on its own or
program 0 of the row kernel, ``counts=True``) and ``_dispatch_kernel`` (tokens out once per destination
rank, expanded to expert rows on the receiver). Static mode (CUDA graphs) and the exact-shape mode
merge the last two into one launch, into worst-case buffers (static mode, small layers) or into outputs
sized from the last calls' counts (large layers' speculative calls; a second writing pass, ``rewrite``,
when the rows outgrow them), and the exact-shape mode's program 0 copies the counts to the host
(``mirror``). A large layer's first exact-shape call launches the counts step alone and copies the
counts to the host before the row kernel. A combine is one launch of ``_combine_kernel``.

With remote peers (``remote_ranks``, reached through a :class:`RemoteTransport`) each step that feeds
them is followed by the host's puts: after the layout (and ``_pack_kernel``: packed token indices per
remote destination) the counts, after the receive layout the base rows, after the row kernel the token
records (then ``_remote_expand_kernel`` expands the records received); combine and barrier run as a
sending and a receiving launch with the puts between. Only the counts-first dispatch flow exists then.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import triton
import triton.language as tl

from ep_a2a.backends.triton import kernels as K

try:  # (where recent Triton keeps its launch hooks; without it every launch goes through the handle)
    from triton import knobs as _triton_knobs
except ImportError:  # pragma: no cover
    _triton_knobs = None

_ALIGN = 256
#: decode-sized chunks (at most this many tokens per work item, and at most WHOLE_ROW_MAX_ELEMS
#: elements of whole rows) make the row kernel hold whole token rows in registers: one load per row,
#: no per-tile reloads of the slot table (whose latency dominates there), peers' flags before own rows
WHOLE_ROW_MAX_CHUNK = 2
WHOLE_ROW_MAX_ELEMS = 16384
#: elements per thread of one [combine_chunk, KP, block_h] gather of the combine kernel (two are in
#: flight): the default combine tile width keeps to it (wider tiles spill registers)
COMBINE_TILE_PER_THREAD = 64
#: FP8 rows in DeepEP's format (``float8_e4m3fn`` row, one float32 scale per ``FP8_BLOCK`` channels)
#: travel as one packed row each, viewed as this dtype: the FP8 bytes, the scale bytes, then up to 15
#: bytes of padding to a multiple of 16 (:func:`pack_fp8_rows`). The kernels move it as any row.
FP8_ROW_DTYPE = torch.int16
FP8_BLOCK = 128


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one packed FP8 row of ``hidden`` channels: ``hidden + 4 * hidden / 128``, rounded up to
    a multiple of 16."""
    return -(-(hidden + 4 * (hidden // FP8_BLOCK)) // 16) * 16


def heap_row_bytes(hidden: int, token_dtype: torch.dtype) -> int:
    """Bytes of a dispatched row's slot in the heap for a layer of ``token_dtype`` rows: ``hidden *
    itemsize``; for ``float8_e4m3fn`` layers (FP8 rows in DeepEP's format) at least :func:`fp8_row_bytes`.
    Rows of two bytes or more per channel hold the packed FP8 row too."""
    nbytes = hidden * token_dtype.itemsize
    return max(nbytes, fp8_row_bytes(hidden)) if token_dtype == torch.float8_e4m3fn else nbytes


def pack_fp8_rows(x_fp8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(x_fp8 [n, H] float8_e4m3fn, scales [n, H / 128] float32)`` as packed rows ``[n,
    fp8_row_bytes(H) / 2]`` of :data:`FP8_ROW_DTYPE` (one concatenation, or two copies where there is
    padding, whose bytes are not written); into ``out`` (contiguous rows of that shape) where given."""
    n, h = x_fp8.shape
    parts = [x_fp8.view(torch.uint8), scales.contiguous().view(torch.uint8)]
    no_padding = fp8_row_bytes(h) == h + 4 * (h // FP8_BLOCK)  # (hidden a multiple of 512: one kernel)
    if out is None:
        if no_padding:
            return torch.cat(parts, 1).view(FP8_ROW_DTYPE)
        out = torch.empty(n, fp8_row_bytes(h) // 2, dtype=FP8_ROW_DTYPE, device=x_fp8.device)
    packed = out.view(torch.uint8)
    if no_padding:
        torch.cat(parts, 1, out=packed)
    else:
        packed[:, :h].copy_(parts[0])
        packed[:, h : h + 4 * (h // FP8_BLOCK)].copy_(parts[1])
    return out


#: dtypes of token rows the row kernel quantizes to packed FP8 rows as it sends them
QUANTIZE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class QuantizeOnSend:
    """Token rows that the row kernel quantizes to packed FP8 rows while it sends and writes them.

    It stands, in a dispatch, for the packed FP8 rows (:func:`pack_fp8_rows`) it becomes: ``dtype`` is
    :data:`FP8_ROW_DTYPE` and ``shape`` ``[n, fp8_row_bytes(hidden) / 2]``; ``x`` holds the rows. Each row
    kernel that stores a token row (to a peer, into a remote peer's staging record, into this rank's
    output) reads ``x``'s row and stores its FP8 bytes and scales, computed by the rule of
    :func:`ep_a2a.reference.quantize_fp8` bit for bit: no FP8 copy of ``x`` exists before the send.

    Args:
        x: ``[n, hidden]`` bf16, fp16 or fp32, ``hidden`` a multiple of 128 (copied once if it is not
            contiguous or its rows are not aligned to their element pairs).

    Raises:
        TypeError: ``x`` of another dtype.
        ValueError: ``x`` not 2-D, or ``hidden`` not a multiple of 128.
    """

    requires_grad = False  # (FP8 rows carry no gradient)

    def __init__(self, x: torch.Tensor) -> None:
        if x.dtype not in QUANTIZE_DTYPES:
            raise TypeError(
                f"input to quantize must have a dtype in {[str(d) for d in QUANTIZE_DTYPES]}, got {x.dtype}"
            )
        if x.dim() != 2 or x.shape[1] % FP8_BLOCK:
            raise ValueError(
                f"input to quantize must be [n, hidden] with hidden a multiple of {FP8_BLOCK} (one scale per "
                f"{FP8_BLOCK} channels), got {list(x.shape)}"
            )
        x = x.contiguous()
        if x.data_ptr() % (2 * x.element_size()):  # (the kernel loads pairs of channels as one word)
            x = x.clone()
        self.x = x
        self.dtype = FP8_ROW_DTYPE
        self.shape = torch.Size((x.shape[0], fp8_row_bytes(x.shape[1]) // FP8_ROW_DTYPE.itemsize))
        self.device = x.device

    def dim(self) -> int:
        return 2

    def element_size(self) -> int:
        return FP8_ROW_DTYPE.itemsize


def unpack_fp8_rows(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous packed FP8 rows ``[R, fp8_row_bytes(hidden) / 2]`` as ``(x_fp8 [R, hidden]
    float8_e4m3fn, scales [R, hidden / 128] float32)``: views of ``rows`` (row stride
    ``fp8_row_bytes(hidden)`` bytes), no copy."""
    b = rows.view(torch.uint8)
    return (
        b[:, :hidden].view(torch.float8_e4m3fn),
        b[:, hidden : hidden + 4 * (hidden // FP8_BLOCK)].view(torch.float32),
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _nz(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a one-element stand-in when it is empty (an empty tensor may have no address)."""
    return t if t.numel() > 0 else torch.zeros(1, dtype=t.dtype, device=t.device)


def _ids_arg(exp_indices: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Expert ids as the kernels take them (``ids_ptr``, ``id64``): int32 as they are; int64 viewed as
    int32, so the kernels' int32 variants take them, and read as int64 (``kernels._load_ids``): no
    conversion kernel and no variants of their own."""
    ids = _nz(exp_indices)
    if ids.dtype == torch.int64:
        return ids.view(torch.int32), 1
    if ids.dtype != torch.int32:
        raise TypeError(f"exp_indices must be int32 or int64, got {ids.dtype}")
    return ids, 0


#: ``id64`` of the expert-id dtypes the kernels take (see :func:`_ids_arg`)
_ID64 = {torch.int32: 0, torch.int64: 1}


def _raw_stream(device_index: int) -> int:
    """Handle of the current CUDA stream of ``device_index`` (what Triton's launcher takes)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def _address(arg: object) -> object:
    """A tensor argument as the address Triton's launcher would take from it; anything else as is."""
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else arg


def _launch_hooks_set() -> bool:
    """Whether a Triton launch hook is registered (a profiler's): launches then go through Triton."""
    runtime = _triton_knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    # (a hook chain is set when it holds calls; a plain hook, of older Tritons, when it is not None)
    return bool(getattr(enter, "calls", enter is not None) or getattr(leave, "calls", leave is not None))


class _DirectLaunch:
    """Launches of one compiled kernel through Triton's C launcher, tensors given as addresses (see
    :func:`_direct_launch`): ``launch(vals, stream)``; through the kernel's handle while a launch hook
    is registered."""

    __slots__ = ("c_launch", "grid", "handle", "rest")

    def __init__(self, c_launch: Callable, grid: tuple[int, ...], rest: tuple, handle: Any) -> None:
        self.c_launch, self.grid, self.rest, self.handle = c_launch, grid, rest, handle

    def head(self, stream: int) -> tuple:
        """The C launcher's arguments before the kernel's own, for a launch on ``stream``."""
        return (*self.grid, stream, *self.rest)

    def __call__(self, vals: list, stream: int) -> None:
        # (``vals``: the tensors already as addresses, which the handle takes as pointer arguments too)
        if _launch_hooks_set():
            self.handle(*vals, stream=stream)
        else:
            self.c_launch(*self.grid, stream, *self.rest, *vals)


def _direct_launch(compiled, grid: tuple[int, ...], args: list, stream: int) -> _DirectLaunch | None:
    """A launch function ``f(vals, stream)`` for a compiled kernel that calls Triton's C launcher
    itself, with tensors as their addresses: it skips the handle's Python layers (launch metadata, the
    launcher object's call, the per-tensor ``data_ptr`` and ``cuPointerGetAttribute``), most of a
    launch's host time. ``None`` where that launcher's arguments cannot be
    verified: the handle of a copy of the kernel is called once with a recording copy of the launcher,
    and the direct arguments must equal the recorded ones (launch metadata and the empty hooks aside,
    passed as None); a Triton whose layers differ, a kernel with scratch buffers or a registered launch
    hook keeps the handle. Launches made while a hook is registered go through the handle too."""
    if _triton_knobs is None:
        return None
    launcher: Any = getattr(compiled, "_run", None)
    c_launch = getattr(launcher, "launch", None)
    fields = ("launch_cooperative_grid", "launch_pdl")
    if c_launch is None or not all(hasattr(launcher, f) for f in fields) or _launch_hooks_set():
        return None
    function, meta = getattr(compiled, "function", None), getattr(compiled, "packed_metadata", None)
    coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
    head = (*grid, stream, function, coop, pdl, None, None, meta)
    recorded: list[tuple] = []
    # the handle of a copy whose launcher is a copy that records: the compiled kernel itself is shared
    # (Triton's cache), so another thread may launch it meanwhile
    recorder = copy.copy(launcher)
    recorder.launch = lambda *a: recorded.append(a)
    probe = copy.copy(compiled)
    probe._run = recorder
    try:
        probe[grid](*args, stream=stream)
    except Exception:
        return None
    if len(recorded) != 1:
        return None
    got = tuple(_address(a) for a in recorded[0])
    n_head = len(head)
    if got[:n_head] != head or got[n_head + 3 :] != tuple(_address(a) for a in args):
        return None
    rest = (function, coop, pdl, None, None, meta, None, None, None)
    return _DirectLaunch(c_launch, tuple(grid), rest, compiled[grid])


class BoundLaunch:
    """One kernel variant's launch on one stream with every argument bound but the kernel's first few:
    ``b.c_launch(*b.head, *first, *b.tail)`` launches it, ``first`` being the kernel's first
    ``len(b.prefix)`` arguments (tensors as addresses). ``prefix`` holds their bound values where they
    are fixed (``None`` where they change from call to call). Only valid while no launch hook is
    registered (:func:`_launch_hooks_set`); made by :meth:`TritonEPEngine.bind`."""

    __slots__ = ("c_launch", "head", "prefix", "tail")

    def __init__(self, c_launch: Callable, head: tuple, prefix: tuple, tail: tuple) -> None:
        self.c_launch, self.head, self.prefix, self.tail = c_launch, head, prefix, tail


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: most compiles one rank runs at once (each can hold several hundred MB while it runs)
MAX_COMPILE_THREADS = 8


def compile_threads(local_ranks: int) -> int:
    """Compiles one rank runs at once: the CPUs this process may use shared by the ``local_ranks``
    ranks of its node (which compile the same variants at the same time), 1 to
    :data:`MAX_COMPILE_THREADS`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_COMPILE_THREADS, cpus // max(1, local_ranks)))


def compile_all(warmups: Sequence[Callable[[], Any]], threads: int) -> None:
    """Run the kernel warmups ``warmups`` (each compiles one variant without launching it) with up to
    ``threads`` compiles at once. Triton's compiler releases the GIL, and its ``AsyncCompileMode`` hands
    each compile to the pool and files every kernel in its JIT cache before returning; where that
    mode is missing or already active, the warmups run one after another."""
    mode: Any = None
    if threads > 1 and len(warmups) > 1:
        try:
            from triton.runtime import _async_compile

            if _async_compile.active_mode.get() is None:
                mode = _async_compile.AsyncCompileMode
        except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
            mode = None
    if mode is None:
        for warmup in warmups:
            warmup()
        return
    from concurrent.futures import ThreadPoolExecutor

    with (
        ThreadPoolExecutor(min(threads, len(warmups)), thread_name_prefix="ep-a2a-compile") as pool,
        mode(pool),
    ):
        for warmup in warmups:
            warmup()


class RemoteTransport(Protocol):
    """Host-side transfers to the ranks the kernels do not reach by stores (other nodes, or forced).

    Offsets are bytes from the start of a heap (the same on every rank). Both calls are ordered on the
    current CUDA stream (the simulation's run at once); the signal is an int64 set to ``value`` once the
    data has arrived.
    """

    def put_signal(self, pe: int, dst_off: int, src_off: int, nbytes: int, sig_off: int, value: int) -> None:
        """Copy ``nbytes`` from this rank's heap at ``src_off`` to ``pe``'s at ``dst_off``, then set the
        signal word at ``sig_off`` in ``pe``'s heap to ``value``."""
        ...

    def signal(self, pe: int, sig_off: int, value: int) -> None:
        """Set the signal word at ``sig_off`` in ``pe``'s heap to ``value``."""
        ...


class EPTimeoutFromDevice(TimeoutError):
    """A device-side wait ran out (step and peer decoded from the device error flag)."""

    def __init__(self, message: str, *, step: str, peer: int) -> None:
        super().__init__(message)
        self.step = step
        self.peer = peer


#: fused multiply-add as the kernels are tuned and tested, independent of Triton's default (off in 3.10)
ENABLE_FP_FUSION = True


@dataclass
class KernelLaunch:
    """One launch of one kernel variant: what :meth:`TritonEPEngine._launch` runs and what the
    ahead-of-time compiles (:meth:`TritonEPEngine.precompile`, the sm_90 compile test) compile.

    Attributes:
        key: the variant (everything its compiled code depends on besides the engine's fixed values).
        kernel: the ``@triton.jit`` function.
        grid: programs.
        num_warps: warps per program.
        var_names, var_vals: the arguments that change from call to call (tensors, runtime ints).
        fixed: the other arguments by name (built only on a variant's first launch).
        launch_pdl: launched with programmatic dependent launch.
        maxnreg: register limit per thread given to ptxas (``None``: its own choice).
    """

    key: tuple
    kernel: Any
    grid: tuple[int, ...]
    num_warps: int
    var_names: tuple[str, ...]
    var_vals: tuple
    fixed: Callable[[], dict]
    launch_pdl: bool = False
    maxnreg: int | None = None

    def arguments(self) -> dict:
        """Every argument of the kernel call, by name."""
        named = self.fixed()
        named.update(zip(self.var_names, self.var_vals, strict=True))
        return named

    def options(self) -> dict:
        """Launch and compile options besides ``num_warps``."""
        opts: dict = {"enable_fp_fusion": ENABLE_FP_FUSION}
        if self.launch_pdl:
            opts["launch_pdl"] = True
        if self.maxnreg:
            opts["maxnreg"] = self.maxnreg
        return opts

    def launch_options(self) -> dict:
        """Every option of the variant's launch and warmup: ``num_warps``, then :meth:`options` (one
        order everywhere: Triton's JIT cache keys a compiled kernel by them as given)."""
        return {"num_warps": self.num_warps, **self.options()}


@dataclass
class DispatchBuffers:
    """The outputs of one dispatch on one rank (on the engine's device; ``n`` tokens dispatched here,
    ``rows`` received).

    Attributes:
        tab: ``[W, max_tokens, topk]`` int32, output row of every received slot (-1: not here).
        skip: ``[n, topk]`` int32, ``skipped_token_topk_mapping_indices``.
        scat: ``[n, topk]`` int32, ``token_dst_scatter_idx``.
        out: ``[rows, hidden]`` received rows (``None`` until allocated).
        out_w: ``[rows]`` weights of the received rows (one element when the call has none).
        out_e: ``[rows]`` int32 local expert of each received row.
        info: ``[info_len]`` int64 counts of the call, when the flow allocates it with the outputs.
    """

    tab: torch.Tensor
    skip: torch.Tensor
    scat: torch.Tensor
    out: torch.Tensor | None = None
    out_w: torch.Tensor | None = None
    out_e: torch.Tensor | None = None
    info: torch.Tensor | None = None


@dataclass(frozen=True)
class HeapLayout:
    """Byte offsets of the regions of one rank's symmetric heap (identical on every rank).

    Regions (``T = max_tokens``, ``W = world_size``, ``L`` experts per rank, ``NC = ceil(T / chunk)``,
    ``NCC = ceil(T / combine_chunk)``):
    ``x [W, T, row_bytes]`` dispatched token rows by source (rows of at most ``row_bytes`` bytes), ``ids/pos/w [W, T, K]`` their slot metadata,
    ``cnt [2, W, L + 1]`` int64 packed (epoch, count) per source and parity, ``flag [W, NC]`` dispatch chunk
    flags, ``back [W, L]`` packed base rows returned by each destination, ``cx [W, T, H]`` (4-byte
    elements) combine rows by expert rank, ``cflag [W, NCC]`` combine chunk flags, ``bar [W]`` barrier.

    With ``remote=True`` (some pairs of ranks exchange through host puts; the same on every rank) ``cnt``
    holds ``CW = L + 2`` words per source (the last: packed token count), and five more regions follow
    (empty otherwise): ``sig [4, W]`` signals (counts, base rows, records, combine rows) by source,
    ``scnt [W, CW]`` / ``sback [W, L]`` staged counts and base rows by destination, ``srec`` / ``rrec
    [W, T, rec]`` packed token records staged by destination / received by source (a record: the row,
    padded to 16 bytes, then the token index, ``K`` ids, ``K`` positions and ``K`` float32 weights, padded
    to 16 bytes), ``scx [W, T, H]`` (4-byte elements) combine rows staged by source.

    ``row_bytes`` defaults to ``H * token_bytes``; a layer of FP8 rows passes :func:`fp8_row_bytes`.
    """

    x: int
    ids: int
    pos: int
    w: int
    cnt: int
    flag: int
    back: int
    cx: int
    cflag: int
    bar: int
    nbytes: int
    nchunks: int
    cnchunks: int
    sig: int = 0
    scnt: int = 0
    sback: int = 0
    srec: int = 0
    rrec: int = 0
    scx: int = 0
    cw: int = 0  # words per source in cnt
    rec: int = 0  # bytes of a packed token record (remote)
    rowb: int = 0  # bytes of a record's row part
    remote: bool = False
    row_bytes: int = 0  # most bytes of a dispatched row (its slot in x and in a record)

    @classmethod
    def build(
        cls,
        *,
        world_size: int,
        max_tokens: int,
        hidden: int,
        topk: int,
        experts_per_rank: int,
        token_bytes: int,
        chunk: int,
        combine_chunk: int | None = None,
        remote: bool = False,
        row_bytes: int | None = None,
    ) -> HeapLayout:
        W, T, H, Kk, L = world_size, max_tokens, hidden, topk, experts_per_rank
        nchunks = triton.cdiv(T, chunk)
        cnchunks = triton.cdiv(T, combine_chunk or chunk)
        cw = L + 1 + int(remote)
        row_bytes = row_bytes or H * token_bytes
        rowb = -(-row_bytes // 16) * 16
        rec = rowb + -(-(1 + 3 * Kk) * 4 // 16) * 16
        r = int(remote)
        sizes = {
            "x": W * T * row_bytes,
            "ids": W * T * Kk * 4,
            "pos": W * T * Kk * 4,
            "w": W * T * Kk * 4,
            "cnt": 2 * W * cw * 8,
            "flag": W * nchunks * 8,
            "back": W * L * 8,
            "cx": W * T * H * 4,
            "cflag": W * cnchunks * 8,
            "bar": W * 8,
            "sig": r * 4 * W * 8,
            "scnt": r * W * cw * 8,
            "sback": r * W * L * 8,
            "srec": r * W * T * rec,
            "rrec": r * W * T * rec,
            "scx": r * W * T * H * 4,
        }
        offs = {}
        cur = 0
        for name, size in sizes.items():
            offs[name] = cur
            cur += (size + _ALIGN - 1) // _ALIGN * _ALIGN
        return cls(
            nbytes=cur, nchunks=nchunks, cnchunks=cnchunks, cw=cw, rec=rec if remote else 0, rowb=rowb if remote else 0, remote=remote,
            row_bytes=row_bytes, **offs,
        )  # fmt: skip


def _region(heap: torch.Tensor, byte_offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at ``byte_offset`` of a uint8 heap tensor (a view)."""
    return heap[byte_offset : byte_offset + numel * dtype.itemsize].view(dtype)


def _decode_error(code: int) -> tuple[str, int]:
    code -= 1
    return K.STEP_NAMES.get(code // 65536, f"step {code // 65536}"), code % 65536


class _Plan:
    """A kernel variant after its first launch (see :meth:`TritonEPEngine._launch`): its launch function
    and its full argument list with the per-call positions ``var_idx`` left empty. ``direct``: the launch
    calls Triton's C launcher, which takes tensors as addresses (``template`` then holds the fixed
    tensors' addresses and ``keep`` the tensors)."""

    __slots__ = ("direct", "keep", "launch", "template", "var_idx")

    def __init__(
        self, launch: Callable, template: list, var_idx: tuple[int, ...], direct: bool, keep: list
    ) -> None:
        self.launch, self.template, self.var_idx = launch, template, var_idx
        self.direct, self.keep = direct, keep

    def run(self, var_vals: Sequence, stream: int) -> None:
        """Launch with ``var_vals`` (in ``var_idx`` order) on ``stream``."""
        vals = self.template.copy()
        for i, v in zip(self.var_idx, var_vals, strict=True):
            vals[i] = v
        self.launch(vals, stream)


class TritonEPEngine:
    """One rank's view of the fast path over a symmetric heap.

    Args:
        rank, world_size, max_tokens, hidden, topk, num_tot_experts: the group's shape.
        token_dtype: dtype of dispatched rows. weight_dtype: dtype of routing weights (4 bytes at most).
        heap_local: this rank's heap as a uint8 tensor of ``layout.nbytes`` (zeroed before first use).
        ptr_table: ``[world_size]`` int64 on the heap's device, every rank's heap base address.
        num_sm: CTAs of the dispatch and combine kernels (the SMs they occupy).
        timeout_s: bound of every device-side wait.
        chunk: tokens per work item (and per ready flag).
        combine_chunk, combine_warps, combine_block_h: the same for the combine kernel (default: the
            dispatch kernel's chunk and warps, and the widest tile of at most ``COMBINE_TILE_PER_THREAD``
            elements per thread, up to ``block_h``); ``layout`` must be built with the same
            ``combine_chunk``. ``combine_maxnreg``: register limit per thread given to ptxas for the
            combine kernel (``.maxnreg``; default: ptxas's choice, which for the default 16-warp combine
            tiles is 128 registers with under 100 bytes of spills, see
            ``benchmarks/offline_compile.py --regs``).
        send_ctas, combine_send_ctas: split of the dispatch / combine kernel's CTAs (``TritonBackend``
            picks the defaults: on for large layers on many SMs). 0 (the engine's default):
            every CTA sends its chunks to the peers, then writes this rank's rows of a chunk, in turn;
            ``0 < k < num_sm``: ``k`` CTAs only send, the others only write this rank's output
            (dispatch: its own rows and the received ones; combine: the sums of its tokens).
        steal: with the dispatch split, the CTAs claim chunks from two shared counters (one per role)
            and take the other role's chunks once their own queue is empty, instead of a fixed share
            of each (``TritonBackend`` turns it on by default).
        ce_pieces: 0 (default), or dispatch moves this rank's token rows and slot metadata to every
            peer with copy-engine copies on a side stream, in ``ce_pieces`` pieces of tokens, each
            followed by an 8-byte copy of the dispatch epoch into the peer's flag of that piece; the
            row kernel then only writes rows (its own first, then each piece once its flag arrives), so
            the NVLink transfer takes no SM. Every token row goes to every peer (on 2 ranks nearly
            every row is needed there). Needs ``peer_heaps``, no remote ranks and no CTA split.
        peer_heaps: every rank's heap as a uint8 tensor mapped here (the copies' targets).
        pdl: launch the row kernel with programmatic dependent launch (only on sm_90 and newer GPUs).
        early_send: decode-sized row kernels send their first chunk while program 0 builds the receive
            layout.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        max_tokens: int,
        hidden: int,
        topk: int,
        num_tot_experts: int,
        token_dtype: torch.dtype,
        weight_dtype: torch.dtype,
        heap_local: torch.Tensor,
        ptr_table: torch.Tensor,
        layout: HeapLayout,
        num_sm: int,
        timeout_s: float,
        chunk: int = 8,
        block_h: int | None = None,
        num_warps: int | None = None,
        combine_chunk: int | None = None,
        combine_warps: int | None = None,
        combine_block_h: int | None = None,
        combine_maxnreg: int | None = None,
        send_ctas: int = 0,
        combine_send_ctas: int = 0,
        steal: bool = False,
        remote_ranks: Sequence[int] = (),
        transport: RemoteTransport | None = None,
        ce_pieces: int = 0,
        peer_heaps: Sequence[torch.Tensor | None] | None = None,
        pdl: bool = True,
        early_send: bool = True,
    ) -> None:
        if weight_dtype.itemsize > 4:
            raise ValueError(f"weight_dtype must be at most 4 bytes wide, got {weight_dtype}")
        self.rank, self.world_size = rank, world_size
        self.max_tokens, self.hidden, self.topk = max_tokens, hidden, topk
        self.num_tot_experts = num_tot_experts
        self.experts_per_rank = num_tot_experts // world_size
        self.token_dtype, self.weight_dtype = token_dtype, weight_dtype
        self.heap_local, self.ptr_table, self.layout = heap_local, ptr_table, layout
        self.device = heap_local.device
        self._device_index = self.device.index or 0
        self.num_sm = max(1, int(num_sm))
        self.timeout_s = timeout_s
        self.chunk = chunk
        self.use_timer = self.device.type == "cuda" and not interpreting()
        # timeouts: nanoseconds of %globaltimer on the GPU, poll iterations in the interpreter
        self.timeout_arg = int(timeout_s * 1e9) if self.use_timer else max(1, int(timeout_s * 1000))
        if block_h is None:
            block_h = min(_next_pow2(hidden), 64 if interpreting() else 1024)
        self.block_h = block_h
        self.combine_chunk = combine_chunk or chunk
        for name, v in (
            ("chunk", chunk),
            ("combine_chunk", self.combine_chunk),
            ("block_h", block_h),
            ("combine_block_h", combine_block_h or 1),
        ):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of 2 (a Triton block size), got {v}")
        #: the row kernel's tile is the whole (padded) row: see WHOLE_ROW_MAX_CHUNK
        self.whole_row = chunk <= WHOLE_ROW_MAX_CHUNK and chunk * _next_pow2(hidden) <= WHOLE_ROW_MAX_ELEMS
        # (one-token chunks of whole rows: 4 warps, the faster choice there)
        self.num_warps = num_warps or (4 if (self.whole_row and chunk == 1) or block_h < 512 else 8)
        if layout.cnchunks != triton.cdiv(max_tokens, self.combine_chunk):
            raise ValueError(
                f"layout was built for {layout.cnchunks} combine chunks, combine_chunk={self.combine_chunk} "
                f"needs {triton.cdiv(max_tokens, self.combine_chunk)}: pass the same combine_chunk to both"
            )
        self.combine_warps = combine_warps or self.num_warps
        if combine_maxnreg is not None and not 16 <= combine_maxnreg <= 255:
            raise ValueError(f"combine_maxnreg must be in [16, 255], got {combine_maxnreg}")
        self.combine_maxnreg = combine_maxnreg
        self.kp = _next_pow2(topk)
        # the combine kernel gathers [combine_chunk, KP, block_h] tiles, two at a time: by default no
        # wider than COMBINE_TILE_PER_THREAD elements per thread each
        self.combine_block_h = combine_block_h or min(
            block_h,
            max(16, COMBINE_TILE_PER_THREAD * 32 * self.combine_warps // (self.combine_chunk * self.kp)),
        )
        self._plans: dict[tuple, _Plan] = {}
        #: cached variants launched through Triton's C launcher directly (see :meth:`_launch`)
        self.direct_launches = 0
        for name, k in (("send_ctas", send_ctas), ("combine_send_ctas", combine_send_ctas)):
            if k and not 0 < k < self.num_sm:
                raise ValueError(f"{name} must be 0 or in [1, num_sm={self.num_sm}), got {k}")
        self.send_ctas = send_ctas
        self.combine_send_ctas = combine_send_ctas
        self.steal = steal
        #: with ``steal``: tokens per block of ``token_dst_scatter_idx`` claimed by the CTAs done first,
        #: about one block per CTA (a block's cost is the latency of polling its destinations' base rows,
        #: nearly independent of its size)
        self.scatter_tokens = min(64, max(chunk, _next_pow2(triton.cdiv(max_tokens, self.num_sm))))
        self.wp = _next_pow2(world_size)
        self.lp = _next_pow2(layout.cw or self.experts_per_rank + 1)
        dev = self.device
        self.state = torch.zeros(K.STATE_SIZE, dtype=torch.int64, device=dev)
        #: length of a dispatch's ``info``: total rows, error word, tokens per source, rows per source,
        #: rows per local expert, slots with an expert id outside [-1, num_tot_experts)
        self.info_len = 3 + 2 * world_size + self.experts_per_rank
        self.info = torch.zeros(self.info_len, dtype=torch.int64, device=dev)
        self.offsets = torch.zeros(self.experts_per_rank, world_size, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(max_tokens, topk, dtype=torch.int32, device=dev)
        self._dummy_w = torch.zeros(1, dtype=weight_dtype, device=dev)
        self._init_layout_workspace()
        # remote peers: every transfer to them is staged in this rank's heap and put by the host
        remote = sorted(set(int(r) for r in remote_ranks))
        if any(not 0 <= r < world_size or r == rank for r in remote):
            raise ValueError(f"remote_ranks must be other ranks of [0, {world_size}), got {remote}")
        if remote and not layout.remote:
            raise ValueError("remote_ranks need a HeapLayout built with remote=True")
        if remote and transport is None:
            raise ValueError("remote_ranks need a transport (host-side put-with-signal)")
        self.remote_ranks = tuple(remote)
        self.remote_bits = sum(1 << r for r in remote)
        self.transport = transport
        #: host mirrors of the device epochs (dispatch, combine, barrier): the values of the host signals
        self.host_epochs = [0, 0, 0]
        self._dummy_i32 = torch.zeros(1, dtype=torch.int32, device=dev)
        self._dummy_i64 = torch.zeros(1, dtype=torch.int64, device=dev)
        # copy-engine dispatch: pieces of ce_tokens tokens (a multiple of the chunk), one flag each
        if ce_pieces < 0:
            raise ValueError(f"ce_pieces must be >= 0, got {ce_pieces}")
        if ce_pieces:
            if remote:
                raise ValueError("ce_pieces (copy-engine dispatch) is for groups without remote peers")
            if send_ctas:
                raise ValueError("ce_pieces (copy-engine dispatch) leaves nothing to send: use send_ctas=0")
            if peer_heaps is None or any(peer_heaps[r] is None for r in range(world_size)):
                raise ValueError("ce_pieces (copy-engine dispatch) needs peer_heaps: every rank's heap")
        self.ce_pieces = ce_pieces
        self.ce_tokens = -(-triton.cdiv(max_tokens, max(ce_pieces, 1)) // chunk) * chunk
        self.peer_heaps = list(peer_heaps) if peer_heaps is not None else None
        self._ce_stream = torch.cuda.Stream(dev) if ce_pieces and dev.type == "cuda" else None
        #: the row kernel is launched with programmatic dependent launch (sm_90+): its CTAs become resident
        #: while the layout kernel runs and wait in ``griddepcontrol.wait`` instead of behind a kernel
        #: boundary
        self.pdl = (
            pdl
            and dev.type == "cuda"
            and not interpreting()
            and torch.cuda.get_device_capability(dev)[0] >= 9
        )
        #: decode-sized row kernels that build the receive layout (program 0) send their first chunk to
        #: the peers while program 0 builds it, instead of after: the NVLink transfer starts earlier.
        #: Only without the CTA split (whose senders start early anyway) and with whole rows per chunk
        self.early_send = self.whole_row and early_send

    def _init_layout_workspace(self) -> None:
        """The layout kernel's grid and workspace: one program per block of ``layout_tokens`` tokens (at
        most ``num_sm`` programs), each waiting only on lower ones for their histograms."""
        dev = self.device
        self.layout_tokens = max(8, _next_pow2(triton.cdiv(self.max_tokens, self.num_sm)))
        self._layout_grid = (triton.cdiv(self.max_tokens, self.layout_tokens),)
        self._hist_width = _next_pow2(self.num_tot_experts)
        self._layout_hist = torch.zeros(self._layout_grid[0], self._hist_width, dtype=torch.int32, device=dev)
        self._layout_bad = torch.zeros(self._layout_grid[0], dtype=torch.int32, device=dev)
        self._layout_flags = torch.zeros(self._layout_grid[0], dtype=torch.int64, device=dev)

    def _early_send_kw(self, counts: bool, send: bool, rewrite: bool) -> dict:
        """The row kernel's ``EARLY_SEND`` constexpr for one variant."""
        on = self.early_send and counts and send and not rewrite and not self.send_ctas and not self.ce_pieces
        return dict(EARLY_SEND=on)

    # ------------------------------------------------------------------ errors
    def check_error(self, err: int | None = None) -> None:
        """Raise :class:`EPTimeoutFromDevice` if any device wait of this engine ran out."""
        if err is None:
            err = int(self.state[K.STATE_ERR].item())
        if err:
            step, peer = _decode_error(err)
            raise EPTimeoutFromDevice(
                f"ep_a2a triton backend, rank {self.rank}: timed out after {self.timeout_s:g} s in step "
                f"'{step}' waiting for rank {peer} (it never signalled; did it crash, stop calling, or call "
                f"with a different sequence of dispatch/combine?). The backend is unusable from now on.",
                step=step,
                peer=peer,
            )

    # ------------------------------------------------------------------ launching
    def _launch(self, spec: KernelLaunch) -> None:
        """Launch ``spec``; after the first launch of a variant, straight through its compiled kernel
        (which keeps the variant's launch and compile options).

        Triton's own launch path binds and re-specialises every argument on every call. Here each
        specification names a variant ``key`` holding what that specialisation depends on (its
        constexprs, num_warps, the dtypes and 16-byte alignment of the caller's tensors); every other
        argument is fixed for the engine's life. The first launch of a variant goes through Triton
        (compiling it) and records the full argument list as a :class:`_Plan`; later launches only swap
        in the per-call values and call the compiled kernel: through Triton's C launcher directly with
        tensors as addresses where :func:`_direct_launch` verified that this gives that launcher the
        same arguments as the compiled kernel's own handle, else through the handle. The launch
        methods reach a direct plan by its key without building the specification at all
        (:meth:`_launch_bound`).
        """
        plan = self._plans.get(spec.key)
        if plan is not None:
            vals = spec.var_vals
            if plan.direct:
                vals = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in vals)
            plan.run(vals, _raw_stream(self._device_index))
            return
        named = spec.arguments()
        kernel, grid = spec.kernel, spec.grid
        compiled = kernel[grid](**named, **spec.launch_options())
        if interpreting():
            return
        names = list(kernel.arg_names)
        var_idx = tuple(names.index(n) for n in spec.var_names)
        full = [named[n] for n in names]
        grid3 = (*grid, 1, 1)[:3]
        direct = _direct_launch(compiled, grid3, full, _raw_stream(self._device_index))
        launch: Callable
        if direct is not None:
            self.direct_launches += 1
            # the fixed tensors as addresses (kept alive with the plan; the engine owns them anyway)
            launch, template = direct, [_address(a) for a in full]
        else:
            runner = compiled[grid3]
            template = list(full)

            def launch(vals: list, stream: int, runner=runner) -> None:
                runner(*vals, stream=stream)

        for i in var_idx:  # hold no reference to this call's tensors
            template[i] = None
        # (the direct path's template holds addresses: keep their fixed tensors alive with the plan)
        keep = [a for i, a in enumerate(full) if i not in var_idx and isinstance(a, torch.Tensor)]
        self._plans[spec.key] = _Plan(launch, template, var_idx, direct is not None, keep if direct else [])

    def bind(self, key: tuple, stream: int, first: int, addresses: Sequence) -> BoundLaunch | None:
        """The variant ``key``'s launch on ``stream`` with its per-call arguments ``addresses`` (in the
        specification's ``var_names`` order, tensors as device addresses) bound, but for the kernel's
        first ``first`` arguments, given at each launch (see :class:`BoundLaunch`; the values for them
        in ``addresses`` are ignored). ``None`` unless an earlier launch left a direct plan of it and
        no launch hook is registered."""
        plan = self._plans.get(key)
        if plan is None or not plan.direct or _launch_hooks_set():
            return None
        launch = plan.launch
        assert isinstance(launch, _DirectLaunch)
        full = plan.template.copy()
        for i, v in zip(plan.var_idx, addresses, strict=True):
            full[i] = v if i >= first else None
        return BoundLaunch(launch.c_launch, launch.head(stream), tuple(full[:first]), tuple(full[first:]))

    def _launch_bound(self, key: tuple, addresses: tuple) -> bool:
        """Launch the variant ``key`` with its per-call arguments ``addresses`` (in the specification's
        ``var_names`` order, tensors as device addresses) when an earlier launch left a direct plan of it;
        ``False`` (nothing launched) otherwise: the caller then launches through its specification."""
        plan = self._plans.get(key)
        if plan is None or not plan.direct:
            return False
        plan.run(addresses, _raw_stream(self._device_index))
        return True

    def _mirror_kw(self, on: bool) -> dict:
        """Constexprs of the row kernel about copying ``info`` to the host (``mirror``); every launch
        passes them (the cached launch path lists every argument by name)."""
        if not on:
            return dict(MIRROR=False, INFO_LEN=1, INFO_P2=1)
        return dict(MIRROR=True, INFO_LEN=self.info_len, INFO_P2=_next_pow2(self.info_len))

    @staticmethod
    def _align(*tensors: torch.Tensor) -> tuple:
        """Specialisation of caller tensors: dtype and 16-byte alignment (buffers of ours are aligned)."""
        return tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors)

    # The variant keys, shared by the specifications and the bound launches (``args``: :meth:`_align`'s
    # tuple of the caller tensors the variant specialises on).
    @staticmethod
    def _layout_key(caller_scatter: bool, ids_ptr: int) -> tuple:
        return ("layout", caller_scatter, ids_ptr % 16 == 0)

    def _dispatch_key(
        self, flags: tuple[bool, ...], out_dtype: torch.dtype, width: int, args: tuple
    ) -> tuple:
        """``flags``: ``(has_w, caller_scatter, send, recv, counts, rewrite, mirror)``."""
        return ("dispatch", *flags, self.send_ctas, self.steal, out_dtype, *args, width)

    def _tail_chunks(self) -> int:
        """The row kernel's ``TAIL``: with the split, ``steal`` and chunks of 2 tokens or more, the last
        ``send_ctas`` write chunks (those the senders send at once at the end) are claimed in halves, so
        the expansions that end a dispatch are shared by twice the CTAs."""
        return self.send_ctas if self.send_ctas and self.steal and self.chunk >= 2 else 0

    def _combine_key(self, width: int, send: bool, recv: bool, out_dtype: torch.dtype, args: tuple) -> tuple:
        return ("combine", width, send, recv, self.combine_send_ctas, out_dtype, *args)

    def alloc_remote(self) -> dict[str, torch.Tensor] | None:
        """Per-dispatch buffers of the remote path (``None`` without remote peers): ``pk`` / ``rtok``
        ``[W, max_tokens]`` int32 (packed index of each token per remote destination / token of each
        packed record per remote source) and ``pinfo [2W]`` int64 (records sent to / received from each
        remote rank)."""
        if not self.remote_ranks:
            return None
        W, T, dev = self.world_size, self.max_tokens, self.device
        return {
            "pk": torch.empty(W, T, dtype=torch.int32, device=dev),
            "rtok": torch.empty(W, T, dtype=torch.int32, device=dev),
            "pinfo": torch.zeros(2 * W, dtype=torch.int64, device=dev),
        }

    def _rb(self, remote: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.remote_ranks and remote is None:
            raise ValueError("this engine has remote peers: pass the dispatch's alloc_remote() buffers")
        if remote is None:
            return self._dummy_i32, self._dummy_i32, self._dummy_i64
        return remote["pk"], remote["rtok"], remote["pinfo"]

    def _tile_kw(self, width: int, whole_row: bool = False) -> dict:
        """Constexprs of the row-copying kernels' tiles (dispatch, remote expansion) for rows of ``width``
        elements; ``whole_row``: one tile spans the row."""
        H, BH = width, _next_pow2(width) if whole_row else self.block_h
        return dict(K=self.topk, KP=self.kp, H=H, BH=BH, CH=self.chunk, EVEN_H=H % BH == 0)

    def _row_tile_kw(self, width: int, quantize_from: int) -> dict:
        """The row kernel's tile constexprs (:meth:`_tile_kw`, rows of ``width`` elements) plus those of
        quantizing on send (``QH``: channels of the rows quantized, else 0): tiles of ``BQ`` pairs of
        channels, half as many as the channels a tile of ``block_h`` holds (the same bytes loaded), at
        least one 128-channel block; whole rows: every pair of the row."""
        tiles = self._tile_kw(width, self.whole_row)
        if not quantize_from:
            return dict(**tiles, QH=0, BQ=FP8_BLOCK // 2)
        pairs = quantize_from // 2
        bq = _next_pow2(pairs) if self.whole_row else max(self.block_h // 2, FP8_BLOCK // 2)
        return dict(**tiles, QH=quantize_from, BQ=bq)

    def _rec_kw(self, row_dtype: torch.dtype) -> dict:
        """Strides of a packed token record: in row elements, in 4-byte words; bytes of its row part."""
        lay = self.layout
        return dict(RECX=lay.rec // row_dtype.itemsize, RECI=lay.rec // 4, ROWB=lay.rowb)

    def _sig_off(self, kind: tl.constexpr | int, src: int) -> int:
        """Byte offset of signal ``kind`` (``kernels.SIG_*``) from source ``src`` in a heap."""
        return self.layout.sig + (int(kind) * self.world_size + src) * 8

    def _put_all(
        self,
        kind: tl.constexpr,
        epoch: int,
        dst_off: int,
        src_off: int,
        stride: int,
        unit: int,
        counts: Sequence[int] | None = None,
    ) -> None:
        """One host put-with-signal to each remote peer ``p``: ``unit * counts[p]`` bytes (``unit``
        without ``counts``) from ``src_off + p * stride`` of this rank's heap to ``dst_off`` of ``p``'s,
        then signal ``kind`` (from this rank) set to ``epoch``."""
        assert self.transport is not None or not self.remote_ranks
        for p in self.remote_ranks:
            nbytes = unit * (int(counts[p]) if counts is not None else 1)
            self.transport.put_signal(  # type: ignore[union-attr]
                p, dst_off, src_off + p * stride, nbytes, self._sig_off(kind, self.rank), epoch
            )

    # ------------------------------------------------------------------ kernel specifications
    # One method per kernel builds the launch of one variant; :meth:`_launch` runs it and
    # :meth:`variants` builds every variant the backend may launch from the same methods (for
    # ahead-of-time compiles: :meth:`precompile`, and the sm_90 compile test).
    def _layout_spec(
        self, ids: torch.Tensor, n_tokens: int, info: torch.Tensor, id64: int, *, caller_scatter: bool
    ) -> KernelLaunch:
        lay = self.layout

        def fixed() -> dict:
            return dict(
                pos_ptr=self.pos, table_ptr=self.ptr_table, state_ptr=self.state, off_cnt=lay.cnt,
                rank=self.rank, E=self.num_tot_experts, L=self.experts_per_rank, W=self.world_size,
                K=self.topk, KP=self.kp, TB=self.layout_tokens, EP=self._hist_width,
                NP=_next_pow2(self._layout_grid[0]), nprog=self._layout_grid[0], hist_ptr=self._layout_hist,
                bad_ptr=self._layout_bad, hflag_ptr=self._layout_flags, timeout=self.timeout_arg,
                USE_TIMER=self.use_timer, WRITE_POS=not caller_scatter, BAD_SLOT=self.info_len - 1,
                off_scnt=lay.scnt, CW=lay.cw, REMOTE=self.remote_bits, PDL=self.pdl,
            )  # fmt: skip

        return KernelLaunch(
            self._layout_key(caller_scatter, ids.data_ptr()), K._layout_kernel, self._layout_grid, 4,
            ("ids_ptr", "n_tokens", "info_ptr", "id64"), (ids, n_tokens, info, id64), fixed,
        )  # fmt: skip

    def _pack_spec(
        self, ids: torch.Tensor, pk: torch.Tensor, pinfo: torch.Tensor, n_tokens: int, id64: int
    ) -> KernelLaunch:
        def fixed() -> dict:
            return dict(
                table_ptr=self.ptr_table, state_ptr=self.state, off_scnt=self.layout.scnt, rank=self.rank,
                max_tokens=self.max_tokens, L=self.experts_per_rank, W=self.world_size, K=self.topk,
                KP=self.kp, BT=min(1024, _next_pow2(max(16, self.max_tokens))), CW=self.layout.cw,
                REMOTE=self.remote_bits,
            )  # fmt: skip

        return KernelLaunch(
            ("pack", ids.data_ptr() % 16 == 0), K._pack_kernel, (1,), 4,
            ("ids_ptr", "pk_ptr", "pinfo_ptr", "n_tokens", "id64"), (ids, pk, pinfo, n_tokens, id64), fixed,
        )  # fmt: skip

    def _counts_spec(self, info: torch.Tensor, pinfo: torch.Tensor) -> KernelLaunch:
        lay = self.layout

        def fixed() -> dict:
            return dict(
                offs_ptr=self.offsets, table_ptr=self.ptr_table, state_ptr=self.state, off_cnt=lay.cnt,
                off_back=lay.back, rank=self.rank, timeout=self.timeout_arg, W=self.world_size,
                L=self.experts_per_rank, WP=self.wp, LP=self.lp, USE_TIMER=self.use_timer, off_sig=lay.sig,
                off_sback=lay.sback, CW=lay.cw, REMOTE=self.remote_bits,
            )  # fmt: skip

        return KernelLaunch(  # (its key: the bound launch in launch_counts names it too)
            ("counts",), K._counts_kernel, (1,), 4, ("info_ptr", "pinfo_ptr"), (info, pinfo), fixed
        )

    def _dispatch_spec(
        self,
        xs: torch.Tensor,
        ids: torch.Tensor,
        id64: int,
        w: torch.Tensor,
        src: torch.Tensor,
        n_tokens: int,
        bufs: DispatchBuffers,
        info: torch.Tensor,
        pk: torch.Tensor,
        pinfo: torch.Tensor,
        mirror_addr: int,
        *,
        has_w: bool,
        caller_scatter: bool,
        counts: bool,
        send: bool,
        recv: bool,
        rewrite: bool,
        mirror: bool,
    ) -> KernelLaunch:
        out, split, lay = bufs.out, self.send_ctas, self.layout
        assert out is not None
        # rows quantized on send (the key's input dtype tells the variant apart)
        quantize_from = self.hidden if xs.dtype != out.dtype else 0

        def fixed() -> dict:
            return dict(
                offs_ptr=self.offsets, table_ptr=self.ptr_table, state_ptr=self.state, rank=self.rank,
                max_tokens=self.max_tokens, nchunks=lay.nchunks, timeout=self.timeout_arg, off_x=lay.x,
                off_ids=lay.ids, off_pos=lay.pos, off_w=lay.w, off_flag=lay.flag, off_back=lay.back,
                off_cnt=lay.cnt, W=self.world_size, L=self.experts_per_rank, WP=self.wp, LP=self.lp,
                HAS_W=has_w, CALLER_SCATTER=caller_scatter, SEND=send, RECV=recv,
                LAG=1 if (send and recv and not split) else 0, COUNTS=counts, SPLIT=bool(split),
                SEND_LOCAL=not split, STEAL=bool(split) and self.steal, REWRITE=rewrite,
                **self._early_send_kw(counts, send, rewrite), **self._mirror_kw(mirror),
                USE_TIMER=self.use_timer, G=self.num_sm, GS=max(split, 1), off_sig=lay.sig, off_sback=lay.sback,
                off_srec=lay.srec, CW=lay.cw, REMOTE=self.remote_bits, CE=bool(self.ce_pieces),
                ce_tokens=self.ce_tokens, **self._row_tile_kw(out.shape[1], quantize_from), **self._rec_kw(out.dtype),
                WHOLE_ROW=self.whole_row, PDL=self.pdl, ST=self.scatter_tokens, TAIL=self._tail_chunks(),
            )  # fmt: skip

        flags = (has_w, caller_scatter, send, recv, counts, rewrite, mirror)
        key = self._dispatch_key(flags, out.dtype, out.shape[1], self._align(xs, ids, w, src))
        names = ("x_ptr", "ids_ptr", "w_ptr", "pos_ptr", "n_tokens", "out_ptr", "out_w_ptr", "out_e_ptr", "tab_ptr",
                 "skip_ptr", "scat_ptr", "info_ptr", "cap_rows", "pk_ptr", "pinfo_ptr", "mirror_addr", "id64")  # fmt: skip
        vals = (xs, ids, w, src, n_tokens, out, bufs.out_w, bufs.out_e, bufs.tab, bufs.skip, bufs.scat, info,
                out.shape[0], pk, pinfo, mirror_addr, id64)  # fmt: skip
        return KernelLaunch(key, K._dispatch_kernel, (self.num_sm,), self.num_warps, names, vals, fixed,
                            launch_pdl=self.pdl)  # fmt: skip

    def _expand_spec(
        self,
        bufs: DispatchBuffers,
        rtok: torch.Tensor,
        pinfo: torch.Tensor,
        *,
        has_w: bool,
        caller_scatter: bool,
    ) -> KernelLaunch:
        out, lay = bufs.out, self.layout
        assert out is not None
        assert bufs.out_w is not None

        def fixed() -> dict:
            return dict(
                offs_ptr=self.offsets, table_ptr=self.ptr_table, state_ptr=self.state, rank=self.rank,
                max_tokens=self.max_tokens, timeout=self.timeout_arg, off_rrec=lay.rrec, off_sig=lay.sig,
                W=self.world_size, L=self.experts_per_rank, HAS_W=has_w, CALLER_SCATTER=caller_scatter,
                USE_TIMER=self.use_timer, REMOTE=self.remote_bits, G=self.num_sm, **self._tile_kw(out.shape[1]),
                **self._rec_kw(out.dtype),
            )  # fmt: skip

        return KernelLaunch(
            ("expand", has_w, caller_scatter, out.dtype, bufs.out_w.dtype, out.shape[1]), K._remote_expand_kernel,
            (self.num_sm,), self.num_warps,
            ("out_ptr", "out_w_ptr", "out_e_ptr", "tab_ptr", "rtok_ptr", "pinfo_ptr", "cap_rows"),
            (out, bufs.out_w, bufs.out_e, bufs.tab, rtok, pinfo, out.shape[0]), fixed,
        )  # fmt: skip

    def _combine_spec(
        self,
        ys: torch.Tensor,
        tab: torch.Tensor,
        ids: torch.Tensor,
        id64: int,
        n_src: torch.Tensor,
        n_tokens: int,
        outs: torch.Tensor,
        pk: torch.Tensor,
        rtok: torch.Tensor,
        pinfo: torch.Tensor,
        *,
        width: int,
        send: bool,
        recv: bool,
    ) -> KernelLaunch:
        split, lay = self.combine_send_ctas, self.layout
        # narrower rows (per-slot weight gradients: width 1) get a narrower tile
        cbh = self.combine_block_h
        bh = cbh if width == self.hidden else max(16, min(_next_pow2(width), cbh))

        def fixed() -> dict:
            return dict(
                table_ptr=self.ptr_table, state_ptr=self.state, rank=self.rank, max_tokens=self.max_tokens,
                nchunks=lay.cnchunks, timeout=self.timeout_arg, off_cx=lay.cx, off_cflag=lay.cflag,
                W=self.world_size, L=self.experts_per_rank, K=self.topk, KP=self.kp, WP=self.wp, H=width, BH=bh,
                CH=self.combine_chunk, EVEN_H=width % bh == 0, SEND=send, RECV=recv,
                LAG=1 if (send and recv and not split) else 0, SPLIT=bool(split), USE_TIMER=self.use_timer,
                G=self.num_sm, GS=max(split, 1), off_scx=lay.scx, off_sig=lay.sig, REMOTE=self.remote_bits,
            )  # fmt: skip

        return KernelLaunch(
            self._combine_key(width, send, recv, outs.dtype, self._align(ys, ids, n_src)), K._combine_kernel,
            (self.num_sm,), self.combine_warps,
            ("y_ptr", "tab_ptr", "ids_ptr", "nsrc_ptr", "n_tokens", "out_ptr", "pk_ptr", "rtok_ptr", "pinfo_ptr",
             "id64"),
            (ys, tab, ids, n_src, n_tokens, outs, pk, rtok, pinfo, id64), fixed, maxnreg=self.combine_maxnreg,
        )  # fmt: skip

    def _barrier_spec(self, send: bool, recv: bool) -> KernelLaunch:
        def fixed() -> dict:
            return dict(
                table_ptr=self.ptr_table, state_ptr=self.state, off_bar=self.layout.bar, rank=self.rank,
                timeout=self.timeout_arg, W=self.world_size, SEND=send, RECV=recv, USE_TIMER=self.use_timer,
                REMOTE=self.remote_bits,
            )  # fmt: skip

        # (its key: the bound launch in launch_barrier names it too)
        return KernelLaunch(("barrier", send, recv), K._barrier_kernel, (1,), 1, (), (), fixed)

    # ------------------------------------------------------------------ dispatch steps
    def launch_layout(
        self,
        exp_indices: torch.Tensor,
        *,
        caller_scatter: bool,
        info: torch.Tensor | None = None,
        remote: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Step 1; counts the slots with invalid expert ids into ``info`` (default :attr:`info`).

        With remote peers also packs this rank's tokens per remote destination (``remote["pk"]``,
        ``remote["pinfo"][:W]``) and puts each remote peer its counts (with a signal)."""
        pk, _, pinfo = self._rb(remote)
        n = exp_indices.shape[0]
        info = self.info if info is None else info
        if not self._launch_layout_bound(exp_indices, info, caller_scatter):
            ids, id64 = _ids_arg(exp_indices)
            self._launch(self._layout_spec(ids, n, info, id64, caller_scatter=caller_scatter))
        if not self.remote_ranks:
            return
        ids, id64 = _ids_arg(exp_indices)
        self._launch(self._pack_spec(ids, pk, pinfo, n, id64))
        ep = self.host_epochs[0] + 1
        lay, cw, W = self.layout, self.layout.cw, self.world_size
        self._put_all(
            K.SIG_CNT, ep, lay.cnt + ((ep % 2) * W * cw + self.rank * cw) * 8, lay.scnt, cw * 8, cw * 8
        )

    def _launch_layout_bound(
        self, exp_indices: torch.Tensor, info: torch.Tensor, caller_scatter: bool
    ) -> bool:
        """The layout kernel through its bound launch (see :meth:`_launch_bound`); ``False`` when there is
        none yet (or no tokens: empty ids have no address to bind, their launch takes the stand-in)."""
        n, id64, ptr = exp_indices.shape[0], _ID64.get(exp_indices.dtype), exp_indices.data_ptr()
        if n == 0 or id64 is None:
            return False
        return self._launch_bound(self._layout_key(caller_scatter, ptr), (ptr, n, info.data_ptr(), id64))

    def launch_counts(
        self, info: torch.Tensor | None = None, remote: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Step 2 on its own (exact-shape mode): wait for the counts, write ``info`` (default
        :attr:`info`) and the receive offsets; with remote peers, the records each sends
        (``remote["pinfo"][W:]``), and each gets its base rows by a put."""
        _, _, pinfo = self._rb(remote)
        info = self.info if info is None else info
        if not self._launch_bound(("counts",), (info.data_ptr(), pinfo.data_ptr())):
            self._launch(self._counts_spec(info, pinfo))
        self.host_epochs[0] += 1
        ep, L, lay = self.host_epochs[0], self.experts_per_rank, self.layout
        self._put_all(K.SIG_BACK, ep, lay.back + self.rank * L * 8, lay.sback, L * 8, L * 8)

    def _check_dispatch_flags(
        self,
        *,
        counts: bool,
        send: bool,
        recv: bool,
        rewrite: bool,
        mirror: torch.Tensor | None,
        npk_send: Sequence[int] | None,
    ) -> None:
        if self.remote_ranks and counts:
            raise ValueError("the receive layout cannot run inside the row kernel with remote peers")
        if self.ce_pieces and (counts or self.send_ctas):
            raise ValueError(
                "copy-engine dispatch (ce_pieces) needs the receive layout in its own launch and no CTA split"
            )
        if self.remote_ranks and send and npk_send is None:
            raise ValueError("npk_send (records per remote destination, on the host) is needed to send")
        if rewrite and (send or counts or not recv or self.remote_ranks or self.ce_pieces):
            raise ValueError(
                "rewrite=True is a writing pass of its own: send=False, recv=True, counts=False, and no "
                "remote peers or copy-engine pieces"
            )
        if mirror is not None and not (counts and recv):
            raise ValueError("mirror: program 0's receive layout writes it (counts=True, recv=True)")
        if mirror is not None and (mirror.dtype != torch.int64 or mirror.numel() != self.info_len + 1):
            raise ValueError(
                f"mirror: want int64 [{self.info_len + 1}], got {mirror.dtype} {list(mirror.shape)}"
            )

    def launch_dispatch(
        self,
        x: torch.Tensor | QuantizeOnSend,
        exp_indices: torch.Tensor,
        weight: torch.Tensor | None,
        scatter_src: torch.Tensor,
        bufs: DispatchBuffers,
        *,
        caller_scatter: bool,
        info: torch.Tensor | None = None,
        counts: bool = False,
        send: bool = True,
        recv: bool = True,
        rewrite: bool = False,
        mirror: torch.Tensor | None = None,
        remote: dict[str, torch.Tensor] | None = None,
        npk_send: Sequence[int] | None = None,
    ) -> None:
        """Step 3: the row kernel, writing ``bufs`` (its ``out``, ``out_w``, ``out_e`` allocated). With
        ``counts=True`` step 2 runs inside this launch (program 0 builds the receive layout, the others
        wait for it): the launch after :meth:`launch_layout` in static mode.

        ``rewrite=True`` (with ``send=False``, ``counts=False``): the writing half again, this rank's own
        rows included, after a pass into outputs too small for the rows (which dropped the rows past
        their end): the speculative exact-shape flow's overflow. The received rows stay in the heap
        until this rank's next dispatch starts, so they can be expanded again.

        ``mirror`` (with ``counts=True``): pinned host int64 ``[info_len + 1]``; program 0 copies ``info``
        into it once the receive layout is known, then writes the dispatch's epoch (nonzero) into its
        last element: the host polls that element (zeroed before the launch) instead of synchronizing.

        With remote peers (``counts=False`` only): the row kernel stages the records for remote peers;
        with ``send`` the host then puts ``npk_send[r]`` records (host copy of ``remote["pinfo"][:W]``) to
        each remote ``r``; with ``recv`` :func:`~.kernels._remote_expand_kernel` expands the records
        received (after the row kernel, which marks remote sources' slots as absent).

        ``x`` a :class:`QuantizeOnSend`: its rows quantized to packed FP8 rows inside the row kernel
        (``bufs.out`` of packed rows); not with copy-engine dispatch, whose copies move rows as they are."""
        self._check_dispatch_flags(
            counts=counts, send=send, recv=recv, rewrite=rewrite, mirror=mirror, npk_send=npk_send
        )
        if isinstance(x, QuantizeOnSend) and self.ce_pieces:
            raise ValueError(
                "copy-engine dispatch (ce_pieces) copies the token rows as they are: quantize them first "
                "(pack_fp8_rows) instead of QuantizeOnSend"
            )
        # (rows wider than the heap's row slots would be written past them)
        self.check_rows(x)
        if bufs.out is None or bufs.out.dtype != x.dtype or bufs.out.shape[1] != x.shape[1]:
            raise ValueError(
                f"bufs.out must be [rows, {x.shape[1]}] {x.dtype} like the input rows, got "
                f"{None if bufs.out is None else (bufs.out.dtype, list(bufs.out.shape))}"
            )
        pk, rtok, pinfo = self._rb(remote)
        has_w = weight is not None
        info = self.info if info is None else info
        xs = x.x if isinstance(x, QuantizeOnSend) else x  # (the rows as the kernel reads them)
        # the copies may start once the receive layout ran (not behind the row kernel)
        fork = self._ce_fork() if self.ce_pieces and send else None
        flags = (has_w, caller_scatter, send, recv, counts, rewrite, mirror is not None)
        mirror_addr = mirror.data_ptr() if mirror is not None else 0
        # (after a variant's first launch: through its bound launch, see _launch_bound)
        bound = self._row_kernel_call(
            xs, exp_indices, weight, scatter_src, bufs, info, pk, pinfo, mirror_addr, flags
        )
        if bound is None or not self._launch_bound(*bound):
            w = _nz(weight) if weight is not None else self._dummy_w
            ids, id64 = _ids_arg(exp_indices)
            self._launch(
                self._dispatch_spec(
                    _nz(xs), ids, id64, w, _nz(scatter_src), x.shape[0], bufs, info, pk, pinfo, mirror_addr,
                    has_w=has_w, caller_scatter=caller_scatter, counts=counts, send=send, recv=recv,
                    rewrite=rewrite, mirror=mirror is not None,
                )
            )  # fmt: skip
        if self.ce_pieces and send:
            ce_w = _nz(weight) if weight is not None else None
            self._ce_send(fork, _nz(xs), _nz(exp_indices), ce_w, _nz(scatter_src))
        if counts and recv:
            self.host_epochs[0] += 1
        if not self.remote_ranks:
            return
        lay, T, ep = self.layout, self.max_tokens, self.host_epochs[0]
        if send:
            assert npk_send is not None
            self._put_all(
                K.SIG_DATA, ep, lay.rrec + self.rank * T * lay.rec, lay.srec, T * lay.rec, lay.rec, npk_send
            )
        if recv:
            self._launch(self._expand_spec(bufs, rtok, pinfo, has_w=has_w, caller_scatter=caller_scatter))

    def _row_kernel_call(
        self,
        x: torch.Tensor,
        exp_indices: torch.Tensor,
        weight: torch.Tensor | None,
        src: torch.Tensor,
        bufs: DispatchBuffers,
        info: torch.Tensor,
        pk: torch.Tensor,
        pinfo: torch.Tensor,
        mirror_addr: int,
        flags: tuple[bool, ...],
    ) -> tuple[tuple, tuple] | None:
        """The row kernel's variant key and per-call arguments (in its specification's ``var_names``
        order, tensors as addresses), as :meth:`_dispatch_spec` would give them; ``None`` without tokens
        (their empty tensors have no address to bind: the specification's stand-ins take them)."""
        n, id64, out = x.shape[0], _ID64.get(exp_indices.dtype), bufs.out
        if n == 0 or id64 is None or out is None or bufs.out_w is None or bufs.out_e is None:
            return None
        w = weight if weight is not None else self._dummy_w
        xp, ip, wp, sp = x.data_ptr(), exp_indices.data_ptr(), w.data_ptr(), src.data_ptr()
        args = (
            (x.dtype, xp % 16 == 0), (torch.int32, ip % 16 == 0), (w.dtype, wp % 16 == 0),
            (src.dtype, sp % 16 == 0),
        )  # fmt: skip
        addresses = (
            xp, ip, wp, sp, n, out.data_ptr(), bufs.out_w.data_ptr(), bufs.out_e.data_ptr(), bufs.tab.data_ptr(),
            bufs.skip.data_ptr(), bufs.scat.data_ptr(), info.data_ptr(), out.shape[0], pk.data_ptr(),
            pinfo.data_ptr(), mirror_addr, id64,
        )  # fmt: skip
        return self._dispatch_key(flags, out.dtype, out.shape[1], args), addresses

    def bind_merged_dispatch(
        self,
        stream: int,
        bufs: DispatchBuffers,
        info: torch.Tensor,
        mirror: torch.Tensor,
        call: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor],
        *,
        caller_scatter: bool,
    ) -> tuple[BoundLaunch, BoundLaunch] | None:
        """The two launches of an exact-shape dispatch whose row kernel builds the receive layout and
        mirrors ``info`` to the host (:meth:`launch_layout`, then :meth:`launch_dispatch` with
        ``counts=True`` and ``mirror``) on ``stream``, bound to ``bufs`` (but ``bufs.out``), ``info`` and
        ``mirror``, for calls whose tensors ``(x, exp_indices, weight or None, scatter source)`` have the
        dtypes and alignment of ``call``'s (:meth:`_align`); launched by :meth:`launch_merged_bound`.
        ``None`` where either has no direct plan yet (or no tokens, remote peers, copy-engine
        dispatch)."""
        if self.remote_ranks or self.ce_pieces:
            return None
        pk, _, pinfo = self._rb(None)
        flags = (call[2] is not None, caller_scatter, True, True, True, False, True)
        row_call = self._row_kernel_call(*call, bufs, info, pk, pinfo, mirror.data_ptr(), flags)
        if row_call is None:
            return None
        key, addresses = row_call
        ip, n, id64 = addresses[1], addresses[4], addresses[-1]
        layout = self.bind(self._layout_key(caller_scatter, ip), stream, 3, (ip, n, info.data_ptr(), id64))
        row = self.bind(key, stream, 6, addresses)
        return None if layout is None or row is None else (layout, row)

    def launch_merged_bound(
        self,
        launches: tuple[BoundLaunch, BoundLaunch],
        x: int,
        ids: int,
        w: int,
        src: int,
        n: int,
        out: int,
        *,
        capturing: bool = False,
    ) -> None:
        """Launch what :meth:`bind_merged_dispatch` bound, for the tensors at these addresses (``w``: the
        weights', or any address without them) with ``n`` tokens into rows at ``out``. ``capturing``:
        into a CUDA graph being captured (nothing runs: :meth:`merged_replayed` counts each replay)."""
        layout, row = launches
        layout.c_launch(*layout.head, ids, layout.prefix[1], n, *layout.tail)
        row.c_launch(*row.head, x, ids, w, src, n, out, *row.tail)
        if not capturing:
            self.host_epochs[0] += 1

    def merged_replayed(self) -> None:
        """Count a replay of a CUDA graph of :meth:`launch_merged_bound`'s launches (a dispatch)."""
        self.host_epochs[0] += 1

    def _ce_fork(self) -> torch.cuda.Event | None:
        """The point of the current stream after which the copies may run (none on CPU)."""
        if self._ce_stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _ce_send(
        self,
        fork: torch.cuda.Event | None,
        x: torch.Tensor,
        ids: torch.Tensor,
        weight: torch.Tensor | None,
        pos: torch.Tensor,
    ) -> None:
        """Copy-engine dispatch: this rank's slot metadata, then its token rows piece by piece, each
        piece followed by the dispatch epoch (``state[0]``, bumped by the receive layout) into the
        peer's flag ``[rank, piece]``. Stream order makes everything before a flag visible with it.
        On a side stream that the current stream joins afterwards (the inputs stay untouched until
        the copies are done); in the CPU simulation, plain copies."""
        assert self.peer_heaps is not None
        n, Kk, H = x.shape[0], self.topk, self.row_width(x.dtype)
        if n == 0:
            return
        lay, base, step = self.layout, self.rank * self.max_tokens, self.ce_tokens
        heaps = [h for r, h in enumerate(self.peer_heaps) if r != self.rank and h is not None]
        side = self._ce_stream
        if side is not None:
            assert fork is not None
            side.wait_event(fork)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            # (int32 as the heap holds them; converted on the side stream, after the fork; an int64 id
            # outside the experts, which the layout kernel counted as invalid, must not wrap into them)
            E = self.num_tot_experts
            ids32 = (
                ids
                if ids.dtype == torch.int32
                else torch.where((ids >= 0) & (ids < E), ids, -1).to(torch.int32)
            )
            pos32 = pos[:n] if pos.dtype == torch.int32 else pos[:n].to(torch.int32)
            meta = [(lay.ids, ids32), (lay.pos, pos32)] + ([(lay.w, weight)] if weight is not None else [])
            for heap in heaps:
                for off, t in meta:
                    _region(heap, off + base * Kk * t.itemsize, n * Kk, t.dtype).copy_(t.reshape(-1))
            for p in range(triton.cdiv(n, step)):
                a, b = p * step, min(n, (p + 1) * step)
                for heap in heaps:
                    _region(heap, lay.x + (base + a) * H * x.itemsize, (b - a) * H, x.dtype).copy_(
                        x[a:b].reshape(-1)
                    )
                    flag = lay.flag + (self.rank * lay.nchunks + p) * 8
                    _region(heap, flag, 1, torch.int64).copy_(self.state[K.STATE_DISPATCH_EPOCH :][:1])
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)

    def launch_combine(
        self,
        y: torch.Tensor,
        tab: torch.Tensor,
        exp_indices: torch.Tensor,
        n_src: torch.Tensor,
        out: torch.Tensor,
        *,
        send: bool = True,
        recv: bool = True,
        remote: dict[str, torch.Tensor] | None = None,
        npk_recv: Sequence[int] | None = None,
    ) -> None:
        """One combine. With remote peers the kernel runs as two launches (send, then receive) with the
        host's puts in between: ``npk_recv[s]`` rows (host copy of the dispatch's ``pinfo[W:]``) back to
        each remote source ``s``."""
        width = y.shape[1]
        if width > self.hidden:
            raise ValueError(f"combine rows are at most hidden={self.hidden} wide, got {width}")
        if self.remote_ranks and send and npk_recv is None:
            raise ValueError("npk_recv (records per remote source, on the host) is needed to send")
        pk, rtok, pinfo = self._rb(remote)
        for snd, rcv in self._halves(send, recv):
            if not self._launch_combine_bound((y, tab, exp_indices, n_src, out, pk, rtok, pinfo), snd, rcv):
                ids, id64 = _ids_arg(exp_indices)
                self._launch(
                    self._combine_spec(
                        _nz(y), tab, ids, id64, n_src, exp_indices.shape[0], _nz(out), pk, rtok, pinfo,
                        width=width, send=snd, recv=rcv,
                    )
                )  # fmt: skip
            if snd and self.remote_ranks:
                assert npk_recv is not None
                lay, T, row = self.layout, self.max_tokens, width * y.dtype.itemsize
                ep = self.host_epochs[1] + 1
                self._put_all(K.SIG_COMB, ep, lay.cx + self.rank * T * row, lay.scx, T * row, row, npk_recv)
        if recv:
            self.host_epochs[1] += 1

    def _launch_combine_bound(self, tensors: tuple[torch.Tensor, ...], send: bool, recv: bool) -> bool:
        """The combine kernel through its bound launch (see :meth:`_launch_bound`), with the arguments
        :meth:`_combine_spec` would give it; ``False`` when there is none yet (or no rows or tokens: empty
        tensors have no address to bind, their launch takes the specification's stand-ins).
        ``tensors``: ``(y, tab, exp_indices, n_src, out, pk, rtok, pinfo)``."""
        y, tab, exp_indices, n_src, out, pk, rtok, pinfo = tensors
        n, id64 = exp_indices.shape[0], _ID64.get(exp_indices.dtype)
        if y.shape[0] == 0 or n == 0 or id64 is None:
            return False
        yp, ip, sp = y.data_ptr(), exp_indices.data_ptr(), n_src.data_ptr()
        args = ((y.dtype, yp % 16 == 0), (torch.int32, ip % 16 == 0), (n_src.dtype, sp % 16 == 0))
        addresses = (yp, tab.data_ptr(), ip, sp, n, out.data_ptr(), pk.data_ptr(), rtok.data_ptr(),
                     pinfo.data_ptr(), id64)  # fmt: skip
        return self._launch_bound(self._combine_key(y.shape[1], send, recv, out.dtype, args), addresses)

    def bind_combine(
        self, stream: int, y: torch.Tensor, exp_indices: torch.Tensor, n_src: torch.Tensor, out: torch.Tensor
    ) -> BoundLaunch | None:
        """A combine's launch on ``stream`` (one launch: no remote peers), bound for calls whose ``y``,
        ``exp_indices``, ``n_src`` and ``out`` have the dtypes, widths and alignment of these; launched by
        :meth:`launch_combine_bound`. ``None`` where it has no direct plan yet (or no rows or tokens,
        remote peers)."""
        n, id64 = exp_indices.shape[0], _ID64.get(exp_indices.dtype)
        if self.remote_ranks or y.shape[0] == 0 or n == 0 or id64 is None or y.shape[1] > self.hidden:
            return None
        yp, ip, sp = y.data_ptr(), exp_indices.data_ptr(), n_src.data_ptr()
        args = ((y.dtype, yp % 16 == 0), (torch.int32, ip % 16 == 0), (n_src.dtype, sp % 16 == 0))
        pk, rtok, pinfo = self._rb(None)
        return self.bind(
            self._combine_key(y.shape[1], True, True, out.dtype, args), stream, 6,
            (yp, 0, ip, sp, n, out.data_ptr(), pk.data_ptr(), rtok.data_ptr(), pinfo.data_ptr(), id64),
        )  # fmt: skip

    def launch_combine_bound(
        self,
        launch: BoundLaunch,
        y: int,
        tab: int,
        ids: int,
        n_src: int,
        n: int,
        out: int,
        *,
        capturing: bool = False,
    ) -> None:
        """Launch what :meth:`bind_combine` bound, for the tensors at these addresses (``n`` tokens).
        ``capturing``: into a CUDA graph being captured (:meth:`combine_replayed` counts each replay)."""
        launch.c_launch(*launch.head, y, tab, ids, n_src, n, out, *launch.tail)
        if not capturing:
            self.host_epochs[1] += 1

    def combine_replayed(self) -> None:
        """Count a replay of a CUDA graph of :meth:`launch_combine_bound`'s launch (a combine)."""
        self.host_epochs[1] += 1

    def _halves(self, send: bool, recv: bool) -> list[tuple[bool, bool]]:
        """A step's launches: one that sends and receives, or with remote peers (whose host signals go
        between) a sending launch and then a receiving one."""
        if self.remote_ranks and send and recv:
            return [(True, False), (False, True)]
        return [(send, recv)]

    def launch_barrier(self, *, send: bool = True, recv: bool = True) -> None:
        """Device-side barrier; remote peers are signalled by the host between a sending and a waiting
        launch."""
        for snd, rcv in self._halves(send, recv):
            if not self._launch_bound(("barrier", snd, rcv), ()):
                self._launch(self._barrier_spec(snd, rcv))
            if snd and self.remote_ranks:
                assert self.transport is not None
                ep = self.host_epochs[2] + 1
                for r in self.remote_ranks:
                    self.transport.signal(r, self.layout.bar + self.rank * 8, ep)
        if recv:
            self.host_epochs[2] += 1

    def per_slot_rows(self, y: torch.Tensor, tab: torch.Tensor, n_src: torch.Tensor) -> list[torch.Tensor]:
        """``K`` copies of ``y`` [R, C], copy ``k`` keeping only the rows that serve a slot ``k``.

        Combining copy ``k`` returns, for every token, the row of its slot ``k`` (no other slot
        contributes): the per-slot combine used for routing-weight gradients.
        """
        rows = y.shape[0]
        t = torch.arange(self.max_tokens, device=tab.device)
        live = (tab >= 0) & (t[None, :, None] < n_src.to(tab.device)[:, None, None])
        slot_of = torch.full((max(rows, 1),), -1, dtype=torch.int64, device=tab.device)
        kidx = torch.arange(self.topk, device=tab.device).expand_as(tab)
        slot_of[tab[live].long()] = kidx[live]
        slot_of = slot_of[:rows]
        return [
            torch.where((slot_of == k)[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
            for k in range(self.topk)
        ]

    # ------------------------------------------------------------------ buffers
    def worst_case_rows(self) -> int:
        """Most rows one rank can receive: every slot of every source on this rank."""
        return self.world_size * self.max_tokens * self.topk

    def _buf(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        if shape[0] == 0:  # at least one element underneath: an empty tensor may have no address
            return torch.empty(1, *shape[1:], dtype=dtype, device=self.device)[:0]
        # (no slice otherwise: one host operation fewer per output, six per exact-shape dispatch)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def alloc_token_slots(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``skip`` and ``scat``: ``[n, topk]`` int32, per slot of this rank's ``n`` tokens."""
        return self._buf(n, self.topk, dtype=torch.int32), self._buf(n, self.topk, dtype=torch.int32)

    def alloc_dispatch_fixed(self, n: int) -> DispatchBuffers:
        """The dispatch outputs whose size does not depend on the received rows (``n`` tokens here):
        the slot table ``tab``, ``skip`` and ``scat``; the rows come later (:meth:`alloc_dispatch_rows`)."""
        skip, scat = self.alloc_token_slots(n)
        return DispatchBuffers(
            tab=self._buf(self.world_size, self.max_tokens, self.topk, dtype=torch.int32),
            skip=skip,
            scat=scat,
        )

    def alloc_dispatch_rows(
        self, rows: int, *, with_weights: bool, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(out, out_w, out_e)`` of ``rows`` received rows (``out_w`` one element without weights)."""
        return (self.alloc_rows(rows, dtype=dtype), *self._alloc_row_tags(rows, with_weights))

    def alloc_rows(self, rows: int, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``out``: ``[rows, row_width(dtype)]`` received rows (default ``token_dtype``)."""
        dtype = dtype or self.token_dtype
        return self._buf(rows, self.row_width(dtype), dtype=dtype)

    def row_width(self, dtype: torch.dtype) -> int:
        """Elements of a dispatched row of ``dtype``: ``hidden``, or for :data:`FP8_ROW_DTYPE` (packed FP8
        rows) ``fp8_row_bytes(hidden) / 2``."""
        return fp8_row_bytes(self.hidden) // FP8_ROW_DTYPE.itemsize if dtype == FP8_ROW_DTYPE else self.hidden

    def check_rows(self, x: torch.Tensor | QuantizeOnSend, name: str = "input") -> None:
        """Raise ``ValueError`` unless ``x``'s rows are ``row_width(x.dtype)`` wide and fit the heap's row
        slots (``layout.row_bytes``)."""
        width = self.row_width(x.dtype)
        if x.dim() != 2 or x.shape[1] != width:
            raise ValueError(f"{name}: rows of {x.dtype} must be [n, {width}], got {list(x.shape)}")
        if width * x.dtype.itemsize > self.layout.row_bytes:
            what = "packed FP8 rows" if x.dtype == FP8_ROW_DTYPE else f"{x.dtype} rows"
            raise ValueError(
                f"{name}: {what} take {width * x.dtype.itemsize} bytes, more than the {self.layout.row_bytes} "
                f"bytes per row the heap was built for (token_dtype {self.token_dtype}, hidden {self.hidden})"
            )

    def _alloc_row_tags(self, rows: int, with_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self._buf(rows if with_weights else 1, dtype=self.weight_dtype),
            self._buf(rows, dtype=torch.int32),
        )

    def alloc_dispatch_outputs(
        self, n: int, rows: int, *, with_weights: bool, dtype: torch.dtype | None = None
    ) -> DispatchBuffers:
        """Every output of a dispatch of ``n`` tokens into ``rows`` rows (``info`` left ``None``)."""
        bufs = self.alloc_dispatch_fixed(n)
        bufs.out, bufs.out_w, bufs.out_e = self.alloc_dispatch_rows(
            rows, with_weights=with_weights, dtype=dtype
        )
        return bufs

    def info_fields(self, info: torch.Tensor) -> dict[str, torch.Tensor]:
        """A dispatch's ``info`` by field: total rows, error word, tokens per source, rows per source,
        rows per local expert, slots with an expert id outside ``[-1, num_tot_experts)``."""
        W, L = self.world_size, self.experts_per_rank
        return {
            "total": info[0],
            "err": info[1],
            "n_src": info[2 : 2 + W],
            "rows_src": info[2 + W : 2 + 2 * W],
            "rows_exp": info[2 + 2 * W : 2 + 2 * W + L],
            "bad_ids": info[2 + 2 * W + L],
        }

    # ------------------------------------------------------------------ ahead-of-time compiles
    def variants(
        self,
        *,
        dtypes: tuple[torch.dtype, ...] = (),
        dispatch_counts: tuple[bool, ...] = (True, False),
        rewrite: bool = False,
        mirror: bool = False,
        row_dtypes: tuple[torch.dtype, ...] | None = None,
        combine_dtypes: tuple[torch.dtype, ...] | None = None,
        quantize_from: tuple[torch.dtype, ...] = (),
    ) -> list[KernelLaunch]:
        """Every kernel variant the backend may launch, as the launches specify them (per-call tensors
        replaced by small aligned stand-ins of the same dtypes).

        ``row_dtypes``: dtypes of the dispatched rows (default ``(token_dtype,)``; :data:`FP8_ROW_DTYPE`:
        packed FP8 rows); ``combine_dtypes``: row dtypes of combine (default ``(token_dtype,)``), and
        ``dtypes`` more of them; ``quantize_from``: dtypes of rows quantized to packed FP8 rows on send
        (:class:`QuantizeOnSend`), each a row kernel variant of its own; ``dispatch_counts``: the dispatch kernel with the
        receive layout merged in (static mode, small exact calls) and/or without (large exact calls);
        ``rewrite``: also the writing pass of :meth:`launch_dispatch`'s ``rewrite=True`` (local peers
        only); ``mirror``: also the merged variant that copies ``info`` to the host (local peers only).
        With remote peers only the unmerged dispatch exists, combine and barrier run as a sending and a
        receiving launch, and the pack and expand kernels are included.
        """
        remote = bool(self.remote_ranks)
        dev, i32, i64 = self.device, torch.int32, torch.int64

        def t(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(16, dtype=dtype, device=dev)

        ids, info, pk, pinfo = t(i32), t(i64), t(i32), t(i64)
        out: list[KernelLaunch] = [
            self._layout_spec(ids, 1, info, 0, caller_scatter=cs) for cs in (False, True)
        ]
        out.append(self._counts_spec(info, pinfo))
        if remote or self.ce_pieces:  # (the receive layout then always runs in its own launch)
            dispatch_counts = (False,)
        if remote:
            out.append(self._pack_spec(ids, pk, pinfo, 1, 0))
        # (counts, send, rewrite, mirror) of each row-kernel variant
        rows = [(counts, True, False, False) for counts in dispatch_counts]
        if not remote and not self.ce_pieces:
            rows += [(False, False, True, False)] if rewrite else []
            rows += [(True, True, False, True)] if mirror else []

        def row(dtype: torch.dtype) -> torch.Tensor:  # (aligned rows of that dtype's width)
            return torch.zeros(16, self.row_width(dtype), dtype=dtype, device=dev)

        # (row dtype, dtype of the rows quantized on send or None) of each variant
        row_dts: list[tuple[torch.dtype, torch.dtype | None]] = [
            (dt, None) for dt in row_dtypes or (self.token_dtype,)
        ]
        if not self.ce_pieces:
            row_dts += [(FP8_ROW_DTYPE, dt) for dt in quantize_from]
        for (dt, qdt), has_w, cs, (counts, send, rw, mi) in itertools.product(
            row_dts, (True, False), (False, True), rows
        ):
            x: torch.Tensor = row(dt) if qdt is None else torch.zeros(16, self.hidden, dtype=qdt, device=dev)
            bufs = DispatchBuffers(tab=t(i32), skip=t(i32), scat=t(i32), out=row(dt),
                                   out_w=t(self.weight_dtype), out_e=t(i32))  # fmt: skip
            out.append(
                self._dispatch_spec(
                    x, ids, 0, t(self.weight_dtype), t(i32), 1, bufs, info, pk, pinfo, 1 << 40 if mi else 0,
                    has_w=has_w, caller_scatter=cs, counts=counts, send=send, recv=True, rewrite=rw, mirror=mi,
                )
            )  # fmt: skip
            if remote:
                out.append(self._expand_spec(bufs, pk, pinfo, has_w=has_w, caller_scatter=cs))
        combine_rows = [(dt, self.hidden) for dt in (*(combine_dtypes or (self.token_dtype,)), *dtypes)]
        combine_rows.append((torch.float32, 1))  # per-slot weight gradients
        for (dt, width), (snd, rcv) in itertools.product(combine_rows, self._halves(True, True)):
            out.append(
                self._combine_spec(
                    t(dt), t(i32), ids, 0, t(i64), 1, t(dt), pk, pk, pinfo, width=width, send=snd, recv=rcv
                )
            )  # fmt: skip
        out += [self._barrier_spec(snd, rcv) for snd, rcv in self._halves(True, True)]
        return out

    def precompile(self, *, threads: int = 1, **variants: Any) -> int:
        """Compile every kernel variant of :meth:`variants` (same arguments) without launching one,
        ``threads`` at a time (:func:`compile_all`).

        Returns:
            the number of variants compiled.
        """
        specs = self.variants(**variants)
        compile_all(
            [
                functools.partial(
                    spec.kernel.warmup, **spec.arguments(), grid=spec.grid, **spec.launch_options()
                )
                for spec in specs
            ],
            threads,
        )
        return len(specs)
