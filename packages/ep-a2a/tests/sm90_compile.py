"""Compile every kernel variant of one rank's Triton engine for sm_90, without a GPU.

The engine is built with the options the Triton backend picks for ``TritonTuning(num_sm=...)`` and the
layer's shape (``resolve.engine_options``); every variant it may launch (``TritonEPEngine.variants``,
the specifications its launches and its ahead-of-time compiles share) is compiled with
``triton.compile`` for ``cuda:90``. Printed per variant: shared memory, PTX instructions and a hash of
the PTX body (kernel parameters, comments, debug information and labels dropped), so two source trees
can be compared; with ``--check-tile-loops`` the run fails on a CTA barrier inside a tile loop of the
dispatch or combine kernel. ``tests/test_compile_sm90.py`` runs it.

Usage (repository root)::

    uv run python packages/ep-a2a/tests/sm90_compile.py --world 4 --node 2      # remote peers
    uv run python packages/ep-a2a/tests/sm90_compile.py --world 8 --num-sm 132  # intra-node
    uv run python packages/ep-a2a/tests/sm90_compile.py --fp8                    # a layer of FP8 rows
    uv run python packages/ep-a2a/tests/sm90_compile.py --low-latency --world 4  # low-latency mode

The arguments are specialised as Triton's launcher specialises them (pointers and ints divisible by
16, ints equal to 1), so the loads and stores get the vector widths they get on the GPU; ``--regs``
adds each variant's registers and spill bytes per thread from the ptxas bundled with Triton.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import re
import subprocess
import tempfile
import warnings
from typing import Any

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from ep_a2a.backends.triton import engine as E
from ep_a2a.backends.triton.resolve import engine_options
from ep_a2a.config import EPConfig
from ep_a2a.tuning import TritonTuning

TARGET = GPUTarget("cuda", 90, 32)


class _NoTransport:
    def put_signal(self, *args: int) -> None:
        pass

    def signal(self, *args: int) -> None:
        pass


def ptxas_usage(ptx: str) -> str:
    """``regs=N spill=S/L`` of a PTX module for sm_90a: registers per thread and spill store / load bytes,
    from the ptxas bundled with Triton."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    st, ld = (max(int(x[i]) for x in spill) for i in (0, 1)) if spill else (0, 0)
    return f"regs={max(int(r) for r in regs) if regs else -1:3d} spill={st}/{ld}"


def innermost_loops(body: list[str]) -> list[tuple[int, int]]:
    """``(first line, last line)`` of every innermost loop of a PTX body: a backward branch to a label,
    holding no other loop."""
    labels = {}
    for i, ln in enumerate(body):
        m = re.match(r"\s*(\$L__BB\d+_\d+):", ln)
        if m:
            labels[m.group(1)] = i
    loops = []
    for i, ln in enumerate(body):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ln)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    return [
        (a, b) for a, b in loops if not any(a <= a2 and b2 <= b and (a2, b2) != (a, b) for a2, b2 in loops)
    ]


def tile_loop_barriers(body: list[str]) -> list[tuple[int, int, int]]:
    """``(first line, last line, bar.sync count)`` of every innermost loop of a PTX body that moves
    16-byte vectors to or from global memory: the kernels' tile loops. A CTA barrier in a tile loop is
    paid per tile (a reduction over the ids once per tile of the combine was such a barrier)."""
    out = []
    for a, b in innermost_loops(body):
        lines = body[a : b + 1]
        if any((".global" in ln and ".v4." in ln) for ln in lines):
            out.append((a, b, sum("bar.sync" in ln for ln in lines)))
    return out


