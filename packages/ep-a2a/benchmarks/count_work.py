"""Work per call of the torch backend and of the NCCL pipelines: collectives, host syncs, device ops.

    python packages/ep-a2a/benchmarks/count_work.py                 # 2 CPU processes over gloo
    torchrun --standalone --nproc-per-node 2 packages/ep-a2a/benchmarks/count_work.py   # GPUs, NCCL

Each rank dispatches ``--tokens`` tokens (hidden 7168, top-8 of 256 experts, uniform routing) through
``EPAll2AllLayer(backend="torch")`` and the benchmark's NCCL pipelines (``bench_torch_backend``), then
combines them, and counts what one call of each does (the second call: the first builds caches):

* ``collectives``: collectives called on a process group (through ``torch.distributed``'s functions or
  the group's own methods, which those functions call);
* ``host_syncs``: points where the host waits for the device: reads of device data (``item``,
  ``tolist``, ``numpy``, ``nonzero`` and the other operations whose output size the data decides) and
  the torch backend's awaited exchanges;
* ``peer_waits``: the torch backend's checks on the operation board (host shared memory, one host)
  that every peer is in the same operation: a wait for the peers' hosts, not for a device;
* ``device_ops``: ATen operations that run on the data (views and allocations excluded), of which
  ``gathers`` (indexing, gather, take, index_select), ``scatters`` (index_put, scatter, index_add,
  index_copy) and ``sorts``;
* ``allocations``: tensors the call allocates (outputs of out-of-place operations and empty tensors);
* ``host_to_device`` / ``device_to_host``: copies between the host and the device (on GPUs).

On CPUs the torch backend runs the flow it runs on NCCL (exchanges on the group itself, awaited where
the host needs them), so the counts are those of a GPU run; on GPUs ``torch.cuda.set_sync_debug_mode``
also counts the synchronizing CUDA calls (``cuda_sync_warnings``), which must stay 0 for the torch
backend's single awaited exchange to be its only wait.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: ATen operations whose output size the data decides: the host reads the device to size them
_SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "bincount",
    "equal",
    "is_nonzero",
}
_GATHERS = {"index", "gather", "take", "index_select", "take_along_dim"}
_SCATTERS = {"index_put", "index_put_", "_index_put_impl_", "scatter", "scatter_", "scatter_add", "scatter_add_",
             "scatter_reduce", "scatter_reduce_", "index_add", "index_add_", "index_copy", "index_copy_"}  # fmt: skip
_SORTS = {"sort", "argsort", "topk"}
_ALLOCS = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}
#: the collective methods of a process group, which torch.distributed's functions call (one per call;
#: newer torch releases add ``*_single`` methods beside the older names and call those)
_COLLECTIVES = (
    "all_to_all_single",
    "all_gather_single",
    "reduce_scatter_single",
    "alltoall_base",
    "alltoall",
    "_allgather_base",
    "allgather",
    "allgather_into_tensor_coalesced",
    "allreduce",
    "broadcast",
    "barrier",
    "_reduce_scatter_base",
    "reduce_scatter",
    "send",
    "recv",
)


class _Mode(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        namespace = func._schema.name.split("::")[0]
        out = func(*args, **kwargs)
        if namespace != "aten":
            return out
        c = self.counts
        returns = func._schema.returns
        view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        if name in _SYNC_OPS:
            c["host_syncs"] += 1
        if name in _ALLOCS:
            c["allocations"] += 1
            return out
        if view or name in ("detach", "alias", "lift_fresh", "set_"):
            return out
        c["device_ops"] += 1
        if name in _GATHERS:
            c["gathers"] += 1
        elif name in _SCATTERS:
            c["scatters"] += 1
        elif name in _SORTS:
            c["sorts"] += 1
        inplace = bool(returns) and returns[0].alias_info is not None and returns[0].alias_info.is_write
        if not inplace:
            c["allocations"] += 1
        if name in ("copy_", "_to_copy"):
            src = args[1] if name == "copy_" else args[0]
            dst_dev = args[0].device if name == "copy_" else kwargs.get("device") or src.device
            if src.device.type == "cpu" and torch.device(dst_dev).type != "cpu":
                c["host_to_device"] += 1
            elif src.device.type != "cpu" and torch.device(dst_dev).type == "cpu":
                c["device_to_host"] += 1
        return out


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Count the work done inside the block (see the module docstring); the counter fills as it runs."""
    counts: Counter = Counter()
    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        old = getattr(owner, attr)
        patched.append((owner, attr, old))
        setattr(owner, attr, make(old))

    def counted(key: str) -> Callable[[Any], Any]:
        """A wrapper factory: the wrapped callable adds one to ``counts[key]`` per call."""

        def make(old: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                counts[key] += 1
                return old(*args, **kwargs)

            return call

        return make

    import ep_a2a.backends.torch as torch_backend
    from ep_a2a._dist import OpBoard

    for name in _COLLECTIVES:
        if hasattr(dist.ProcessGroup, name):
            patch(dist.ProcessGroup, name, counted("collectives"))
    for name in ("tolist", "numpy"):  # (on CUDA: a blocking copy to the host)
        patch(torch.Tensor, name, counted("host_syncs"))
    patch(torch_backend, "_wait", counted("host_syncs"))  # the torch backend's awaited exchanges
    patch(OpBoard, "wait", counted("peer_waits"))
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with _Mode(counts):
                    yield counts
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        counts["cuda_sync_warnings"] += sum("synchroniz" in str(w.message) for w in caught)
    finally:
        for owner, attr, old in reversed(patched):
            setattr(owner, attr, old)


KEYS = (
    "collectives",
    "host_syncs",
    "peer_waits",
    "device_ops",
    "gathers",
    "scatters",
    "sorts",
    "allocations",
    "host_to_device",
    "device_to_host",
    "cuda_sync_warnings",
)

#: what the benchmark's rows record of the counts
SUMMARY_KEYS = ("collectives", "host_syncs", "peer_waits", "device_ops", "cuda_sync_warnings")


def count_methods(rank: int, world: int, tokens: int, hidden: int = 7168, experts: int = 256,
                  topk: int = 8, device: torch.device | None = None) -> dict[str, dict[str, dict[str, int]]]:  # fmt: skip
    """``{method: {"dispatch": counts, "combine": counts}}`` for the torch backend (default, and with
    ``enable_local_combine``) and the NCCL per-rank and per-expert pipelines, on this rank."""
    import bench_torch_backend as bench

    from ep_a2a import EPAll2AllLayer

    dev = device or torch.device("cpu")
    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    ids, w = bench.make_routing(tokens, experts, topk, "uniform", 1000 + rank, dev)

    def per_call(dispatch: Callable, combine: Callable) -> dict[str, dict[str, int]]:
        for _ in range(2):  # (the second call's counts: the first builds what is kept)
            with counting() as d:
                rows, _, state = dispatch(x, ids, w)
            with counting() as c:
                combine(rows, state)
        return {"dispatch": {k: d[k] for k in KEYS}, "combine": {k: c[k] for k in KEYS}}

    out: dict[str, dict[str, dict[str, int]]] = {}
    for name, local_combine in (("torch", False), ("torch-lc", True)):
        layer = EPAll2AllLayer(
            None, tokens, hidden, topk, rank, experts, world, world, dtype=torch.bfloat16,
            enable_local_combine=local_combine, backend="torch",
        )  # fmt: skip
        if dev.type == "cpu":
            layer.ctx.backend._on_device = True  # the NCCL flow's logic over the gloo group
        out[name] = per_call(layer.dispatch, layer.combine)
        layer.finalize()
    for name, cls in (("nccl-dest", bench.NcclPerDest), ("nccl-expert", bench.NcclPerExpert)):
        pipe = cls(rank, world, experts // world)
        out[name] = per_call(pipe.dispatch, pipe.combine)
    return out


def table(counts: dict[str, dict[str, dict[str, int]]]) -> str:
    """The counts of one rank as a markdown table."""
    head = "| method | op | " + " | ".join(KEYS) + " |"
    lines = [head, "|" + "---|" * (len(KEYS) + 2)]
    for method, ops in counts.items():
        for op, c in ops.items():
            lines.append(f"| {method} | {op} | " + " | ".join(str(c[k]) for k in KEYS) + " |")
    return "\n".join(lines)


def _rank_main(rank: int, world: int, tokens: int) -> dict:
    return count_methods(rank, world, tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--world", type=int, default=2, help="CPU processes (without torchrun)")
    p.add_argument("--json", default=None, help="also write rank 0's counts here")
    args = p.parse_args()
    if "RANK" in os.environ:  # under torchrun: one GPU per rank
        import run_record

        rank, world, dev = run_record.start_ranks()
        counts = count_methods(rank, world, args.tokens, device=dev)
        dist.barrier()
        if rank == 0:
            print(table(counts), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(counts, indent=1) + "\n")
        dist.destroy_process_group()
        return
    from ep_a2a.testing import run_local

    counts = run_local(f"{__file__}:_rank_main", args.world, (args.tokens,), timeout_s=600)[0]
    print(table(counts))
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=1) + "\n")


if __name__ == "__main__":
    main()
