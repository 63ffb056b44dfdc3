"""Every kernel launch of the package compiled ahead of time for sm_90 (H100/H200), without a GPU.

The public ops run on small CPU tensors with the device checks and device queries answering as an H200
would (132 multiprocessors, compute capability 9.0); each kernel launch they make is captured instead of
run and compiled with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, its arguments specialised as
Triton's launcher specialises them. So every configuration the launchers pick is compiled under the
installed Triton: the Triton kernels always, the Gluon kernels where :func:`gluon_supported` holds (where it
does not, the ops select the Triton kernels, which is also checked). The compile runs in a subprocess
without ``TRITON_INTERPRET`` (under the interpreter Triton builds no compilable kernels).

``python tests/test_compile_sm90.py [SCENARIO ...]`` prints one line per launch: kernel, a hash of its PTX
body (debug information and names dropped), its shared memory and (for the backward's scenarios) its
register spill bytes under ptxas (-1 elsewhere), to compare two source trees.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

HERE = os.path.abspath(__file__)


def pretend_h200_host() -> None:
    """The package's host side as on an H200, without a GPU: CPU tensors pass the device checks, 132
    multiprocessors, sm_90 (the Gluon kernels where the installed Triton supports them)."""
    import sparse_mla_attn  # noqa: F401 (loads the modules patched below)
    from sparse_mla_attn.backends import gluon_sm90

    for mod in ("forward", "attn_dist", "decode", "backward"):
        m = sys.modules[f"sparse_mla_attn.{mod}"]
        if hasattr(m, "check_kernel_device"):
            m.check_kernel_device = lambda *a: None  # type: ignore[attr-defined]
    sys.modules["sparse_mla_attn.forward"].num_sms = lambda device: 132  # type: ignore[attr-defined]
    sys.modules["sparse_mla_attn.attn_dist"].num_sms = lambda device: 132  # type: ignore[attr-defined]
    gluon_sm90.gluon_usable = lambda t, *rows: gluon_sm90.HAVE_GLUON  # type: ignore[assignment]


#: Scenario families (the part of a scenario's name before its first ``_``), compiled by separate tests.
FAMILIES = ("fwd", "dec", "ad", "bwd", "indexer")


def _capture_and_compile(names: list[str]) -> list[tuple[str, int, str, str, int]]:
    """Run the scenarios ``names`` (or every scenario of the families ``names``) with launches captured;
    compile each launch for sm_90."""
    import torch
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, native_specialize_impl

    import sparse_mla_attn as sm
    from sparse_mla_attn import _runtime

    captured: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def capture(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        captured.append((self, args, dict(kwargs)))

    JITFunction.run = capture  # type: ignore[method-assign]
    pretend_h200_host()
    assert _runtime.interpreting() is False

    def problem(s_q: int, h_q: int, d_qk: int, s_kv: int, topk: int) -> tuple[torch.Tensor, ...]:
        q = torch.randn(s_q, h_q, d_qk).bfloat16()
        kv = torch.randn(s_kv, 1, d_qk).bfloat16()
        return q, kv, torch.randint(0, s_kv, (s_q, 1, topk), dtype=torch.int32)

    def fwd(
        h_q: int, d_qk: int, backend: str, extras: bool = False, num_splits: int = 0, topk: int = 128,
        **options: Any,
    ) -> None:  # fmt: skip
        q, kv, idx = problem(2, h_q, d_qk, 256, topk)
        kw: dict[str, Any] = {}
        if extras:
            kw = dict(causal=True, q_start_index=3, k_stride=2, attn_sink=torch.randn(h_q),
                      topk_length=torch.full((2,), 5, dtype=torch.int32))  # fmt: skip
        cfg = sm.Config(backend=backend, num_splits=num_splits, **options)
        sm.sparse_mla_fwd(q, kv, idx, 0.1, 512, config=cfg, **kw)

    def decode(
        b: int, h_q: int, topk: int, backend: str, split_merge: str = "auto", *, fp8: bool = False,
        rows: bool = False, s_q: int = 1, num_splits: int = 0,
    ) -> None:  # fmt: skip
        q = torch.randn(b, s_q, h_q, 576).bfloat16()
        cache = torch.randn(8, 64, 1, 576).bfloat16()
        if fp8:
            cache = sm.quantize_fp8_kv_cache(cache)
        table = torch.zeros(b, 4, dtype=torch.int32)
        seqlens = torch.full((b,), 200, dtype=torch.int32)
        idx = torch.randint(0, 200, (b, s_q, topk), dtype=torch.int32)
        cfg = sm.Config(backend=backend, split_merge=split_merge, num_splits=num_splits)
        kw: dict[str, Any] = {"index_kind": "cache_rows"} if rows else {}
        sm.sparse_mla_decode(q, cache, table, seqlens, idx, 0.1, config=cfg, **kw)

    def attn_dist(
        h_q: int, s_kv: int, backend: str, d_qk: int = 576, split: str = "blocks", order: str = "auto"
    ) -> None:
        q, kv, idx = problem(2, h_q, d_qk, s_kv, 128)
        cfg = sm.Config(backend=backend, attn_dist_split=split, attn_dist_order=order)
        sm.attn_dist(q, kv, idx, torch.randn(2, h_q), 0.1, q_start_index=5, config=cfg)

    def bwd(h_q: int, d_qk: int, det: bool, attn_sum: bool = False, causal: bool = False) -> None:
        q, kv, idx = problem(2, h_q, d_qk, 64, 128)
        out, dout = torch.randn(2, h_q, 512).bfloat16(), torch.randn(2, h_q, 512).bfloat16()
        sm.sparse_mla_bwd(q, kv, out, dout, idx, torch.randn(2, h_q), 0.1, 512, causal=causal,
                          deterministic=det, return_attn_sum=attn_sum)  # fmt: skip

    def bwd_tiles(h_q: int, det: bool, tiles: dict[str, int], causal: bool = False) -> None:
        """The backward with kernel options its launcher offers beside the defaults."""
        from sparse_mla_attn.backward import launch_bwd

        q, kv, idx = problem(2, h_q, 576, 64, 256)
        out, dout = torch.randn(2, h_q, 512).bfloat16(), torch.randn(2, h_q, 512).bfloat16()
        launch_bwd(q, kv, out, dout, idx, torch.randn(2, h_q), 0.1, 512, deterministic=det, causal=causal,
                   tiles=tiles)  # fmt: skip

    def indexer(causal: bool) -> None:
        q_idx = torch.randn(4, 64, 128).bfloat16().requires_grad_()
        k_idx, w = torch.randn(32, 128).bfloat16(), torch.randn(4, 64)
        logits = sm.indexer_logits(q_idx, k_idx, w, causal=causal)
        sys.modules["sparse_mla_attn.indexer"].launch_logits_bwd(
            torch.randn(4, 32), q_idx, k_idx, w, causal, 0, 1
        )
        assert logits.shape == (4, 32)

    from sparse_mla_attn.backends import gluon_sm90

    # Scenarios that force the Gluon kernels run the Triton ones where the installed Triton has no Gluon.
    gluon_backend = "gluon" if gluon_sm90.HAVE_GLUON else "auto"
    gluon_forced = 1 if gluon_sm90.HAVE_GLUON else 0
    scenarios: dict[str, Callable[[], None]] = {
        "fwd_h128_gluon": lambda: fwd(128, 576, "auto"),
        "fwd_h128_triton": lambda: fwd(128, 576, "triton"),
        "fwd_h64_extras_gluon": lambda: fwd(64, 576, "auto", True),
        "fwd_h64_extras_triton": lambda: fwd(64, 576, "triton", True),
        "fwd_h16_d512": lambda: fwd(16, 512, "auto", True),
        "fwd_h32_d576": lambda: fwd(32, 576, "auto"),
        "fwd_h128_d512_gluon": lambda: fwd(128, 512, "auto"),
        # The persistent Gluon forward (Config.fwd_persistent), also with the extras and split-K.
        # The Gluon forward is persistent by default above 64 heads (fwd_h128_gluon); each mode forced.
        "fwd_h128_not_persistent": lambda: fwd(128, 576, "auto", fwd_persistent="off"),
        "fwd_h64_extras_persistent": lambda: fwd(64, 576, "auto", True, fwd_persistent="on"),
        "fwd_h128_d512_persistent_split2": lambda: fwd(
            128, 512, gluon_backend, True, num_splits=2, fwd_persistent="on"
        ),
        # The Gluon forward's last items in pieces (Config.fwd_tail_split), per item and persistent.
        "fwd_h64_extras_tail": lambda: fwd(
            64, 576, gluon_backend, True, num_splits=1, topk=256, fwd_tail_split="on", fwd_persistent="off"
        ),
        "fwd_h128_d512_tail_persistent": lambda: fwd(
            128, 512, gluon_backend, True, num_splits=1, topk=256, fwd_tail_split="on", fwd_persistent="on"
        ),
        # Split-K decode, merged by the last split program (eager) or by a merge kernel (graph capture).
        "dec_b2_splitk": lambda: decode(2, 128, 2048, "auto", "last_program"),
        "dec_b2_splitk_merge_kernel": lambda: decode(2, 128, 2048, "auto", "kernel"),  # Gluon on sm_90
        "dec_b2_splitk_merge_kernel_triton": lambda: decode(2, 128, 2048, "triton", "kernel"),
        "dec_b8_splitk": lambda: decode(8, 128, 2048, "auto", "last_program"),
        "dec_b1_h16_splitk": lambda: decode(1, 16, 2048, "auto", "last_program"),
        "dec_b1_h16_splitk_merge_kernel": lambda: decode(1, 16, 2048, "auto", "kernel"),
        "dec_b64_gluon": lambda: decode(64, 128, 2048, "auto"),
        "dec_b64_h64_triton": lambda: decode(64, 64, 2048, "triton"),
        # The Gluon decode / forward split-K (the default of a split grid at h_q > 32 on sm_90).
        "dec_b64_h64_gluon_split2": lambda: decode(64, 64, 2048, "auto"),
        "fwd_h128_extras_gluon_split3": lambda: fwd(128, 576, gluon_backend, True, num_splits=3),
        # FP8 cache, the Triton kernel: unsplit at h_q 128, split-K with both merges, h_q 16 (the default
        # there), and the default at h_q 128 on sm_90 with a split merged by the merge kernel (Gluon).
        "dec_fp8_b64_s2_h128_rows_triton": lambda: decode(
            64, 128, 2048, "triton", fp8=True, rows=True, s_q=2
        ),
        "dec_fp8_b2_splitk": lambda: decode(2, 128, 2048, "auto", "last_program", fp8=True),
        "dec_fp8_b2_splitk_merge_kernel_triton": lambda: decode(2, 128, 2048, "triton", "kernel", fp8=True),
        "dec_fp8_b2_splitk_merge_kernel": lambda: decode(2, 128, 2048, "auto", "kernel", fp8=True),
        "dec_fp8_b1_h16_splitk": lambda: decode(1, 16, 2048, "auto", "last_program", fp8=True),
        # The Gluon FP8 decode (sm_90, the default at h_q > 32): unsplit at h_q 128 (both index kinds) and
        # split-K at h_q 64.
        "dec_fp8_b64_s2_h128_gluon": lambda: decode(64, 128, 2048, gluon_backend, fp8=True, s_q=2),
        "dec_fp8_b64_h128_rows_gluon": lambda: decode(64, 128, 2048, gluon_backend, fp8=True, rows=True),
        "dec_fp8_b64_h64_gluon_split2": lambda: decode(64, 64, 2048, gluon_backend, fp8=True),
        "ad_h128_gluon": lambda: attn_dist(128, 256, "auto"),
        "ad_h128_triton": lambda: attn_dist(128, 256, "triton"),
        "ad_h64_gluon": lambda: attn_dist(64, 256, "auto"),
        "ad_h64_split_cols": lambda: attn_dist(64, 256, "auto", split="cols"),
        # The persistent index-order form (Config.attn_dist_order; automatic with 4+ tokens per SM).
        "ad_h64_index": lambda: attn_dist(64, 256, "auto", order="index"),
        "ad_h48_d512_index": lambda: attn_dist(48, 256, "auto", 512, order="index"),
        "ad_h128_index": lambda: attn_dist(128, 256, "auto", order="index"),
        "ad_h96_d512_index": lambda: attn_dist(96, 256, "auto", 512, order="index"),
        "ad_h48_d512_split_cols": lambda: attn_dist(48, 256, "auto", 512, split="cols"),
        "ad_h64_triton": lambda: attn_dist(64, 256, "triton"),
        "ad_h64_long_triton": lambda: attn_dist(64, 32768, "triton"),
        "ad_h16_d512": lambda: attn_dist(16, 256, "auto", 512),
        "bwd_h128": lambda: bwd(128, 576, False, True, True),
        "bwd_h128_det": lambda: bwd(128, 576, True),
        "bwd_h64_d512": lambda: bwd(64, 512, False),
        "bwd_h256": lambda: bwd(256, 576, False),
        "bwd_h256_det": lambda: bwd(256, 576, True, True),
        # The kernels without the defaults' slot sort, grouped dkv launch, rope chunk in the loops and index
        # prefetch, at 128-slot main blocks, with the Triton dkv kernel.
        "bwd_h128_unsorted": lambda: bwd_tiles(
            128,
            False,
            {
                "SORT_IDX": 0,
                "TOK_GROUP": 1,
                "ROPE_IN_LOOP": 0,
                "IDX_PREFETCH": 0,
                "N_CSPLIT": 2,
                "BLOCK_T": 128,
                "DKV_GLUON": 0,
            },
        ),
        # The Triton dkv kernel (Config.bwd_dkv_backend="triton"; the default on other GPUs), both modes.
        "bwd_h128_dkv_triton": lambda: bwd_tiles(128, False, {"DKV_GLUON": 0}),
        "bwd_h128_det_dkv_triton": lambda: bwd_tiles(128, True, {"DKV_GLUON": 0}),
        # The Gluon dkv kernel (Config.bwd_dkv_backend), both modes, causal, fewer heads than a tile.
        "bwd_h128_dkv_gluon": lambda: bwd_tiles(128, False, {"DKV_GLUON": gluon_forced}),
        "bwd_h128_det_dkv_gluon": lambda: bwd_tiles(128, True, {"DKV_GLUON": gluon_forced}),
        "bwd_h64_causal_dkv_gluon": lambda: bwd_tiles(64, False, {"DKV_GLUON": gluon_forced}, causal=True),
        "bwd_h20_dkv_gluon": lambda: bwd_tiles(20, False, {"DKV_GLUON": gluon_forced}),
        # The deterministic workspace in fp32 (fp16 is the default for bf16), and without the evict-first
        # hints, with a reduction of 3 programs per row.
        "bwd_h128_det_fp32_workspace": lambda: bwd_tiles(128, True, {"DET_HALF": 0}),
        "bwd_h128_det_no_evict": lambda: bwd_tiles(128, True, {"DET_EVICT": 0, "GROUPS_RED": 4}),
        "indexer": lambda: indexer(False),
        "indexer_causal": lambda: indexer(True),
    }
    target = GPUTarget("cuda", 90, 32)
    results = []
    unknown = {n.split("_")[0] for n in scenarios} - set(FAMILIES)
    assert not unknown, f"scenario families missing from FAMILIES: {unknown}"
    picked = [n for n in scenarios if not names or n in names or n.split("_")[0] in names]
    assert all(n in scenarios or n in FAMILIES for n in names), names
    assert picked, names
    for name in picked:
        captured.clear()
        scenarios[name]()
        assert captured, f"{name}: no kernel launch"
        for i, (fn, args, kwargs) in enumerate(captured):
            params = list(inspect.signature(fn.fn).parameters)
            # Launch options; a Gluon kernel also takes num_warps as a constexpr argument.
            opts = {
                k: (kwargs[k] if k in params else kwargs.pop(k))
                for k in list(kwargs)
                if k in ("num_warps", "num_stages", "enable_fp_fusion")
            }
            # Fused multiply-add as the kernels are tuned, not Triton's default (off in 3.10).
            assert opts.get("enable_fp_fusion") is True, (name, i, fn.fn.__name__, opts)
            named = {**dict(zip(params, args, strict=False)), **kwargs}
            sig: dict[str, str] = {}
            const: dict[tuple[int, ...], Any] = {}
            attrs: dict[tuple[int, ...], Any] = {}
            for j, p in enumerate(params):
                v = named.get(p)
                if j in fn.constexprs or v is None:
                    sig[p], const[(j,)] = "constexpr", v
                    continue
                kp = fn.params[j]
                ty, spec = native_specialize_impl(
                    BaseBackend, v, False, not kp.do_not_specialize, not kp.do_not_specialize_on_alignment
                )
                sig[p] = ty
                if ty == "constexpr":
                    const[(j,)] = spec
                elif spec:
                    attrs[(j,)] = BaseBackend.parse_attr(spec)
            gluon = type(fn).__name__ == "GluonJITFunction"
            if gluon:
                from triton.experimental.gluon._runtime import GluonASTSource as source
            else:
                source = ASTSource
            k = triton.compile(source(fn, sig, constexprs=const, attrs=attrs), target=target, options=opts)
            assert k.metadata.enable_fp_fusion is True, (name, i, fn.fn.__name__)
            ptx = k.asm["ptx"].split(".section\t.debug")[0]
            ptx = re.sub(r"\$L__tmp\d+:?", "", re.sub(r"//.*", "", ptx)).replace(fn.fn.__name__, "KERNEL")
            body = [ln for ln in ptx.splitlines() if ln.strip() and ".loc" not in ln and ".file" not in ln]
            digest = hashlib.md5("\n".join(body).encode()).hexdigest()[:12]
            spill = _spill_bytes(k.asm["ptx"]) if name.startswith(("bwd", "ad_")) else -1
            results.append((name, i, fn.fn.__name__, digest, k.metadata.shared, spill))
    return results


def _spill_bytes(ptx: str) -> int:
    """Spill stores + loads of a kernel's PTX assembled by Triton's ptxas for sm_90a (``ptxas -v``)."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stdout + proc.stderr)
    assert found, proc.stderr[-2000:]
    return sum(int(a) + int(b) for a, b in found)