def compile_sm90(
    kernel: Any, options: dict, named: dict, dump: str | None = None, regs: bool = False
) -> tuple[int, int, str, list[tuple[int, int, int]], list[tuple[int, int, bool]]]:
    """``(shared bytes, PTX instructions, hash of the PTX body, tile loops, spin loops)`` of one
    launch's variant compiled with its ``options`` (``KernelLaunch.launch_options``, what the engine's
    launches and warmups pass). The body is also written to the file ``dump``; with ``regs`` the hash is
    followed by :func:`ptxas_usage`; tile loops: :func:`tile_loop_barriers`; spin loops: :func:`spin_loops`."""
    sig, const, attrs = {}, {}, {}
    for i, (p, param) in enumerate(inspect.signature(kernel.fn).parameters.items()):
        v = named.get(p, param.default)  # (arguments left at their defaults)
        if i in kernel.constexprs or v is None:
            sig[p], const[(i,)] = "constexpr", v
            continue
        # as Triton's launcher specialises them: pointers and ints divisible by 16 marked so (16-byte
        # vectors), ints equal to 1 as constants, except the kernel's do_not_specialize arguments
        kp = kernel.params[i]
        ty, spec = native_specialize_impl(
            BaseBackend, v, False, not kp.do_not_specialize, not kp.do_not_specialize_on_alignment
        )
        sig[p] = ty
        if ty == "constexpr":
            const[(i,)] = spec
        elif spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    k = triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=TARGET, options=options)
    ptx = k.asm["ptx"].split(".section\t.debug")[0]
    ptx = re.sub(r"\$L__tmp\d+:?", "", re.sub(r"//.*", "", ptx))
    skip = ("param", ".loc", ".file")
    body = [ln for ln in ptx.splitlines() if ln.strip() and not any(s in ln for s in skip)]
    n_ins = sum(1 for ln in body if ln.strip().endswith(";"))
    if dump:
        with open(dump, "w") as f:
            f.write("\n".join(body))
    h = hashlib.md5("\n".join(body).encode()).hexdigest()[:12]
    usage = " " + ptxas_usage(k.asm["ptx"]) if regs else ""
    return k.metadata.shared, n_ins, h + usage, tile_loop_barriers(body), spin_loops(body)


