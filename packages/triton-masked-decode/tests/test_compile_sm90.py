"""Every Triton kernel of the package compiles for sm_90 (H100/H200), without a GPU.

The launcher runs on CPU tensors with the launch plan it picks for a 132-SM Hopper GPU, and every kernel
launch is compiled for ``GPUTarget("cuda", 90, 32)`` instead of being run (Triton's active driver is
replaced by a stand-in that only names the target). The argument specialisation is Triton's own, so the
compiled variants are those a GPU would get. Where the launcher autotunes the dense tile, every candidate
the autotuner may pick is compiled. Every launch asks for FP fusion (fused multiply-add) itself, so
Triton neither picks nor warns about its default. This runs in subprocesses, one per shard of the cases
(run side by side by the test workers): compiled kernels need a Python process without
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Shared memory per block on sm_90 (227 KB): a variant above it could not launch.
MAX_SHARED = 227 * 1024

# (name, batch, Hq, Hkv, D, L, mask, dtype, layout, seqlens, config fields)
CASES = [
    ("B1-L64K-bool", 1, 32, 8, 128, 65536, "bool", "fp16", "dense", False, {}),
    ("B8-L64K-bool", 8, 32, 8, 128, 65536, "bool", "fp16", "dense", False, {}),
    ("B1-L1K-bool", 1, 32, 8, 128, 1024, "bool", "fp16", "dense", False, {}),
    ("B8-L64K-nomask", 8, 32, 8, 128, 65536, None, "fp16", "dense", False, {}),
    ("B4-L64K-packed", 4, 32, 8, 128, 65536, "packed", "fp16", "dense", False, {}),
    ("B64-L32K-seqlens", 64, 32, 8, 128, 32768, "bool", "fp16", "dense", True, {}),
    ("B4-paged16-seqlens", 4, 32, 8, 128, 8192, "bool", "fp16", "paged16", True, {}),
    ("B16-paged64-packed", 16, 32, 8, 128, 16384, "packed", "bf16", "paged64", True, {}),
    ("B2-bf16", 2, 32, 8, 128, 8192, "bool", "bf16", "dense", False, {}),
    ("B2-d64-gqa1", 2, 4, 4, 64, 4096, "bool", "fp16", "dense", False, {}),
    ("B2-d256-gqa8", 2, 16, 2, 256, 5000, "bool", "fp16", "dense", False, {}),
    ("B2-d96", 2, 16, 4, 96, 3000, "bool", "fp16", "dense", False, {}),
    ("B2-d16-gqa64", 2, 64, 1, 16, 3000, "bool", "fp16", "dense", False, {}),
    ("B3-path-dense", 3, 32, 8, 128, 8192, "bool", "fp16", "dense", True, {"path": "dense"}),
    ("B3-path-sparse", 3, 32, 8, 128, 8192, "bool", "fp16", "dense", False, {"path": "sparse"}),
    ("B2-threshold-0.5", 2, 32, 8, 128, 8192, "bool", "fp16", "dense", False, {"sparse_threshold": 0.5}),
    ("B1-L1K-nomask-1split", 1, 32, 8, 128, 1024, None, "fp16", "dense", False, {"num_splits": 1}),
    ("B8-L64K-fp8", 8, 32, 8, 128, 65536, "bool", "fp8-fp16", "dense", False, {}),
    ("B1-L64K-fp8-bf16-tensor-scales", 1, 32, 8, 128, 65536, "bool", "fp8-bf16", "dense", False, {}),
    ("B8-paged16-fp8-token-scales", 8, 32, 8, 128, 8192, "bool", "fp8tok-fp16", "paged16", True, {}),
    ("B4-fp8-nomask", 4, 32, 8, 128, 8192, None, "fp8-fp16", "dense", False, {}),
]


#: the cases compiled by one subprocess each: shard ``k`` compiles ``CASES[k::SHARDS]`` (and shard 0 the merge
#: kernel of the in-kernel merge's fallback)
SHARDS = 3


def _compile_all(shard: int) -> None:
    """Compile every launch of the cases of ``shard``; print one line per compiled kernel variant."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    import triton_masked_decode  # noqa: F401
    from triton_masked_decode import MaskedDecodeConfig

    md = sys.modules["triton_masked_decode.masked_decode"]
    merge = sys.modules["triton_masked_decode.merge"]

    class _Sm90Driver:
        """Stands in for the CUDA driver: names the target, never touches a device."""

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    seen: set[tuple] = set()
    jit_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        assert kwargs.get("enable_fp_fusion") is True, f"{self.fn.__name__}: {sorted(kwargs)}"
        kernel = jit_run(self, *args, grid=grid, warmup=True, **kwargs)
        meta = kernel.metadata
        key = (self.fn.__name__, meta.num_warps, meta.num_stages, meta.shared, kernel.hash)
        if key not in seen:
            seen.add(key)
            print(
                f"compiled {self.fn.__name__} warps={meta.num_warps} stages={meta.num_stages} shared={meta.shared}"
                f" fp_fusion={meta.enable_fp_fusion}"
            )
        return kernel

    driver.set_active(_Sm90Driver())
    md._pdl_available = lambda device: True  # as on an H200: the two-launch path's PDL variants
    JITFunction.run = compile_only  # type: ignore[method-assign]
    dev = md._Device(132, "NVIDIA H200")
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    err = torch.zeros(1, dtype=torch.int32)
    for name, b, hq, hkv, d, length, mask_kind, dt, layout, with_seqlens, fields in CASES[shard::SHARDS]:
        # "fp8-<q dtype>": an FP8 cache (per-tensor scales; "fp8tok": also per-token scales)
        dtype = dtypes[dt.split("-")[-1]]
        kv_dtype = torch.float8_e4m3fn if dt.startswith("fp8") else dtype
        q = torch.empty(b, hq, d, dtype=dtype)
        if layout.startswith("paged"):
            page = int(layout[5:])
            k = torch.empty(b * length // page + 3, page, hkv, d, dtype=kv_dtype)
            block_table = torch.zeros(b, length // page, dtype=torch.int32)
            tok_shape = tuple(k.shape[:3])
        else:
            k = torch.empty(b, hkv, length, d, dtype=kv_dtype)
            block_table = None
            tok_shape = (b, hkv, length)
        scale_t = torch.ones((), dtype=torch.float32) if "bf16" in dt and dt.startswith("fp8") else None
        tok = torch.ones(tok_shape, dtype=torch.float32) if dt.startswith("fp8tok") else None
        mask = {
            None: None,
            "bool": torch.zeros(b, hkv, length, dtype=torch.bool),
            "packed": torch.zeros(b, hkv, (length + 7) // 8, dtype=torch.uint8),
        }[mask_kind]
        seqlens = torch.full((b,), length, dtype=torch.int32) if with_seqlens else None
        config = MaskedDecodeConfig(**fields)
        plan, threshold = md._plan_launch(
            b, hq, hkv, d, length, mask is not None, config, dev, fp8=kv_dtype == torch.float8_e4m3fn
        )
        plans = [plan]
        if plan.autotune:  # every tile the autotuner may pick
            block_g = max(16, 1 << (hq // hkv - 1).bit_length())
            block_d = max(16, 1 << (d - 1).bit_length())
            candidates = md._prune_configs(md._AUTOTUNE_CONFIGS, None, BLOCK_D=block_d, BLOCK_G=block_g)
            plans = [
                plan._replace(
                    autotune=0, block_n=c.kwargs["BLOCK_N"], num_warps=c.num_warps, num_stages=c.num_stages
                )
                for c in candidates
            ]
        print(f"case {name}: {plan}")
        for p in plans:
            md._launch(
                q, k, k, mask, seqlens, block_table, err, scale_t, scale_t, tok, tok, 0.5, 0.5,
                length, d**-0.5, length, threshold, list(p),
            )  # fmt: skip
            if p.splits > 1:  # the two-launch path of CUDA graph capture: split kernel + merge kernel
                scales = md._Scales(0.5, 0.5, scale_t, scale_t, tok, tok)
                st = md._static(q, k, k, mask, seqlens, block_table, scales, p)
                md._run(
                    q, k, k, mask, seqlens, block_table, err, scales, length, d**-0.5, length, threshold, p, st,
                    two_launch=True,
                )  # fmt: skip
    for d in (32, 128, 256) if shard == 0 else ():
        o, lse = torch.empty(4, 8, d, dtype=torch.float16), torch.empty(4, 8)
        merge._launch_merge(o, lse, o, lse)
    print(f"variants {len(seen)}")
    for name, _warps, _stages, shared, _hash in seen:
        if shared > MAX_SHARED:
            print(f"TOO MUCH SHARED MEMORY {name} {shared}")


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("shard", range(SHARDS), ids=[f"shard{k}" for k in range(SHARDS)])
def test_every_kernel_compiles_for_sm90(shard: int) -> None:
    # Triton's FP-fusion settings unset: a launch without the option would take (and warn about) its default.
    drop = {"TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, __file__, str(shard)], env=env, capture_output=True, text=True, timeout=1200
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "TOO MUCH SHARED MEMORY" not in out, out
    compiled_lines = [ln for ln in run.stdout.splitlines() if ln.startswith("compiled ")]
    assert all(ln.endswith(" fp_fusion=True") for ln in compiled_lines), out
    compiled = {ln.split()[1] for ln in compiled_lines}
    want = {"_masked_decode_split_kernel"} | (
        {"_merge_splits_kernel", "_merge_two_kernel"} if shard == 0 else set()
    )
    assert want <= compiled, out
    cases = [ln for ln in run.stdout.splitlines() if ln.startswith("case ")]
    assert len(cases) == len(CASES[shard::SHARDS]), out


if __name__ == "__main__":
    import warnings

    # Triton 3.9 warns when a kernel compiles without the option, taking its default (off from 3.10).
    warnings.filterwarnings("error", message="TRITON_DEFAULT_FP_FUSION is unset")
    _compile_all(int(sys.argv[1]))
