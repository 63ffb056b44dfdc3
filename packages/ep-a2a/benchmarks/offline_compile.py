"""Compile every kernel launch of one rank's Triton engine for sm_90, without a GPU.

Each launch the engine makes in one dispatch (counts-first flow, and the merged flow for groups without
remote peers), one combine and one barrier is captured instead of run, then compiled with
``triton.compile`` for ``cuda:90``. Printed per launch: shared memory, PTX instructions and a hash of the
PTX body (kernel parameters, comments, debug information and labels dropped), so two source trees can
be compared: run once per tree (``PYTHONPATH=<tree>/packages/ep-a2a/src``) and diff the outputs.

Usage (repository root)::

    uv run python packages/ep-a2a/benchmarks/offline_compile.py --world 4 --node 2      # remote peers
    uv run python packages/ep-a2a/benchmarks/offline_compile.py --world 8 --split 16    # intra-node

``--node`` is the simulated node size (``force_remote``): ranks outside rank 0's block are remote.
``--backend-tiles`` takes the tiles ``TritonBackend`` picks for the shape and ``--num-sm`` (else chunk
``--chunk``, 8 warps, 1024 wide); ``--regs`` adds each variant's registers and spill bytes per thread
from the ptxas bundled with Triton (``ptxas -v``), so tile choices can be checked for spills offline;
``--id-dtype int64`` gives the kernels int64 expert ids. The arguments are specialised as Triton's
launcher specialises them (pointers and ints divisible by 16, ints equal to 1), so the loads and stores
get the vector widths they get on the GPU. (The first versions of this tool did not: their register and
spill figures were those of scalar loads.) Each launch line ends with the ``bar.sync`` count of each
tile loop (:func:`tile_loop_barriers`); ``--check-tile-loops`` fails on a CTA barrier in a tile loop of
the dispatch or combine kernel (``tests/test_offline_compile.py`` runs it on large layers' tiles).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import re
import subprocess
import tempfile
from typing import Any

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from ep_a2a.triton_backend import engine as E

TARGET = GPUTarget("cuda", 90, 32)


class _NoTransport:
    def put_signal(self, *args: int) -> None:
        pass

    def signal(self, *args: int) -> None:
        pass


def _capture(launches: list) -> None:
    def fake_launch(
        self, key, kernel, grid, num_warps, var_names, var_vals, fixed, launch_pdl=False, maxnreg=None
    ) -> None:
        named = fixed()
        named.update(zip(var_names, var_vals, strict=True))
        launches.append((key, kernel, num_warps, named, maxnreg))

    E.TritonEPEngine._launch = fake_launch  # type: ignore[method-assign]


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


def tile_loop_barriers(body: list[str]) -> list[tuple[int, int, int]]:
    """``(first line, last line, bar.sync count)`` of every innermost loop of a PTX body that moves
    16-byte vectors to or from global memory: the kernels' tile loops. A loop is a backward branch to a
    label; innermost: it holds no other loop. A CTA barrier in a tile loop is paid per tile (as the
    combine's per-tile reduction over the ids was, between ``cd8c480`` and ``056468a``)."""
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
    out = []
    for a, b in loops:
        if any(a <= a2 and b2 <= b and (a2, b2) != (a, b) for a2, b2 in loops):
            continue  # not innermost
        lines = body[a : b + 1]
        if any((".global" in ln and ".v4." in ln) for ln in lines):
            out.append((a, b, sum("bar.sync" in ln for ln in lines)))
    return out


def compile_sm90(
    kernel: Any,
    num_warps: int,
    named: dict,
    dump: str | None = None,
    regs: bool = False,
    maxnreg: int | None = None,
) -> tuple[int, int, str, list[tuple[int, int, int]]]:
    """``(shared bytes, PTX instructions, hash of the PTX body, tile loops)`` of one launch's variant
    (the body also written to the file ``dump``; with ``regs`` the hash is followed by
    :func:`ptxas_usage`; tile loops: :func:`tile_loop_barriers`)."""
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
    opts: dict[str, Any] = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=TARGET, options=opts)
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
    return k.metadata.shared, n_ins, h + usage, tile_loop_barriers(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--node", type=int, default=0, help="simulated node size (0: one node, no remote peers)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--split", type=int, default=0, help="send_ctas = combine_send_ctas")
    ap.add_argument(
        "--steal", action="store_true", help="work stealing with the split (TritonBackend's default)"
    )
    ap.add_argument("--num-sm", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--dump", default=None, help="write each launch's PTX body into this folder")
    ap.add_argument("--pdl", action="store_true", help="the row kernel as launched with PDL on sm_90")
    ap.add_argument("--probe", action="store_true", help="with the profiling stamps (engine.probe)")
    ap.add_argument("--backend-tiles", action="store_true", help="the tiles TritonBackend picks (see above)")
    ap.add_argument("--regs", action="store_true", help="registers and spill bytes per launch (ptxas -v)")
    ap.add_argument("--combine-maxnreg", type=int, default=None, help="the engine's combine_maxnreg")
    ap.add_argument("--id-dtype", default="int32", choices=["int32", "int64"], help="dtype of the expert ids")
    ap.add_argument(
        "--check-tile-loops",
        action="store_true",
        help="exit 1 if a tile loop of the dispatch or combine kernel (an innermost loop with 16-byte global"
        " loads or stores) has a CTA barrier; for tiled layers (with --backend-tiles at 4096 tokens):"
        " in decode-sized ones the innermost loop is the per-chunk loop, whose barriers are by design",
    )
    a = ap.parse_args()
    tiles: dict[str, Any] = {}
    if a.backend_tiles:
        from ep_a2a.triton_backend.backend import _default_tiles

        d, c = _default_tiles(a.hidden, a.tokens, a.num_sm)
        a.chunk = d["chunk"]
        tiles = {"num_warps": d["num_warps"], "block_h": d["block_h"]}
        tiles.update(combine_chunk=c["chunk"], combine_warps=c["num_warps"], combine_block_h=c["block_h"])
        lay_kw = {"combine_chunk": c["chunk"]}
    W, node = a.world, a.node or a.world
    remote = [p for p in range(W) if p // node != 0]
    if not a.backend_tiles:
        lay_kw = {}
    if remote:  # (a tree from before the remote path has no such argument)
        lay_kw["remote"] = True
    lay = E.HeapLayout.build(
        world_size=W, max_tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts_per_rank=a.experts // W,
        token_bytes=2, chunk=a.chunk, **lay_kw,
    )  # fmt: skip
    eng_kw: dict[str, Any] = {"remote_ranks": remote, "transport": _NoTransport()} if remote else {}
    eng = E.TritonEPEngine(
        rank=0, world_size=W, max_tokens=a.tokens, hidden=a.hidden, topk=a.topk, num_tot_experts=a.experts,
        token_dtype=torch.bfloat16, weight_dtype=torch.float32, heap_local=torch.zeros(16, dtype=torch.uint8),
        ptr_table=torch.zeros(W, dtype=torch.int64), layout=lay, num_sm=a.num_sm, timeout_s=1.0, chunk=a.chunk,
        send_ctas=a.split, combine_send_ctas=a.split, combine_maxnreg=a.combine_maxnreg, **eng_kw, **tiles,
    )  # fmt: skip
    eng.use_timer = True
    if a.steal:  # (set after construction: a tree from before work stealing has no such argument)
        eng.steal = True
    if not a.backend_tiles:  # the GPU's settings (the engine picks interpreter-sized tiles on a CPU)
        eng.block_h = min(1024, 1 << (a.hidden - 1).bit_length())
        eng.num_warps = 8 if eng.block_h >= 512 else 4
    eng.pdl = a.pdl
    if a.probe:
        eng.probe = torch.zeros(2, a.num_sm, int(E.K.PROBE_SLOTS.value), dtype=torch.int64)
    launches: list = []
    _capture(launches)
    n = 16
    x = torch.zeros(n, a.hidden, dtype=torch.bfloat16)
    ids = torch.zeros(n, a.topk, dtype=getattr(torch, a.id_dtype))
    w = torch.zeros(n, a.topk)
    rb = eng.alloc_remote() if remote else None
    rkw: dict[str, Any] = {"remote": rb} if remote else {}
    info = torch.zeros(eng.info_len, dtype=torch.int64)
    eng.launch_layout(ids, caller_scatter=False, info=info, **rkw)
    eng.launch_counts(info, **rkw)
    b = eng.alloc_dispatch_outputs(n, 64, with_weights=True)
    args = (x, ids, w, eng.pos, b["out"], b["out_w"], b["out_e"], b["tab"], b["skip"], b["scat"])
    eng.launch_dispatch(
        *args, caller_scatter=False, info=info, **rkw, **({"npk_send": [0] * W} if remote else {})
    )
    if not remote:
        eng.launch_dispatch(*args, caller_scatter=False, info=info, counts=True)
    y = torch.zeros(64, a.hidden, dtype=torch.bfloat16)
    out = torch.zeros(n, a.hidden, dtype=torch.bfloat16)
    eng.launch_combine(
        y, b["tab"], ids, info[2 : 2 + W], out, **rkw, **({"npk_recv": [0] * W} if remote else {})
    )
    eng.launch_barrier()
    print(f"world {W}, node {node}, remote peers of rank 0: {remote}; sm_90")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
    bad = []
    for i, (key, kernel, nw, named, maxnreg) in enumerate(launches):
        dump = os.path.join(a.dump, f"{i}-{key[0]}.ptx") if a.dump else None
        shared, n_ins, h, loops = compile_sm90(kernel, nw, named, dump, a.regs, maxnreg)
        barriers = [n for _, _, n in loops]
        print(f"{key[0]:8s} {key[1:7]!s:64s} shared={shared:6d} ptx_ins={n_ins:6d} body={h} "
              f"tile-loop-barriers={barriers}")  # fmt: skip
        if key[0] in ("dispatch", "combine"):
            bad += [f"{i}-{key[0]}: lines {lo}-{hi}, {n} bar.sync" for lo, hi, n in loops if n]
    if a.check_tile_loops and bad:
        raise SystemExit("CTA barriers inside tile loops: " + "; ".join(bad))


if __name__ == "__main__":
    main()
