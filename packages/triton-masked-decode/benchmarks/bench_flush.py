"""Timing with either L2 flush, side by side (a diagnostic, not ``nox -s bench``).

    python packages/triton-masked-decode/benchmarks/bench_flush.py --out docs/benchmarks/triton-masked-decode-flush.json

``triton.testing.do_bench`` flushes the L2 before each timed call by writing zeros to a 256 MB buffer, which
leaves the L2 full of dirty lines; the call being timed then also pays for writing them back to HBM.
``run.py`` flushes by reading the buffer instead (``bench_masked_decode.flush_l2``). This script times the
same CUDA graphs with both flushes, alternated (three rounds, median of the rounds), for

* a read-only probe (``sum`` over 32 MB / 128 MB buffers): the extra time of the "zero" flush is the
  write-back it leaves behind;
* ``masked_decode`` (default launch) at the seed's shapes with the 50% random mask and with the sparse masks
  of ``run.py`` at batch 1 and 8, and torch SDPA at two of them;

and reports each sparse case's time relative to the same batch's 50%-mask time under each flush.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_masked_decode import FLUSH_METHODS, Case, copy_bandwidth, make_mask, run_header, time_us

from triton_masked_decode import masked_decode

L, ALLOC = 65536, 131072
ROUNDS = 3


def cases() -> list[Case]:
    out = []
    for b in (1, 8):
        out.append(Case("seed", b, [L] * b, ALLOC, 0.5, "random"))
        for pattern in ("random", "cluster64"):
            for dens in (0.1, 0.25):
                out.append(Case("sparse", b, [L] * b, L, dens, pattern))
    return out


def build(c: Case) -> dict:
    """Inputs laid out as in ``run.py`` (flat [B, Hkv, alloc, D] buffers viewed over the valid length)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, hkv, d, vl = c.batch, c.hkv, c.dim, c.lengths[0]
    q = torch.randn(b, c.hq, d, generator=gen, device="cuda", dtype=torch.float16)
    kf = torch.randn(b * hkv * c.alloc * d, generator=gen, device="cuda", dtype=torch.float16)
    vf = torch.randn_like(kf)
    mask_full = make_mask(c, gen)
    assert mask_full is not None
    k = kf[: b * hkv * vl * d].view(b, hkv, vl, d)
    v = vf[: b * hkv * vl * d].view(b, hkv, vl, d)
    return {"q": q, "k": k, "v": v, "mask": mask_full[..., :vl].contiguous()}


def timed(fn, rounds: int = ROUNDS) -> dict[str, float]:
    """Median over ``rounds`` of each flush's median (flushes alternated within a round), microseconds."""
    per: dict[str, list[float]] = {m: [] for m in FLUSH_METHODS}
    for _ in range(rounds):
        for m in FLUSH_METHODS:
            per[m].append(time_us(fn, flush=m)[0])
    return {m: statistics.median(v) for m, v in per.items()} | {f"{m}_rounds": v for m, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    bw = copy_bandwidth(flush="clean")
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.3f} TB/s (clean flush)", flush=True)
    probes = []
    for mb in (32, 128):
        x = torch.ones(mb << 18, dtype=torch.float32, device="cuda")
        s = torch.zeros((), dtype=torch.float32, device="cuda")
        t = timed(lambda x=x, s=s: torch.sum(x, dim=0, out=s))
        probes.append({"read_MB": mb, **t})
        print(
            f"read {mb:4d} MB: clean {t['clean']:7.1f} us, zero {t['zero']:7.1f} us "
            f"(+{t['zero'] - t['clean']:.1f} us)",
            flush=True,
        )
        del x
    rows = []
    for c in cases():
        inp = build(c)
        q, k, v, mask = inp["q"], inp["k"], inp["v"], inp["mask"]
        provs = {"ours": lambda q=q, k=k, v=v, mask=mask: masked_decode(q, k, v, mask, check_values=False)}
        if c.batch == 1 and (c.group == "seed" or (c.pattern, c.density) == ("random", 0.25)):
            b, hkv, g, vl = c.batch, c.hkv, c.hq // c.hkv, c.lengths[0]
            am = (~mask)[:, :, None, None, :].expand(b, hkv, g, 1, vl).reshape(b, c.hq, 1, vl).contiguous()
            q4 = q.view(b, c.hq, 1, c.dim)
            provs["sdpa"] = lambda am=am, q4=q4, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                q4, k, v, attn_mask=am, enable_gqa=True
            )
        for p, fn in provs.items():
            t = timed(fn)
            rows.append({"case": c.name, "batch": c.batch, "group": c.group, "pattern": c.pattern,
                         "density": c.density, "provider": p, **t})  # fmt: skip
            print(
                f"{c.name:28s} {p:5s} clean {t['clean']:7.1f} us  zero {t['zero']:7.1f} us "
                f"(+{t['zero'] - t['clean']:.1f})",
                flush=True,
            )
        del inp, provs
        torch.cuda.empty_cache()
    ratios = []
    for r in rows:
        if r["group"] != "sparse" or r["provider"] != "ours":
            continue
        dense = next(
            x for x in rows if x["group"] == "seed" and x["batch"] == r["batch"] and x["provider"] == "ours"
        )
        ratio = {m: r[m] / dense[m] for m in FLUSH_METHODS}
        ratios.append({"case": r["case"], **ratio})
        print(f"{r['case']:28s} / 50% mask: clean {ratio['clean']:.3f}  zero {ratio['zero']:.3f}", flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    **run_header(
                        "CUDA-graph replay times under a read (clean) vs a zero-write L2 flush; see the docstring"
                    ),
                    "copy_bandwidth_Bps_clean": bw,
                    "rounds": ROUNDS,
                    "read_probes": probes,
                    "rows": rows,
                    "sparse_over_dense50": ratios,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
