"""Tile / pipelining / split sweep for the masked decode kernel (a tuning aid, not part of ``nox -s bench``).

    python packages/triton-masked-decode/benchmarks/tune_masked_decode.py [--out FILE.json]

Times forced dense / sparse loops and ``auto`` at the seed's shapes (Hq=32, Hkv=8, D=128, fp16, L=64K)
for several (BLOCK_N, num_warps, num_stages) tiles and split targets, with CUDA-graph timing, and prints
the compiled kernels' registers and spills.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_masked_decode import copy_bandwidth, time_us

from triton_masked_decode import masked_decode

md = sys.modules["triton_masked_decode.masked_decode"]  # the package re-exports a function of that name

TILES = [(64, 4, 3), (64, 4, 2), (64, 4, 4), (32, 4, 3), (32, 4, 4), (128, 4, 2), (128, 8, 2), (64, 8, 3)]
CASES = [  # name, batch, visible fraction, pattern
    ("B1-rand50", 1, 0.5, "random"),
    ("B8-rand50", 8, 0.5, "random"),
    ("B1-rand10", 1, 0.1, "random"),
    ("B4-rand25", 4, 0.25, "random"),
    ("B1-clus25", 1, 0.25, "cluster64"),
    ("B1-nomask", 1, 1.0, "none"),
]


def make(batch: int, dens: float, pattern: str, length: int = 65536):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn_like(k)
    if pattern == "none":
        mask = None
    elif pattern == "cluster64":
        mask = ~(torch.rand(batch, 8, length // 64, device="cuda", generator=g) < dens).repeat_interleave(
            64, -1
        )
    else:
        mask = torch.rand(batch, 8, length, device="cuda", generator=g) >= dens
    return q, k, v, mask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bw {bw / 1e12:.3f} TB/s", flush=True)
    data = {name: make(b, d, p) for name, b, d, p in CASES}
    floors = {
        name: (2 * 8 * 65536 * 128 * 2 * b + (8 * 65536 * b if p != "none" else 0)) / bw * 1e6
        for name, b, d, p in CASES
    }
    rows = []

    def measure(tag: str, name: str, path: str) -> None:
        q, k, v, mask = data[name]
        fn = lambda: masked_decode(q, k, v, mask, path=path, check_values=False)
        t, method = time_us(fn, warmup=10, rep=60)
        rows.append(
            {
                "variant": tag,
                "case": name,
                "path": path,
                "us": t,
                "floor_frac": floors[name] / t,
                "method": method,
            }
        )
        print(f"{tag:28s} {name:10s} {path:7s} {t:8.1f} us  {floors[name] / t * 100:6.1f}% floor", flush=True)

    for bn, nw, ns in TILES:
        md._TUNE_OVERRIDE.clear()
        md._TUNE_OVERRIDE.update(block_n=bn, num_warps=nw, num_stages=ns)
        tag = f"BN{bn}-w{nw}-s{ns}"
        for name, _, _, p in CASES:
            paths = ["auto"] if p == "none" else ["auto", "dense", "sparse"]
            for path in paths:
                measure(tag, name, path)
    md._TUNE_OVERRIDE.clear()
    for per_sm in (1, 2, 8, 16):
        md._TUNE_OVERRIDE.update(programs_per_sm=per_sm)
        for name in ("B1-rand50", "B1-rand10", "B1-nomask"):
            measure(f"default-perSM{per_sm}", name, "auto")
    md._TUNE_OVERRIDE.clear()
    for bc in (512, 2048):
        md._TUNE_OVERRIDE.update(block_c=bc)
        for name in ("B1-rand10", "B4-rand25"):
            measure(f"default-BC{bc}", name, "sparse")
    md._TUNE_OVERRIDE.clear()
    q, k, v, mask = data["B1-rand50"]
    am = (~mask)[:, :, None, None, :].expand(1, 8, 4, 1, 65536).reshape(1, 32, 1, 65536).contiguous()
    t, method = time_us(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=am, enable_gqa=True
        )
    )
    print(f"sdpa B1-rand50 {t:.1f} us ({method}) {floors['B1-rand50'] / t * 100:.1f}% floor")
    kinfo = []
    for kern in (md._masked_decode_split_kernel, md._merge_splits_kernel):
        for dev_cache in getattr(kern, "device_caches", {}).values():
            cache = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for key, ck in cache.items():
                info = {
                    "kernel": kern.__name__,
                    "n_regs": getattr(ck, "n_regs", None),
                    "n_spills": getattr(ck, "n_spills", None),
                    "shared": ck.metadata.shared if hasattr(ck, "metadata") else None,
                    "warps": ck.metadata.num_warps if hasattr(ck, "metadata") else None,
                    "stages": ck.metadata.num_stages if hasattr(ck, "metadata") else None,
                    "key": str(key)[-300:],
                }
                kinfo.append(info)
    for i in kinfo:
        print(
            {k: i[k] for k in ("kernel", "n_regs", "n_spills", "shared", "warps", "stages")}, i["key"][-160:]
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"bw": bw, "rows": rows, "kernels": kinfo}, indent=1))


if __name__ == "__main__":
    main()
