"""Per-rank driver of the Triton kernels: heap layout, epochs, launches, error reporting.

:class:`TritonEPEngine` knows nothing about process groups: it is given a heap (its own base address
and the table of every rank's base address) and launches the kernels of :mod:`.kernels`. The backend
(:mod:`ep_a2a.triton_backend.backend`) builds it over a real symmetric heap; the CPU tests build several
over plain CPU buffers (:mod:`ep_a2a.triton_backend.simulate`).

A dispatch has three steps: ``_layout_kernel`` (per-expert slot positions, counts pushed to the expert
owners), the receive layout (wait for every source's counts; either ``_counts_kernel`` on its own or
program 0 of the row kernel, ``counts=True``) and ``_dispatch_kernel`` (tokens out once per destination
rank, expanded to expert rows on the receiver). Static mode (CUDA graphs) and the exact-shape mode of
small layers merge the last two into one launch into worst-case buffers; the exact-shape mode of large
layers launches the counts step alone, copies the counts to the host and allocates exactly ``R`` rows
before the row kernel. A combine is one launch of ``_combine_kernel``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from ep_a2a.triton_backend import kernels as K

_ALIGN = 256


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _nz(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a one-element stand-in when it is empty (an empty tensor may have no address)."""
    return t if t.numel() > 0 else torch.zeros(1, dtype=t.dtype, device=t.device)


def _raw_stream(device_index: int) -> int:
    """Handle of the current CUDA stream of ``device_index`` (what Triton's launcher takes)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class EPTimeoutFromDevice(TimeoutError):
    """A device-side wait ran out (step and peer decoded from the device error flag)."""

    def __init__(self, message: str, *, step: str, peer: int) -> None:
        super().__init__(message)
        self.step = step
        self.peer = peer


@dataclass(frozen=True)
class HeapLayout:
    """Byte offsets of the regions of one rank's symmetric heap (identical on every rank).

    Regions (``T = max_tokens``, ``W = world_size``, ``L`` experts per rank, ``NC = ceil(T / chunk)``):
    ``x [W, T, H]`` dispatched token rows by source, ``ids/pos/w [W, T, K]`` their slot metadata,
    ``cnt [2, W, L + 1]`` int64 packed (epoch, count) per source and parity, ``flag [W, NC]`` dispatch chunk
    flags, ``back [W, L]`` packed base rows returned by each destination, ``cx [W, T, H]`` (4-byte
    elements) combine rows by expert rank, ``cflag [W, NC]`` combine chunk flags, ``bar [W]`` barrier.
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
    ) -> HeapLayout:
        W, T, H, Kk, L = world_size, max_tokens, hidden, topk, experts_per_rank
        nchunks = triton.cdiv(T, chunk)
        sizes = {
            "x": W * T * H * token_bytes,
            "ids": W * T * Kk * 4,
            "pos": W * T * Kk * 4,
            "w": W * T * Kk * 4,
            "cnt": 2 * W * (L + 1) * 8,
            "flag": W * nchunks * 8,
            "back": W * L * 8,
            "cx": W * T * H * 4,
            "cflag": W * nchunks * 8,
            "bar": W * 8,
        }
        offs = {}
        cur = 0
        for name, size in sizes.items():
            offs[name] = cur
            cur += (size + _ALIGN - 1) // _ALIGN * _ALIGN
        return cls(nbytes=cur, nchunks=nchunks, **offs)


