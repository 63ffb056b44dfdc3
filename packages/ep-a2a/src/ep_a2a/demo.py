"""Demo of ep-a2a (``python -m ep_a2a.demo``): a 2-process dispatch -> expert -> combine round trip.

Runs on two local processes: NCCL with one GPU each when two GPUs are visible, gloo on CPU otherwise.
Every rank checks its dispatch rows, weights and combine result against the single-process reference
(:mod:`ep_a2a.reference`) computed from all ranks' inputs, and the parent prints a summary.
"""

from __future__ import annotations

import sys
import time

import torch

WORLD = 2
HIDDEN = 256
TOPK = 4
EXPERTS = 16
TOKENS = (48, 29)  # different per rank on purpose
SEED = 2024


def _inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(SEED)
    xs, idxs, ws = [], [], []
    for n in TOKENS:
        xs.append(torch.randn(n, HIDDEN, generator=gen).to(dtype))
        logits = torch.randn(n, EXPERTS, generator=gen)
        top = logits.topk(TOPK, dim=1)
        idx = top.indices.to(torch.int32)
        idx[:3, -1] = -1  # a few dropped slots (e.g. capacity limits)
        ws.append(torch.softmax(top.values, dim=1))
        idxs.append(idx)
    return xs, idxs, ws


def _expert(rows: torch.Tensor, local_expert: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Stand-in expert MLP: each local expert scales by its own factor; then the routing weight."""
    return (rows.float() * (1.0 + 0.5 * local_expert.float()[:, None]) * weights[:, None]).to(rows.dtype)


def _rank_main(rank: int, world: int, backend: str, layer_backend: str) -> dict:
    from ep_a2a import EPAll2AllLayer
    from ep_a2a.reference import combine_ref, dispatch_ref

    device = (
        torch.device("cuda", rank) if torch.cuda.is_available() and backend == "nccl" else torch.device("cpu")
    )
    dtype = torch.bfloat16
    xs, idxs, ws = _inputs(dtype)
    with EPAll2AllLayer(
        None, max(TOKENS), HIDDEN, TOPK, rank, EXPERTS, world, world, dtype=dtype, backend=layer_backend
    ) as layer:
        t0 = time.perf_counter()
        rows, weights, desc = layer.dispatch(xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device))
        assert weights is not None
        y = _expert(rows, desc.recv_expert_indices, weights)
        out = layer.combine(y, desc)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        received, scatter = dispatch_ref(xs, idxs, ws, num_tot_experts=EXPERTS)
        ref_rows = received[rank]
        assert ref_rows.weights is not None
        ref_out = combine_ref(
            [_expert(r.output, r.local_expert, r.weights) for r in received],  # type: ignore[arg-type]
            idxs,
            scatter,
            num_tot_experts=EXPERTS,
        )[rank]
        rows_ok = torch.equal(rows.cpu(), ref_rows.output) and torch.equal(weights.cpu(), ref_rows.weights)
        err = (out.float().cpu() - ref_out.float()).abs().max().item() if out.numel() else 0.0
        scale = ref_out.float().abs().max().item() if ref_out.numel() else 1.0
        return {
            "backend": layer.backend_name,
            "reason": layer.backend_reason,
            "device": str(device),
            "tokens": int(xs[rank].shape[0]),
            "slots_sent": int((idxs[rank] >= 0).sum()),
            "rows_received": desc.num_recv_rows,
            "rows_per_expert": desc.num_recv_tokens_per_expert.tolist(),
            "rows_from_rank": desc.num_recv_tokens_per_rank.tolist(),
            "dispatch_exact": bool(rows_ok),
            "combine_max_err": err,
            "combine_ok": err <= 1.6e-2 * max(scale, 1.0),
            "seconds": elapsed,
        }


def _report(results: list[dict]) -> bool:
    print(f"backend: {results[0]['backend']} ({results[0]['reason']})")
    print(
        f"{'rank':>4} {'device':>7} {'tokens':>6} {'slots sent':>10} {'rows recv':>9} {'from rank':>10}"
        "  rows per local expert"
    )
    for rank, r in enumerate(results):
        print(
            f"{rank:>4} {r['device']:>7} {r['tokens']:>6} {r['slots_sent']:>10} {r['rows_received']:>9} "
            f"{r['rows_from_rank']!s:>10}  {r['rows_per_expert']}"
        )
    exact = all(r["dispatch_exact"] for r in results)
    ok = exact and all(r["combine_ok"] for r in results)
    worst = max(r["combine_max_err"] for r in results)
    print(
        f"check vs reference: dispatch rows/weights {'bit-identical' if exact else 'DIFFER'}; combine max "
        f"|err| = {worst:.3g} (bf16 output, fp32 accumulation) -> {'OK' if ok else 'FAILED'}"
    )
    return ok


def main() -> int:
    from ep_a2a import __version__
    from ep_a2a.testing import run_local

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= WORLD else "gloo"
    print(
        f"ep-a2a {__version__} demo: {WORLD} processes over {backend}, hidden={HIDDEN}, "
        f"top-{TOPK} of {EXPERTS} experts, tokens per rank {TOKENS}"
    )
    # the portable backend always; then whatever backend="auto" picks here, if that is another one
    results = run_local("ep_a2a.demo:_rank_main", WORLD, (backend, "torch"), backend=backend, timeout_s=300)
    ok = _report(results)
    auto = run_local("ep_a2a.demo:_rank_main", WORLD, (backend, "auto"), backend=backend, timeout_s=300)
    if auto[0]["backend"] != "torch":
        ok &= _report(auto)
    else:
        print(f"backend='auto' picks torch here: {auto[0]['reason']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
