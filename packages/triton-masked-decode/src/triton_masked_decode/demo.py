"""``python -m triton_masked_decode.demo``: one masked decode step, checked against the reference.

On a GPU it runs the Triton kernel at a realistic size (dense and paged cache); on a CPU-only machine it
runs the same kernel at a tiny size through the Triton interpreter (re-launching itself with
``TRITON_INTERPRET=1``). With ``TRITON_INTERPRET=0`` and no GPU it can only check the float32 reference
against a direct softmax.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def _report(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    err = (out.float() - ref.float()).abs().max().item()
    ok = err <= tol and not torch.isnan(out).any().item()
    print(f"  {name:34s} max |out - ref| = {err:.2e}  ({'ok' if ok else 'FAIL'}, tol {tol:g})")
    return ok


def main() -> int:
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") is None:
        # No GPU: run the same Triton kernels through the interpreter, which must be chosen before the
        # package (and its kernels) is imported, hence a fresh process.
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.call([sys.executable, "-m", "triton_masked_decode.demo"], env=env)
    from triton_masked_decode import MaskedDecodeConfig, masked_decode, masked_decode_ref, pack_mask

    torch.manual_seed(0)
    gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    dev = torch.device("cuda" if gpu else "cpu")
    b, hkv, group, d, length = (4, 8, 4, 128, 8192) if gpu else (2, 2, 4, 32, 48)
    q = torch.randn(b, hkv * group, d, device=dev, dtype=torch.float16)
    k = torch.randn(b, hkv, length, d, device=dev, dtype=torch.float16)
    v = torch.randn_like(k)
    mask = torch.rand(b, hkv, length, device=dev) < 0.7  # True = excluded: 30% visible
    seqlens = torch.randint(1, length + 1, (b,), device=dev, dtype=torch.int32)
    k[mask] = float("nan")  # excluded rows must never be read
    v[mask] = float("nan")
    ref, _ = masked_decode_ref(q, k, v, mask, seqlens=seqlens)
    ok = True
    if gpu or interp:
        where = "GPU" if gpu else "CPU, Triton interpreter"
        print(f"masked_decode on {where}: B={b} Hq={hkv * group} Hkv={hkv} D={d} L={length}, 30% visible")
        for path in ("auto", "dense", "sparse"):
            out, _ = masked_decode(q, k, v, mask, seqlens=seqlens, config=MaskedDecodeConfig(path=path))
            ok &= _report(f"bool mask, path={path}", out, ref, 5e-3)
        out, _ = masked_decode(q, k, v, pack_mask(mask), seqlens=seqlens)
        ok &= _report("bit-packed mask", out, ref, 5e-3)
        page = 16
        pages = b * length // page
        perm = torch.randperm(pages, device=dev)
        block_table = perm.view(b, length // page).to(torch.int32)
        kp = torch.empty(pages, page, hkv, d, device=dev, dtype=k.dtype)
        vp = torch.empty_like(kp)
        kp[perm] = k.permute(0, 2, 1, 3).reshape(pages, page, hkv, d)
        vp[perm] = v.permute(0, 2, 1, 3).reshape(pages, page, hkv, d)
        out, _ = masked_decode(q, kp, vp, mask, seqlens=seqlens, block_table=block_table)
        ok &= _report(f"paged cache (page_size={page}, shuffled)", out, ref, 5e-3)
    else:
        print("TRITON_INTERPRET=0 without a GPU: checking the reference only (the kernel cannot run).")
        for bi in range(b):
            for h in range(hkv * group):
                kh = h // group
                vis = ~mask[bi, kh, : int(seqlens[bi])]
                if not vis.any():
                    ok &= bool((ref[bi, h] == 0).all())
                    continue
                s = (k[bi, kh, : int(seqlens[bi])][vis].double() @ q[bi, h].double()) * d**-0.5
                direct = torch.softmax(s, 0) @ v[bi, kh, : int(seqlens[bi])][vis].double()
                ok &= bool(torch.allclose(ref[bi, h].double(), direct, atol=2e-3, rtol=2e-3))
        print(f"  reference vs direct softmax: {'ok' if ok else 'FAIL'}")
    print("demo", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
