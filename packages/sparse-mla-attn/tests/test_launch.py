"""The cached launch path (``_runtime.launch``) hands the compiled kernel exactly the arguments Triton's own
launch would, and is taken from the second call of a call signature on.

Runs the public ops in a subprocess without ``TRITON_INTERPRET``, with Triton's launch replaced by a
recorder that returns a stand-in compiled kernel (no GPU needed) and the device answering as an H200.
For each launch, the arguments the stand-in receives on a repeated call must be, position by position,
the kernel's parameters bound from the first call's ``fn[grid](*args, **kwargs)`` (``inspect`` binding,
defaults applied): the same values for everything but tensors, tensors of the same dtype where tensors
were, and Triton's launch path must not run again. Each first call passes ``enable_fp_fusion=True``.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from typing import Any

import pytest

HERE = os.path.abspath(__file__)


def _check_cached_launches() -> int:
    import torch
    from triton.runtime.jit import JITFunction

    import sparse_mla_attn as sm
    from sparse_mla_attn import _runtime

    assert not _runtime.interpreting()
    first: dict[str, list[Any]] = {}
    repeated: dict[str, list[Any]] = {}
    triton_launches: list[str] = []

    class Compiled:
        packed_metadata = "packed"
        function = "function"

        def __init__(self, name: str) -> None:
            self.name = name

        def launch_metadata(self, *args: Any) -> None:
            return None

        def run(self, gx: int, gy: int, gz: int, stream: Any, function: Any, packed: Any, meta: Any,
                enter: Any, leave: Any, *args: Any) -> None:  # fmt: skip
            assert (stream, function, packed) == ("stream", "function", "packed")
            repeated.setdefault(self.name, []).append(list(args))

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Compiled:
        name = self.fn.__name__
        triton_launches.append(name)
        assert kwargs.get("enable_fp_fusion") is True, name  # the kernels' own option, not Triton's default
        sig = inspect.signature(self.fn)
        params = {k: v for k, v in kwargs.items() if k in sig.parameters}  # num_warps/stages are options
        bound = sig.bind(*args, **params)
        bound.apply_defaults()
        first.setdefault(name, []).append(list(bound.arguments.values()))
        return Compiled(name)

    class Driver:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int) -> str:
            return "stream"

    JITFunction.run = run  # type: ignore[method-assign]
    _runtime._driver = lambda: Driver()  # type: ignore[assignment]
    sys.path.insert(0, os.path.dirname(HERE))
    from test_compile_sm90 import pretend_h200_host

    pretend_h200_host()

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 128, 576, generator=g).bfloat16()
    kv = torch.randn(256, 1, 576, generator=g).bfloat16()
    idx = torch.randint(0, 256, (2, 1, 128), generator=g, dtype=torch.int32)
    lse = torch.randn(2, 128, generator=g)
    cache = torch.randn(8, 64, 1, 576, generator=g).bfloat16()
    table = torch.zeros(2, 4, dtype=torch.int32)
    seqlens = torch.full((2,), 200, dtype=torch.int32)
    calls = {
        "fwd": lambda: sm.sparse_mla_fwd(q, kv, idx, 0.1, causal=True, q_start_index=3),
        "fwd_triton_sink": lambda: sm.sparse_mla_fwd(
            q[:, :64], kv, idx, 0.1, attn_sink=lse[0, :64].contiguous(), config=sm.Config(backend="triton")
        ),
        "attn_dist": lambda: sm.attn_dist(q, kv, idx, lse, 0.1),
        "attn_dist_triton": lambda: sm.attn_dist(q, kv, idx, lse, 0.1, config=sm.Config(backend="triton")),
        "decode_splitk": lambda: sm.sparse_mla_decode(q[:, None], cache, table, seqlens, idx, 0.1),
        "decode_split_merge_kernel": lambda: sm.sparse_mla_decode(
            q[:, None], cache, table, seqlens, idx, 0.1, config=sm.Config(num_splits=2, split_merge="kernel")
        ),
        "decode_split_last_program": lambda: sm.sparse_mla_decode(
            q[:, None], cache, table, seqlens, idx, 0.1, config=sm.Config(num_splits=2, split_merge="last_program")
        ),
        "bwd": lambda: sm.sparse_mla_bwd(q, kv, q[..., :512], q[..., :512], idx, lse, 0.1, return_attn_sum=True),
        "bwd_det": lambda: sm.sparse_mla_bwd(q, kv, q[..., :512], q[..., :512], idx, lse, 0.1, deterministic=True),
    }  # fmt: skip
    checked = 0
    for call in calls.values():
        first.clear()
        repeated.clear()
        triton_launches.clear()
        call()
        n_first = len(triton_launches)
        call()
        call()
        assert len(triton_launches) == n_first, triton_launches  # repeated calls: cached handles only
        assert set(repeated) == set(first), (set(repeated), set(first))
        for name, launches in first.items():
            assert len(repeated[name]) == 2 * len(launches), name
            for k, args in enumerate(repeated[name]):
                want = launches[k % len(launches)]
                assert len(args) == len(want), (name, len(args), len(want))
                for i, (a, b) in enumerate(zip(args, want, strict=True)):
                    if isinstance(b, torch.Tensor):
                        assert isinstance(a, torch.Tensor), (name, i)
                        assert a.dtype == b.dtype, (name, i)
                    else:
                        assert type(a) is type(b), (name, i, a, b)
                        assert a == b, (name, i, a, b)
                checked += 1
    return checked


def _check_decode_replay(layout: str) -> int:
    """Eager decode calls on a GPU stream replay the launches of the plan's first call through cached
    kernels: straight to each compiled kernel's C launcher, with the same arguments as that call except
    that tensors are data pointers, the call's own tensors (inputs, outputs) its own and every other
    tensor (scratch) the recorded one. Checked for the split kernel with each merge and for Gluon, with
    the C launcher's arguments as Triton 3.6 orders them (``layout`` "3.6") or as later releases do
    ("3.7": metadata before the scratch buffers, then the arguments' annotations, their signature and
    the arguments as one tuple)."""
    import torch
    from triton.runtime.jit import JITFunction

    import sparse_mla_attn as sm
    from sparse_mla_attn import _runtime, decode
    from sparse_mla_attn.forward import LOG2E

    generic: list[tuple[Any, ...]] = []
    direct: list[tuple[Any, ...]] = []

    class CudaLauncher:  # stands in for Triton's, by name
        global_scratch_size = 0
        profile_scratch_size = 0
        launch_cooperative_grid = False
        launch_pdl = False

        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, gx: int, gy: int, gz: int, stream: Any, function: Any, packed: Any, meta: Any,
                     enter: Any, leave: Any, *args: Any) -> None:  # fmt: skip
            generic.append((self.name, (gx, gy, gz), stream, function, packed, args))

        def launch(self, gx: int, gy: int, gz: int, stream: Any, function: Any, coop: Any, pdl: Any,
                   gscratch: Any, pscratch: Any, packed: Any, meta: Any, enter: Any, leave: Any,
                   *args: Any) -> None:  # fmt: skip
            assert (coop, pdl, gscratch, pscratch, meta, enter, leave) == (False, False, *[None] * 5)
            direct.append((self.name, (gx, gy, gz), stream, function, packed, args))

    class CudaLauncherTuple(CudaLauncher):  # Triton 3.7 and later
        arg_annotations = "annotations"
        kernel_signature = "signature"

        def launch(self, gx: int, gy: int, gz: int, stream: Any, function: Any, coop: Any, pdl: Any,  # type: ignore[override]
                   packed: Any, meta: Any, enter: Any, leave: Any, gscratch: Any, pscratch: Any, annotations: Any,
                   signature: Any, args: tuple[Any, ...]) -> None:  # fmt: skip
            assert (coop, pdl, meta, enter, leave, gscratch, pscratch) == (False, False, *[None] * 5)
            assert (annotations, signature) == ("annotations", "signature")
            direct.append((self.name, (gx, gy, gz), stream, function, packed, args))

    launcher_cls = {"3.6": CudaLauncher, "3.7": CudaLauncherTuple}[layout]
    launcher_cls.__name__ = "CudaLauncher"

    class Compiled:
        packed_metadata = "packed"
        function = 1234

        def __init__(self, name: str) -> None:
            self.run = launcher_cls(name)

        def launch_metadata(self, *args: Any) -> None:
            return None

    class Driver:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int) -> int:
            return 77

    JITFunction.run = lambda self, *a, grid, warmup, **k: Compiled(self.fn.__name__)  # type: ignore[method-assign]
    _runtime._driver = lambda: Driver()  # type: ignore[assignment]
    ctx = _runtime.LaunchContext(0, 77, False)
    from sparse_mla_attn import forward

    attn_dist_mod = sys.modules["sparse_mla_attn.attn_dist"]
    for mod in (decode, forward, attn_dist_mod):
        mod.launch_context = lambda device: ctx  # type: ignore[attr-defined]
        mod.eager_stream = lambda t: (0, 77)  # type: ignore[attr-defined]
    sys.path.insert(0, os.path.dirname(HERE))
    from test_compile_sm90 import pretend_h200_host

    pretend_h200_host()

    def inputs(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 1, 128, 576, generator=g).bfloat16()
        cache = torch.randn(8, 64, 1, 576, generator=g).bfloat16()
        table = torch.randint(0, 8, (2, 4), generator=g, dtype=torch.int32)
        seqlens = torch.full((2,), 200, dtype=torch.int32)
        idx = torch.randint(0, 200, (2, 1, 128), generator=g, dtype=torch.int32)
        return q, cache, table, seqlens, idx

    checked = 0
    for cfg in (sm.Config(num_splits=2, split_merge="kernel"), sm.Config(num_splits=2, split_merge="last_program"),
                sm.Config()):  # fmt: skip
        a1, a2, a3 = inputs(1), inputs(2), inputs(3)
        sm.sparse_mla_decode(*a1, 0.1, config=cfg)  # compiles (Triton's launch path)
        generic.clear()
        direct.clear()
        out2 = sm.sparse_mla_decode(*a2, 0.1, config=cfg)  # through the cached kernels, recorded
        assert generic
        assert not direct
        recorded = list(generic)
        generic.clear()
        out3 = sm.sparse_mla_decode(*a3, 0.3, config=cfg)  # replayed
        assert direct, len(generic)
        assert not generic
        assert len(direct) == len(recorded)
        own2, own3 = (*a2, *out2), (*a3, *out3)
        for (n2, g2, s2, f2, p2, args2), (n3, g3, s3, f3, p3, args3) in zip(recorded, direct, strict=True):
            assert (n2, g2, s2, f2, p2) == (n3, g3, s3, f3, p3)
            assert len(args2) == len(args3)
            for x2, x3 in zip(args2, args3, strict=True):
                if isinstance(x2, torch.Tensor):
                    mine = [i for i, t in enumerate(own2) if t is x2]
                    want = own3[mine[0]].data_ptr() if mine else x2.data_ptr()
                    assert type(x3) is int, (n2, x3)
                    assert x3 == want, (n2, x3, want)
                elif type(x2) is float:
                    assert x2 == 0.1 * LOG2E, (n2, x2)  # the call's sm_scale, in base 2
                    assert x3 == 0.3 * LOG2E, (n2, x3)
                else:
                    assert type(x3) is type(x2), (n2, x2, x3)
                    assert x3 == x2, (n2, x2, x3)
                checked += 1
        launch = _runtime.last_launch("fwd")
        assert launch is not None
        assert launch.merge == (None if cfg.num_splits == 0 else cfg.split_merge)

    # The forward (Gluon persistent, Triton with a sink and split-K): the same.
    def fwd_inputs(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 128, 576, generator=g).bfloat16()
        kv = torch.randn(256, 1, 576, generator=g).bfloat16()
        idx = torch.randint(0, 256, (2, 1, 128), generator=g, dtype=torch.int32)
        return q, kv, idx, torch.randn(128, generator=g)

    for kw in ({}, {"attn_sink": True, "config": sm.Config(backend="triton", num_splits=2)}):
        f1, f2, f3 = fwd_inputs(1), fwd_inputs(2), fwd_inputs(3)

        def fwd(
            f: tuple[torch.Tensor, ...], scale: float, kw: dict[str, Any] = kw
        ) -> tuple[torch.Tensor, ...]:
            sink = {"attn_sink": f[3]} if kw.get("attn_sink") else {}
            return sm.sparse_mla_fwd(*f[:3], scale, config=kw.get("config"), **sink)

        fwd(f1, 0.1)  # compiles
        generic.clear()
        direct.clear()
        o2 = fwd(f2, 0.1)  # recorded
        recorded = list(generic)
        assert recorded
        assert not direct
        generic.clear()
        o3 = fwd(f3, 0.3)  # replayed
        assert not generic
        assert len(direct) == len(recorded)
        sink2 = (f2[3],) if kw.get("attn_sink") else (None,)
        sink3 = (f3[3],) if kw.get("attn_sink") else (None,)
        own2, own3 = (*f2[:3], *sink2, None, *o2), (*f3[:3], *sink3, None, *o3)
        for (n2, g2, s2, fn2, p2, args2), (n3, g3, s3, fn3, p3, args3) in zip(recorded, direct, strict=True):
            assert (n2, g2, s2, fn2, p2) == (n3, g3, s3, fn3, p3)
            for x2, x3 in zip(args2, args3, strict=True):
                if isinstance(x2, torch.Tensor):
                    mine = [i for i, t in enumerate(own2) if t is x2]
                    assert x3 == (own3[mine[0]].data_ptr() if mine else x2.data_ptr()), n2
                elif type(x2) is float:
                    assert (x2, x3) == (0.1 * LOG2E, 0.3 * LOG2E), n2
                else:
                    assert x3 == x2, (n2, x2, x3)
                checked += 1
    # attn_dist (Gluon, whose output is zeroed for its partial sums, and Triton): the same.
    for cfg in (None, sm.Config(backend="triton")):
        f1, f2, f3 = fwd_inputs(1), fwd_inputs(2), fwd_inputs(3)
        lse2, lse3 = f2[3][None].expand(2, 128).contiguous(), f3[3][None].expand(2, 128).contiguous()
        sm.attn_dist(*f1[:3], f1[3][None].expand(2, 128).contiguous(), 0.1, config=cfg)  # compiles
        generic.clear()
        direct.clear()
        a2 = sm.attn_dist(*f2[:3], lse2, 0.1, config=cfg)  # recorded
        recorded = list(generic)
        assert recorded
        assert not direct
        generic.clear()
        a3 = sm.attn_dist(*f3[:3], lse3, 0.3, config=cfg)  # replayed
        assert not generic
        assert len(direct) == len(recorded)
        own2, own3 = (*f2[:3], lse2, a2), (*f3[:3], lse3, a3)
        for (n2, g2, s2, fn2, p2, args2), (n3, g3, s3, fn3, p3, args3) in zip(recorded, direct, strict=True):
            assert (n2, g2, s2, fn2, p2) == (n3, g3, s3, fn3, p3)
            for x2, x3 in zip(args2, args3, strict=True):
                if isinstance(x2, torch.Tensor):
                    # kv and indices reach the kernels as views kv[:, 0] and indices[:, 0] (same start)
                    mine = [i for i, t in enumerate(own2) if t.data_ptr() == x2.data_ptr()]
                    assert x3 == (own3[mine[0]].data_ptr() if mine else x2.data_ptr()), n2
                elif type(x2) is float and x2 == 0.1 * LOG2E:
                    assert x3 == 0.3 * LOG2E, n2
                else:
                    assert x3 == x2, (n2, x2, x3)
                checked += 1
        if cfg is None:
            # A kernel that adds partial sums gets a zeroed output, replayed calls too (the stand-in kernels
            # write nothing): the Gluon kernel at h_q 128; without Gluon (another Triton) the Triton one
            # writes every value.
            from sparse_mla_attn.backends.gluon_sm90 import HAVE_GLUON

            (plan,) = attn_dist_mod._PLANS.values()
            assert plan[3] == HAVE_GLUON
            if plan[3]:
                assert bool((a3 == 0).all())
    # A call the replay does not serve (an input that requires grad; no eager stream, e.g. under graph
    # capture) takes the op's launches, through the cached kernels.
    a4 = inputs(4)
    a4[0].requires_grad_()
    for patched in (False, True):
        if patched:
            a4[0].requires_grad_(False)
            decode.eager_stream = lambda t: None  # type: ignore[assignment]
        generic.clear()
        direct.clear()
        sm.sparse_mla_decode(*a4, 0.1)
        assert generic, patched
        assert not direct, patched
    return checked


def test_replay_binds_pointers_and_refuses_views() -> None:
    """A replay passes the call's data pointers where the recorded call's own tensors were and its scale
    where the recorded scale was, and the kept tensors' pointers and every other value as recorded; it is
    not made when a launch got a view of one of the call's tensors, or when two of them are one tensor."""
    import torch

    from sparse_mla_attn._runtime import LaunchReplay

    class Kernel:
        function = "function"
        packed_metadata = "packed"

        def __init__(self) -> None:
            self.calls: list[tuple[Any, ...]] = []

        def run(self, *args: Any) -> None:
            self.calls.append(args)

    k = Kernel()
    x, y, kept = torch.zeros(4), torch.zeros(4), torch.zeros(2)
    replay = LaunchReplay.bind([(k, (3, 1, 1), (y, kept, 0.5, 0.25, 7, None, x))], (x, y), 0.5, 99, None)
    assert replay is not None
    replay.run(111, 222, 0.75)
    assert k.calls == [(3, 1, 1, 99, "function", "packed", None, None, None, 222, kept.data_ptr(), 0.75, 0.25, 7,
                        None, 111)]  # fmt: skip
    assert LaunchReplay.bind([(k, (1, 1, 1), (x[1:],))], (x, y), 0.5, 99, None) is None
    assert LaunchReplay.bind([(k, (1, 1, 1), (x,))], (x, x), 0.5, 99, None) is None


def test_cached_launch_passes_tritons_arguments() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, HERE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert int(proc.stdout.split()[-1]) >= 10


@pytest.mark.parametrize("layout", ["3.6", "3.7"])
def test_eager_decode_replays_the_recorded_launches(layout: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, HERE, "replay", layout], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert int(proc.stdout.split()[-1]) >= 100


if __name__ == "__main__":
    print(_check_decode_replay(sys.argv[2]) if sys.argv[1:2] == ["replay"] else _check_cached_launches())
