"""Run a function on N local processes joined in one ``torch.distributed`` group (tests, demo).

Each process gets ``RANK``/``WORLD_SIZE`` and a gloo (or NCCL, one GPU per rank) default group on
localhost, runs ``target(rank, world_size, *args)`` and reports its result or traceback back.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_target(target: str) -> Any:
    """The object named by ``"package.module:name"`` or ``"/path/to/file.py:name"``.

    A file is imported as a module registered in ``sys.modules`` (dataclasses and pickling need that).
    """
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_ep_a2a_target_{abs(hash(where))}", where)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _child(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    target: str,
    args: tuple,
    queue: Any,
    timeout_s: float,
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    # a rank still running shortly before the deadline prints where it is stuck (stderr), then gets killed
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 3.0), exit=False)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = load_target(target)(rank, world_size, *args)
        pickle.dumps(result)  # fail here, with a traceback, rather than silently in the queue's thread
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_local(
    target: str,
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    error_grace_s: float = 15.0,
) -> list[Any]:
    """Run ``target`` on ``world_size`` local processes and return each rank's result.

    Args:
        target: ``"package.module:function"`` or ``"/path/to/file.py:function"``; called as
            ``function(rank, world_size, *args)`` after the default process group is up.
        world_size: processes to start.
        args: extra picklable arguments.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank ``r`` on GPU ``r``).
        timeout_s: bound on the whole run; processes still alive after it are killed.
        error_grace_s: once a rank has raised, how long the others may still run before being killed.

    Returns:
        the results, by rank.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), died, or the run timed out.
    """
    # fork when it is safe (CPU-only parent): importing torch in a fresh interpreter costs seconds, and
    # children run with one intra-op thread (as DataLoader workers do) so the inherited OpenMP pool is unused.
    use_fork = backend == "gloo" and sys.platform == "linux" and not torch.cuda.is_initialized()
    ctx: Any = mp.get_context("fork" if use_fork else "spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, port, backend, target, tuple(args), queue, timeout_s),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = queue.get(timeout=min(remaining, 1.0))
                results[rank] = (status, value)
                if status == "error":  # the others would only wait for it: give them a moment, then stop
                    deadline = min(deadline, time.monotonic() + error_grace_s)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(results.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in results]
    if errors or missing:
        detail = "\n".join(errors)
        raise RuntimeError(f"run_local({target}) failed; ranks without a result: {missing}\n{detail}")
    return [results[r][1] for r in range(world_size)]