def _run(names: list[str]) -> str:
    # (Without Triton's FP-fusion variables: the launches' own option is what the compile sees.)
    drop = ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.run(
        [sys.executable, HERE, *names], env=env, capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def _ptxas_major() -> int:
    """Major CUDA version of the ptxas the installed Triton assembles sm_90 code with."""
    from triton.backends.nvidia.compiler import get_ptxas

    out = subprocess.run([get_ptxas(90).path, "--version"], capture_output=True, text=True, check=True).stdout
    return int(re.findall(r"release (\d+)\.", out)[-1])


# Register spills allowed (bytes of spill stores + loads per launch): the fused deterministic backward
# kernel above 128 heads always (a known limit); under the ptxas of CUDA 13 (Triton 3.9), a few spilled
# values in the Gluon attn_dist consumers and the deterministic dkv kernel, which CUDA 12's ptxas keeps
# in registers.
SPILLS_ALLOWED = {("bwd_h256_det", "_main_kernel"): 10**9}
SPILLS_ALLOWED_CUDA13 = {"_attn_dist_ws_kernel": 64, "_attn_dist_index_kernel": 64, "_dkv_ws_kernel": 32}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    ("families", "triton_kernels", "gluon_kernels"),
    [
        pytest.param(
            ["fwd", "dec"],
            {"_sparse_mla_fwd_kernel", "_split_combine_kernel", "_paged_rows_kernel"},
            {"_sparse_mla_fwd_ws_kernel", "_sparse_mla_decode_fp8_kernel"},
            id="forward-decode",
        ),
        pytest.param(
            ["ad", "bwd", "indexer"],
            {"_attn_dist_kernel", "_delta_kernel", "_main_kernel", "_dkv_kernel", "_dq_kernel",
             "_det_reduce_kernel", "_logits_kernel", "_dqw_kernel", "_dk_kernel"},
            {"_attn_dist_ws_kernel", "_dkv_ws_kernel", "_attn_dist_index_kernel", "_index_order_kernel"},
            id="attn_dist-backward-indexer",
        ),
    ],
)  # fmt: skip
def test_every_kernel_launch_compiles_for_sm90(
    families: list[str], triton_kernels: set[str], gluon_kernels: set[str]
) -> None:
    out = _run(families)
    lines = [ln.split() for ln in out.splitlines() if ln.strip()]
    assert {ln[0].split("_")[0] for ln in lines} == set(families)
    kernels = {ln[2] for ln in lines}
    # Every launch fits an H100 / H200 multiprocessor's shared memory (227 KB per block); the attn_dist and
    # backward kernels (whose spills are measured) do not spill registers beyond SPILLS_ALLOWED.
    too_big = [ln for ln in lines if int(ln[4]) > 232448]
    assert not too_big, too_big
    cuda13 = SPILLS_ALLOWED_CUDA13 if _ptxas_major() >= 13 else {}
    spilling = [
        ln for ln in lines
        if int(ln[5]) > max(SPILLS_ALLOWED.get((ln[0], ln[2]), 0), cuda13.get(ln[2], 0))
    ]  # fmt: skip
    assert not spilling, spilling
    assert triton_kernels <= kernels, triton_kernels - kernels
    from sparse_mla_attn import gluon_supported

    # Where the installed Triton's Gluon API is not one the kernels are written for, the ops select the
    # Triton kernels (no Gluon launch at all, nor the index-order attn_dist's Triton ordering kernel, which
    # only that Gluon form uses).
    assert (gluon_kernels <= kernels) if gluon_supported() else not (gluon_kernels & kernels)


if __name__ == "__main__":
    import warnings

    # Every launch sets enable_fp_fusion itself: Triton 3.9 warns (message start) on one that does not.
    warnings.filterwarnings("error", message="TRITON_DEFAULT_FP_FUSION is unset")
    for row in _capture_and_compile(sys.argv[1:]):
        print(*row, flush=True)
