"""The engine's cached launch path passes exactly the arguments Triton's own launch path would.

After the first launch of a kernel variant the engine calls the compiled kernel directly with a stored
argument list in which only the per-call arguments are replaced (see ``TritonEPEngine._launch``). The
GPU runs only that path, the CPU simulation only Triton's; this test runs both on fake kernels (no GPU,
no interpreter) and compares the arguments, call by call, for every launch the backend makes.
"""

from __future__ import annotations

import collections
import inspect
import weakref
from types import SimpleNamespace

import pytest
import torch
import triton

import ep_a2a.backends.triton.engine as engine_mod
from ep_a2a.backends.triton import kernels as K
from ep_a2a.backends.triton.engine import (
    DispatchBuffers,
    HeapLayout,
    KernelLaunch,
    TritonEPEngine,
    heap_row_bytes,
)


class _FakeCompiled:
    def __init__(self, log: list) -> None:
        self.log = log

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.log.append(("fast", grid, list(args)))

        return runner


class _FakeKernel:
    """Records Triton-style launches (keyword arguments) and hands back a fake compiled kernel; files each
    launch's options (the keywords that are no kernel argument, in the order given) in ``options``."""

    def __init__(self, real, log: list, options: list | None = None) -> None:
        self.name, self.arg_names = real.fn.__name__, real.arg_names
        self.log = log
        self.options = options if options is not None else []
        # (arguments left out take their defaults, as Triton's binder does)
        params = inspect.signature(real.fn).parameters.values()
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def __getitem__(self, grid):
        def launch(**named):
            opts = {k: named.pop(k) for k in list(named) if k not in self.arg_names}
            assert "num_warps" in opts
            self.options.append((self.name, opts))
            named = {**self.defaults, **named}
            self.log.append(("triton", grid, [named[n] for n in self.arg_names]))
            return _FakeCompiled(self.log)

        return launch


#: every kernel the engine launches
KERNELS = (
    "_layout_kernel",
    "_counts_kernel",
    "_dispatch_kernel",
    "_combine_kernel",
    "_barrier_kernel",
    "_pack_kernel",
    "_remote_expand_kernel",
)


@pytest.fixture
def fake_gpu(monkeypatch):
    log: list = []
    monkeypatch.setattr(engine_mod, "interpreting", lambda: False)
    monkeypatch.setattr(engine_mod, "_raw_stream", lambda index: 0)
    for name in KERNELS:
        monkeypatch.setattr(K, name, _FakeKernel(getattr(K, name), log))
    return log


class _NoTransport:
    """Host puts that do nothing (no kernel runs here)."""

    def put_signal(self, *args: int) -> None:
        pass

    def signal(self, *args: int) -> None:
        pass


def _engine(
    world=2, max_tokens=8, hidden=64, topk=4, experts=8, remote=False, token_dtype=torch.bfloat16, **kw
) -> TritonEPEngine:
    lay = HeapLayout.build(
        world_size=world,
        max_tokens=max_tokens,
        hidden=hidden,
        topk=topk,
        experts_per_rank=experts // world,
        token_bytes=token_dtype.itemsize,
        chunk=4,
        remote=remote,
        row_bytes=heap_row_bytes(hidden, token_dtype),
    )
    # (with remote=True rank 1's one peer is remote)
    return TritonEPEngine(
        rank=1, world_size=world, max_tokens=max_tokens, hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=token_dtype, weight_dtype=torch.float32, heap_local=torch.zeros(lay.nbytes, dtype=torch.uint8),
        ptr_table=torch.zeros(world, dtype=torch.int64), layout=lay, num_sm=3, timeout_s=1.0, chunk=4,
        remote_ranks=[0] if remote else (), transport=_NoTransport() if remote else None, **kw,
    )  # fmt: skip


def _one_call(eng: TritonEPEngine, n: int, rows: int, *, with_w: bool, counts: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, eng.hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, eng.num_tot_experts, (n, eng.topk), generator=gen, dtype=torch.int32)
    w = torch.rand(n, eng.topk, generator=gen) if with_w else None
    b = eng.alloc_dispatch_outputs(n, rows, with_weights=with_w)
    for t in (b.tab, b.skip, b.scat, b.out, b.out_w, b.out_e):  # defined contents: compared by value
        t.zero_()
    info = torch.zeros(eng.info_len, dtype=torch.int64)
    rb = eng.alloc_remote()
    for t in (rb or {}).values():
        t.zero_()
    npk = [3] * eng.world_size if rb is not None else None
    eng.launch_layout(ids, caller_scatter=False, remote=rb)
    if not counts:
        eng.launch_counts(info, remote=rb)
    eng.launch_dispatch(
        x, ids, w, eng.pos, b, caller_scatter=False, info=info, counts=counts, remote=rb, npk_send=npk
    )
    y = torch.randn(rows, eng.hidden, generator=gen)
    out = torch.zeros(n, eng.hidden)
    eng.launch_combine(y, b.tab, ids, info[2 : 2 + eng.world_size], out, remote=rb, npk_recv=npk)
    eng.launch_barrier()


@pytest.mark.parametrize(
    ("with_w", "counts", "remote"),
    [(True, False, False), (False, True, False), (True, False, True)],
    ids=["w-counts", "noW-merged", "remote-peer"],
)
def test_cached_launch_passes_the_same_arguments(fake_gpu, with_w, counts, remote):
    log = fake_gpu
    cached = _engine(remote=remote)
    calls = [(6, 20, 1), (5, 17, 2), (8, 30, 3)]
    for n, rows, seed in calls:
        _one_call(cached, n, rows, with_w=with_w, counts=counts, seed=seed)
    kinds = [k for k, _, _ in log]
    per_call = len(kinds) // len(calls)
    assert kinds[:per_call] == ["triton"] * per_call, "the first call of each variant goes through Triton"
    assert kinds[per_call:] == ["fast"] * (len(kinds) - per_call), "later calls take the cached path"
    got = log[per_call:]
    # the reference: a fresh engine (no cached variants) launching the same calls through Triton
    log.clear()
    for n, rows, seed in calls[1:]:
        _one_call(_engine(remote=remote), n, rows, with_w=with_w, counts=counts, seed=seed)
    want = log
    assert len(got) == len(want)
    for (_, grid_g, args_g), (_, grid_w, args_w) in zip(got, want, strict=True):
        assert grid_g == (*grid_w, 1, 1)[:3]
        assert len(args_g) == len(args_w)
        for a, b in zip(args_g, args_w, strict=True):
            if isinstance(a, torch.Tensor):
                # same shapes, dtypes and contents (fresh engines own equal but different buffers)
                assert isinstance(b, torch.Tensor)
                assert (a.dtype, a.shape) == (b.dtype, b.shape)
                assert torch.equal(a, b)
            else:
                assert a == b


def test_new_variant_goes_through_triton(fake_gpu):
    """A changed specialisation (caller tensor misaligned, other dtype, weights dropped) is a new variant."""
    log = fake_gpu
    eng = _engine()
    _one_call(eng, 6, 20, with_w=True, counts=False, seed=1)
    log.clear()
    _one_call(eng, 6, 20, with_w=False, counts=False, seed=1)
    kinds = {(k, len(a)) for k, _, a in log}
    assert ("triton", len(K._dispatch_kernel.arg_names)) in kinds
    log.clear()
    ids = torch.zeros(1, eng.topk * 4 + 1, dtype=torch.int32)[:, 1:].reshape(4, eng.topk)  # 4-byte offset
    eng.launch_layout(ids, caller_scatter=False)
    assert log[-1][0] == "triton"
    eng.launch_layout(ids.clone(), caller_scatter=False)
    assert log[-1][0] == "fast"  # aligned again: cached by the first calls
    eng.launch_layout(ids, caller_scatter=False)
    assert log[-1][0] == "fast"  # the misaligned variant is cached now too


def test_cached_template_holds_no_call_tensors(fake_gpu):
    eng = _engine()
    _one_call(eng, 6, 20, with_w=True, counts=True, seed=1)
    for plan in eng._plans.values():
        assert all(plan.template[i] is None for i in plan.var_idx)


def test_cta_split_requests():
    """No split unless asked; a request must leave both roles at least one CTA."""
    from ep_a2a.backends.triton.resolve import _split

    assert _split(None, 132) == 0
    assert _split(0, 132) == 0
    assert _split(44, 132) == 44
    with pytest.raises(ValueError, match="num_sm=4"):
        _split(4, 4)


def test_engine_rejects_bad_split():
    with pytest.raises(ValueError, match="combine_send_ctas must be 0 or in"):
        TritonEPEngine(
            rank=0,
            world_size=2,
            max_tokens=4,
            hidden=16,
            topk=2,
            num_tot_experts=4,
            token_dtype=torch.bfloat16,
            weight_dtype=torch.float32,
            heap_local=torch.zeros(1, dtype=torch.uint8),
            ptr_table=torch.zeros(2, dtype=torch.int64),
            layout=HeapLayout.build(
                world_size=2, max_tokens=4, hidden=16, topk=2, experts_per_rank=2, token_bytes=2, chunk=4
            ),
            num_sm=2,
            timeout_s=1.0,
            combine_send_ctas=2,
        )


@pytest.mark.parametrize(
    ("num_sm", "max_tokens", "want"),
    [
        pytest.param(132, 4096, (44, 66), id="sm132-T4096-split"),
        pytest.param(64, 2048, (21, 32), id="sm64-T2048-split"),
        pytest.param(32, 4096, (0, 0), id="sm32-T4096-off"),
        pytest.param(132, 1024, (0, 0), id="sm132-T1024-off"),
    ],
)
def test_default_split(num_sm, max_tokens, want):
    """The sender / writer split is on by default only for large layers on many SMs."""
    from ep_a2a.backends.triton.resolve import _default_split, _split

    got = tuple(_split(None, num_sm, _default_split(num_sm, max_tokens, f)) for f in (3, 2))
    assert got == want
    assert _split(0, num_sm, 44) == 0  # an explicit 0 turns the split off
    with pytest.raises(ValueError, match="send_ctas"):
        _split(num_sm, num_sm)


@pytest.mark.parametrize(
    ("hidden", "max_tokens", "num_sm", "want_dispatch", "want_combine"),
    [
        pytest.param(7168, 4096, 32, (32, 16, 512), (8, 16, None), id="H7168-T4096-sm32"),
        pytest.param(7168, 4096, 64, (16, 16, 1024), (8, 16, None), id="H7168-T4096-sm64"),
        pytest.param(7168, 4096, 96, (8, 16, 1024), (8, 16, None), id="H7168-T4096-sm96"),
        pytest.param(7168, 4096, 132, (8, 16, 1024), (8, 16, None), id="H7168-T4096-sm132"),
        pytest.param(2048, 4096, 32, (32, 16, 512), (8, 16, None), id="H2048-T4096-sm32"),
        pytest.param(2048, 4096, 132, (16, 16, 1024), (8, 16, None), id="H2048-T4096-sm132"),
        pytest.param(4096, 4096, 132, (8, 16, 1024), (8, 16, None), id="H4096-T4096-sm132"),
        pytest.param(7168, 128, 32, (1, None, None), (None, None, None), id="H7168-T128-sm32"),
        pytest.param(7168, 1024, 132, (2, None, None), (None, None, None), id="H7168-T1024-sm132"),
        pytest.param(512, 4096, 32, (16, None, None), (None, None, None), id="H512-T4096-sm32"),
    ],
)
def test_default_tiles(hidden, max_tokens, num_sm, want_dispatch, want_combine):
    """Tuned tiles for large layers, by SM count; elsewhere the engine's own."""
    from ep_a2a.backends.triton.resolve import _default_tiles

    d, c = _default_tiles(hidden, max_tokens, num_sm)
    assert (d["chunk"], d["num_warps"], d["block_h"]) == want_dispatch
    assert (c["chunk"], c["num_warps"], c["block_h"]) == want_combine