def build_engine(a: argparse.Namespace) -> E.TritonEPEngine:
    """Rank 0's engine for the layer of ``a`` on a CPU heap, with the options the Triton backend picks
    for ``TritonTuning(num_sm=a.num_sm, ...)`` (``resolve.engine_options``) as on an sm_90 GPU."""
    W, node = a.world, a.node or a.world
    dtype = torch.float8_e4m3fn if a.fp8 else torch.bfloat16
    cfg = EPConfig(
        max_tokens=a.tokens, hidden=a.hidden, topk=a.topk, num_tot_experts=a.experts, rank=0, world_size=W,
        local_world_size=W, token_dtype=dtype,
    )  # fmt: skip
    remote = [p for p in range(W) if p // node != 0]
    tuning = TritonTuning(
        num_sm=a.num_sm, send_ctas=a.split, combine_send_ctas=a.split, combine_maxnreg=a.combine_maxnreg
    )
    opts = engine_options(tuning, cfg, a.num_sm, remote=bool(remote))
    if not opts["block_h"]:  # the GPU's settings (the engine picks interpreter-sized tiles on a CPU)
        opts["block_h"] = min(1024, 1 << (a.hidden - 1).bit_length())
    lay = E.HeapLayout.build(
        world_size=W, max_tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts_per_rank=a.experts // W,
        token_bytes=dtype.itemsize, chunk=opts["chunk"], combine_chunk=opts["combine_chunk"], remote=bool(remote),
        row_bytes=E.heap_row_bytes(a.hidden, dtype),
    )  # fmt: skip
    eng = E.TritonEPEngine(
        rank=0, world_size=W, max_tokens=a.tokens, hidden=a.hidden, topk=a.topk, num_tot_experts=a.experts,
        token_dtype=dtype, weight_dtype=torch.float32, heap_local=torch.zeros(16, dtype=torch.uint8),
        ptr_table=torch.zeros(W, dtype=torch.int64), layout=lay, num_sm=a.num_sm, timeout_s=1.0,
        remote_ranks=remote, transport=_NoTransport() if remote else None, **opts,
    )  # fmt: skip
    eng.use_timer = True  # (the engine sees a CPU: the GPU's timer, PDL and early sends as on sm_90)
    eng.timeout_arg = int(a.timeout_s * 1e9)
    eng.pdl = True
    return eng


def spin_loops(body: list[str]) -> list[tuple[int, int, bool]]:
    """``(first line, last line, reloaded)`` of every innermost loop of a PTX body that polls epoch words
    with ``ld.acquire.sys`` loads (``kernels._spin_epoch``); ``reloaded``: the words are loaded again
    within the few instructions after the loop. Words fewer than the CTA's threads are held by several
    threads each, and the loop's exit is decided by a reduction over one copy: without that load a
    thread whose copy predates a word's arrival would go on with the older word."""
    out = []
    for a, b in innermost_loops(body):
        if any("ld.acquire.sys" in x for x in body[a : b + 1]):
            after = [x for x in body[b + 1 :] if x.strip().endswith((";", "}"))][:8]
            out.append((a, b, any("ld.acquire.sys" in x for x in after)))
    return out


def build_low_latency_engine(a: argparse.Namespace) -> Any:
    """Rank 0's low-latency engine (``TritonTuning(low_latency=True)``) for the layer of ``a``, as the
    backend builds it on an sm_90 GPU of ``a.num_sm`` SMs."""
    from ep_a2a.backends.triton.low_latency import LowLatencyEngine, LowLatencyLayout

    W = a.world
    dtype = torch.float8_e4m3fn if a.fp8 else torch.bfloat16
    lay = LowLatencyLayout.build(
        world_size=W, max_tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts_per_rank=a.experts // W,
        row_bytes=E.heap_row_bytes(a.hidden, dtype), comb_bytes=2,
    )  # fmt: skip
    eng = LowLatencyEngine(
        rank=0, world_size=W, max_tokens=a.tokens, hidden=a.hidden, topk=a.topk, num_tot_experts=a.experts,
        weight_dtype=torch.float32, heap_local=torch.zeros(16, dtype=torch.uint8),
        ptr_table=torch.zeros(W, dtype=torch.int64), layout=lay, num_sm=a.num_sm, timeout_s=a.timeout_s,
    )  # fmt: skip
    # (the engine sees a CPU: the GPU's timer and tiles as on sm_90)
    eng.use_timer, eng.timeout_arg = True, int(a.timeout_s * 1e9)
    eng.block_h, eng.num_warps = 8192, 8
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--node", type=int, default=0, help="simulated node size (0: one node, no remote peers)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--num-sm", type=int, default=132, help="TritonTuning.num_sm (an H100 / H200: 132)")
    ap.add_argument("--split", type=int, default=None, help="send_ctas = combine_send_ctas (default: picked)")
    ap.add_argument("--combine-maxnreg", type=int, default=None)
    ap.add_argument(
        "--timeout-s", type=float, default=300.0, help="the layer's timeout_s (the kernels' bound)"
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="a layer of FP8 rows (dtype=torch.float8_e4m3fn): its packed FP8 rows (as they are and quantized "
        "from bf16 rows on send) and raw float8 rows, bf16 and float32 combine rows (as the backend's use_aot "
        "compiles them)",
    )
    ap.add_argument(
        "--low-latency",
        action="store_true",
        help="the low-latency mode's kernels (TritonTuning(low_latency=True)): dispatch of the layer's rows, of "
        "packed FP8 rows and quantizing bf16 rows on send (with --fp8: the FP8 ones), combine in bf16",
    )
    ap.add_argument(
        "--check-spin-reload",
        action="store_true",
        help="exit 1 if a loop polling epoch words (kernels._spin_epoch) is not followed by a load of the words "
        "again (every thread then holds the values the CTA's exit decision saw)",
    )
    ap.add_argument("--dump", default=None, help="write each variant's PTX body into this folder")
    ap.add_argument("--regs", action="store_true", help="registers and spill bytes per variant (ptxas -v)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="of the dispatch variants only those with weights and no caller scatter",
    )
    ap.add_argument(
        "--check-tile-loops",
        action="store_true",
        help="exit 1 if a tile loop of the dispatch or combine kernel (an innermost loop with 16-byte global"
        " loads or stores) has a CTA barrier; for tiled layers (4096 tokens): in decode-sized ones the"
        " innermost loop is the per-chunk loop, whose barriers are by design",
    )
    a = ap.parse_args()
    # (Triton 3.9 warns on a compile that leaves FP fusion to its default: every variant must set it)
    warnings.filterwarnings("error", message="TRITON_DEFAULT_FP_FUSION is unset", category=UserWarning)
    if a.low_latency:
        ll = build_low_latency_engine(a)
        print(f"low-latency world {a.world}, {a.tokens} tokens, {a.num_sm} SMs; sm_90")
        rows = (E.FP8_ROW_DTYPE,) if a.fp8 else (torch.bfloat16, E.FP8_ROW_DTYPE)
        unloaded = []
        for spec in ll.variants(row_dtypes=rows, quantize_from=(torch.bfloat16,)):
            named = spec.arguments()
            shared, n_ins, h, _, spins = compile_sm90(spec.kernel, spec.launch_options(), named, None, a.regs)
            print(f"{spec.key[0]:12s} {spec.key[1:]!s:60s} shared={shared:6d} ptx_ins={n_ins:6d} body={h} "
                  f"spin-reloads={[r for _, _, r in spins]}", flush=True)  # fmt: skip
            unloaded += [f"{spec.key[0]} lines {lo}-{hi}" for lo, hi, r in spins if not r]
        if a.check_spin_reload and unloaded:
            raise SystemExit("epoch words not loaded again after the spin: " + "; ".join(unloaded))
        return
    eng = build_engine(a)
    W = a.world
    remote = list(eng.remote_ranks)
    print(f"world {W}, node {a.node or W}, remote peers of rank 0: {remote}; sm_90")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
    bad: list[str] = []
    unloaded: list[str] = []
    fp8 = (
        {
            "row_dtypes": (E.FP8_ROW_DTYPE, torch.float8_e4m3fn),
            "combine_dtypes": (torch.bfloat16,),
            "quantize_from": (torch.bfloat16,),
        }
        if a.fp8
        else {}
    )
    variants = eng.variants(dtypes=(torch.float32,), rewrite=not remote, mirror=not remote, **fp8)
    if a.quick:  # (dispatch and expand keys start with has_w, caller_scatter)
        variants = [
            v for v in variants if v.key[0] not in ("dispatch", "expand") or v.key[1:3] == (True, False)
        ]
    for i, spec in enumerate(variants):
        name = spec.key[0]
        dump = os.path.join(a.dump, f"{i}-{name}.ptx") if a.dump else None
        shared, n_ins, h, loops, spins = compile_sm90(
            spec.kernel, spec.launch_options(), spec.arguments(), dump, a.regs
        )
        barriers = [n for _, _, n in loops]
        print(f"{name:8s} {spec.key[1:]!s:100s} shared={shared:6d} ptx_ins={n_ins:6d} body={h} "
              f"tile-loop-barriers={barriers} spin-reloads={[r for _, _, r in spins]}", flush=True)  # fmt: skip
        unloaded += [f"{i}-{name}: lines {lo}-{hi}" for lo, hi, r in spins if not r]
        if (
            name in ("dispatch", "combine")
            and spec.key[1:]
            and (name != "combine" or spec.key[1] == a.hidden)
        ):
            bad += [f"{i}-{name}: lines {lo}-{hi}, {n} bar.sync" for lo, hi, n in loops if n]
    if a.check_tile_loops and bad:
        raise SystemExit("CTA barriers inside tile loops: " + "; ".join(bad))
    if a.check_spin_reload and unloaded:
        raise SystemExit("epoch words not loaded again after the spin: " + "; ".join(unloaded))


if __name__ == "__main__":
    main()
