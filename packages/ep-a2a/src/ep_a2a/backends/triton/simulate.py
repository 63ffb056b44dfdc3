"""Single-process simulation of several ranks over plain buffers (CPU tests under ``TRITON_INTERPRET=1``).

Every simulated rank gets a heap (a uint8 tensor), and all of them share one pointer table, so the
kernels write into "peer" heaps exactly as they do over NVLink. The interpreter runs one program at a
time, so a kernel that both sends and waits would wait for a rank that has not run yet: the simulation
launches the producing half of a step on every rank before the consuming half
(``send=True, recv=False`` then ``send=False, recv=True``); the GPU runs both halves in one launch.

``node_size``: ranks ``[k * node_size, (k + 1) * node_size)`` form simulated node ``k``; every other rank
is remote, reached only through :class:`SimTransport` (a put is a copy into the peer's heap, then the
signal word is set), exactly where the GPU path uses NVSHMEM put-with-signal. Each engine's pointer table
then points remote ranks at a decoy heap, which must stay untouched (:meth:`SimWorld.check_decoy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ep_a2a.backends.triton.engine import (
    DispatchBuffers,
    HeapLayout,
    QuantizeOnSend,
    TritonEPEngine,
    heap_row_bytes,
    pack_fp8_rows,
    unpack_fp8_rows,
)

_DECOY = 0x5A
_ENGINE_DEFAULTS: dict[str, Any] = {
    "token_dtype": torch.bfloat16,
    "weight_dtype": torch.float32,
    "num_sm": 2,
    "chunk": 4,
    "timeout_s": 1.0,
}


def _poison(bufs: DispatchBuffers) -> None:
    for buf in (bufs.tab, bufs.skip, bufs.scat, bufs.out, bufs.out_w, bufs.out_e):
        if buf is not None:
            buf.fill_(float("nan") if buf.is_floating_point() else -7)


class SimTransport:
    """Host puts between simulated ranks: a byte copy into the peer's heap, then its signal word."""

    def __init__(self, heaps: Sequence[torch.Tensor], src: int) -> None:
        self.heaps, self.src = heaps, src
        #: (kind, peer, nbytes) of every transfer, for the tests
        self.log: list[tuple[str, int, int]] = []

    def put_signal(self, pe: int, dst_off: int, src_off: int, nbytes: int, sig_off: int, value: int) -> None:
        self.heaps[pe][dst_off : dst_off + nbytes].copy_(self.heaps[self.src][src_off : src_off + nbytes])
        self.signal(pe, sig_off, value)
        self.log[-1] = ("put", pe, nbytes)

    def signal(self, pe: int, sig_off: int, value: int) -> None:
        self.heaps[pe][sig_off : sig_off + 8].view(torch.int64)[0] = value
        self.log.append(("signal", pe, 0))


@dataclass
class SimDispatch:
    """One simulated rank's dispatch result (exact shapes)."""

    output: Any  # [R, hidden]; an FP8 dispatch: (rows [R, hidden] float8_e4m3fn, scales [R, hidden / 128])
    weights: torch.Tensor | None  # [R]
    local_expert: torch.Tensor  # [R] int32
    num_recv_tokens_per_expert: torch.Tensor  # [L] int64
    num_recv_tokens_per_rank: torch.Tensor  # [W] int64
    num_input_tokens_per_rank: torch.Tensor  # [W] int64
    token_dst_scatter_idx: torch.Tensor  # [n, K] int32
    skipped_token_topk_mapping_indices: torch.Tensor  # [n, K] int32
    tab: torch.Tensor  # [W, T, K] int32
    num_invalid_ids: int  # slots of this rank with an expert id outside [-1, E) (dropped)
    remote: dict[str, torch.Tensor] | None = None  # the remote path's per-dispatch buffers
    npk_recv: list[int] | None = None  # records received from each remote source
    info: torch.Tensor | None = None  # [info_len] int64: the call's info (counts, error word, ...)
    mirror: torch.Tensor | None = None  # [info_len + 1] int64: the host copy program 0 wrote, if asked


