"""Compile a kernel of this package for sm_90 on a machine without a GPU and report its resources.

Used to check registers, spills and shared memory of a tile variant before spending device time on it
(NOTES.md). Arguments are described the way ``triton.compile`` takes them: a signature of Triton types
and the constexpr values; every pointer and every ``stride*`` argument is marked divisible by 16, as
the JIT specialises real launches.

    python packages/sparse-mla-attn/benchmarks/offline_compile.py gluon_fwd --consumer-regs 232 --producer-regs 40
    python packages/sparse-mla-attn/benchmarks/offline_compile.py gluon_attn_dist --h-q 64 [--split64 2] [--no-turns]
    python packages/sparse-mla-attn/benchmarks/offline_compile.py attn_dist --h-q 128 --num-stages 1
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 128)


def ptxas_resources(ptx: str) -> dict[str, int]:
    """Registers and spill bytes that ptxas (bundled with Triton) reports for sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {
        "n_regs": int(regs.group(1)) if regs else -1,
        "spill_stores": int(spill.group(1)) if spill else -1,
    }


def compile_sm90(
    fn: Any,
    types: dict[str, str],
    constexprs: dict[str, Any],
    *,
    num_warps: int,
    num_stages: int,
    source: type = ASTSource,
) -> dict[str, Any]:
    """Compile ``fn`` (a ``@triton.jit`` function) for sm_90; return registers, spills, smem, asm."""
    params = list(inspect.signature(fn.fn).parameters)
    signature = {p: ("constexpr" if p in constexprs else types.get(p, "i32")) for p in params}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, p in enumerate(params)
        if p not in constexprs and (signature[p].startswith("*") or p.startswith("stride"))
    }
    src = source(
        fn, signature, constexprs={(params.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    k = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = k.asm["ptx"]
    return {
        "shared_bytes": k.metadata.shared,
        **ptxas_resources(ptx),
        "wgmma": ptx.count("wgmma.mma_async"),
        "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "local_ld_st": ptx.count("ld.local") + ptx.count("st.local"),
        "asm": k.asm,
    }


TYPES = {
    "Q": "*bf16",
    "KV": "*bf16",
    "IDX": "*i32",
    "LSE": "*fp32",
    "OUT": "*bf16",
    "MAX_LOGITS": "*fp32",
    "SINK": "*fp32",
    "TOPK_LEN": "*i32",
    "sm_scale_log2": "fp32",
    "lse_to_log2": "fp32",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=["attn_dist", "gluon_attn_dist", "gluon_fwd"])
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--d-qk", type=int, default=576)
    ap.add_argument("--block-h", type=int, default=0, help="Triton attn_dist head tile (default: all heads)")
    ap.add_argument("--block-t", type=int, default=64)
    ap.add_argument("--num-buf", type=int, default=3, help="Gluon ring depth")
    ap.add_argument("--num-warps", type=int, default=8)
    ap.add_argument("--num-stages", type=int, default=1, help="Triton pipeline stages")
    ap.add_argument("--consumer-regs", type=int, default=232, help="Gluon forward: consumer worker registers")
    ap.add_argument("--producer-regs", type=int, default=40, help="Gluon forward: producer registers")
    ap.add_argument(
        "--split64", type=int, default=1, help="Gluon attn_dist (ws), h_q <= 64: 1 columns, 2 blocks"
    )
    ap.add_argument(
        "--no-turns", action="store_true", help="Gluon attn_dist (ws): no turns between consumers"
    )
    ap.add_argument("--dump-ptx", default="", help="write the PTX here")
    a = ap.parse_args()
    import importlib

    d_rope = a.d_qk - 512
    if a.kernel == "attn_dist":
        fn = importlib.import_module("sparse_mla_attn.attn_dist")._attn_dist_kernel
        block_h = a.block_h or min(128, triton.next_power_of_2(a.h_q))
        const = {
            "D_NOPE": 512,
            "D_ROPE": d_rope,
            "BLOCK_H": block_h,
            "BLOCK_T": a.block_t,
            "CAUSAL": True,
            "ATOMIC": block_h < a.h_q,
            "STATIC_T": 0,
            "DOT_F32": False,
        }
        types = dict(TYPES, OUT="*fp32")
        r = compile_sm90(fn, types, const, num_warps=a.num_warps, num_stages=a.num_stages)
    else:
        g = importlib.import_module("sparse_mla_attn._gluon")
        from triton.experimental.gluon._runtime import GluonASTSource

        if a.kernel == "gluon_attn_dist":  # warp specialised (4 warps per partition)
            fn = g._attn_dist_ws_kernel
            types = dict(TYPES, OUT="*fp32")
            const = {"SPLIT": 0 if a.h_q > 64 else a.split64, "CAUSAL": True, "NUM_BUF": a.num_buf}
            const["TURNS"] = not a.no_turns
            const.update(CONSUMER_REGS=a.consumer_regs, PRODUCER_REGS=a.producer_regs)
            a.num_warps = 4
        else:  # gluon_fwd: the warp-specialised forward (4 warps per partition)
            fn = g._sparse_mla_fwd_pingpong_kernel
            types = dict(TYPES)
            const = {"HAS_SINK": True, "HAS_TOPK_LEN": False, "CAUSAL": False}
            const.update(CONSUMER_REGS=a.consumer_regs, PRODUCER_REGS=a.producer_regs)
            a.num_warps = 4
        const.update(D_NOPE=512, D_ROPE=d_rope, BLOCK_T=a.block_t, num_warps=a.num_warps)
        r = compile_sm90(fn, types, const, num_warps=a.num_warps, num_stages=1, source=GluonASTSource)
    if a.dump_ptx:
        with open(a.dump_ptx, "w") as f:
            f.write(r["asm"]["ptx"])
    print({k: v for k, v in r.items() if k != "asm"})


if __name__ == "__main__":
    main()
