"""Masked decode benchmark: cases, providers and timing (driven by ``run.py``).

Every time is a median over calls timed with CUDA events like ``triton.testing.do_bench``, with the L2
cache flushed before each call by reading a 256 MB buffer (:func:`flush_l2`: the L2 then holds no K/V and
no dirty lines, as after the rest of a decode step). Three ways of calling:

* CUDA-graph replay (providers without a suffix): the call captured once, the graph replayed;
* eager, idle start (``*_eager``): a direct call with default arguments, started after the host has waited
  for the flush, so the GPU is idle and the whole host cost of the call is in the time (its latency);
* eager, back-to-back (``*_eager_b2b``): direct calls as ``triton.testing.do_bench`` makes them (flush,
  call, flush, call, ... with events), the host free to run ahead: host cost counts only where it exceeds
  the GPU time of the flush before it.

Times are compared with the read-once floor: the bytes of K and V over the valid lengths, the mask (bool,
one byte per position) and q/out, moved once at the copy bandwidth measured in the same run. Eager
providers also get the host time of one call (``host_us``: wall-clock time the Python call takes, launch
included, measured around each idle-start call).
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import sys
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from triton_masked_decode import MaskedDecodeConfig, masked_decode

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


def flush_l2() -> None:
    """Evict the L2 cache before a timed call by reading a 256 MB buffer (clean lines: nothing to write
    back; ``triton.testing.do_bench`` writes zeros instead, whose dirty lines the timed call would pay for)."""
    if "buf" not in _flush_state:
        _flush_state["buf"] = torch.zeros(_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
        _flush_state["sum"] = torch.zeros((), dtype=torch.float32, device="cuda")
    torch.sum(_flush_state["buf"], dim=0, out=_flush_state["sum"])


def bench_ms(
    fn: Callable[[], object], warmup: int = 25, rep: int = 100, idle_start: bool = False
) -> tuple[float, float]:
    """(median time of ``fn`` in ms, median host time of one call in us) with the L2 flushed before each
    call: ``triton.testing.do_bench``'s loop (estimate from 5 calls, then ``warmup`` ms of unflushed calls
    and ``rep`` ms of flushed, event-timed ones). With ``idle_start`` the host waits for the flush before
    each timed call, so the GPU is idle when the call starts and the call's host-side cost counts (an eager
    call's latency); without it the host runs ahead, as in ``do_bench``."""
    fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        flush_l2()
        fn()
    t1.record()
    torch.cuda.synchronize()
    estimate = max(t0.elapsed_time(t1) / 5, 1e-3)
    n_warmup, n_repeat = max(1, int(warmup / estimate)), max(1, int(rep / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    host = [0.0] * n_repeat
    for _ in range(n_warmup):
        fn()
    clock = time.perf_counter
    for i in range(n_repeat):
        flush_l2()
        if idle_start:
            torch.cuda.synchronize()
        starts[i].record()
        h0 = clock()
        fn()
        host[i] = clock() - h0
        ends[i].record()
    torch.cuda.synchronize()
    return _median([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]), _median(host) * 1e6


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms, _ = bench_ms(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * nbytes / (ms * 1e-3)


def load_baseline(path: str) -> types.ModuleType:
    """Import a script defining the Triton function ``triton_masked_flash_decoding(q, k, v, mask,
    valid_length, num_k_heads)`` from ``path``; flash-attn is stubbed when absent (only the Triton kernel is
    used)."""
    if importlib.util.find_spec("flash_attn") is None and "flash_attn" not in sys.modules:
        stub = types.ModuleType("flash_attn")

        def _missing(*args, **kwargs):
            raise RuntimeError("flash-attn is not installed")

        stub._tmd_stub = True  # type: ignore[attr-defined]
        stub.flash_attn_func = _missing  # type: ignore[attr-defined]
        stub.flash_attn_with_kvcache = _missing  # type: ignore[attr-defined]
        sys.modules["flash_attn"] = stub
    spec = importlib.util.spec_from_file_location("tmd_baseline_kernel", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass
class Case:
    group: str  # "batch" | "short" | "ragged" | "sparse" | "density"
    batch: int
    lengths: list[int]  # valid length per sequence
    alloc: int  # allocated positions per sequence
    density: float  # visible fraction among valid positions
    pattern: str = "random"  # random | cluster64 | none
    hq: int = 32
    hkv: int = 8
    dim: int = 128
    providers: list[str] = field(default_factory=list)
    kv_dtype: str = "fp16"  # fp16 | fp8 (float8_e4m3fn K/V with per-tensor scales given as tensors)

    @property
    def name(self) -> str:
        lens = f"L{self.lengths[0] // 1024}K" if len(set(self.lengths)) == 1 else "L4K-32K"
        return f"{self.group}-B{self.batch}-{lens}-{self.pattern}{round(self.density * 100)}"

    @property
    def kv_bytes(self) -> int:
        """Bytes per K or V value in the cache."""
        return 1 if self.kv_dtype == "fp8" else 2


def floor_bytes(c: Case) -> int:
    """K + V over the valid lengths (1 byte per value for FP8, with its two per-tensor scales), the bool
    mask, q and out: each read or written once."""
    valid = sum(c.lengths)
    kv = 2 * c.hkv * valid * c.dim * c.kv_bytes + (8 if c.kv_dtype == "fp8" else 0)
    mask = c.hkv * valid if c.pattern != "none" else 0
    return kv + mask + 2 * c.batch * c.hq * c.dim * 2


def visible_bytes(c: Case, mask: torch.Tensor | None) -> int:
    """Bytes a kernel that reads only visible K/V rows (plus the whole mask) must move."""
    if mask is None:
        return floor_bytes(c)
    lens = torch.tensor(c.lengths, device=mask.device)
    inside = torch.arange(c.alloc, device=mask.device)[None, :] < lens[:, None]
    n_vis = int(((~mask) & inside[:, None, :]).sum())
    return 2 * n_vis * c.dim * c.kv_bytes + c.hkv * sum(c.lengths) + 2 * c.batch * c.hq * c.dim * 2


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


# How each provider is called and timed, by the suffix of its name.
EAGER_IDLE, EAGER_B2B = "_eager", "_eager_b2b"


def timing_mode(provider: str) -> str:
    """``"eager_b2b"``, ``"eager_idle"`` or ``"cuda_graph"`` for a provider name."""
    if provider.endswith(EAGER_B2B):
        return "eager_b2b"
    return "eager_idle" if provider.endswith(EAGER_IDLE) else "cuda_graph"


def time_us(
    fn: Callable[[], object], mode: str = "cuda_graph", warmup: int = 25, rep: int = 120
) -> tuple[float, str, float | None]:
    """(median time of ``fn`` in microseconds, the method, median host time of a call in us or None), L2
    flushed before each call (:func:`bench_ms`).

    ``cuda_graph``: ``fn`` is captured once in a CUDA graph and the graph is replayed, so host-side launch
    overhead (Python, argument binding, allocation) does not count, as in a decode loop served from graphs
    (a callable that cannot be captured is timed back-to-back instead). ``eager_idle``: ``fn`` is called
    directly, each call from an idle GPU, so its host-side cost counts. ``eager_b2b``: called directly,
    back-to-back as ``triton.testing.do_bench`` calls it.
    """
    if mode == "cuda_graph":
        try:
            graph, _ = capture_graph(fn)
        except Exception:
            torch.cuda.synchronize()
            mode = "eager_b2b"
        else:
            return bench_ms(graph.replay, warmup=warmup, rep=rep)[0] * 1e3, "cuda_graph", None
    ms, host_us = bench_ms(fn, warmup=warmup, rep=rep, idle_start=mode == "eager_idle")
    return ms * 1e3, mode, host_us


class Runner:
    def __init__(self, baseline: types.ModuleType | None, bw: float, flex_ok: bool = True) -> None:
        self.baseline = baseline
        self.bw = bw
        self.flex_ok = flex_ok
        self._flex = None
        self.fa_kvcache = None
        try:
            import flash_attn  # type: ignore[import-not-found]

            if not getattr(flash_attn, "_tmd_stub", False):  # load_baseline's stand-in is not flash-attn
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
        # Flat buffers: [B, Hkv, alloc, D] contiguous (triton_masked_flash_decoding reads the first
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
        scales: dict = {}
        if c.kv_dtype == "fp8":  # quantized as vLLM stores it: K / k_scale, scales as 0-d device tensors
            k = (k / 0.05).to(torch.float8_e4m3fn)
            v = (v / 0.05).to(torch.float8_e4m3fn)
            del kf, vf
            scale = torch.tensor(0.05, device="cuda")
            scales = {"k_scale": scale, "v_scale": scale}
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
        if not any(p.startswith("ours") for p in c.providers):  # comparators only: this package's output
            ref_out = masked_decode(q3, k, v, mask, seqlens=seqlens, **scales)[0].reshape(b, c.hq, d).float()
        fns: dict[str, Callable[[], object]] = {}
        for p in c.providers:
            if p in ("ours", "ours_dense", "ours_sparse"):
                cfg = MaskedDecodeConfig(
                    path={"ours": "auto", "ours_dense": "dense", "ours_sparse": "sparse"}[p]
                )
                fns[p] = lambda cfg=cfg: masked_decode(
                    q3, k, v, mask, seqlens=seqlens, check_values=False, config=cfg, **scales
                )
            elif p in ("ours_eager", "ours_eager_b2b"):  # as a user calls it: default arguments, eagerly
                fns[p] = lambda: masked_decode(q3, k, v, mask, seqlens=seqlens, **scales)
            elif p == "baseline_triton" and self.baseline is not None:
                flat_mask = (
                    mask.reshape(-1)
                    if mask is not None
                    else torch.zeros(b * hkv * vl, dtype=torch.bool, device="cuda")
                )
                kk, vv = k.reshape(-1), v.reshape(-1)
                fns[p] = lambda kk=kk, vv=vv, fm=flat_mask: self.baseline.triton_masked_flash_decoding(
                    q, kk, vv, fm, vl, hkv
                )
            elif p in ("sdpa", "sdpa_eager", "sdpa_eager_b2b"):
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
                if p.startswith(("ours", "sdpa")) or p in ("baseline_triton", "flex"):
                    o = out[1] if p == "baseline_triton" else out[0] if p.startswith("ours") else out
                    o = o.reshape(b, c.hq, d).float()
                    if ref_out is None and p.startswith("ours"):
                        ref_out = o
                    elif ref_out is not None and mask is not None:
                        res["errors"][p] = float((o - ref_out).abs().max())
                t, method, host_us = time_us(fn, timing_mode(p))
                res["times_us"][p] = t
                res.setdefault("method", {})[p] = method
                host = ""
                if host_us is not None:
                    res.setdefault("host_us", {})[p] = host_us
                    host = f", host {host_us:.1f} us"
                log(
                    f"  {c.name:28s} {p:14s} {t:9.1f} us  {floor_us / t * 100:6.1f}% of floor  ({method}{host})"
                )
            except Exception as e:  # a baseline failing must not stop the run
                res["times_us"][p] = None
                res["errors"][p] = f"{type(e).__name__}: {str(e)[:200]}"
                log(f"  {c.name:28s} {p:12s} FAILED {type(e).__name__}: {str(e)[:120]}")
            torch.cuda.synchronize()
        fns.clear()
        return res
