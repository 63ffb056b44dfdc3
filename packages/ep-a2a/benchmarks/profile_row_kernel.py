"""The dispatch row kernel's local work on one GPU: 2 simulated ranks over two heaps of one device.

:class:`~ep_a2a.triton_backend.simulate.SimWorld` on ``cuda``: each rank's sending half (its own rows
into its output; with ``--ce`` the copies of its rows into the peer's heap, otherwise SM stores) runs
before every receiving half (the rows that arrived, expanded), so nothing waits on another GPU and each
half is timed alone with CUDA events. Compared in the same run with a plain expansion of the same
rows (no metadata: every row's output rows given), the local-memory floor of the row kernel.

``python packages/ep-a2a/benchmarks/profile_row_kernel.py [--ce 4] [--num-sm 132]``
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ep_a2a.reference import dispatch_ref
from ep_a2a.triton_backend.simulate import SimWorld


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--num-sm", type=int, default=132)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--ce", type=int, default=0, help="copy-engine pieces (0: SM stores)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    W, n, H, K, E = 2, args.tokens, args.hidden, args.topk, args.experts
    sim = SimWorld(
        world_size=W, max_tokens=n, hidden=H, topk=K, num_tot_experts=E, num_sm=args.num_sm, chunk=args.chunk,
        timeout_s=10.0, device="cuda", ce_pieces=args.ce,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, H, generator=g).to(torch.bfloat16).cuda() for _ in range(W)]
    ids = [torch.rand(n, E, generator=g).argsort(1)[:, :K].to(torch.int32).cuda() for _ in range(W)]
    ws = [torch.rand(n, K, generator=g).cuda() for _ in range(W)]
    engs = sim.engines
    infos = [torch.zeros(e.info_len, dtype=torch.int64, device="cuda") for e in engs]
    for r, e in enumerate(engs):
        e.launch_layout(ids[r], caller_scatter=False, info=infos[r])
    for r, e in enumerate(engs):
        e.launch_counts(infos[r])
    torch.cuda.synchronize()
    bufs = [e.alloc_dispatch_outputs(n, int(infos[r][0]), with_weights=True) for r, e in enumerate(engs)]
    times: dict[str, list[float]] = {"layout": [], "counts": [], "send": [], "recv": []}

    def ev():
        t = torch.cuda.Event(enable_timing=True)
        t.record()
        return t

    for it in range(args.iters + 2):
        marks = [ev()]
        for r, e in enumerate(engs):
            e.launch_layout(ids[r], caller_scatter=False, info=infos[r])
        marks.append(ev())
        for r, e in enumerate(engs):
            e.launch_counts(infos[r])
        marks.append(ev())
        for half in ((True, False), (False, True)):
            for r, e in enumerate(engs):
                b = bufs[r]
                e.launch_dispatch(
                    xs[r], ids[r], ws[r], e.pos, b["out"], b["out_w"], b["out_e"], b["tab"], b["skip"], b["scat"],
                    caller_scatter=False, info=infos[r], send=half[0], recv=half[1],
                )  # fmt: skip
            marks.append(ev())
        torch.cuda.synchronize()
        if it >= 2:
            for name, a, b in zip(times, marks, marks[1:], strict=False):
                times[name].append(a.elapsed_time(b) * 1e3 / W)  # per rank, us
    for e in engs:
        e.check_error()
    res = {k: statistics.median(v) for k, v in times.items()}
    res["config"] = vars(args)
    res["device"] = torch.cuda.get_device_name()
    rows = [int(i[0]) for i in infos]
    # local traffic per rank: own and received rows read once, every output row written once
    res["local_bytes_per_rank"] = (2 * n + sum(rows) / W) * H * 2
    if args.check:
        ref, _ = dispatch_ref(
            [x.cpu() for x in xs], [i.cpu() for i in ids], [w.cpu() for w in ws], num_tot_experts=E
        )
        res["bit_identical"] = all(torch.equal(bufs[r]["out"].cpu(), ref[r].output) for r in range(W))
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