class SimWorld:
    """``world_size`` engines over CPU heaps sharing one pointer table.

    Args:
        world_size: simulated ranks.
        device: where the heaps live (``"cpu"`` under the interpreter).
        node_size: ranks per simulated node (default: one node).
        engine: :class:`~ep_a2a.backends.triton.engine.TritonEPEngine`'s keyword arguments of the
            group's shape and tiles (``max_tokens``, ``hidden``, ``topk``, ``num_tot_experts`` needed;
            defaults: bfloat16 rows, float32 weights, 2 SMs, chunks of 4 tokens, 1 s timeouts).
    """

    def __init__(
        self, *, world_size: int, device: str = "cpu", node_size: int | None = None, **engine: Any
    ) -> None:
        node_size = node_size or world_size
        if world_size % node_size:
            raise ValueError(f"node_size {node_size} must divide world_size {world_size}")
        remote = node_size < world_size
        engine = {**_ENGINE_DEFAULTS, **engine}
        self.layout = HeapLayout.build(
            world_size=world_size,
            max_tokens=engine["max_tokens"],
            hidden=engine["hidden"],
            topk=engine["topk"],
            experts_per_rank=engine["num_tot_experts"] // world_size,
            token_bytes=engine["token_dtype"].itemsize,
            chunk=engine["chunk"],
            combine_chunk=engine.get("combine_chunk"),
            remote=remote,
            row_bytes=heap_row_bytes(engine["hidden"], engine["token_dtype"]),
        )
        self.heaps = [
            torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device) for _ in range(world_size)
        ]
        lay = self.layout
        for h in self.heaps:  # poison the data regions (flags, counts and signals must start at zero)
            h[lay.x : lay.cnt].fill_(0xFF)
            h[lay.cx : lay.cflag].fill_(0xFF)
            if remote:
                h[lay.scnt :].fill_(0xFF)
        self.table = torch.tensor([h.data_ptr() for h in self.heaps], dtype=torch.int64, device=device)
        self.remote_ranks = [
            [p for p in range(world_size) if p // node_size != r // node_size] for r in range(world_size)
        ]
        self.decoy = torch.full((self.layout.nbytes,), _DECOY, dtype=torch.uint8, device=device)
        self.transports = [SimTransport(self.heaps, r) for r in range(world_size)]
        tables = [self.table] * world_size
        if remote:  # remote ranks point at the decoy: the kernels must never touch them
            tables = [
                torch.tensor(
                    [
                        self.decoy.data_ptr() if p in self.remote_ranks[r] else h.data_ptr()
                        for p, h in enumerate(self.heaps)
                    ],
                    dtype=torch.int64,
                    device=device,
                )
                for r in range(world_size)
            ]
        self.engines = [
            TritonEPEngine(
                rank=r,
                world_size=world_size,
                heap_local=self.heaps[r],
                ptr_table=tables[r],
                layout=self.layout,
                remote_ranks=self.remote_ranks[r],
                transport=self.transports[r] if remote else None,
                peer_heaps=self.heaps,
                **engine,
            )
            for r in range(world_size)
        ]
        self.world_size = world_size
        self.remote = remote

    def check_decoy(self) -> None:
        """Raise if any kernel wrote through a remote rank's table entry."""
        bad = int((self.decoy != _DECOY).sum())
        if bad:
            raise AssertionError(f"{bad} byte(s) of the decoy heap written: a kernel addressed a remote rank")

    def dispatch(
        self,
        inputs: Sequence[torch.Tensor] | Sequence[tuple[torch.Tensor, torch.Tensor]],
        exp_indices: Sequence[torch.Tensor],
        weights: Sequence[torch.Tensor] | None = None,
        full_scatter_indices: Sequence[torch.Tensor] | None = None,
        *,
        skip_ranks: Sequence[int] = (),
        merged: bool = False,
        send_ctas: int = 0,
        steal: bool = False,
        whole: bool = False,
        speculative_rows: int | None = None,
        mirror: bool = False,
        quantize: bool = False,
    ) -> list[SimDispatch]:
        """Run one dispatch on every rank (ranks in ``skip_ranks`` never run: their peers time out).

        ``merged=False``: the exact-shape flow of large layers (layout, counts, exact buffers, rows);
        ``merged=True``: the receive layout inside the row kernel (static / CUDA-graph mode and the
        exact-shape flow of small layers), into worst-case buffers. ``send_ctas``: the engines'
        split of the row kernel's CTAs into senders and writers (0: every CTA does both); ``steal``:
        with the split, chunks claimed from shared counters (the interpreter runs one program at a
        time, so the first program of each half claims every chunk: this checks the claiming, the
        role switches and the counters' reset, not the balance). ``whole``: one launch that both sends
        and writes, as on a GPU (only on one rank, where nothing waits for a peer).
        ``speculative_rows`` (with ``merged=True``): the speculative exact-shape flow, outputs of that
        many rows instead of the worst case; a rank that receives more gets exact outputs and a second
        writing pass (``rewrite=True``), as the backend does. ``mirror`` (with ``merged=True``): the row
        kernel's program 0 also copies ``info`` into a host buffer (``SimDispatch.mirror``), as the
        backend's exact-shape flows without a host wait ask.

        ``inputs`` of FP8 rows in DeepEP's format, tuples ``(x_fp8, scales)``, travel packed as the
        backend sends them (:func:`~.engine.pack_fp8_rows`); each rank's ``output`` is then the tuple
        ``(rows, scales)`` of views the backend returns (:func:`~.engine.unpack_fp8_rows`).
        ``quantize=True``: ``inputs`` are bf16 / fp16 / fp32 rows that the row kernel quantizes to those
        packed rows as it sends them (:class:`~.engine.QuantizeOnSend`); ``output`` is the same tuple.
        """
        fp8 = quantize or isinstance(inputs[0], tuple)
        rows_in: list[Any] = [
            QuantizeOnSend(x) if quantize else pack_fp8_rows(*x) if isinstance(x, tuple) else x  # type: ignore[arg-type]
            for x in inputs
        ]
        self._check_flow(merged=merged, whole=whole, speculative=speculative_rows is not None or mirror)
        for eng in self.engines:  # (combine follows the dispatch's split)
            eng.send_ctas = eng.combine_send_ctas = send_ctas
            eng.steal = steal
        caller = full_scatter_indices is not None
        ranks = [r for r in range(self.world_size) if r not in skip_ranks]
        dev = self.heaps[0].device
        infos = {r: torch.full((self.engines[r].info_len,), -9, dtype=torch.int64, device=dev) for r in ranks}
        rbufs = {r: self.engines[r].alloc_remote() for r in ranks}
        for rb in rbufs.values():  # poison: every entry read must have been written
            for t in (rb or {}).values():
                t.fill_(-5)
        for r in ranks:
            self.engines[r].launch_layout(
                exp_indices[r], caller_scatter=caller, info=infos[r], remote=rbufs[r]
            )
        if not merged:
            for r in ranks:
                self.engines[r].launch_counts(infos[r], remote=rbufs[r])
        bufs: dict[int, DispatchBuffers] = {}
        for r in ranks:
            eng = self.engines[r]
            # (as the backend's exact-shape flow: the outputs of fixed size first, then those of R rows)
            bufs[r] = eng.alloc_dispatch_fixed(rows_in[r].shape[0])
            if speculative_rows is not None:  # (chosen before the counts are known)
                rows = speculative_rows
            elif merged:  # worst-case rows: the receive layout is only known inside the launch
                rows = eng.worst_case_rows()
            else:
                eng.check_error(int(infos[r][1]))
                rows = int(infos[r][0])
            bufs[r].out, bufs[r].out_w, bufs[r].out_e = eng.alloc_dispatch_rows(
                rows, with_weights=weights is not None, dtype=rows_in[r].dtype
            )
            _poison(bufs[r])  # every element read must have been written

        mirrors = {r: torch.zeros(self.engines[r].info_len + 1, dtype=torch.int64) for r in ranks}

        def rows_pass(r: int, send: bool, recv: bool, rewrite: bool = False) -> None:
            b = bufs[r]
            src = full_scatter_indices[r] if caller else self.engines[r].pos  # type: ignore[index]
            self.engines[r].launch_dispatch(
                rows_in[r],
                exp_indices[r],
                weights[r] if weights is not None else None,
                src,
                b,
                caller_scatter=caller,
                info=infos[r],
                counts=merged and not rewrite,
                send=send,
                recv=recv,
                rewrite=rewrite,
                mirror=mirrors[r] if (mirror and recv and not rewrite) else None,
                remote=rbufs[r],
                npk_send=self._npk(rbufs[r], 0),
            )

        for send, recv in ((True, True),) if whole else ((True, False), (False, True)):
            for r in ranks:
                rows_pass(r, send, recv)
        if speculative_rows is not None:
            for r in ranks:
                rows = int(infos[r][0])
                if rows > speculative_rows:
                    eng = self.engines[r]
                    b = bufs[r]
                    b.out, b.out_w, b.out_e = eng.alloc_dispatch_rows(
                        rows, with_weights=weights is not None, dtype=rows_in[r].dtype
                    )
                    # poison all of it: the second pass must rewrite the slot table and the scatter
                    # indices too (the first marked the rows past the outputs' end as absent)
                    _poison(b)
                    rows_pass(r, False, True, rewrite=True)
        with_w = weights is not None
        results = [
            self._result(
                r, bufs[r], infos[r], rbufs[r], mirrors[r] if mirror else None, fp8=fp8, with_w=with_w
            )
            for r in ranks
        ]
        self.check_decoy()
        return results

    def _check_flow(self, *, merged: bool, whole: bool, speculative: bool) -> None:
        """Raise ``ValueError`` for a flow this simulation cannot run (see :meth:`dispatch`)."""
        if whole and self.world_size != 1:
            raise ValueError(
                "whole=True (one launch per dispatch) needs world_size 1: peers would be waited for"
            )
        if self.remote and merged:
            raise ValueError("remote peers: only the unmerged flow (merged=False)")
        if speculative and not (merged and not whole and not self.remote):
            raise ValueError(
                "speculative_rows / mirror: variants of the merged flow (merged=True), local peers"
            )

    def _result(
        self,
        r: int,
        b: DispatchBuffers,
        info: torch.Tensor,
        rb: dict[str, torch.Tensor] | None,
        mirror: torch.Tensor | None,
        *,
        fp8: bool,
        with_w: bool,
    ) -> SimDispatch:
        """Rank ``r``'s dispatch result from its buffers and ``info``, after checking its error word."""
        eng = self.engines[r]
        assert b.out is not None
        assert b.out_w is not None
        assert b.out_e is not None
        eng.check_error(int(info[1]))
        eng.check_error()
        f = eng.info_fields(info)
        rows = int(f["total"])
        return SimDispatch(
            output=unpack_fp8_rows(b.out[:rows], eng.hidden) if fp8 else b.out[:rows],
            weights=b.out_w[:rows] if with_w else None,
            local_expert=b.out_e[:rows],
            num_recv_tokens_per_expert=f["rows_exp"].clone(),
            num_recv_tokens_per_rank=f["rows_src"].clone(),
            num_input_tokens_per_rank=f["n_src"].clone(),
            token_dst_scatter_idx=b.scat,
            skipped_token_topk_mapping_indices=b.skip,
            tab=b.tab,
            num_invalid_ids=int(f["bad_ids"]),
            remote=rb,
            npk_recv=self._npk(rb, 1),
            info=info,
            mirror=mirror,
        )

    def _npk(self, rb: dict[str, torch.Tensor] | None, half: int) -> list[int] | None:
        """Host copy of records sent to (``half=0``) / received from (``1``) each rank."""
        if rb is None:
            return None
        W = self.world_size
        return [int(v) for v in rb["pinfo"][half * W : (half + 1) * W]]

    def combine(
        self,
        expert_outputs: Sequence[torch.Tensor],
        dispatched: Sequence[SimDispatch],
        exp_indices: Sequence[torch.Tensor],
        *,
        skip_ranks: Sequence[int] = (),
    ) -> list[torch.Tensor]:
        """Run one combine on every rank; returns per rank ``[n, hidden]`` in the rows' dtype."""
        ranks = [r for r in range(self.world_size) if r not in skip_ranks]
        outs = {
            r: torch.full(
                (exp_indices[r].shape[0], expert_outputs[i].shape[1]),
                float("nan"),
                dtype=expert_outputs[i].dtype,
                device=self.heaps[0].device,  # (the heaps' device: a GPU in the one-GPU tests)
            )
            for i, r in enumerate(ranks)
        }
        for send, recv in ((True, False), (False, True)):
            for i, r in enumerate(ranks):
                d = dispatched[i]
                self.engines[r].launch_combine(
                    expert_outputs[i],
                    d.tab,
                    exp_indices[r],
                    d.num_input_tokens_per_rank,
                    outs[r],
                    send=send,
                    recv=recv,
                    remote=d.remote,
                    npk_recv=d.npk_recv,
                )
        for r in ranks:
            self.engines[r].check_error()
        self.check_decoy()
        return [outs[r] for r in ranks]

    def combine_per_slot(
        self,
        expert_outputs: Sequence[torch.Tensor],
        dispatched: Sequence[SimDispatch],
        exp_indices: Sequence[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Per-slot combine on every rank (``[n, K, C]``): one barrier and one combine per slot."""
        per_rank = [
            eng.per_slot_rows(y, d.tab, d.num_input_tokens_per_rank)
            for eng, y, d in zip(self.engines, expert_outputs, dispatched, strict=True)
        ]
        topk = self.engines[0].topk
        outs: list[list[torch.Tensor]] = [[] for _ in self.engines]
        for k in range(topk):
            for send, recv in ((True, False), (False, True)):
                for eng in self.engines:
                    eng.launch_barrier(send=send, recv=recv)
            rows_k = [per_rank[r][k] for r in range(self.world_size)]
            res = self.combine(rows_k, dispatched, exp_indices)
            for r in range(self.world_size):
                outs[r].append(res[r])
        return [torch.stack(o, dim=1) for o in outs]


class SimLowLatency:
    """``world_size`` low-latency engines (:mod:`.low_latency`) over heaps of one device sharing one
    pointer table: under the interpreter (CPU), or on one GPU (its buffers as the ranks' heaps).

    Each step launches the sending half on every rank before the receiving halves (the interpreter runs
    one program at a time); ``concurrent=True`` (a GPU) launches each rank's whole kernel on its own
    stream instead, all at once, as ranks on separate GPUs run them (``num_sm * world_size`` must not
    exceed the GPU's SMs: every CTA has to be resident).

    Args:
        world_size: simulated ranks.
        device: where the heaps live.
        engine: :class:`~.low_latency.LowLatencyEngine`'s shape arguments (``max_tokens``, ``hidden``,
            ``topk``, ``num_tot_experts``) and optionally ``token_dtype`` (sizes the receive slots;
            default bfloat16), ``weight_dtype``, ``num_sm`` (default 2), ``timeout_s`` (default 1 s).
    """

    def __init__(self, *, world_size: int, device: str = "cpu", **engine: Any) -> None:
        from ep_a2a.backends.triton.low_latency import LowLatencyEngine, LowLatencyLayout

        token_dtype = engine.pop("token_dtype", torch.bfloat16)
        engine.setdefault("weight_dtype", torch.float32)
        engine.setdefault("num_sm", 2)
        engine.setdefault("timeout_s", 1.0)
        self.layout = LowLatencyLayout.build(
            world_size=world_size, max_tokens=engine["max_tokens"], hidden=engine["hidden"],
            topk=engine["topk"], experts_per_rank=engine["num_tot_experts"] // world_size,
            row_bytes=heap_row_bytes(engine["hidden"], token_dtype),
            comb_bytes=4 if token_dtype.itemsize >= 4 else 2,
        )  # fmt: skip
        self.heaps = [
            torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device) for _ in range(world_size)
        ]
        for h in self.heaps:  # poison the data regions (the epoch words must start at zero)
            h[self.layout.x :].fill_(0xFF)
        self.table = torch.tensor([h.data_ptr() for h in self.heaps], dtype=torch.int64, device=device)
        self.engines = [
            LowLatencyEngine(
                rank=r,
                world_size=world_size,
                heap_local=self.heaps[r],
                ptr_table=self.table,
                layout=self.layout,
                **engine,
            )
            for r in range(world_size)
        ]
        self.world_size = world_size
        self._streams: list[Any] = []

    def _steps(self, ranks: Sequence[int], launch: Any, concurrent: bool) -> None:
        if not concurrent:
            for send, recv in ((True, False), (False, True)):
                for r in ranks:
                    launch(r, send, recv)
            return
        if not self._streams:
            self._streams = [torch.cuda.Stream(self.heaps[0].device) for _ in range(self.world_size)]
        main = torch.cuda.current_stream()
        for r in ranks:
            self._streams[r].wait_stream(main)
            with torch.cuda.stream(self._streams[r]):
                launch(r, True, True)
        for r in ranks:
            main.wait_stream(self._streams[r])

    def dispatch(
        self,
        inputs: Sequence[Any],
        exp_indices: Sequence[torch.Tensor],
        weights: Sequence[torch.Tensor] | None = None,
        *,
        quantize: bool = False,
        refuse: Sequence[int] = (),
        skip_ranks: Sequence[int] = (),
        concurrent: bool = False,
    ) -> list[Any]:
        """One dispatch on every rank (``inputs``: rows, FP8 tuples ``(x_fp8, scales)`` or, with
        ``quantize``, rows quantized on send); ranks in ``refuse`` run it refused (as for more tokens than
        ``max_tokens``), ranks in ``skip_ranks`` never run. Returns each running rank's
        :class:`~.low_latency.LowLatencyDispatch` (fixed-size buffers)."""
        rows_in = [
            QuantizeOnSend(x) if quantize else pack_fp8_rows(*x) if isinstance(x, tuple) else x
            for x in inputs
        ]
        ranks = [r for r in range(self.world_size) if r not in skip_ranks]
        res: dict[int, Any] = {}

        def launch(r: int, send: bool, recv: bool) -> None:
            w = weights[r] if weights is not None else None
            res[r] = self.engines[r].dispatch(
                rows_in[r], exp_indices[r], w, refuse=r in refuse, send=send, recv=recv
            )

        self._steps(ranks, launch, concurrent)
        return [res[r] for r in ranks]

    def combine(
        self,
        expert_outputs: Sequence[torch.Tensor],
        dispatched: Sequence[Any],
        *,
        skip_ranks: Sequence[int] = (),
        concurrent: bool = False,
    ) -> list[torch.Tensor]:
        """One combine on every running rank (``expert_outputs`` and ``dispatched`` of those ranks, in
        order); returns per rank ``[n, hidden]``."""
        ranks = [r for r in range(self.world_size) if r not in skip_ranks]
        outs: dict[int, torch.Tensor] = {}
        for i, r in enumerate(ranks):
            d = dispatched[i]
            outs[r] = torch.full(
                (d.exp_indices.shape[0], self.engines[r].hidden), float("nan"), dtype=expert_outputs[i].dtype,
                device=self.heaps[0].device,
            )  # fmt: skip

        def launch(r: int, send: bool, recv: bool) -> None:
            i = ranks.index(r)
            self.engines[r].combine(expert_outputs[i], dispatched[i], out=outs[r], send=send, recv=recv)

        self._steps(ranks, launch, concurrent)
        return [outs[r] for r in ranks]