def _decode_error(code: int) -> tuple[str, int]:
    code -= 1
    return K.STEP_NAMES.get(code // 65536, f"step {code // 65536}"), code % 65536


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
        send_ctas, combine_send_ctas: split of the dispatch / combine kernel's CTAs (``TritonBackend``
            picks the defaults: on for large layers on many SMs). 0 (the engine's default):
            every CTA sends its chunks to the peers, then writes this rank's rows of a chunk, in turn;
            ``0 < k < num_sm``: ``k`` CTAs only send, the others only write this rank's output
            (dispatch: its own rows and the received ones; combine: the sums of its tokens).
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
        send_ctas: int = 0,
        combine_send_ctas: int = 0,
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
        self.num_warps = num_warps or (8 if block_h >= 512 else 4)
        self._plans: dict[tuple, tuple] = {}
        for name, k in (("send_ctas", send_ctas), ("combine_send_ctas", combine_send_ctas)):
            if k and not 0 < k < self.num_sm:
                raise ValueError(f"{name} must be 0 or in [1, num_sm={self.num_sm}), got {k}")
        self.send_ctas = send_ctas
        self.combine_send_ctas = combine_send_ctas
        self.kp = _next_pow2(topk)
        self.wp = _next_pow2(world_size)
        self.lp = _next_pow2(self.experts_per_rank + 1)
        dev = self.device
        self.state = torch.zeros(K.STATE_SIZE, dtype=torch.int64, device=dev)
        #: length of a dispatch's ``info``: total rows, error word, tokens per source, rows per source,
        #: rows per local expert, slots with an expert id outside [-1, num_tot_experts)
        self.info_len = 3 + 2 * world_size + self.experts_per_rank
        self.info = torch.zeros(self.info_len, dtype=torch.int64, device=dev)
        self.offsets = torch.zeros(self.experts_per_rank, world_size, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(max_tokens, topk, dtype=torch.int32, device=dev)
        self._dummy_w = torch.zeros(1, dtype=weight_dtype, device=dev)
        self.scan_block = min(4096, _next_pow2(max(16, max_tokens * topk)))
        self._layout_grid = (min(self.num_tot_experts, self.num_sm),)

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
    def _launch(
        self,
        key: tuple,
        kernel,
        grid: tuple[int, ...],
        num_warps: int,
        var_names: tuple[str, ...],
        var_vals: tuple,
        fixed: Callable[[], dict],
    ) -> None:
        """Launch ``kernel``; after the first launch of a variant, straight through its compiled handle.

        Triton's own launch path binds and re-specialises every argument on every call (about 30 us of
        Python per launch for these kernels). Here each call site names a variant ``key`` holding what
        that specialisation depends on (its constexprs, num_warps, the dtypes and 16-byte alignment of
        the caller's tensors); every other argument is fixed for the engine's life. The first launch of a
        variant goes through Triton (compiling it) and records the full argument list; later launches
        only swap in ``var_vals`` and call the compiled kernel. ``var_names`` are the arguments that may
        change between calls (tensors, and ints Triton does not specialise on).
        """
        plan = self._plans.get(key)
        if plan is not None:
            runner, template, var_idx = plan
            vals = template.copy()
            for i, v in zip(var_idx, var_vals, strict=True):
                vals[i] = v
            runner(*vals, stream=_raw_stream(self._device_index))
            return
        named = fixed()
        named.update(zip(var_names, var_vals, strict=True))
        if interpreting():
            kernel[grid](**named, num_warps=num_warps)
            return
        compiled = kernel[grid](**named, num_warps=num_warps)
        names = list(kernel.arg_names)
        var_idx = [names.index(n) for n in var_names]
        template = [named[n] for n in names]
        for i in var_idx:  # hold no reference to this call's tensors
            template[i] = None
        self._plans[key] = (compiled[(*grid, 1, 1)[:3]], template, var_idx)

    @staticmethod
    def _align(*tensors: torch.Tensor) -> tuple:
        """Specialisation of caller tensors: dtype and 16-byte alignment (buffers of ours are aligned)."""
        return tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors)

    # ------------------------------------------------------------------ dispatch steps
    def launch_layout(
        self, exp_indices: torch.Tensor, *, caller_scatter: bool, info: torch.Tensor | None = None
    ) -> None:
        """Step 1; counts the slots with invalid expert ids into ``info`` (default :attr:`info`)."""
        ids = _nz(exp_indices)
        self._launch(
            ("layout", caller_scatter, ids.data_ptr() % 16 == 0),
            K._layout_kernel,
            self._layout_grid,
            4,
            ("ids_ptr", "n_tokens", "info_ptr"),
            (ids, exp_indices.shape[0], self.info if info is None else info),
            lambda: dict(
                pos_ptr=self.pos,
                table_ptr=self.ptr_table,
                state_ptr=self.state,
                off_cnt=self.layout.cnt,
                rank=self.rank,
                E=self.num_tot_experts,
                L=self.experts_per_rank,
                W=self.world_size,
                K=self.topk,
                BLOCK=self.scan_block,
                WRITE_POS=not caller_scatter,
                BAD_SLOT=self.info_len - 1,
                nprog=self._layout_grid[0],
            ),
        )

    def launch_counts(self, info: torch.Tensor | None = None) -> None:
        """Step 2 on its own (exact-shape mode): wait for the counts, write ``info`` (default
        :attr:`info`) and the receive offsets."""
        self._launch(
            ("counts",),
            K._counts_kernel,
            (1,),
            4,
            ("info_ptr",),
            (self.info if info is None else info,),
            lambda: dict(
                offs_ptr=self.offsets,
                table_ptr=self.ptr_table,
                state_ptr=self.state,
                off_cnt=self.layout.cnt,
                off_back=self.layout.back,
                rank=self.rank,
                timeout=self.timeout_arg,
                W=self.world_size,
                L=self.experts_per_rank,
                WP=self.wp,
                LP=self.lp,
                USE_TIMER=self.use_timer,
            ),
        )

    def launch_dispatch(
        self,
        x: torch.Tensor,
        exp_indices: torch.Tensor,
        weight: torch.Tensor | None,
        scatter_src: torch.Tensor,
        out: torch.Tensor,
        out_w: torch.Tensor,
        out_e: torch.Tensor,
        tab: torch.Tensor,
        skip: torch.Tensor,
        scat: torch.Tensor,
        *,
        caller_scatter: bool,
        info: torch.Tensor | None = None,
        counts: bool = False,
        send: bool = True,
        recv: bool = True,
    ) -> None:
        """Step 3. With ``counts=True`` step 2 runs inside this launch (program 0 builds the receive
        layout, the others wait for it): the launch after :meth:`launch_layout` in static mode."""
        has_w = weight is not None
        split = self.send_ctas
        w = _nz(weight) if weight is not None else self._dummy_w
        xs, ids, src = _nz(x), _nz(exp_indices), _nz(scatter_src)
        self._launch(
            (
                "dispatch",
                has_w,
                caller_scatter,
                send,
                recv,
                counts,
                split,
                out.dtype,
                *self._align(xs, ids, w, src),
            ),
            K._dispatch_kernel,
            (self.num_sm,),
            self.num_warps,
            (
                "x_ptr",
                "ids_ptr",
                "w_ptr",
                "pos_ptr",
                "n_tokens",
                "out_ptr",
                "out_w_ptr",
                "out_e_ptr",
                "tab_ptr",
                "skip_ptr",
                "scat_ptr",
                "info_ptr",
                "cap_rows",
            ),
            (
                xs,
                ids,
                w,
                src,
                x.shape[0],
                out,
                out_w,
                out_e,
                tab,
                skip,
                scat,
                self.info if info is None else info,
                out.shape[0],
            ),
            lambda: dict(
                offs_ptr=self.offsets,
                table_ptr=self.ptr_table,
                state_ptr=self.state,
                rank=self.rank,
                max_tokens=self.max_tokens,
                nchunks=self.layout.nchunks,
                timeout=self.timeout_arg,
                off_x=self.layout.x,
                off_ids=self.layout.ids,
                off_pos=self.layout.pos,
                off_w=self.layout.w,
                off_flag=self.layout.flag,
                off_back=self.layout.back,
                off_cnt=self.layout.cnt,
                W=self.world_size,
                L=self.experts_per_rank,
                K=self.topk,
                KP=self.kp,
                WP=self.wp,
                LP=self.lp,
                H=self.hidden,
                BH=self.block_h,
                CH=self.chunk,
                EVEN_H=self.hidden % self.block_h == 0,
                HAS_W=has_w,
                CALLER_SCATTER=caller_scatter,
                SEND=send,
                RECV=recv,
                LAG=1 if (send and recv and not split) else 0,
                COUNTS=counts,
                SPLIT=bool(split),
                SEND_LOCAL=not split,
                USE_TIMER=self.use_timer,
                G=self.num_sm,
                GS=max(split, 1),
            ),
        )

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
    ) -> None:
        width = y.shape[1]
        if width > self.hidden:
            raise ValueError(f"combine rows are at most hidden={self.hidden} wide, got {width}")
        ys, ids, outs = _nz(y), _nz(exp_indices), _nz(out)
        self._launch(
            ("combine", width, send, recv, self.combine_send_ctas, outs.dtype, *self._align(ys, ids, n_src)),
            K._combine_kernel,
            (self.num_sm,),
            self.num_warps,
            ("y_ptr", "tab_ptr", "ids_ptr", "nsrc_ptr", "n_tokens", "out_ptr"),
            (ys, tab, ids, n_src, exp_indices.shape[0], outs),
            lambda: self._combine_fixed(width, send, recv),
        )

    def _combine_fixed(self, width: int, send: bool, recv: bool) -> dict:
        # narrower rows (per-slot weight gradients: width 1) get a narrower tile
        bh = self.block_h if width == self.hidden else max(16, min(_next_pow2(width), self.block_h))
        return dict(
            table_ptr=self.ptr_table,
            state_ptr=self.state,
            rank=self.rank,
            max_tokens=self.max_tokens,
            nchunks=self.layout.nchunks,
            timeout=self.timeout_arg,
            off_cx=self.layout.cx,
            off_cflag=self.layout.cflag,
            W=self.world_size,
            L=self.experts_per_rank,
            K=self.topk,
            KP=self.kp,
            WP=self.wp,
            H=width,
            BH=bh,
            CH=self.chunk,
            EVEN_H=width % bh == 0,
            SEND=send,
            RECV=recv,
            LAG=1 if (send and recv and not self.combine_send_ctas) else 0,
            SPLIT=bool(self.combine_send_ctas),
            USE_TIMER=self.use_timer,
            G=self.num_sm,
            GS=max(self.combine_send_ctas, 1),
        )

    def launch_barrier(self, *, send: bool = True, recv: bool = True) -> None:
        self._launch(
            ("barrier", send, recv),
            K._barrier_kernel,
            (1,),
            1,
            (),
            (),
            lambda: dict(
                table_ptr=self.ptr_table,
                state_ptr=self.state,
                off_bar=self.layout.bar,
                rank=self.rank,
                timeout=self.timeout_arg,
                W=self.world_size,
                SEND=send,
                RECV=recv,
                USE_TIMER=self.use_timer,
            ),
        )

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

    def alloc_dispatch_outputs(
        self,
        n: int,
        rows: int,
        *,
        with_weights: bool,
        out: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        dev = self.device

        def buf(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            # at least one element underneath: an empty tensor may have no address to hand a kernel
            return torch.empty(max(1, shape[0]), *shape[1:], dtype=dtype, device=dev)[: shape[0]]

        return {
            "out": out if out is not None else buf(rows, self.hidden, dtype=dtype or self.token_dtype),
            "out_w": buf(rows if with_weights else 1, dtype=self.weight_dtype),
            "out_e": buf(rows, dtype=torch.int32),
            "tab": buf(self.world_size, self.max_tokens, self.topk, dtype=torch.int32),
            "skip": buf(n, self.topk, dtype=torch.int32),
            "scat": buf(n, self.topk, dtype=torch.int32),
        }

    def info_fields(self, info: torch.Tensor) -> dict[str, torch.Tensor]:
        W, L = self.world_size, self.experts_per_rank
        return {
            "total": info[0],
            "err": info[1],
            "n_src": info[2 : 2 + W],
            "rows_src": info[2 + W : 2 + 2 * W],
            "rows_exp": info[2 + 2 * W : 2 + 2 * W + L],
            "bad_ids": info[2 + 2 * W + L],
        }

    # ------------------------------------------------------------------ AOT
    def precompile(
        self, *, dtypes: tuple[torch.dtype, ...] = (), dispatch_counts: tuple[bool, ...] = (True, False)
    ) -> int:
        """Compile every kernel variant the layer uses, without launching. Returns the variant count.

        ``dtypes``: extra row dtypes of combine; ``dispatch_counts``: the dispatch kernel with the
        receive layout merged in (static mode, small exact calls) and/or without (large exact calls).
        """
        lay = self.layout
        i32, i64 = torch.int32, torch.int64
        common = dict(W=self.world_size, L=self.experts_per_rank)
        n = 0
        for ws in (True, False):
            K._layout_kernel.warmup(
                i32,
                i32,
                1,
                i64,
                i64,
                lay.cnt,
                self.rank,
                i64,
                grid=(1,),
                E=self.num_tot_experts,
                K=self.topk,
                BLOCK=self.scan_block,
                WRITE_POS=ws,
                BAD_SLOT=self.info_len - 1,
                nprog=1,
                num_warps=4,
                **common,
            )
            n += 1
        K._counts_kernel.warmup(
            i64,
            i64,
            i64,
            i64,
            lay.cnt,
            lay.back,
            self.rank,
            self.timeout_arg,
            grid=(1,),
            WP=self.wp,
            LP=self.lp,
            USE_TIMER=self.use_timer,
            num_warps=4,
            **common,
        )
        n += 1
        nw = self.num_warps
        for has_w, cs, counts in itertools.product((True, False), (False, True), dispatch_counts):
            K._dispatch_kernel.warmup(
                self.token_dtype,
                i32,
                self.weight_dtype,
                i32,
                1,
                self.token_dtype,
                self.weight_dtype,
                i32,
                i32,
                i32,
                i32,
                i64,
                i64,
                i64,
                i64,
                self.rank,
                self.max_tokens,
                lay.nchunks,
                1,
                self.timeout_arg,
                lay.x,
                lay.ids,
                lay.pos,
                lay.w,
                lay.flag,
                lay.back,
                lay.cnt,
                grid=(self.num_sm,),
                K=self.topk,
                KP=self.kp,
                WP=self.wp,
                LP=self.lp,
                H=self.hidden,
                BH=self.block_h,
                CH=self.chunk,
                EVEN_H=self.hidden % self.block_h == 0,
                HAS_W=has_w,
                CALLER_SCATTER=cs,
                SEND=True,
                RECV=True,
                LAG=0 if self.send_ctas else 1,
                COUNTS=counts,
                SPLIT=bool(self.send_ctas),
                SEND_LOCAL=not self.send_ctas,
                USE_TIMER=self.use_timer,
                G=self.num_sm,
                GS=max(self.send_ctas, 1),
                num_warps=nw,
                **common,
            )
            n += 1
        narrow = max(16, min(_next_pow2(1), self.block_h))
        combine_variants = [(dt, self.hidden, self.block_h) for dt in (self.token_dtype, *dtypes)]
        combine_variants.append((torch.float32, 1, narrow))  # per-slot weight gradients
        for dt, width, bh in combine_variants:
            K._combine_kernel.warmup(
                dt,
                i32,
                i32,
                i64,
                1,
                dt,
                i64,
                i64,
                self.rank,
                self.max_tokens,
                lay.nchunks,
                self.timeout_arg,
                lay.cx,
                lay.cflag,
                grid=(self.num_sm,),
                K=self.topk,
                KP=self.kp,
                WP=self.wp,
                H=width,
                BH=bh,
                CH=self.chunk,
                EVEN_H=width % bh == 0,
                SEND=True,
                RECV=True,
                LAG=0 if self.combine_send_ctas else 1,
                SPLIT=bool(self.combine_send_ctas),
                USE_TIMER=self.use_timer,
                G=self.num_sm,
                GS=max(self.combine_send_ctas, 1),
                num_warps=nw,
                **common,
            )
            n += 1
        K._barrier_kernel.warmup(
            i64,
            i64,
            lay.bar,
            self.rank,
            self.timeout_arg,
            grid=(1,),
            W=self.world_size,
            SEND=True,
            RECV=True,
            USE_TIMER=self.use_timer,
        )
        return n + 1
