"""Demo of sparse-mla-attn (`python -m sparse_mla_attn.demo`).

Runs the forward, attn_dist (+ indexer_target) and paged decode kernels on a small problem with invalid
indices and checks each against its float32 reference. On a GPU the kernels run natively; on a CPU-only
machine the demo re-runs itself under Triton's interpreter (TRITON_INTERPRET=1), which executes the same
kernels on CPU tensors. Exits with status 1 if any check fails.
"""

import math
import os
import subprocess
import sys
import time


def main() -> int:
    import torch

    from sparse_mla_attn._runtime import interpreting

    if not torch.cuda.is_available() and not interpreting():
        # Triton reads TRITON_INTERPRET when the kernels are defined, so start a fresh interpreter.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.call([sys.executable, "-m", "sparse_mla_attn.demo"], env=env)

    import sparse_mla_attn as sm
    from sparse_mla_attn._inputs import random_indices, sprinkle_invalid

    dev = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    s_q, h_q, d_qk, s_kv, topk = (256, 128, 576, 8192, 512) if dev == "cuda" else (4, 16, 576, 64, 40)
    scale = 1 / math.sqrt(d_qk)
    q = torch.randn(s_q, h_q, d_qk, device=dev, generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, d_qk, device=dev, generator=g).bfloat16()
    idx = sprinkle_invalid(random_indices(s_q, s_kv, topk, device=dev, generator=g), s_kv, 0.1, generator=g)
    start = s_kv - s_q
    t0 = time.perf_counter()
    out, _, lse = sm.sparse_mla_fwd(q, kv, idx, scale, causal=True, q_start_index=start)
    attn_sum = sm.attn_dist(q, kv, idx, lse, scale, q_start_index=start)
    target = sm.indexer_target(attn_sum)
    b, block = 2, 16
    cache = torch.randn(8, block, 1, d_qk, device=dev, generator=g).bfloat16()
    block_table = torch.tensor([[3, 1, 6], [0, 7, 2]], dtype=torch.int32, device=dev)
    seqlens = torch.tensor([40, 25], dtype=torch.int32, device=dev)
    dec_idx = torch.randint(-2, 48, (b, 1, 20), dtype=torch.int32, device=dev, generator=g)
    q_dec = torch.randn(b, 1, h_q, d_qk, device=dev, generator=g).bfloat16()
    dec_out, dec_lse = sm.sparse_mla_decode(q_dec, cache, block_table, seqlens, dec_idx, scale)
    elapsed = time.perf_counter() - t0

    ref_out, _, ref_lse = sm.sparse_mla_fwd_ref(
        q.float(), kv.float(), idx, scale, causal=True, q_start_index=start
    )
    ref_sum = sm.attn_dist_ref(q, kv, idx, lse, scale, q_start_index=start)
    ref_dec, ref_dec_lse = sm.sparse_mla_decode_ref(
        q_dec.float(), cache.float(), block_table, seqlens, dec_idx, scale
    )
    checks = {
        "fwd out": (out.float() - ref_out).abs().max().item(),
        "fwd lse": (lse - ref_lse).nan_to_num().abs().max().item(),
        "attn_dist": (attn_sum - ref_sum).abs().max().item(),
        "decode out": (dec_out.float() - ref_dec).abs().max().item(),
        "decode lse": (dec_lse - ref_dec_lse).nan_to_num().abs().max().item(),
        "target row sums - 1": (target.sum(-1) - 1).abs().max().item(),
    }
    limits = {"fwd out": 2e-2, "fwd lse": 1e-3, "attn_dist": 1e-3, "decode out": 2e-2, "decode lse": 1e-3}
    limits["target row sums - 1"] = 1e-4
    mode = torch.cuda.get_device_name() if dev == "cuda" else "CPU, Triton interpreter"
    print(
        f"sparse-mla-attn {sm.__version__} demo on {mode}: s_q={s_q} h_q={h_q} d_qk={d_qk} s_kv={s_kv} topk={topk}"
    )
    print(f"kernels ran in {elapsed:.2f} s (first call includes compilation)")
    ok = True
    for name, err in checks.items():
        good = err <= limits[name] and not math.isnan(err)
        ok &= good
        print(f"  {name:22s} max |err| = {err:.2e}  (limit {limits[name]:.0e})  {'ok' if good else 'FAIL'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
