"""What every benchmark and probe of ep-a2a records about its run, and how a distributed run starts and ends.

``header()`` is the first part of each JSON file: the device, the world size, the UTC date, the command
as it was launched, the commit, the torch and Triton versions and the NVLink-multicast switches.
``start_ranks()`` binds this process to its local GPU, joins the NCCL group and brings the GPU out of its
idle clocks (``warm_up_clocks``); ``finish()`` writes the
record from rank 0 and leaves the group once every rank is done.
"""

from __future__ import annotations

import json
import os
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