class _WarmupRecorder:
    """Stands in for a kernel's ``warmup``: binds the call to the kernel's signature like Triton does; files
    each warmup's options (the keywords that are no kernel argument, in the order given) in ``options``."""

    def __init__(self, real, log: list, options: list | None = None) -> None:
        self.real, self.log = real, log
        self.options = options if options is not None else []

    def warmup(self, *args, grid, **kwargs):
        opts = {k: kwargs.pop(k) for k in list(kwargs) if k not in self.real.arg_names}
        self.options.append((self.real.fn.__name__, opts))
        if opts.get("maxnreg") is not None:
            self.log.append(("maxnreg", self.real.fn.__name__, opts["maxnreg"]))
        # Triton turns dtypes into mock tensors only when they come positionally; a dtype by keyword
        # fails on the GPU ("failed to specialize argument of type: torch.dtype")
        by_kw = [k for k, v in kwargs.items() if isinstance(v, torch.dtype)]
        assert not by_kw, f"{self.real.fn.__name__}: dtype passed by keyword for {by_kw}"
        bound = inspect.signature(self.real.fn).bind(*args, **kwargs)  # every parameter, once
        self.log.append(self.real.fn.__name__)
        return bound


def test_combine_maxnreg_reaches_the_compiler(monkeypatch):
    """``combine_maxnreg``: the combine kernel's warmups (and only its) get the register limit, which
    Triton compiles into ``.maxnreg``; out-of-range values are refused."""
    log: list = []
    for name in KERNELS:
        monkeypatch.setattr(K, name, _WarmupRecorder(getattr(K, name), log))
    eng = _engine(combine_maxnreg=128)
    eng.precompile()
    limits = [e for e in log if isinstance(e, tuple)]
    assert limits
    assert set(limits) == {("maxnreg", "_combine_kernel", 128)}
    assert len(limits) == log.count("_combine_kernel")
    with pytest.raises(ValueError, match="combine_maxnreg must be in"):
        _engine(combine_maxnreg=8)


@pytest.mark.parametrize("remote", [False, True], ids=["intra-node", "remote-peer"])
def test_precompile_binds_every_kernel(monkeypatch, remote):
    """``use_aot``: every warmup call binds to its kernel's parameters, pointers given as Triton wants."""
    log: list = []
    for name in KERNELS:
        monkeypatch.setattr(K, name, _WarmupRecorder(getattr(K, name), log))
    eng = _engine(remote=remote)
    n = eng.precompile(dtypes=(torch.float32,))
    assert n == len(log)  # (no register limit by default: no extra entries)
    assert ("_pack_kernel" in log) == remote
    assert ("_remote_expand_kernel" in log) == remote
    # the speculative flow's rewriting pass: one more row-kernel variant per (weights, caller scatter)
    rows_before = log.count("_dispatch_kernel")
    log.clear()
    n = eng.precompile(dtypes=(torch.float32,), rewrite=True, mirror=True)
    assert n == len(log)
    # ... and the merged variant that copies info to the host mirror: one more again
    assert log.count("_dispatch_kernel") == rows_before + (0 if remote else 8)


def _ll_engine():
    """Rank 1 of 2 of a small low-latency engine on a CPU heap."""
    from ep_a2a.backends.triton.low_latency import LowLatencyEngine, LowLatencyLayout

    lay = LowLatencyLayout.build(
        world_size=2, max_tokens=8, hidden=64, topk=4, experts_per_rank=4,
        row_bytes=heap_row_bytes(64, torch.bfloat16), comb_bytes=2,
    )  # fmt: skip
    return LowLatencyEngine(
        rank=1, world_size=2, max_tokens=8, hidden=64, topk=4, num_tot_experts=8, weight_dtype=torch.float32,
        heap_local=torch.zeros(lay.nbytes, dtype=torch.uint8), ptr_table=torch.zeros(2, dtype=torch.int64),
        layout=lay, num_sm=3, timeout_s=1.0,
    )  # fmt: skip


@pytest.mark.parametrize("interpret", [False, True], ids=["compiled", "interpreter"])
def test_every_launch_and_warmup_asks_for_fp_fusion(monkeypatch, interpret):
    """Every launch through Triton and every ahead-of-time compile (``use_aot``) of both engines passes
    ``enable_fp_fusion=True`` (the kernels compile with fused multiply-add whatever Triton's default;
    Triton 3.9 warns on a compile without it), and a launch gives a kernel the options of one of its
    warmups in the same order (Triton's JIT cache keys the compiled kernel by them)."""
    import ep_a2a.backends.triton.low_latency as ll_mod

    monkeypatch.setattr(engine_mod, "interpreting", lambda: interpret)
    monkeypatch.setattr(ll_mod, "interpreting", lambda: interpret)
    monkeypatch.setattr(engine_mod, "_raw_stream", lambda index: 0)
    kernels = [(K, name) for name in KERNELS] + [
        (ll_mod, "_ll_dispatch_kernel"),
        (ll_mod, "_ll_combine_kernel"),
    ]
    real = {name: getattr(mod, name) for mod, name in kernels}
    log: list = []
    launched: list = []
    for mod, name in kernels:
        monkeypatch.setattr(mod, name, _FakeKernel(real[name], log, launched))
    for remote in (False, True):
        eng = _engine(remote=remote, combine_maxnreg=128)
        eng.pdl = True  # (off on a CPU: the row kernel's launch option as on sm_90)
        for with_w, counts in ((True, False), (False, True)):
            if not (remote and counts):
                _one_call(eng, 6, 20, with_w=with_w, counts=counts, seed=1)
    ll = _ll_engine()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (5, 4), generator=gen, dtype=torch.int32)
    d = ll.dispatch(
        torch.randn(5, 64, generator=gen).to(torch.bfloat16), ids, torch.rand(5, 4, generator=gen)
    )
    ll.combine(torch.zeros(d.output.shape[0], 64, dtype=torch.bfloat16), d)
    assert {name for name, _ in launched} == {name for _, name in kernels}
    assert all(opts.get("enable_fp_fusion") is True for _, opts in launched), launched
    if interpret:
        assert ll.precompile() == 0  # (nothing to compile under the interpreter)
        return
    warmed: list = []
    for mod, name in kernels:
        monkeypatch.setattr(mod, name, _WarmupRecorder(real[name], [], warmed))
    for remote in (False, True):
        eng = _engine(remote=remote, combine_maxnreg=128)
        eng.pdl = True
        eng.precompile(dtypes=(torch.float32,), rewrite=True, mirror=True)
    assert ll.precompile() > 0
    assert {name for name, _ in warmed} == {name for _, name in kernels}
    assert all(opts.get("enable_fp_fusion") is True for _, opts in warmed), warmed
    options = lambda calls: {(name, tuple(opts.items())) for name, opts in calls}
    assert options(launched) <= options(warmed)


@pytest.mark.parametrize("threads", [1, 3])
def test_compile_all_runs_each_compile_once_in_the_pool(threads):
    """``use_aot``'s parallel compiles go through Triton's ``AsyncCompileMode``: every warmup runs once
    on the calling thread, each compile it hands over runs once (in the pool when ``threads`` > 1), and
    every compiled kernel is filed before ``compile_all`` returns."""
    import threading

    from triton.runtime import _async_compile

    submit_params = inspect.signature(_async_compile.AsyncCompileMode.submit).parameters
    compiled, filed, callers = [], [], []

    def warmup(i):
        callers.append(threading.current_thread() is threading.main_thread())
        mode = _async_compile.active_mode.get()

        def compile_fn():
            compiled.append((i, threading.current_thread().name))
            return f"kernel-{i}"

        if mode is None:
            filed.append(compile_fn())
        else:
            # newer Triton's JIT also hands over a cleanup for failed compiles
            cleanup = (lambda future_kernel: None,) if "cleanup_fn" in submit_params else ()
            mode.submit(("key", i), compile_fn, filed.append, *cleanup)

    engine_mod.compile_all([lambda i=i: warmup(i) for i in range(5)], threads)
    assert callers == [True] * 5
    assert sorted(i for i, _ in compiled) == list(range(5))
    assert sorted(filed) == [f"kernel-{i}" for i in range(5)]
    in_pool = {name.startswith("ep-a2a-compile") for _, name in compiled}
    assert in_pool == {threads > 1}
    assert _async_compile.active_mode.get() is None


