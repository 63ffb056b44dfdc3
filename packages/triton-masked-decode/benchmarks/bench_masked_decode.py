"""Masked decode benchmark: cases, providers and timing (driven by ``run.py``).

Every time is the median over CUDA-graph replays of the call, timed with CUDA events like
``triton.testing.do_bench``, with the L2 cache flushed before each replay (see :func:`time_us` and
:func:`flush_l2`), and is compared with the read-once floor: the bytes of K and V over the valid lengths, the
mask (bool, one byte per position) and q/out, moved once at the copy bandwidth measured in the same run.

The flush reads a 256 MB buffer ("clean", the default), so that the L2 holds no K/V and no dirty lines when
the timed call starts. ``triton.testing.do_bench`` flushes by *writing* zeros to such a buffer ("zero"),
which leaves the L2 full of dirty lines: the timed call then pays for writing up to an L2's worth of them
back to HBM while it reads its own data. A decode step does not follow a 256 MB write, and that
write-back is a fixed cost that weighs most on the shortest calls (batch 1, sparse masks);
``bench_flush.py`` measures both methods side by side.
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import sys
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from triton_masked_decode import masked_decode

FLUSH_METHODS = ("clean", "zero")
#: Flush used by :func:`time_us` when none is given (``run.py --flush`` sets it).
DEFAULT_FLUSH = "clean"
_FLUSH_BYTES = 256 << 20
_flush_state: dict[str, torch.Tensor] = {}


def run_header(what: str) -> dict[str, str]:
    """The fields every benchmark JSON of this package starts with: what was run, where, when, how."""
    import triton

    return {
        "package": "triton-masked-decode",
        "what": what,
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def flush_l2(method: str) -> None:
    """Evict the L2 cache before a timed call.

    ``"clean"`` reads a 256 MB buffer (the L2 is left holding clean lines of it: nothing to write back);
    ``"zero"`` writes zeros to it, as ``triton.testing.do_bench`` does (the L2 is left full of dirty lines,
    written back to HBM during the next call).
    """
    if "buf" not in _flush_state:
        _flush_state["buf"] = torch.zeros(_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
        _flush_state["sum"] = torch.zeros((), dtype=torch.float32, device="cuda")
    buf = _flush_state["buf"]
    if method == "clean":
        torch.sum(buf, dim=0, out=_flush_state["sum"])
    elif method == "zero":
        buf.zero_()
    else:
        raise ValueError(f"flush method must be one of {FLUSH_METHODS}, got {method!r}")


def bench_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100, flush: str | None = None) -> float:
    """Median time of ``fn`` in ms with the L2 flushed before each call: ``triton.testing.do_bench``'s loop
    (estimate from 5 calls, then ``warmup`` ms of unflushed calls and ``rep`` ms of flushed, event-timed ones)
    with a choice of flush (:func:`flush_l2`; default :data:`DEFAULT_FLUSH`)."""
    method = DEFAULT_FLUSH if flush is None else flush
    fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        flush_l2(method)
        fn()
    t1.record()
    torch.cuda.synchronize()
    estimate = max(t0.elapsed_time(t1) / 5, 1e-3)
    n_warmup, n_repeat = max(1, int(warmup / estimate)), max(1, int(rep / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for _ in range(n_warmup):
        fn()
    for i in range(n_repeat):
        flush_l2(method)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])


def copy_bandwidth(nbytes: int = 2 << 30, flush: str | None = None) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup=50, rep=300, flush=flush)
    return 2 * nbytes / (ms * 1e-3)


def load_seed(path: str) -> types.ModuleType:
    """Import the seed script from ``path``; flash-attn is stubbed when absent (only its Triton kernel is used)."""
    if importlib.util.find_spec("flash_attn") is None and "flash_attn" not in sys.modules:
        stub = types.ModuleType("flash_attn")

        def _missing(*args, **kwargs):
            raise RuntimeError("flash-attn is not installed")

        stub._tmd_stub = True  # type: ignore[attr-defined]
        stub.flash_attn_func = _missing  # type: ignore[attr-defined]
        stub.flash_attn_with_kvcache = _missing  # type: ignore[attr-defined]
        sys.modules["flash_attn"] = stub
    spec = importlib.util.spec_from_file_location("tmd_seed_kernel", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass
class Case:
    group: str  # "seed" | "ragged" | "sparse" | "density"
    batch: int
    lengths: list[int]  # valid length per sequence
    alloc: int  # allocated positions per sequence
    density: float  # visible fraction among valid positions
    pattern: str = "random"  # random | cluster64 | none
    hq: int = 32
    hkv: int = 8
    dim: int = 128
    providers: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        lens = f"L{self.lengths[0] // 1024}K" if len(set(self.lengths)) == 1 else "L4K-32K"
        return f"{self.group}-B{self.batch}-{lens}-{self.pattern}{round(self.density * 100)}"


def floor_bytes(c: Case) -> int:
    """K + V over the valid lengths, the bool mask, q and out: each read or written once."""
    valid = sum(c.lengths)
    kv = 2 * c.hkv * valid * c.dim * 2
    mask = c.hkv * valid if c.pattern != "none" else 0
    return kv + mask + 2 * c.batch * c.hq * c.dim * 2


def visible_bytes(c: Case, mask: torch.Tensor | None) -> int:
    """Bytes a kernel that reads only visible K/V rows (plus the whole mask) must move."""
    if mask is None:
        return floor_bytes(c)
    lens = torch.tensor(c.lengths, device=mask.device)
    inside = torch.arange(c.alloc, device=mask.device)[None, :] < lens[:, None]
    n_vis = int(((~mask) & inside[:, None, :]).sum())
    return 2 * n_vis * c.dim * 2 + c.hkv * sum(c.lengths) + 2 * c.batch * c.hq * c.dim * 2


def make_mask(c: Case, gen: torch.Generator) -> torch.Tensor | None:
    """[B, Hkv, alloc] bool, True = excluded; positions past each length are excluded."""
    if c.pattern == "none":
        return None
    if c.pattern == "cluster64":
        blocks = math.ceil(c.alloc / 64)
        vis = torch.rand(c.batch, c.hkv, blocks, generator=gen, device="cuda") < c.density
        excl = ~vis.repeat_interleave(64, dim=-1)[..., : c.alloc]
    else:
        excl = torch.rand(c.batch, c.hkv, c.alloc, generator=gen, device="cuda") >= c.density
    lens = torch.tensor(c.lengths, device="cuda")
    excl |= torch.arange(c.alloc, device="cuda")[None, None, :] >= lens[:, None, None]
    return excl


def capture_graph(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``fn`` up (eagerly and on a side stream), capture one call in a CUDA graph; returns (graph, result)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = fn()
    torch.cuda.synchronize()
    return graph, res


def time_us(
    fn: Callable[[], object], warmup: int = 25, rep: int = 120, flush: str | None = None
) -> tuple[float, str]:
    """Median time of ``fn`` in microseconds, L2 flushed before each call (:func:`bench_ms`).

    ``fn`` is captured once in a CUDA graph and the graph is replayed, so host-side launch overhead
    (Python, argument binding, allocation) does not count — as in a decode loop served from graphs. A
    callable that cannot be captured is timed eagerly; the method is returned with the time.
    """
    try:
        graph, _ = capture_graph(fn)
    except Exception:
        torch.cuda.synchronize()
        return bench_ms(fn, warmup=warmup, rep=rep, flush=flush) * 1e3, "eager"
    return bench_ms(graph.replay, warmup=warmup, rep=rep, flush=flush) * 1e3, "cuda_graph"


class Runner:
    def __init__(self, seed_mod: types.ModuleType | None, bw: float, flex_ok: bool = True) -> None:
        self.seed_mod = seed_mod
        self.bw = bw
        self.flex_ok = flex_ok
        self._flex = None
        self.fa_kvcache = None
        try:
            import flash_attn  # type: ignore[import-not-found]

            if not getattr(flash_attn, "_tmd_stub", False):  # load_seed's stand-in is not flash-attn
                self.fa_kvcache = flash_attn.flash_attn_with_kvcache
        except Exception:  # not installed
            pass

    def flex(self):
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = torch.compile(flex_attention, dynamic=False)
        return self._flex

    def run_case(self, c: Case, log: Callable[[str], None]) -> dict:
        gen = torch.Generator(device="cuda").manual_seed(0)
        b, hkv, g, d, alloc = c.batch, c.hkv, c.hq // c.hkv, c.dim, c.alloc
        uniform = len(set(c.lengths)) == 1
        # Flat buffers in the seed's layout: [B, Hkv, alloc, D] contiguous (the seed reads the first
        # B*Hkv*valid*D elements as [B, Hkv, valid, D] when all lengths are equal).
        q = torch.randn(b, c.hq, 1, d, generator=gen, device="cuda", dtype=torch.float16)
        kf = torch.randn(b * hkv * alloc * d, generator=gen, device="cuda", dtype=torch.float16)
        vf = torch.randn_like(kf)
        mask_full = make_mask(c, gen)
        if uniform:
            vl = c.lengths[0]
            k = kf[: b * hkv * vl * d].view(b, hkv, vl, d)
            v = vf[: b * hkv * vl * d].view(b, hkv, vl, d)
            mask = None if mask_full is None else mask_full[..., :vl].contiguous()
            seqlens: torch.Tensor | None = None
        else:
            vl = alloc
            k = kf.view(b, hkv, alloc, d)
            v = vf.view(b, hkv, alloc, d)
            mask = mask_full
            seqlens = torch.tensor(c.lengths, dtype=torch.int32, device="cuda")
        q3 = q.view(b, c.hq, d)
        fb = floor_bytes(c)
        floor_us = fb / self.bw * 1e6
        res: dict = {
            "case": c.name,
            **{kk: vv for kk, vv in asdict(c).items() if kk not in ("lengths", "providers")},
            "mean_length": sum(c.lengths) / b,
            "floor_bytes": fb,
            "floor_us": floor_us,
            "visible_bytes": visible_bytes(c, mask_full),
            "times_us": {},
            "errors": {},
        }
        ref_out = None
        fns: dict[str, Callable[[], object]] = {}
        for p in c.providers:
            if p in ("ours", "ours_dense", "ours_sparse", "ours_readall"):
                path = {
                    "ours": "auto",
                    "ours_dense": "dense",
                    "ours_sparse": "sparse",
                    "ours_readall": "dense_read_all",
                }[p]
                fns[p] = lambda path=path: masked_decode(
                    q3, k, v, mask, seqlens=seqlens, path=path, check_values=False
                )
            elif p == "seed" and self.seed_mod is not None:
                seed_mask = (
                    mask.reshape(-1)
                    if mask is not None
                    else torch.zeros(b * hkv * vl, dtype=torch.bool, device="cuda")
                )
                kk, vv = k.reshape(-1), v.reshape(-1)
                fns[p] = lambda kk=kk, vv=vv, sm=seed_mask: self.seed_mod.triton_masked_flash_decoding(
                    q, kk, vv, sm, vl, hkv
                )
            elif p == "sdpa":
                # SDPA's bool mask is True = attend, per query head: prepared once, outside the timing.
                if mask is not None:
                    am = (
                        (~mask)[:, :, None, None, :]
                        .expand(b, hkv, g, 1, vl)
                        .reshape(b, c.hq, 1, vl)
                        .contiguous()
                    )
                else:
                    am = None
                fns[p] = lambda am=am: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=am, enable_gqa=True
                )
            elif p == "flex" and self.flex_ok:
                from torch.nn.attention.flex_attention import create_block_mask

                mref = mask if mask is not None else torch.zeros(b, hkv, vl, dtype=torch.bool, device="cuda")

                def mask_mod(bi, hi, qi, ki, mref=mref, g=g):
                    return ~mref[bi, hi // g, ki]

                bm = create_block_mask(mask_mod, b, c.hq, 1, vl, device="cuda")
                flex_fn = self.flex()
                fns[p] = lambda bm=bm, fx=flex_fn: fx(q, k, v, block_mask=bm, enable_gqa=True)
            elif p == "flash_attn" and self.fa_kvcache is not None and uniform:
                kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # flash-attn wants [B, L, Hkv, D]; no mask
                fns[p] = lambda kt=kt, vt=vt: self.fa_kvcache(
                    q.transpose(1, 2), kt.contiguous(), vt.contiguous()
                )
        for p, fn in fns.items():
            try:
                out = fn()
                if p.startswith("ours") or p in ("seed", "sdpa", "flex"):
                    o = out[1] if p == "seed" else out[0] if p.startswith("ours") else out
                    o = o.reshape(b, c.hq, d).float()
                    if ref_out is None and p.startswith("ours"):
                        ref_out = o
                    elif ref_out is not None and mask is not None:
                        res["errors"][p] = float((o - ref_out).abs().max())
                t, method = time_us(fn)
                res["times_us"][p] = t
                res.setdefault("method", {})[p] = method
                log(f"  {c.name:28s} {p:12s} {t:9.1f} us  {floor_us / t * 100:6.1f}% of floor  ({method})")
            except Exception as e:  # a baseline failing must not stop the run
                res["times_us"][p] = None
                res["errors"][p] = f"{type(e).__name__}: {str(e)[:200]}"
                log(f"  {c.name:28s} {p:12s} FAILED {type(e).__name__}: {str(e)[:120]}")
            torch.cuda.synchronize()
        fns.clear()
        return res
