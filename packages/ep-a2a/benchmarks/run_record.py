"""What every benchmark and probe of ep-a2a records about its run, and how a distributed run starts and ends.

``header()`` is the first part of each JSON file: the device, the world size, the UTC date, the command
as it was launched, the commit, the torch and Triton versions and the NVLink-multicast switches.
``start_ranks()`` binds this process to its local GPU, joins the NCCL group and brings the GPU out of its
idle clocks (``warm_up_clocks``); ``finish()`` writes the
record from rank 0 and leaves the group once every rank is done. ``host_speed()`` and ``cpu_times()``
describe the host the eager calls ran on (they are bound by its speed).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

# the switches a multi-GPU run on the device machines sets (their values belong to the record)
ENV_KEYS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def commit() -> str | None:
    """``EP_A2A_COMMIT`` if set, else ``git rev-parse HEAD``; None where neither gives a hash.

    The device machines get a copy of the tree without ``.git``, where git prints "HEAD" or fails:
    record nothing rather than that.
    """
    if os.environ.get("EP_A2A_COMMIT"):
        return os.environ["EP_A2A_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return head if len(head) == 40 else None


def header(device: torch.device, *, world_size: int | None = None) -> dict:
    """The record's header. ``world_size`` set: the command is written as a ``torchrun`` launch of that
    many processes (how every distributed script here is started), else as a plain ``python`` one."""
    launcher = (
        ["python"] if world_size is None else ["torchrun --standalone --nproc-per-node", str(world_size)]
    )
    record: dict = {"device": torch.cuda.get_device_name(device)}
    if world_size is not None:
        record["world_size"] = world_size
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    record.update(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([*launcher, *sys.argv]),
        commit=commit(),
        torch=torch.__version__,
        triton=triton_version,
        env={k: os.environ.get(k) for k in ENV_KEYS},
    )
    return record


#: the fixed piece of plain Python work whose wall time ``host_speed`` reports
_PYTHON_WORK = 20_000


def host_speed(device: torch.device, *, reps: int = 5) -> dict[str, float]:
    """This process's host speed now, medians of ``reps`` in microseconds: ``python_us``, a fixed loop of
    plain Python (``_PYTHON_WORK`` multiply-adds), and ``graph_replay_us``, the host's share of replaying
    a CUDA graph of one small kernel (``CUDAGraph.replay``, no wait for the GPU). Eager calls are bound
    by host work and move with these, which differ between machines, between processes on one machine
    and over a process's life (a virtual machine's CPUs share their cores with other guests)."""
    t = torch.zeros(16, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # (the kernel loaded before the capture)
        t.add_(1)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t.add_(1)
    python, replay = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        sum(i * i for i in range(_PYTHON_WORK))
        python.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(100):
            graph.replay()
        replay.append((time.perf_counter() - t0) * 1e4)
        torch.cuda.synchronize(device)
    return {"python_us": statistics.median(python), "graph_replay_us": statistics.median(replay)}


def cpu_times() -> tuple[int, int] | None:
    """This machine's CPU time so far as ``(steal, total)`` clock ticks over all CPUs (``/proc/stat``;
    ``None`` without it). Steal: the time a virtual machine's CPUs were runnable but the hypervisor ran
    something else."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_pct(since: tuple[int, int] | None) -> float | None:
    """Percent of this machine's CPU time stolen (see :func:`cpu_times`) since ``since``."""
    now = cpu_times() if since is not None else None
    if since is None or now is None or now[1] <= since[1]:
        return None
    return round(100.0 * (now[0] - since[0]) / (now[1] - since[1]), 2)


def warm_up_clocks(device: torch.device, *, seconds: float = 0.5) -> None:
    """Keep ``device`` busy with bf16 matmuls for ``seconds`` of wall time.

    A GPU left idle for a few seconds drops to its idle SM clock and takes a fraction of a second of
    work to come back: without this the first timings of a process would be slower than the rest.
    """
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a = (a @ a).clamp_(-1.0, 1.0)
        torch.cuda.synchronize(device)


def start_ranks() -> tuple[int, int, torch.device]:
    """Bind to ``LOCAL_RANK``'s GPU, join the NCCL process group and warm the GPU's clocks up
    (``warm_up_clocks``); returns (rank, world size, device)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    warm_up_clocks(device)
    return dist.get_rank(), dist.get_world_size(), device


def write(record: dict, path: str | None, *, rank: int = 0) -> None:
    """Rank 0 writes ``record`` to ``path`` (nothing when ``path`` is None)."""
    if rank == 0 and path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {path}", flush=True)


def finish(record: dict, path: str | None, *, rank: int) -> None:
    """Write the record from rank 0, then leave the process group once every rank got here."""
    write(record, path, rank=rank)
    dist.barrier()
    dist.destroy_process_group()
