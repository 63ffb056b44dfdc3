"""Check the timing method's lead: a graph dispatch / combine timed after the cycle-counted lead
(``torch.cuda._sleep(LEAD_CYCLES)``, what ``bench_triton.Timer`` uses) and after a ``%globaltimer`` spin
of the same length (at 1.98 GHz), interleaved in one process (DeepSeek-V3 uniform, 128 and 4096
tokens per rank, 132 SMs). A lead that lets the ranks' GPUs leave it apart adds their skew to the time.

    torchrun --standalone --nproc-per-node 2 packages/ep-a2a/benchmarks/probe_lead.py out.json

Measured on 2x H100: ``docs/benchmarks/ep-a2a-h100x2/lead-clock/README.txt``.
"""

from __future__ import annotations

import json
import sys

import run_record
import torch
import torch.distributed as dist
import triton
from bench_triton import LEAD_CYCLES, Timer, capture_graphs, shape_inputs

from ep_a2a.triton_backend.kernels import _now  # %globaltimer on the GPU

LEAD_GHZ = 1.98  # the H100 / H200 boost clock: the globaltimer lead lasts LEAD_CYCLES at this clock


@triton.jit
def _spin_ns_kernel(ns):
    t0 = _now(True)
    t = t0
    while t - t0 < ns:
        t = _now(True)


def _globaltimer_lead(cycles: int) -> None:
    _spin_ns_kernel[(1,)](int(cycles / LEAD_GHZ))


def _sm_clocks_mhz(dev: torch.device, world: int) -> list[float]:
    """Every rank's current SM clock (NVML through ``torch.cuda.clock_rate``; -1 where unavailable)."""
    try:
        mhz = float(torch.cuda.clock_rate(dev))
    except Exception:
        mhz = -1.0
    mine = torch.tensor([mhz], device=dev, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [float(v) for v in every]


def main() -> None:
    from ep_a2a.triton_backend import TritonBackend

    rank, world, dev = run_record.start_ranks()
    out = {**run_record.header(dev, world_size=world), "lead_cycles": LEAD_CYCLES, "rounds": []}
    cycle_sleep = torch.cuda._sleep
    leads = {"cycles": cycle_sleep, "time": _globaltimer_lead}
    for tokens in (128, 4096):
        cfg, x, ids, w = shape_inputs("deepseek-v3", tokens, rank, world, dev)
        be = TritonBackend(
            cfg, dist.group.WORLD, num_sm=132, enable_local_combine=True, use_aot=False, timeout_s=60.0
        )
        g_d, g_c = capture_graphs(be, x, ids, w)
        timer = Timer(be.engine.launch_barrier)
        _globaltimer_lead(1000)  # compile outside the timed rounds
        torch.cuda.synchronize()
        try:
            for rnd in range(6 if tokens == 128 else 3):
                for mode, fn in leads.items():
                    torch.cuda._sleep = fn  # what Timer calls for its lead
                    d = timer.median_ms(g_d.replay, 40, lead=True)
                    c = timer.median_ms(g_c.replay, 40, setup=g_d.replay, lead=True)
                    row = {
                        "tokens": tokens,
                        "round": rnd,
                        "lead": mode,
                        "dispatch_us": 1e3 * d,
                        "combine_us": 1e3 * c,
                        "sm_clock_mhz": _sm_clocks_mhz(dev, world),
                    }
                    out["rounds"].append(row)
                    if rank == 0:
                        print(json.dumps(row), flush=True)
        finally:
            torch.cuda._sleep = cycle_sleep
        be.check_errors()
        be.finalize()
        del g_d, g_c, be
    run_record.finish(out, sys.argv[1], rank=rank)


if __name__ == "__main__":
    main()