def test_compile_threads_share_the_cpus_between_local_ranks(monkeypatch):
    monkeypatch.setattr(engine_mod.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert engine_mod.compile_threads(1) == engine_mod.MAX_COMPILE_THREADS
    assert engine_mod.compile_threads(4) == 4
    assert engine_mod.compile_threads(8) == 2
    assert engine_mod.compile_threads(32) == 1


def test_speculative_rows_fit_and_overflow():
    """The speculative flow's host step after the counts (no GPU: a recording engine): rows that fit
    keep the outputs; more rows get exact outputs and a rewriting pass (``send=False``,
    ``rewrite=True``) into them. The outputs' size: the most rows of the last calls plus an eighth."""
    from ep_a2a.backends.triton import TritonBackend
    from ep_a2a.backends.triton.backend import SPECULATIVE_WINDOW, _Call, _speculative_rows_guess

    launches: list[dict] = []

    class Engine:
        def alloc_dispatch_rows(self, rows, *, with_weights, dtype=None):
            return torch.empty(rows, 4), torch.empty(rows), torch.empty(rows)

        def launch_dispatch(self, *args, **kw):
            launches.append({"rows": args[4].out.shape[0], **kw})

    be = object.__new__(TritonBackend)
    be.engine = Engine()
    be.speculative_overflows = 0
    x, ids, src, info = torch.zeros(2, 4), torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(8)

    def fit(rows: int, ahead: int) -> DispatchBuffers:
        bufs = DispatchBuffers(
            tab=torch.empty(2, 2, 8), skip=torch.empty(2, 8), scat=torch.empty(2, 8),
            out=torch.empty(ahead, 4), out_w=torch.empty(ahead), out_e=torch.empty(ahead),
        )  # fmt: skip
        be._fit_speculative_rows(rows, _Call(x, ids, None, None, src), info, bufs)
        return bufs

    for rows in (100, 40, 0):  # fit: the outputs stay, nothing more runs
        assert fit(rows, 100).out.shape[0] == 100
    assert not launches
    assert be.speculative_overflows == 0
    bufs = fit(130, 100)  # outgrows them: exact outputs and a rewriting pass into them
    assert bufs.out.shape[0] == 130
    assert be.speculative_overflows == 1
    assert launches == [{"rows": 130, "caller_scatter": False, "info": info, "send": False, "rewrite": True}]
    # sizes: the window's maximum (a small call does not shrink them), an eighth above, at most the
    # worst case; a call older than the window no longer counts
    recent: collections.deque[int] = collections.deque(maxlen=SPECULATIVE_WINDOW)
    for rows in (800, 40, 0, 120):
        recent.append(rows)
    assert _speculative_rows_guess(recent, 10_000) == 900
    assert _speculative_rows_guess(recent, 850) == 850
    for _ in range(SPECULATIVE_WINDOW - 3):
        recent.append(64)
    assert _speculative_rows_guess(recent, 10_000) == 120 + 120 // 8


@pytest.mark.parametrize(
    "hold",
    [
        "tab", "n_src", "rows_exp", "skip", "scat", "info", "slice_of_out_e", "view_of_scat", "slice_of_out_w",
        "state", "n_in_host", "slice_of_n_recv_host",
    ],
)  # fmt: skip
def test_workspace_reused_only_when_nothing_refers_to_it(hold):
    """A dispatch's outputs but the rows come from a per-stream ring of workspaces: a workspace is handed
    out again only once nothing refers to it (no reference to a view it handed out, no other view of
    its buffer); while anything does, the next call gets another one."""
    from ep_a2a.backends.triton.workspace import WorkspaceRing

    ring = WorkspaceRing(_engine(), None, lambda ws: SimpleNamespace(tab=ws.tab))
    ws = ring.take(7, 4)
    assert (ws.skip.shape, ws.scat.shape, ws.tab.shape) == ((4, 4), (4, 4), (2, 8, 4))
    assert ring.take(7, 4) is ws, "nothing refers to it: the same workspace again"
    held = {
        "tab": lambda: ws.tab, "n_src": lambda: ws.n_src, "rows_exp": lambda: ws.rows_exp, "skip": lambda: ws.skip,
        "scat": lambda: ws.scat, "info": lambda: ws.info, "slice_of_out_e": lambda: ws.out_e[:3],
        "view_of_scat": lambda: ws.scat.view(-1), "slice_of_out_w": lambda: ws.out_w[1:2], "state": lambda: ws.state,
        "n_in_host": lambda: ws.n_in_host, "slice_of_n_recv_host": lambda: ws.n_recv_host[1:],
    }[hold]()  # fmt: skip
    other = ring.take(7, 4)
    assert other is not ws, f"{hold} is held: another workspace"
    assert other.tab.data_ptr() != ws.tab.data_ptr()
    assert ring.take(7, 4) is other, "the other one is free"
    del held
    assert ring.take(7, 4) is ws, "released: the first workspace again"
    assert ring.allocated == 2


def test_workspace_ring_per_stream_and_bounded(monkeypatch):
    """One ring per stream; a ring keeps at most RING_SIZE workspaces (more held at once are allocated
    per call); views follow the call's token count; without the storage use count nothing is reused."""
    from ep_a2a.backends.triton import workspace as WS

    ring = WS.WorkspaceRing(_engine())
    ws = ring.take(7, 4)
    assert ring.take(8, 4) is not ws, "another stream: its own ring"
    assert ring.take(7, 3) is ws
    assert ws.skip.shape == (3, 4)
    assert ws.scat.shape == (3, 4)
    held = [ring.take(7, 2).skip for _ in range(WS.RING_SIZE + 2)]  # the caller keeps each call's skip
    assert len({t.data_ptr() for t in held}) == WS.RING_SIZE + 2
    assert len(ring._rings[7]) == WS.RING_SIZE
    del held
    assert ring.take(7, 2) is ws
    monkeypatch.setattr(WS, "_storage_use_count", None)
    ring = WS.WorkspaceRing(_engine())
    first = ring.take(7, 4)
    assert ring.take(7, 4) is not first
    assert not ring._rings[7]


@pytest.mark.parametrize("hold", ["out_rows", "w_rows", "e_rows", "view_of_out_rows", "whole_out"])
def test_workspace_rows_and_their_views(hold):
    """A workspace with rows holds them in its buffer; the views of a call's first R rows are kept for
    the next call of R rows (the same tensors) and replaced for another R, and a workspace whose rows
    or views are held, as they are or through a view, is not handed out again."""
    from ep_a2a.backends.triton.workspace import WorkspaceRing

    eng = _engine()
    ring = WorkspaceRing(eng, (torch.bfloat16, eng.hidden, eng.worst_case_rows()))
    ws = ring.take(7, 4)
    assert ws.out is not None
    assert ws.out.shape == (eng.worst_case_rows(), eng.hidden)
    assert ws.out.untyped_storage().data_ptr() == ws.tab.untyped_storage().data_ptr(), "one buffer"
    w_rows, e_rows, out_rows = ws.first_rows(5)
    assert (w_rows.shape, e_rows.shape, out_rows.shape) == ((5,), (5,), (5, eng.hidden))
    assert ws.first_rows(5)[2] is out_rows, "the same R: the same views"
    del w_rows, e_rows, out_rows
    assert ring.take(7, 4) is ws
    assert ws.first_rows(3)[0].shape == (3,), "another R: new views"
    assert ring.take(7, 4) is ws
    w_rows, e_rows, out_rows = ws.first_rows(6)
    assert out_rows is not None
    held = {"out_rows": out_rows, "w_rows": w_rows, "e_rows": e_rows}.get(hold)
    if hold == "view_of_out_rows":
        held = out_rows[1:]
    elif hold == "whole_out":
        held = ws.out[:2]
    del w_rows, e_rows, out_rows
    assert ring.take(7, 4) is not ws, f"{hold} is held: another workspace"
    del held
    assert ring.take(7, 4) is ws
    w_rows = ws.first_rows(6)[0]
    w_rows.requires_grad_()  # (as autograd marks a function's outputs)
    del w_rows
    assert ring.take(7, 4) is ws
    assert not ws.first_rows(6)[0].requires_grad, "a view that requires grad is replaced"
    assert WorkspaceRing(eng).take(7, 4).out is None
    assert WorkspaceRing(eng).take(7, 4).first_rows(2)[2] is None


@pytest.mark.parametrize("hold", ["slice", "view_of_slice", "storage", "none"])
def test_workspace_keeps_rows_until_they_are_replaced(hold):
    """A workspace without rows keeps the rows allocated for its call: they serve a later call that would
    allocate between three quarters of them and all of them, once nothing else refers to their memory
    (a handed-out slice, a view of it, their storage); rows kept in their place replace them."""
    from ep_a2a.backends.triton.workspace import WorkspaceRing

    eng = _engine()
    ring = WorkspaceRing(eng)
    ws = ring.take(7, 4)
    assert (ws.kept, ws.spare_rows(1)) == (None, None), "nothing kept yet"
    rows = ws.keep_rows(torch.empty(40, eng.hidden, dtype=torch.bfloat16))
    assert (ws.kept, ws.kept_rows) == (rows, 40)
    assert ws.spare_rows(40) is rows
    assert ws.spare_rows(30) is rows, "a quarter unused"
    assert ws.spare_rows(29) is None, "more than a quarter unused"
    assert ws.spare_rows(41) is None, "too few rows"
    handed = rows[:35]
    views = {"slice": handed, "view_of_slice": handed[2:].view(-1), "storage": handed.untyped_storage()}
    held = views.get(hold)
    del handed, rows, views
    assert ring.take(7, 4) is ws, "the rows are not the workspace's buffer"
    if hold != "none":
        assert ws.spare_rows(40) is None, f"{hold} is held: not written again"
        del held
    assert ws.spare_rows(40) is not None
    other = ws.keep_rows(torch.empty(80, eng.hidden, dtype=torch.bfloat16))
    assert (ws.spare_rows(80), ws.kept_rows) == (other, 80), "the new rows replace the kept ones"


@pytest.mark.parametrize("hold", ["output", "view", "none"])
def test_combine_outputs_reused_only_when_nothing_refers_to_them(hold):
    """A combine output of the ring is handed out again only once nothing refers to it or its memory;
    a ring keeps RING_SIZE outputs of one shape and dtype per stream (another shape or dtype: a ring of
    its own beside it), and outputs larger than RING_OUTPUT_BYTES are allocated per call."""
    from ep_a2a.backends.triton import workspace as WS

    ring = WS.OutputRing(torch.device("cpu"))
    out = ring.take(7, 4, 16, torch.bfloat16)
    assert out.shape == (4, 16)
    assert out.dtype == torch.bfloat16
    address = out.data_ptr()
    held = out if hold == "output" else out[1:] if hold == "view" else None
    del out
    again = ring.take(7, 4, 16, torch.bfloat16)
    assert (again.data_ptr() == address) == (hold == "none")
    del held, again
    assert ring.take(7, 4, 16, torch.bfloat16).data_ptr() == address, "released: the same output"
    assert ring.take(8, 4, 16, torch.bfloat16).data_ptr() != address, "another stream: its own"
    many = [ring.take(7, 4, 16, torch.bfloat16) for _ in range(WS.RING_SIZE + 2)]
    assert len({t.data_ptr() for t in many}) == WS.RING_SIZE + 2
    assert len(ring._rings[7][(4, 16, torch.bfloat16)]) == WS.RING_SIZE
    del many
    assert ring.take(7, 4, 16, torch.bfloat16).data_ptr() == address
    assert ring.take(7, 4, 16, torch.float32).dtype == torch.float32, "another dtype: a ring of its own"
    assert len(ring._rings[7][(4, 16, torch.float32)]) == 1
    assert ring.take(7, 4, 16, torch.bfloat16).data_ptr() == address, "beside the first one"
    ring.take(7, 4, 16, torch.float32).requires_grad_()  # (as autograd marks a function's outputs)
    assert not ring.take(7, 4, 16, torch.float32).requires_grad, "an output that requires grad is forgotten"
    rows = WS.RING_OUTPUT_BYTES // (16 * 4) + 1
    ring.take(7, rows, 16, torch.float32)
    assert (rows, 16, torch.float32) not in ring._rings[7], "larger than RING_OUTPUT_BYTES: not kept"
    assert ring._kept[7] == sum(h.out.nbytes for r in ring._rings[7].values() for h in r)


def test_combine_outputs_of_alternating_shapes_kept_within_the_stream_bytes(monkeypatch):
    """Combines of batch sizes that alternate take their own outputs again (no allocation, the same
    addresses for their CUDA graphs), within RING_OUTPUT_STREAM_BYTES per stream: a shape that does not
    fit drops the shapes kept first."""
    from ep_a2a.backends.triton import workspace as WS

    bf16 = torch.bfloat16
    monkeypatch.setattr(WS, "RING_OUTPUT_STREAM_BYTES", 2 * 4 * 16 * 2)  # (two [4, 16] bf16 outputs)
    ring = WS.OutputRing(torch.device("cpu"))
    a, b = ring.take(7, 4, 16, bf16).data_ptr(), ring.take(7, 2, 32, bf16).data_ptr()
    for _ in range(3):
        assert ring.take(7, 4, 16, bf16).data_ptr() == a
        assert ring.take(7, 2, 32, bf16).data_ptr() == b
    assert ring.allocated == 2
    ring.take(7, 1, 64, bf16)  # (a third shape: the first one is dropped to make room)
    assert list(ring._rings[7]) == [(2, 32, bf16), (1, 64, bf16)]
    assert ring.take(7, 2, 32, bf16).data_ptr() == b
    assert ring.allocated == 3
    held = ring.take(7, 1, 64, bf16)
    ring.take(7, 1, 64, bf16)  # (a second output of that shape: the other shape is dropped)
    assert list(ring._rings[7]) == [(1, 64, bf16)]
    assert len(ring._rings[7][(1, 64, bf16)]) == 2
    assert ring._kept[7] == 2 * 4 * 16 * 2
    del held


def _backend_on_fake_kernels(
    monkeypatch,
    *,
    overlap_exact: bool,
    rows: int,
    ring_rows: bool = False,
    fp8: bool = False,
    hidden: int = 128,
):
    """A Triton backend over an engine of CPU buffers whose kernels do not run: the layout kernel does
    nothing, the counts kernel and the row kernel's program 0 write the counts of ``rows`` received rows
    into ``info`` and the host mirror, so the backend's exact-shape flows run their host side as on a
    GPU (outputs, counts, descriptor); ``ring_rows``: the workspaces hold the worst-case rows, as for
    decode-sized layers; ``fp8``: a layer of FP8 rows, whose workspaces hold packed FP8
    rows (``hidden`` channels). Returns the backend and the counts it reports."""
    import numpy as np

    from ep_a2a.backends.triton import TritonBackend
    from ep_a2a.backends.triton import backend as B
    from ep_a2a.backends.triton.workspace import OutputRing, WorkspaceRing
    from ep_a2a.config import EPConfig

    monkeypatch.setattr(B, "_raw_stream", lambda index: 7)
    monkeypatch.setattr(B, "_capturing", lambda: False)
    token_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    eng = _engine(hidden=hidden, token_dtype=token_dtype) if fp8 else _engine()
    W, L = eng.world_size, eng.experts_per_rank
    vals = torch.zeros(eng.info_len, dtype=torch.int64)
    vals[0], vals[2 : 2 + W], vals[2 + W : 2 + 2 * W] = (
        rows,
        torch.tensor([6, 5]),
        torch.tensor([rows - 3, 3]),
    )
    vals[2 + 2 * W : 2 + 2 * W + L] = torch.tensor([rows, 0, 0, 0])
    be = object.__new__(TritonBackend)

    def row_kernel(x, ids, w, src, bufs, *, info, mirror=None, **kw):
        info.copy_(vals)
        if mirror is not None:
            be._mirror_np[:-1], be._mirror_np[-1] = vals.numpy(), 1

    monkeypatch.setattr(eng, "launch_layout", lambda *a, **kw: None)
    monkeypatch.setattr(eng, "launch_counts", lambda info, remote=None: info.copy_(vals))
    monkeypatch.setattr(eng, "launch_dispatch", row_kernel)
    be.config = EPConfig(
        max_tokens=eng.max_tokens, hidden=eng.hidden, topk=eng.topk, num_tot_experts=eng.num_tot_experts,
        rank=1, world_size=W, local_world_size=W, token_dtype=token_dtype,
    )  # fmt: skip
    be.engine, be.device, be.layout = eng, torch.device("cpu"), eng.layout
    be.overlap_exact, be.speculative_rows = overlap_exact, not overlap_exact
    row_dtype = B.FP8_ROW_DTYPE if fp8 else torch.bfloat16
    be.workspaces = WorkspaceRing(
        eng,
        (row_dtype, eng.row_width(row_dtype), eng.worst_case_rows()) if ring_rows else None,
        lambda ws: B._TritonState(owner=id(be), tab=ws.tab, n_src=ws.n_src),
        fp8_hidden=eng.hidden if fp8 and ring_rows else 0,
    )
    be.combine_outputs, be._bound_combines = OutputRing(be.device), {}
    be._dummy_w_address = eng._dummy_w.data_ptr()
    be.eager_graphs, be.graph_captures, be.graph_replays, be._capture_stream = False, 0, 0, None
    be._combine_graphs, be._combine_sightings = {}, {}
    be._mirror = torch.zeros(eng.info_len + 1, dtype=torch.int64)
    be._mirror_np, be._mirror_wait_s, be._mirror_lost, be._finalized = be._mirror.numpy(), 1.0, None, False
    be._info_host, be._pinfo_host = torch.zeros(eng.info_len, dtype=torch.int64), None
    be._info_event = SimpleNamespace(record=lambda stream: None, query=lambda: True)
    be._current_stream = lambda: None
    be._recent_rows, be._rows_ahead = collections.deque(maxlen=8), 0
    be.speculative_calls = be.speculative_overflows = 0
    be._op, be._combine_allowed = (-1, ""), False
    be.board = SimpleNamespace(publish=lambda op: 0, check=lambda call, op: True, peers={0: None})
    be._init_eager_path()
    return be, np.asarray(vals)


@pytest.mark.parametrize(
    ("overlap_exact", "ring_rows"),
    [(True, True), (True, False), (False, False)],
    ids=["worst-case-rows-in-workspaces", "worst-case-buffers", "counts-then-speculative"],
)
def test_exact_flows_return_the_counts_and_take_released_workspaces(monkeypatch, overlap_exact, ring_rows):
    """The exact-shape flows' host side (kernels faked): outputs of exactly the received rows, counts and
    descriptor from ``info``; a held result keeps its workspace (the next call takes another), a
    released one is taken again (with the rows it holds). Without ``overlap_exact`` the first call
    waits for the counts and the next ones speculate."""
    be, vals = _backend_on_fake_kernels(monkeypatch, overlap_exact=overlap_exact, rows=9, ring_rows=ring_rows)
    W, H = be.config.world_size, be.config.hidden
    x, ids, w = torch.randn(6, H).to(torch.bfloat16), torch.zeros(6, 4, dtype=torch.int64), torch.rand(6, 4)
    out, out_w, desc = be.dispatch(x, ids, w, None)
    assert (out.shape, out_w.shape, desc.recv_expert_indices.shape, desc.num_recv_rows) == (
        (9, H),
        (9,),
        (9,),
        9,
    )
    assert desc.num_input_tokens_per_rank.tolist() == vals[2 : 2 + W].tolist()
    assert desc.num_recv_tokens_per_rank.tolist() == vals[2 + W : 2 + 2 * W].tolist()
    assert desc.num_recv_tokens_per_expert.tolist() == vals[2 + 2 * W : -1].tolist()
    assert desc.token_dst_scatter_idx.shape == desc.skipped_token_topk_mapping_indices.shape == (6, 4)
    in_workspace = out.untyped_storage().data_ptr() == desc.backend_state.tab.untyped_storage().data_ptr()
    assert in_workspace == ring_rows
    first_rows = out.data_ptr()
    assert be.speculative_calls == 0
    _out2, out_w2, desc2 = be.dispatch(x, ids, None, None)  # (the first result still held)
    assert out_w2 is None
    assert be.speculative_calls == (0 if overlap_exact else 1)
    assert be.workspaces.allocated == 2
    assert desc2.backend_state.tab.data_ptr() != desc.backend_state.tab.data_ptr()
    first_tab = desc.backend_state.tab.data_ptr()
    del out, out_w, desc
    if ring_rows:
        assert _out2.data_ptr() != first_rows, "the first rows are held: other rows"
    out3, _, desc3 = be.dispatch(x[:3], ids[:3], w[:3], None)
    assert be.workspaces.allocated == 2, "the released workspace is taken again"
    assert desc3.backend_state.tab.data_ptr() == first_tab
    if ring_rows:
        assert out3.data_ptr() == first_rows, "with its rows"
    assert desc3.token_dst_scatter_idx.shape == (3, 4)


def _dispatch_on_fake_graphs(monkeypatch, *, large: bool = False):
    """:func:`_backend_on_fake_kernels` (worst-case rows in the workspaces; ``large``: rows allocated per
    call, the speculative flow from the second call on) with ``eager_graphs``, whose dispatch launches
    (bound, or captured and replayed as CUDA graphs, the capture minus CUDA) are recorded in ``events``
    and write the counts as the row kernel's program 0 does. Returns the backend, the counts and
    ``events``."""
    from ep_a2a.backends.triton import backend as B
    from ep_a2a.backends.triton.engine import BoundLaunch

    be, vals = _backend_on_fake_kernels(monkeypatch, overlap_exact=not large, rows=9, ring_rows=not large)
    eng = be.engine
    be.eager_graphs = True
    events: list[str] = []

    def publish() -> None:  # (what program 0 of the row kernel does)
        be._mirror_np[:-1], be._mirror_np[-1] = vals, 1

    def launch_merged_bound(launches, *addresses, capturing=False):
        events.append("capture" if capturing else "launch")
        if not capturing:
            publish()
            eng.host_epochs[0] += 1

    noop = BoundLaunch(lambda *a: None, (), (0, 0, 0), ())
    monkeypatch.setattr(eng, "bind_merged_dispatch", lambda *a, **kw: (noop, noop))
    monkeypatch.setattr(eng, "launch_merged_bound", launch_merged_bound)
    monkeypatch.setattr(B, "_launch_hooks_set", lambda: False)

    class _Graph:
        def launch(self, stream: int) -> None:
            events.append("replay")
            publish()

    def capture(bind, launch, graphs, at):  # (the capture itself, minus CUDA)
        bound = bind(99)
        assert bound is not None
        launch(bound)
        graphs[at] = _Graph()
        be.graph_captures += 1
        return graphs[at]

    monkeypatch.setattr(be, "_capture", capture)
    return be, vals, events


def test_eager_graphs_replay_repeated_inputs(monkeypatch):
    """With ``eager_graphs`` a bound speculative dispatch launches its kernels one by one until the same
    inputs (addresses, token count) come a second time into the same workspace; then it captures them
    as a CUDA graph and replays it, and replays it for every later call at those addresses. Other
    addresses launch one by one; a workspace keeps at most GRAPHS_PER_WORKSPACE graphs."""
    from ep_a2a.backends.triton import backend as B

    be, _, events = _dispatch_on_fake_graphs(monkeypatch)
    eng = be.engine
    H = be.config.hidden
    x, ids, w = torch.randn(6, H).to(torch.bfloat16), torch.zeros(6, 4, dtype=torch.int64), torch.rand(6, 4)
    for _ in range(4):
        be.dispatch(x, ids, w, None)  # (each result dropped: one workspace)
    assert events == ["launch", "capture", "replay", "replay", "replay"]
    assert (be.graph_captures, be.graph_replays, eng.host_epochs[0]) == (1, 3, 4)
    # the layer's common case finds the same graph by the key it builds from its checks
    assert be._plain_rows
    events.clear()
    out, _, desc = be.dispatch_plain(x, ids, w)
    assert events == ["replay"]
    assert (out.shape, desc.num_recv_rows, desc.num_recv_tokens_per_rank.tolist()) == ((9, H), 9, [6, 3])
    del out, desc
    x3 = x.clone()
    for _ in range(3):
        be.dispatch_plain(x3, ids, w)
    assert events == ["replay", "launch", "capture", "replay", "replay"]
    assert (be.graph_captures, be.graph_replays) == (2, 6)
    events.clear()
    be.dispatch(x.clone(), ids, w, None)  # (other rows: launched one by one)
    be.dispatch(x[:3], ids[:3], w[:3], None)  # (another token count, the same addresses)
    assert events == ["launch", "launch"]
    events.clear()
    out, _, _ = be.dispatch(x, ids, w, None)
    assert events == ["replay"]
    assert out.shape == (9, H)
    (ws,) = be.workspaces._rings[7]
    ws.graphs.update({("full", i): object() for i in range(B.GRAPHS_PER_WORKSPACE)})
    x2 = x.clone()
    del out
    for _ in range(3):
        be.dispatch(x2, ids, w, None)
    assert events[1:] == ["launch"] * 3, "a workspace full of graphs captures no more"


@pytest.mark.parametrize(
    ("hidden", "quantize"),
    [(128, False), (512, False), (512, True)],
    ids=["tuple-H128-padded-rows", "tuple-H512", "quantize-H512"],
)
def test_fp8_common_case_into_the_workspace_and_replays(monkeypatch, hidden, quantize):
    """A layer of FP8 rows whose workspaces hold the rows. A tuple ``(x_fp8, scales)``
    (``dispatch_fp8_plain``) is packed into the workspace's input rows and dispatched; bf16 rows with
    ``fp8=True`` (``dispatch_quantize_plain``) go to the row kernel to quantize. From the second call
    at the same addresses a CUDA graph (of the packing and the launches) is replayed, and new values at
    those addresses arrive. The result's ``(rows, scales)`` are views of the workspace's rows, kept with
    them, and a held result keeps its workspace out of the next call. Fake kernels: the row kernel
    sends the packed (or quantized) input rows to the output in reverse order."""
    from ep_a2a.backends.triton import backend as B
    from ep_a2a.backends.triton.engine import BoundLaunch, pack_fp8_rows
    from ep_a2a.reference import quantize_fp8

    be, vals = _backend_on_fake_kernels(
        monkeypatch, overlap_exact=True, rows=6, ring_rows=True, fp8=True, hidden=hidden
    )
    eng, H = be.engine, be.config.hidden
    assert be._fp8_plain
    assert not be._plain_rows, "dispatch_plain of raw FP8 bytes does not take the packed rows"
    be.eager_graphs = True
    events: list[str] = []
    replaying = [False]
    inputs: dict[int, torch.Tensor] = {}  # (the bf16 rows to quantize, by address)

    def row_kernel(xp: int, n: int, op: int) -> None:  # (the rows reversed, then the counts)
        (ws,) = [ws for ws in be.workspaces._rings[7] if ws.out.data_ptr() == op]
        rows = ws.packed_in if xp == ws.packed_in.data_ptr() else pack_fp8_rows(*quantize_fp8(inputs[xp]))
        ws.out[:n] = rows.flip(0)
        be._mirror_np[:-1], be._mirror_np[-1] = vals, 1

    def launch_merged_bound(launches, xp, ip, wp, sp, n, op, capturing=False):
        if capturing and not replaying[0]:
            events.append("capture")
            return
        events.append("replay" if replaying[0] else "launch")
        row_kernel(xp, n, op)

    class _Graph:  # (replays what was captured: the packing, then the launches)
        def __init__(self, launch, bound):
            self.run = lambda: launch(bound)

        def launch(self, stream: int) -> None:
            replaying[0] = True
            try:
                self.run()
            finally:
                replaying[0] = False

    def capture(bind, launch, graphs, at):
        bound = bind(99)
        launch(bound)
        graphs[at] = _Graph(launch, bound)
        be.graph_captures += 1
        return graphs[at]

    noop = BoundLaunch(lambda *a: None, (), (0, 0, 0), ())
    monkeypatch.setattr(eng, "bind_merged_dispatch", lambda *a, **kw: (noop, noop))
    monkeypatch.setattr(eng, "launch_merged_bound", launch_merged_bound)
    monkeypatch.setattr(B, "_launch_hooks_set", lambda: False)
    monkeypatch.setattr(be, "_capture", capture)
    gen = torch.Generator().manual_seed(5)

    def new_rows() -> tuple[torch.Tensor, ...]:
        if quantize:
            return ((torch.randn(6, H, generator=gen) * 100).to(torch.bfloat16),)
        q = torch.randint(0, 256, (6, H), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
        return q, torch.rand(6, H // 128, generator=gen) + 0.5

    def dispatch(rows: tuple[torch.Tensor, ...]):
        if quantize:
            inputs[rows[0].data_ptr()] = rows[0]
            return be.dispatch_quantize_plain(rows[0], ids, w)
        return be.dispatch_fp8_plain(*rows, ids, w)

    x = new_rows()
    ids, w = torch.zeros(6, 4, dtype=torch.int64), torch.rand(6, 4, generator=gen)
    for i, want_events in enumerate((["launch"], ["capture", "replay"], ["replay"])):
        events.clear()
        (q, s), out_w, desc = dispatch(x)
        assert events == want_events, i
        want = pack_fp8_rows(*(quantize_fp8(x[0]) if quantize else x)).view(torch.uint8).flip(0)
        assert (q.dtype, s.dtype, q.shape, s.shape) == (
            torch.float8_e4m3fn,
            torch.float32,
            (6, H),
            (6, H // 128),
        )
        assert torch.equal(q.view(torch.uint8), want[:, :H]), i
        assert torch.equal(s.view(torch.uint8), want[:, H : H + H // 32]), i
        assert q.untyped_storage().data_ptr() == desc.backend_state.tab.untyped_storage().data_ptr()
        assert (out_w.shape, desc.num_recv_rows) == ((6,), 6)
        again = be.workspaces._rings[7][0].first_fp8_rows()
        assert again[0] is q, "the views the workspace keeps"
        assert again[1] is s
        del q, s, again, out_w, desc
        for t, new in zip(x, new_rows(), strict=True):  # (new values at the same addresses)
            t.copy_(new)
    assert (be.graph_captures, be.graph_replays) == (1, 2)
    # a held result (the scales view alone) keeps its workspace and rows out of the next call
    (_, held), _, _ = dispatch(x)
    before = held.clone()
    events.clear()
    (q2, _), _, _ = dispatch((x[0].clone(), *x[1:]))
    assert events == ["launch"]
    assert be.workspaces.allocated == 2
    assert q2.data_ptr() != held.data_ptr()
    assert torch.equal(held, before)
    del held, q2
    (ws, _) = be.workspaces._rings[7]
    assert be.workspaces.take(7, 6) is ws, "released: the first workspace again"


def test_large_layer_common_case_replays_by_addresses_and_rows(monkeypatch):
    """A layer whose rows are not in the workspaces: from the second call on ``dispatch_plain`` writes
    the rows the workspace kept from its last call (allocated once, while nothing else refers to them)
    and replays the graph captured for the call's addresses with those rows (their address and count),
    found by them alone once captured; rows elsewhere (the kept ones held by the caller) launch one by
    one. Every call returns the counts the kernels wrote, in rows of exactly the received count."""
    be, vals, events = _dispatch_on_fake_graphs(monkeypatch, large=True)
    eng = be.engine
    assert be._plain_large
    assert not be._plain_rows
    H, W = be.config.hidden, be.config.world_size
    allocated: list[int] = []

    def alloc_rows(rows: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        allocated.append(rows)
        return torch.empty(rows, H, dtype=dtype)

    monkeypatch.setattr(eng, "alloc_rows", alloc_rows)
    speculative = be._dispatch_speculative
    calls: list[int] = []
    monkeypatch.setattr(
        be, "_dispatch_speculative", lambda *a, **kw: calls.append(1) or speculative(*a, **kw)
    )
    x, ids, w = torch.randn(6, H).to(torch.bfloat16), torch.zeros(6, 4, dtype=torch.int64), torch.rand(6, 4)
    kept = 0
    for i in range(5):
        out, out_w, desc = be.dispatch(x, ids, w, None)
        assert (out.shape, out_w.shape, desc.num_recv_rows) == ((9, H), (9,), 9), i
        assert desc.num_recv_tokens_per_rank.tolist() == vals[2 + W : 2 + 2 * W].tolist()
        assert i < 2 or out.data_ptr() == kept, "the kept rows"
        kept = out.data_ptr()
        del out, out_w, desc
    # (the first call waits for the counts; the second launches, the third captures, then replays)
    assert events == ["launch", "capture", "replay", "replay", "replay"]
    assert calls == [1, 1], "the replays skip the step-by-step path"
    assert allocated == [9, 10], "the first call's exact rows, then rows allocated once"
    (ws,) = be.workspaces._rings[7]
    assert list(ws.plain_graphs) == [(x.data_ptr(), ids.data_ptr(), w.data_ptr(), 6, torch.int64, kept, 10)]
    events.clear()
    held, _, desc = be.dispatch(x, ids, w, None)  # (the caller keeps the rows, drops the descriptor)
    del desc
    _, _, desc = be.dispatch(x, ids, w, None)  # (the kept rows held: new ones, launched one by one)
    assert events == ["replay", "launch"]
    assert allocated == [9, 10, 10]
    assert desc.num_recv_rows == 9
    assert held.data_ptr() == kept


def test_common_case_dispatch_replays_by_addresses_and_checks_the_board_once_launched(monkeypatch):
    """``dispatch`` hands the common case (rows of the layer's dtype and width, weights of its weight
    dtype, no scatter indices) to ``dispatch_plain``, which replays a graph captured for those addresses
    (found by them alone from the third call on), publishes the call on the operation board once
    launched and returns the counts the replay wrote; a peer found in another operation raises
    ``EPProtocolError`` and leaves the backend unusable. Other cases take the step-by-step path."""
    from ep_a2a import EPProtocolError

    be, vals, events = _dispatch_on_fake_graphs(monkeypatch)
    plain: list[int] = []
    real_plain = be.dispatch_plain
    monkeypatch.setattr(be, "dispatch_plain", lambda *a: plain.append(1) or real_plain(*a))
    board: list = []
    peers_ok = be.board.check
    be.board = SimpleNamespace(
        publish=lambda op: board.append((op, list(events))) or len(board), check=peers_ok, peers={0: None}
    )
    H, W = be.config.hidden, be.config.world_size
    x, ids, w = torch.randn(6, H).to(torch.bfloat16), torch.zeros(6, 4, dtype=torch.int64), torch.rand(6, 4)
    for i in range(4):
        out, out_w, desc = be.dispatch(x, ids, w, None)
        assert (out.shape, out_w.shape, desc.num_recv_rows) == ((9, H), (9,), 9)
        assert desc.num_input_tokens_per_rank.tolist() == vals[2 : 2 + W].tolist()
        assert desc.num_recv_tokens_per_rank.tolist() == vals[2 + W : 2 + 2 * W].tolist()
        assert board[-1] == ("dispatch", events), f"call {i}: published once launched"
        del out, out_w, desc
    assert events == ["launch", "capture", "replay", "replay", "replay"]
    assert plain == [1, 1, 1, 1]
    (ws,) = be.workspaces._rings[7]
    assert list(ws.plain_graphs) == [(x.data_ptr(), ids.data_ptr(), w.data_ptr(), 6, torch.int64)]
    be.dispatch(x, ids, None, None)  # (no weights)
    be.dispatch(x.half(), ids, w, None)  # (rows of another dtype)
    assert plain == [1, 1, 1, 1], "not the common case"

    def misordered(call: int, op: str) -> bool:
        raise EPProtocolError(f"rank 0 is in combine (call #{call})", operations={0: "combine", 1: op})

    be.board.check = misordered
    events.clear()
    with pytest.raises(EPProtocolError, match="rank 0 is in combine"):
        be.dispatch(x, ids, w, None)
    assert events == ["replay"]
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        be.dispatch(x, ids, w, None)


def test_eager_graphs_replay_repeated_combines(monkeypatch):
    """With ``eager_graphs`` an exact-shape combine whose tensors (rows, the descriptor's, the output)
    repeat their addresses is captured at their second call and replayed from then on; other rows
    launch through the bound launch; a combine of a caller's CUDA-graph capture never makes a graph."""
    from ep_a2a.backends.triton import backend as B
    from ep_a2a.backends.triton.engine import BoundLaunch

    be, _ = _backend_on_fake_kernels(monkeypatch, overlap_exact=True, rows=9, ring_rows=True)
    eng = be.engine
    be.eager_graphs = True
    be.board.wait = lambda *a: None
    events: list[str] = []
    noop = BoundLaunch(lambda *a: None, (), (0,) * 6, ())
    monkeypatch.setattr(eng, "bind_combine", lambda *a: noop)
    monkeypatch.setattr(
        eng,
        "launch_combine_bound",
        lambda b, *a, capturing=False: events.append("capture" if capturing else "launch"),
    )
    monkeypatch.setattr(eng, "launch_barrier", lambda **kw: events.append("barrier"))
    monkeypatch.setattr(B, "_launch_hooks_set", lambda: False)

    class _Graph:
        def launch(self, stream: int) -> None:
            events.append("replay")

    def capture(bind, launch, graphs, at):
        bound = bind(99)
        assert bound is not None
        launch(bound)
        be.graph_captures += 1
        graphs[at] = _Graph()
        return graphs[at]

    monkeypatch.setattr(be, "_capture", capture)
    H = be.config.hidden
    x, ids, w = torch.randn(6, H).to(torch.bfloat16), torch.zeros(6, 4, dtype=torch.int64), torch.rand(6, 4)
    _, _, desc = be.dispatch(x, ids, w, None)
    y = torch.randn(9, H).to(torch.bfloat16)
    for _ in range(4):
        be.combine(y, desc)  # (each output dropped: the ring's one output again)
    assert events == ["launch", "barrier", "capture", "replay", "barrier", "replay", "barrier", "replay"]
    events.clear()
    be.combine(y.clone(), desc)
    assert events == ["barrier", "launch"], "other rows: the bound launch"
    events.clear()
    be._combine(y, desc.backend_state, ids, 6)  # (combine_static's: no graph of its own)
    assert events == ["barrier", "launch"]
    assert be.graph_captures == 1


def _combine_on_fake_kernels(monkeypatch):
    """:func:`_backend_on_fake_kernels` whose combine launches, and replays of the CUDA graphs captured of
    them, compute ``out = f(rows, n)`` (:func:`_fake_combine_sum`) from the tensors at the addresses they
    are given (a replay: the addresses it was captured with), so a replay served to the wrong tensors
    returns the wrong sums. Returns the backend, the launches (``events``) and the calls that left the
    common-case path (``checked``)."""
    from ep_a2a.backends.triton import backend as B
    from ep_a2a.backends.triton.engine import BoundLaunch

    be, _ = _backend_on_fake_kernels(monkeypatch, overlap_exact=True, rows=9, ring_rows=True)
    eng = be.engine
    be.eager_graphs = True
    be.board.wait = lambda *a: None
    events: list[str] = []
    # rows and outputs by address (what a kernel would read), held weakly: the ring reuses an output
    # only once nothing refers to it
    at_address: dict[int, weakref.ref] = {}

    def run(y: int, out: int, n: int) -> None:
        at_address[out]().copy_(_fake_combine_sum(at_address[y](), n))

    take = be.combine_outputs.take

    def take_and_note(*a):
        out = take(*a)
        at_address[out.data_ptr()] = weakref.ref(out)
        return out

    def launch_bound(b, y, tab, ids, n_src, n, out, *, capturing=False):
        events.append("capture" if capturing else "launch")
        if not capturing:
            run(y, out, n)

    def launch_unbound(y, tab, ids, n_src, out, **kw):
        events.append("unbound")
        out.copy_(_fake_combine_sum(y, ids.shape[0]))

    noop = BoundLaunch(lambda *a: None, (), (0,) * 6, ())
    monkeypatch.setattr(be.combine_outputs, "take", take_and_note)
    monkeypatch.setattr(eng, "bind_combine", lambda *a: noop)
    monkeypatch.setattr(eng, "launch_combine_bound", launch_bound)
    monkeypatch.setattr(eng, "launch_combine", launch_unbound)
    monkeypatch.setattr(eng, "launch_barrier", lambda **kw: events.append("barrier"))
    monkeypatch.setattr(B, "_launch_hooks_set", lambda: False)

    class _Graph:
        def __init__(self, at: tuple) -> None:
            self.at = at

        def launch(self, stream: int) -> None:
            events.append("replay")
            run(self.at[0], self.at[5], self.at[4])

    def capture(bind, launch, graphs, at):
        launch(bind(99))
        be.graph_captures += 1
        graphs[at] = _Graph(at)
        return graphs[at]

    monkeypatch.setattr(be, "_capture", capture)
    checked: list[int] = []
    slow = be._combine_checked
    monkeypatch.setattr(be, "_combine_checked", lambda *a: checked.append(1) or slow(*a))

    def note(y: torch.Tensor) -> torch.Tensor:
        at_address[y.data_ptr()] = weakref.ref(y)
        return y

    be.note_rows = note
    return be, events, checked


def _fake_combine_sum(y: torch.Tensor, n: int) -> torch.Tensor:
    """What the fake combine kernel writes: ``[n, hidden]`` rows that depend on every value of ``y`` and
    on ``n`` (the float32 sum of the rows, plus ``n``)."""
    return (y.float().sum(0) + n).expand(n, -1).to(y.dtype)


def test_common_case_combine_replays_only_its_own_tensors(monkeypatch):
    """The common-case combine (``combine_plain``, which ``combine`` takes for contiguous ``[rows,
    hidden]`` rows): a dispatch's combine whose rows, descriptor and output repeat an earlier one's
    replays its CUDA graph from the second call on, and returns what the launches return (the kernels
    faked: every launch and replay computes from the tensors at its addresses); rows rewritten in place
    are read afresh; rows at another address, another token count, graphs off launch (no stale graph);
    a dispatch combined again and rows of another dtype leave the common case, with its errors."""
    be, events, checked = _combine_on_fake_kernels(monkeypatch)
    H = be.config.hidden
    x, ids, w = torch.randn(6, H).to(torch.bfloat16), torch.zeros(6, 4, dtype=torch.int64), torch.rand(6, 4)
    y = be.note_rows(torch.randn(9, H).to(torch.bfloat16))

    def round_trip(rows: torch.Tensor, n: int = 6, *, plain: bool = True) -> torch.Tensor:
        _, _, desc = be.dispatch(x[:n], ids[:n], w[:n], None)  # (the last one dropped: one workspace)
        out = (be.combine_plain if plain else be.combine)(rows, desc)
        got = out.clone()
        out.fill_(float("nan"))  # (the ring hands it out again: the next combine must write every row)
        return got

    for i in range(4):
        if i == 3:
            y.copy_(torch.randn(9, H).to(torch.bfloat16))  # (new values, same address)
        assert torch.equal(round_trip(y, plain=i % 2 == 0), _fake_combine_sum(y, 6)), f"call {i}"
    assert events == ["launch", "capture", "replay", "replay", "replay"]
    assert checked == [], "every call took the common-case path"
    assert (be.graph_captures, be.graph_replays, be.combine_outputs.allocated) == (1, 3, 1)
    events.clear()
    y2 = be.note_rows(y.clone() * 2)
    assert torch.equal(round_trip(y2), _fake_combine_sum(y2, 6)), "other rows: not the graph of y"
    be.eager_graphs = False
    assert torch.equal(round_trip(y), _fake_combine_sum(y, 6))
    be.eager_graphs = True
    assert events == ["launch", "launch"], "graphs off: the bound launch"
    assert checked == []
    events.clear()
    _, _, desc = be.dispatch(x, ids, w, None)
    first = be.combine_plain(y, desc).clone()
    again = be.combine_plain(y, desc)  # (combined again: a barrier first, on the checked path)
    assert torch.equal(first, again)
    assert events == ["replay", "barrier", "replay"]
    assert checked == [1]
    with pytest.raises(ValueError, match="float type of at most 4 bytes"):
        be.combine_plain(y.double(), desc)
    assert checked == [1, 1]
    del desc, again
    with pytest.raises(ValueError, match="not produced by this triton backend"):
        be.combine_plain(y, SimpleNamespace(backend_state=object(), num_dispatch_token_cur_rank=6))
    events.clear()
    assert torch.equal(round_trip(y, 3), _fake_combine_sum(y, 3)), "3 tokens: not the graph of 6"
    assert events == ["launch"]


def test_common_case_combine_checks_the_board_after_its_launch(monkeypatch):
    """The common-case combine publishes its call on the operation board once launched, then waits for
    the peers: a peer found in another operation raises ``EPProtocolError`` and leaves the backend
    unusable, as the step-by-step combine does."""
    from ep_a2a import EPProtocolError

    be, events, checked = _combine_on_fake_kernels(monkeypatch)
    H = be.config.hidden
    x, ids, w = torch.randn(6, H).to(torch.bfloat16), torch.zeros(6, 4, dtype=torch.int64), torch.rand(6, 4)
    y = be.note_rows(torch.randn(9, H).to(torch.bfloat16))
    board: list = []

    def publish(op: str) -> int:
        board.append((op, list(events)))
        return 3

    def misordered(call: int, op: str) -> bool:
        raise EPProtocolError(f"rank 0 is in dispatch (call #{call})", operations={0: "dispatch", 1: op})

    _, _, desc = be.dispatch(x, ids, w, None)
    be.board = SimpleNamespace(publish=publish, check=misordered, peers={0: None})
    with pytest.raises(EPProtocolError, match=r"rank 0 is in dispatch \(call #3\)"):
        be.combine_plain(y, desc)
    assert board[-1] == ("combine", ["launch"]), "published after its launch"
    assert checked == []
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        be.combine_plain(y, desc)


def test_layer_hands_its_common_case_combine_to_combine_plain(monkeypatch):
    """``EPLayer.combine`` passes rows of its common case (contiguous ``[num_recv_rows, hidden]`` on its
    device, outside autograd) to the backend's ``combine_plain`` and anything else, once checked, to its
    ``combine``; rows of another shape raise naming ``input`` before any communication."""
    import ep_a2a.layer as layer_mod
    from ep_a2a import EPLayer

    be, events, checked = _combine_on_fake_kernels(monkeypatch)
    calls: list[str] = []

    def counted(name: str):
        real = getattr(be, name)
        return lambda *a: calls.append(name) or real(*a)

    for name in ("combine", "combine_plain"):
        monkeypatch.setattr(be, name, counted(name))
    layer = object.__new__(EPLayer)
    layer.config, layer._cuda_index = be.config, 0
    layer.ctx = SimpleNamespace(backend=be, finalized=False, device=torch.device("cpu"))
    # (the layer's CUDA device, as its CPU tensors report it here)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    H = be.config.hidden
    x, ids, w = torch.randn(6, H).to(torch.bfloat16), torch.zeros(6, 4, dtype=torch.int64), torch.rand(6, 4)
    y = be.note_rows(torch.randn(9, H).to(torch.bfloat16))
    _, _, desc = be.dispatch(x, ids, w, None)
    assert torch.equal(layer.combine(y, desc), _fake_combine_sum(y, 6))
    assert calls == ["combine_plain"]
    assert (events, checked) == (["launch"], [])
    strided = torch.randn(H, 9).to(torch.bfloat16).t()  # ([9, H], not contiguous)
    monkeypatch.setattr(layer_mod, "_dense", lambda t: be.note_rows(t.contiguous()))
    _, _, desc = be.dispatch(x, ids, w, None)
    calls.clear()
    assert torch.equal(layer.combine(strided, desc), _fake_combine_sum(strided, 6))
    assert calls[0] == "combine", "checked one step at a time, then densified"
    calls.clear()
    with pytest.raises(ValueError, match=r"input must have shape \[9, 64\]"):
        layer.combine(y[:8], desc)
    assert calls == []


def _polling_backend(*, rank: int, wait_s: float, call: int, check):
    """A Triton backend reduced to its host poll of the counts mirror (never written here) during a
    dispatch at ``call``, with ``check`` standing in for the operation board's."""
    import numpy as np

    from ep_a2a.backends.triton import TritonBackend

    be = object.__new__(TritonBackend)
    be.config = SimpleNamespace(rank=rank)
    be._mirror_np = np.zeros(6, dtype=np.int64)
    be._mirror_mv, be._epoch_at = be._mirror_np.data, 5
    be._mirror_wait_s = wait_s
    be._mirror_lost = None
    be._finalized = False
    be._op = (call, "dispatch")
    be.board = SimpleNamespace(check=check)
    return be


def test_mirror_poll_is_bounded():
    """The exact-shape flows without a host wait poll the host mirror of ``info``: a row kernel that
    never writes it raises ``EPTimeoutError`` after the bound, and the backend refuses later calls (a late
    write could land in a later call's poll)."""
    from ep_a2a import EPTimeoutError

    # (the peers not there yet, nothing wrong)
    be = _polling_backend(rank=3, wait_s=0.01, call=0, check=lambda call, op: False)
    with pytest.raises(EPTimeoutError, match="rank 3's row kernel") as exc:
        be._read_mirror()
    assert exc.value.missing_ranks == [3]
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        be._check_usable()


def test_poll_stops_at_a_peer_in_another_operation():
    """While the host polls for its counts, a peer found in another operation at the same call ends the
    wait at once with that ``EPProtocolError`` (not the timeout), and the backend refuses later calls."""
    from ep_a2a import EPProtocolError

    seen = []

    def check(call, op):
        seen.append((call, op))
        if len(seen) > 3:
            raise EPProtocolError("rank 1 is in combine (call #5)", operations={0: "dispatch", 1: "combine"})
        return False

    be = _polling_backend(rank=0, wait_s=60.0, call=5, check=check)
    with pytest.raises(EPProtocolError, match="rank 1 is in combine"):
        be._read_mirror()
    assert seen[0] == (5, "dispatch")
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        be._check_usable()


# ------------------------------------------------------------------ direct launches through Triton's C launcher
def _compiled_like_triton(log: list, launcher_cls=None):
    """A compiled kernel made of Triton's own Python layers (``CompiledKernel``'s handle and the CUDA
    launcher object's call), whose C ``launch`` only records its arguments: what the GPU path runs, minus
    the driver."""
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.compiler.compiler import CompiledKernel

    launcher = object.__new__(launcher_cls or CudaLauncher)
    launcher.launch = lambda *a: log.append(a)
    launcher.num_ctas = 1
    launcher.launch_cooperative_grid = False
    launcher.launch_pdl = True
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    ck = object.__new__(CompiledKernel)
    ck.module, ck.function, ck.packed_metadata, ck.src, ck._run = object(), 4242, (16, 1, 0), None, launcher
    ck.name = "probe"
    ck._module_pid = None  # (newer Triton: no module of this process to unload when it is collected)
    try:  # (a Triton whose launcher object asks the GPU driver for state when called cannot be mimicked)
        ck[(1, 1, 1)](stream=0)
    except RuntimeError as exc:
        if "active drivers" not in str(exc):
            raise
        pytest.skip(f"Triton {triton.__version__}'s launcher needs a GPU driver to be called: {exc}")
    log.clear()
    return ck


def _as_addresses(args) -> tuple:
    return tuple(engine_mod._address(a) for a in args)


def test_direct_launch_passes_what_the_handle_passes():
    """The direct launch gives Triton's C launcher the same arguments as the compiled kernel's handle
    (tensors as addresses; no launch metadata and no hooks, which are empty)."""
    log: list = []
    ck = _compiled_like_triton(log)
    args = [torch.zeros(4), 7, torch.zeros(3, dtype=torch.int32), None, True]
    launch = engine_mod._direct_launch(ck, (132, 1, 1), args, 5)
    assert launch is not None
    assert log == [], "the verification records through copies: the shared launcher launched nothing"
    fresh = [torch.ones(4), 9, torch.ones(3, dtype=torch.int32), None, True]
    ck[(132, 1, 1)](*fresh, stream=5)
    via_handle = log.pop()
    launch(list(_as_addresses(fresh)), 5)
    via_direct = log.pop()
    assert len(via_direct) == len(via_handle)
    assert via_direct[:10] == _as_addresses(via_handle[:10])
    assert via_direct[10:13] == (None, None, None)  # launch metadata and the (empty) hooks
    assert via_direct[13:] == _as_addresses(via_handle[13:])


def test_direct_launch_refused_where_unverified():
    """A launcher whose call passes anything else, or a registered launch hook, keeps the handle."""
    from triton import knobs
    from triton.backends.nvidia.driver import CudaLauncher

    class _Reordered(CudaLauncher):
        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            self.launch(gridX, gridY, gridZ, stream, function, 0, 0, None, None, *args)  # pdl dropped

    args = [torch.zeros(2), 3]
    assert engine_mod._direct_launch(_compiled_like_triton([], _Reordered), (4, 1, 1), args, 0) is None
    assert engine_mod._direct_launch(object(), (4, 1, 1), args, 0) is None  # no launcher to call

    def hook(*a):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert engine_mod._direct_launch(_compiled_like_triton([]), (4, 1, 1), args, 0) is None
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    log: list = []
    launch = engine_mod._direct_launch(_compiled_like_triton(log), (4, 1, 1), args, 0)
    assert launch is not None
    knobs.runtime.launch_exit_hook.add(hook)
    try:  # a hook registered later: that launch goes through the handle (it passes the hooks)
        log.clear()
        launch(list(_as_addresses(args)), 0)
        assert log[-1][12] is knobs.runtime.launch_exit_hook
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)


def test_cached_launch_goes_direct(monkeypatch):
    """The engine's cached launches take the direct path once verified: a later call hands the C
    launcher its fixed arguments and this call's tensors as addresses, exactly what the handle would."""
    log: list = []
    ck = _compiled_like_triton(log)

    class _Kernel:
        arg_names = ("a_ptr", "n", "b_ptr", "C")

        def __getitem__(self, grid):
            def launch(**named):
                return ck

            return launch

    monkeypatch.setattr(engine_mod, "interpreting", lambda: False)
    monkeypatch.setattr(engine_mod, "_raw_stream", lambda index: 3)
    eng = _engine()
    fixed_b = torch.zeros(8)
    call = lambda a, n: eng._launch(
        KernelLaunch(("probe",), _Kernel(), (6,), 4, ("a_ptr", "n"), (a, n), lambda: dict(b_ptr=fixed_b, C=2))
    )
    call(torch.zeros(4), 1)
    assert eng.direct_launches == 1
    log.clear()
    a2 = torch.ones(5)
    call(a2, 9)
    (got,) = log
    log.clear()
    ck[(6, 1, 1)](a2, 9, fixed_b, 2, stream=3)
    want = log.pop()
    assert got[:10] == _as_addresses(want[:10])
    assert got[13:] == (a2.data_ptr(), 9, fixed_b.data_ptr(), 2)


class _DirectKernel:
    """A kernel whose launch through Triton returns a compiled kernel made of Triton's own launch layers
    (see :func:`_compiled_like_triton`), so that the engine's plans of it call the C launcher directly."""

    def __init__(self, real, log: list) -> None:
        self.arg_names = real.arg_names
        self.ck = _compiled_like_triton(log)

    def __getitem__(self, grid):
        def launch(**named):
            return self.ck

        return launch


@pytest.mark.parametrize(
    ("with_w", "counts", "remote", "quantize"),
    [
        (True, False, False, False),
        (False, True, False, False),
        (True, True, False, False),
        (True, False, True, False),
        (True, True, False, True),
    ],
    ids=["w-counts", "noW-merged", "w-merged", "remote-peer", "quantize-on-send"],
)
def test_bound_launches_pass_what_the_specifications_pass(monkeypatch, with_w, counts, remote, quantize):
    """After a variant's first launch, the launch methods reach its plan by key without building the
    specification (``_launch_bound``): every launch of a call (layout, counts, row kernel, combine,
    barrier) then hands Triton's C launcher exactly what the specification's launch through the same
    plan hands it, and creates no plan of its own (the keys agree)."""
    log: list = []
    monkeypatch.setattr(engine_mod, "interpreting", lambda: False)
    monkeypatch.setattr(engine_mod, "_raw_stream", lambda index: 3)
    for name in KERNELS:
        monkeypatch.setattr(K, name, _DirectKernel(getattr(K, name), log))
    eng = _engine(remote=remote, hidden=128)
    gen = torch.Generator().manual_seed(3)
    n, rows = 6, 20
    x = torch.randn(n, eng.hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randint(-1, eng.num_tot_experts, (n, eng.topk), generator=gen)  # int64, as topk gives them
    w = torch.rand(n, eng.topk, generator=gen) if with_w else None
    rows_dtype = engine_mod.FP8_ROW_DTYPE if quantize else x.dtype
    b = eng.alloc_dispatch_outputs(n, rows, with_weights=with_w, dtype=rows_dtype)
    if quantize:  # (rows quantized to packed FP8 rows by the row kernel)
        x = engine_mod.QuantizeOnSend(x)
    info = torch.zeros(eng.info_len, dtype=torch.int64)
    mirror = torch.zeros(eng.info_len + 1, dtype=torch.int64) if counts else None
    rb = eng.alloc_remote()
    npk = [3] * eng.world_size if rb is not None else None
    y, out = torch.randn(rows, eng.hidden, generator=gen), torch.zeros(n, eng.hidden)

    def one_call() -> list:
        log.clear()
        eng.launch_layout(ids, caller_scatter=False, info=info, remote=rb)
        if not counts:
            eng.launch_counts(info, remote=rb)
        eng.launch_dispatch(
            x, ids, w, eng.pos, b, caller_scatter=False, info=info, counts=counts, mirror=mirror, remote=rb,
            npk_send=npk,
        )  # fmt: skip
        eng.launch_combine(y, b.tab, ids, info[2 : 2 + eng.world_size], out, remote=rb, npk_recv=npk)
        eng.launch_barrier()
        return [_as_addresses(a) for a in log]

    one_call()  # first launches: through Triton, each leaving a direct plan
    plans = dict(eng._plans)
    assert plans
    assert all(p.direct for p in plans.values())
    specified: list[str] = []
    launch = eng._launch
    monkeypatch.setattr(eng, "_launch", lambda spec: (specified.append(spec.key[0]), launch(spec)))
    bound = one_call()
    assert eng._plans == plans
    # (the remote path's pack and expand kernels launch through their specifications)
    assert set(specified) <= {"pack", "expand"}, f"launched through a specification again: {specified}"
    monkeypatch.setattr(eng, "_launch_bound", lambda key, addresses: False)
    through_specs = one_call()
    assert len(bound) == len(through_specs) >= 4
    assert bound == through_specs


@pytest.mark.parametrize(
    ("with_w", "id_dtype", "quantize"),
    [(True, torch.int64, False), (False, torch.int32, False), (True, torch.int32, True)],
    ids=["w-int64", "noW-int32", "quantize-on-send"],
)
def test_bound_dispatch_and_combine_pass_what_the_specifications_pass(
    monkeypatch, with_w, id_dtype, quantize
):
    """The speculative dispatch's two launches and the combine's launch bound to one workspace and
    stream (``bind_merged_dispatch`` / ``bind_combine``) hand Triton's C launcher, for new tensors of the
    same dtypes and alignment at other addresses and another token count, exactly what the launches
    through the specifications hand it."""
    log: list = []
    monkeypatch.setattr(engine_mod, "interpreting", lambda: False)
    monkeypatch.setattr(engine_mod, "_raw_stream", lambda index: 3)
    for name in KERNELS:
        monkeypatch.setattr(K, name, _DirectKernel(getattr(K, name), log))
    eng = _engine(hidden=128)
    gen = torch.Generator().manual_seed(5)
    rows_dtype = engine_mod.FP8_ROW_DTYPE if quantize else torch.bfloat16
    b = eng.alloc_dispatch_outputs(8, 40, with_weights=True, dtype=rows_dtype)
    info = torch.zeros(eng.info_len, dtype=torch.int64)
    mirror = torch.zeros(eng.info_len + 1, dtype=torch.int64)

    def inputs(n: int):
        x = torch.randn(n, eng.hidden, generator=gen).to(torch.bfloat16)
        ids = torch.randint(-1, eng.num_tot_experts, (n, eng.topk), generator=gen).to(id_dtype)
        w = torch.rand(n, eng.topk, generator=gen) if with_w else None
        y = torch.randn(40, eng.hidden, generator=gen).to(torch.bfloat16)
        out = torch.empty(n, eng.hidden, dtype=torch.bfloat16)
        return (engine_mod.QuantizeOnSend(x) if quantize else x), ids, w, y, out

    def through_specs(x, ids, w, y, out) -> list:
        log.clear()
        eng.launch_layout(ids, caller_scatter=False, info=info)
        eng.launch_dispatch(
            x, ids, w, eng.pos, b, caller_scatter=False, info=info, counts=True, mirror=mirror
        )
        eng.launch_combine(y, b.tab, ids, info[2 : 2 + eng.world_size], out)
        return [_as_addresses(a) for a in log]

    through_specs(*inputs(6))  # (the first launches leave the plans)
    monkeypatch.setattr(eng, "_launch_bound", lambda key, addresses: False)
    x, ids, w, y, out = inputs(6)
    xs = x.x if quantize else x
    launches = eng.bind_merged_dispatch(3, b, info, mirror, (xs, ids, w, eng.pos), caller_scatter=False)
    combine = eng.bind_combine(3, y, ids, info[2 : 2 + eng.world_size], out)
    assert launches is not None
    assert combine is not None
    for n in (6, 3):  # (another call: other addresses, another token count)
        x, ids, w, y, out = inputs(n)
        xs = x.x if quantize else x
        want = through_specs(x, ids, w, y, out)
        log.clear()
        epochs = list(eng.host_epochs)
        wp = (w if w is not None else eng._dummy_w).data_ptr()
        eng.launch_merged_bound(
            launches, xs.data_ptr(), ids.data_ptr(), wp, eng.pos.data_ptr(), n, b.out.data_ptr()
        )
        eng.launch_combine_bound(
            combine, y.data_ptr(), b.tab.data_ptr(), ids.data_ptr(), info[2:].data_ptr(), n, out.data_ptr()
        )
        assert [_as_addresses(a) for a in log] == want
        assert eng.host_epochs == [epochs[0] + 1, epochs[1] + 1, epochs[2]]
    # no plan of the variant (another alignment of the rows): nothing is bound
    odd = torch.zeros(6 * eng.hidden + 1, dtype=torch.bfloat16)[1:].view(6, eng.hidden)
    assert eng.bind_combine(3, odd, ids, info[2:4], out) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("merged", "chunk"), [(True, 1), (False, 2)], ids=["merged", "counts-launch"])
def test_bound_launches_on_one_gpu(monkeypatch, merged, chunk):
    """The compiled kernels on one GPU (two simulated ranks whose heaps are buffers of this GPU, each
    step's sending launches before its receiving ones): after the first dispatch every launch goes
    through its bound launch (nothing is specified again), and every dispatch matches the reference,
    with fresh inputs, other token counts and int64 ids."""
    from ep_a2a.backends.triton.simulate import SimWorld
    from ep_a2a.reference import dispatch_ref

    world, hidden, topk, experts = 2, 7168, 8, 32
    sim = SimWorld(
        world_size=world, device="cuda", max_tokens=128, hidden=hidden, topk=topk, num_tot_experts=experts,
        num_sm=16, chunk=chunk, timeout_s=20.0,
    )  # fmt: skip
    specified: list[str] = []
    for eng in sim.engines:
        launch = eng._launch
        monkeypatch.setattr(
            eng, "_launch", lambda spec, launch=launch: (specified.append(spec.key[0]), launch(spec))
        )
    gen = torch.Generator().manual_seed(11)
    for call, ns in enumerate(([128, 100], [128, 100], [64, 128])):
        xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in ns]
        ids = [torch.randint(-1, experts, (n, topk), generator=gen) for n in ns]  # int64, as topk gives them
        ws = [torch.rand(n, topk, generator=gen) for n in ns]
        res = sim.dispatch(
            [x.cuda() for x in xs], [i.cuda() for i in ids], [w.cuda() for w in ws], merged=merged
        )
        torch.cuda.synchronize()
        ref, scat = dispatch_ref(xs, [i.int() for i in ids], ws, num_tot_experts=experts)
        for r in range(world):
            assert torch.equal(res[r].output.cpu(), ref[r].output), f"call {call}, rank {r}: rows differ"
            assert torch.equal(res[r].weights.cpu(), ref[r].weights)
            assert torch.equal(res[r].token_dst_scatter_idx.cpu().long(), scat[r])
        if call == 0:
            assert specified, "the first dispatch launches through the specifications"
            specified.clear()
    assert not specified, f"launched through a specification again: {specified}"
    assert all(eng.direct_launches > 0 for eng in sim.engines)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [64, 1024], ids=["T64", "T1024"])
def test_combine_on_one_gpu(tokens):
    """The compiled dispatch and combine kernels on one GPU, four simulated ranks whose heaps are buffers
    of this GPU (each step's sending launches before its receiving ones): every rank's combine against
    the reference within two bf16 roundings."""
    from ep_a2a.backends.triton.simulate import SimWorld
    from ep_a2a.reference import combine_ref, dispatch_ref

    world, hidden, topk, experts = 4, 2048, 8, 64
    sim = SimWorld(
        world_size=world, device="cuda", max_tokens=tokens, hidden=hidden, topk=topk, num_tot_experts=experts,
        num_sm=16, chunk=8, timeout_s=20.0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(tokens)
    for _ in range(2):
        ns = [tokens - 5 * r for r in range(world)]
        xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in ns]
        ids = [torch.rand(n, experts, generator=gen).argsort(1)[:, :topk].int() for n in ns]
        res = sim.dispatch([x.cuda() for x in xs], [i.cuda() for i in ids], merged=True)
        ref, scat = dispatch_ref(xs, ids, None, num_tot_experts=experts)
        ys = [torch.randn(r.output.shape[0], hidden, generator=gen).to(torch.bfloat16) for r in ref]
        outs = sim.combine([y.cuda() for y in ys], res, [i.cuda() for i in ids])
        torch.cuda.synchronize()
        want = combine_ref([y.float() for y in ys], ids, scat, num_tot_experts=experts)
        mag = combine_ref([y.float().abs() for y in ys], ids, scat, num_tot_experts=experts)
        for r in range(world):
            err = (outs[r].float().cpu() - want[r]).abs()
            assert bool((err <= 2.0**-7 * mag[r] + 1e-30).all()), (
                f"rank {r}: combine error {float(err.max())}"
            )
    for eng in sim.engines:
        eng.check_error()


def test_rows_allocated_ahead():
    """The large layers' exact-shape dispatch allocates row outputs ahead from the last calls' counts:
    a call repeating the count that set the guess fits, a fitting call leaves at most a third of its
    rows' size unused, and the guess never exceeds the worst case."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ep_a2a.backends.triton.backend import _rows_fit_ahead, _rows_to_allocate_ahead

    @settings(max_examples=300, deadline=None)
    @given(st.integers(0, 1 << 22), st.integers(0, 1 << 22), st.integers(0, 1 << 22))
    def check(rows: int, extra: int, other: int) -> None:
        worst = rows + extra
        ahead = _rows_to_allocate_ahead(rows, worst)
        assert rows <= ahead <= worst
        assert _rows_fit_ahead(rows, ahead)
        if _rows_fit_ahead(other, ahead):
            assert other <= ahead
            assert 3 * (ahead - other) <= other

    check()
    assert _rows_fit_ahead(7, 9)  # 9 - 9 // 4 = 7
    assert not _rows_fit_ahead(6, 9)
    assert not _rows_fit_ahead(10, 9)


@pytest.mark.parametrize("remote", [False, True], ids=["intra-node", "remote-peer"])
def test_every_launch_is_a_precompiled_variant(monkeypatch, remote):
    """One specification per kernel: every variant the launches of both dispatch flows, combine and the
    barrier use is among :meth:`TritonEPEngine.variants` (what ``use_aot`` and the sm_90 compile test
    compile), with the same kernel, grid and warps."""
    launched: dict = {}
    monkeypatch.setattr(TritonEPEngine, "_launch", lambda self, spec: launched.setdefault(spec.key, spec))
    eng = _engine(remote=remote)
    for with_w, counts in ((True, False), (False, False), (True, True), (False, True)):
        if not (remote and counts):
            _one_call(eng, 6, 20, with_w=with_w, counts=counts, seed=1)
    variants = {v.key: v for v in eng.variants(dtypes=(torch.float32,), rewrite=True, mirror=True)}
    assert launched
    for key, spec in launched.items():
        assert key in variants, key
        v = variants[key]
        assert (v.kernel, v.grid, v.num_warps, v.options()) == (
            spec.kernel,
            spec.grid,
            spec.num_warps,
            spec.options(),
        )
