"""Bounded waits for the layer: store check-ins, a CPU side group, and post-mortems naming missing ranks."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import numpy as np
import torch
import torch.distributed as dist

_T = TypeVar("_T")


class EPError(RuntimeError):
    """A collective step of the layer failed."""


class EPTimeoutError(EPError, TimeoutError):
    """A rank did not arrive at a step within the layer's ``timeout_s``.

    Attributes:
        step: the step that waited (``"construct"``, ``"dispatch/counts"``, ``"dispatch/payload"``,
            ``"combine"``, ``"barrier"``).
        missing_ranks: ranks (inside the expert-parallel group) that never checked in.
    """

    def __init__(self, message: str, *, step: str, missing_ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.step = step
        self.missing_ranks = list(missing_ranks)


class EPConfigMismatchError(EPError, ValueError):
    """Ranks constructed the layer with different arguments."""


class EPProtocolError(EPError):
    """Ranks called the layer's collective operations in different orders (for example one rank
    dispatches while another combines). Raised on every rank that took part; no rank returns data.

    Attributes:
        operations: ``{rank: "<operation> #<call>"}`` of every rank that arrived.
    """

    def __init__(self, message: str, *, operations: dict[int, str]) -> None:
        super().__init__(message)
        self.operations = dict(operations)


_LAYER_SEQ: dict[tuple[int, ...], itertools.count] = {}


def group_device(group: dist.ProcessGroup) -> torch.device:
    """Device the group's collectives take: CUDA (current device) for NCCL, CPU otherwise."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _default_store() -> dist.Store:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class RankMonitor:
    """Check-ins and guarded collectives for one layer on one group.

    Construction is collective. It creates a gloo side group over the same ranks whose collectives
    time out after ``timeout_s``; small host-side exchanges (token counts) run on it. Collectives run
    through :meth:`run` that fail (a peer closed its connection, or the wait ran out) trigger a post-mortem:
    every surviving rank writes a key in the c10d store and waits a short grace period for the others'
    keys; the ranks whose key never appears are named in the :class:`EPTimeoutError`.
    """

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group = group
        self.timeout_s = float(timeout_s)
        self.global_ranks = list(dist.get_process_group_ranks(group))
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        seq = next(_LAYER_SEQ.setdefault(tuple(self.global_ranks), itertools.count()))
        self.prefix = f"ep_a2a/{'-'.join(map(str, self.global_ranks[:4]))}.{len(self.global_ranks)}/L{seq}"
        self.store = _default_store()
        self._calls: dict[str, int] = {}
        self.side_group: dist.ProcessGroupGloo | None = None

    def create_side_group(self) -> dist.ProcessGroupGloo:
        """The gloo side group over the same ranks (collective on first call).

        Built directly on a store prefix unique to this layer: ``dist.new_group`` would reuse one name for
        every group over the same ranks and let a new group read a destroyed one's stale addresses.
        """
        if self.side_group is None:
            store = dist.PrefixStore(f"{self.prefix}/side", self.store)
            # connecting gets a generous bound (a loaded host connects slowly); ops then pass timeout_s
            group = dist.ProcessGroupGloo(
                store, self.rank, self.world_size, timedelta(seconds=max(self.timeout_s, 60.0))
            )
            # every rank's connections are up before any rank goes on (a rank that destroyed the group
            # at once would close a connection a peer is still opening)
            group.allreduce([torch.zeros(1)]).wait()  # type: ignore[attr-defined]
            self.side_group = group
        return self.side_group

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        """``all_to_all_single`` of CPU tensors on the side group, bounded by ``timeout_s``."""
        group = self.create_side_group()
        opts = dist.AllToAllOptions()
        opts.timeout = timedelta(seconds=self.timeout_s)
        group.alltoall_base(output, input, output_split_sizes or [], input_split_sizes or [], opts).wait()  # type: ignore[attr-defined]

    def _next(self, step: str) -> int:
        n = self._calls.get(step, 0)
        self._calls[step] = n + 1
        return n

    def _key(self, step: str, call: int, rank: int) -> str:
        return f"{self.prefix}/{step}/{call}/{rank}"

    def _missing(self, step: str, call: int, ranks: Sequence[int]) -> list[int]:
        missing = []
        for r in ranks:
            try:
                if not self.store.check([self._key(step, call, r)]):
                    missing.append(r)
            except Exception:  # store gone (its host rank died): cannot tell who is missing
                missing.append(r)
        return missing

    def checkin(self, step: str, value: str, *, ranks: Sequence[int] | None = None) -> list[str]:
        """Store-based all-gather of a short string among ``ranks`` (default: all), bounded by ``timeout_s``.

        Returns:
            the values of ``ranks`` in order.

        Raises:
            EPTimeoutError: naming the ranks that did not check in.
        """
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        call = self._next(step)
        self.store.set(self._key(step, call, self.rank), value)
        keys = [self._key(step, call, r) for r in ranks]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as exc:
            missing = self._missing(step, call, ranks)
            raise EPTimeoutError(
                f"ep_a2a: rank {self.rank} waited {self.timeout_s:g}s at step {step!r} (call #{call}) "
                f"but rank(s) {missing} of the expert-parallel group never arrived ({type(exc).__name__})",
                step=step,
                missing_ranks=missing,
            ) from exc
        values = [self.store.get(k).decode() for k in keys]
        if call > 0:
            # every rank passed the previous call before anyone passed this one: its key is dead weight
            with contextlib.suppress(Exception):
                self.store.delete_key(self._key(step, call - 1, self.rank))
        return values

    def run(self, step: str, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, a collective (or its wait); on failure raise naming the ranks that did not reach
        ``step`` (see :meth:`_failed`)."""
        call = self._next(step)
        try:
            return fn(*args)
        except Exception as exc:
            self._failed(step, call, exc)

    def _failed(self, step: str, call: int, exc: Exception) -> NoReturn:
        """The post-mortem of a failed guarded step: raise naming the ranks that never reached it."""
        grace = min(self.timeout_s, 5.0)
        with contextlib.suppress(Exception):
            self.store.set(self._key(step, call, self.rank), "failed")
        deadline = time.monotonic() + grace
        missing = self._missing(step, call, range(self.world_size))
        while missing and time.monotonic() < deadline:
            time.sleep(0.05)
            missing = self._missing(step, call, missing)
        if missing:
            raise EPTimeoutError(
                f"ep_a2a: step {step!r} (call #{call}) failed on rank {self.rank}: rank(s) {missing} of the "
                f"expert-parallel group did not arrive (they exited, crashed or are stuck; wait bound "
                f"{self.timeout_s:g}s). Cause: {type(exc).__name__}: {exc}",
                step=step,
                missing_ranks=missing,
            ) from exc
        raise EPError(
            f"ep_a2a: step {step!r} (call #{call}) failed on rank {self.rank} although every rank "
            f"arrived: {type(exc).__name__}: {exc}"
        ) from exc

    def destroy(self) -> None:
        if self.side_group is not None:
            with contextlib.suppress(Exception):
                self.side_group.shutdown()
            self.side_group = None


def poll_until(ready: Callable[[], bool], deadline: float) -> bool:
    """Call ``ready()`` until it returns true (then True) or ``time.monotonic()`` passes ``deadline`` (then
    False). The first 1000 polls only yield the core (a peer that shares it runs meanwhile: a sleep would
    add its own latency to the usual short wait), later ones sleep 50 us each."""
    spins = 0
    while not ready():
        if time.monotonic() > deadline:
            return False
        spins += 1
        if spins > 1000:
            time.sleep(5e-5)
        else:
            os.sched_yield()
    return True


def create_shared_words(name: str, shape: tuple[int, ...]) -> tuple[str, np.memmap]:
    """A new int64 array of ``shape`` filled with -1 (a tag no call has), in a file ``name`` in host shared
    memory (``/dev/shm``) where there is any, else in the temp folder. Returns the file's path and its
    mapping (other processes map the path).

    Raises:
        OSError: neither folder takes the file.
    """
    folders = [f for f in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(f)]
    for i, folder in enumerate(folders):
        path = os.path.join(folder, name)
        try:
            words = np.memmap(path, dtype=np.int64, mode="w+", shape=shape)
        except OSError:
            if i == len(folders) - 1:
                raise
            continue
        words[:] = -1
        words.flush()
        return path, words
    raise OSError(f"ep_a2a: no folder for the shared file {name!r}")


#: operation codes of :class:`OpBoard` words
BOARD_OPS = {
    "dispatch": 1, "combine": 2, "combine_per_slot": 3, "barrier": 4, "dispatch_static": 5, "combine_static": 6,
}  # fmt: skip
_BOARD_NAMES = {code: name for name, code in BOARD_OPS.items()}
#: words per rank: a peer is never more than a call or two ahead, so a ring of 8 keeps every word read
_BOARD_SLOTS = 8


class OpBoard:
    """Every rank's latest operations, in host shared memory, for the ranks of one host.

    Each rank writes ``(call << 8) | operation`` into slot ``call % 8`` of its own small file in
    ``/dev/shm`` (a plain store, no collective) when it starts an operation, and reads the peers' files:
    two ranks whose words for one call name different operations called the layer in different orders.
    Peers on other hosts (whose files are not visible here) are not checked.

    Construction is collective (the files' paths travel through the monitor's store check-in).
    """

    def __init__(self, monitor: RankMonitor) -> None:
        self.rank = monitor.rank
        self.timeout_s = monitor.timeout_s
        tag = monitor.prefix.replace("/", "_")
        name = f"ep_a2a{tag}-r{self.rank}-p{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path, self.mine = create_shared_words(name, (_BOARD_SLOTS,))
        # (read and written through plain arrays over the mappings: a memmap's own indexing runs Python)
        self._mine = self.mine.view(np.ndarray)
        host = socket.gethostname()
        entries = monitor.checkin("board", f"{host}\x00{self.path}")
        #: peer rank -> its words (ranks of this host only)
        self.peers: dict[int, np.memmap] = {}
        for r, entry in enumerate(entries):
            their_host, _, path = entry.partition("\x00")
            if r == self.rank or their_host != host:
                continue
            with contextlib.suppress(OSError, ValueError):
                self.peers[r] = np.memmap(path, dtype=np.int64, mode="r", shape=(_BOARD_SLOTS,))
        self._peer_words = [(r, words.view(np.ndarray)) for r, words in self.peers.items()]
        self.calls = 0

    def publish(self, op: str) -> int:
        """Record that this rank starts ``op``; returns its call number."""
        call = self.calls
        self.calls += 1
        self._mine[call % _BOARD_SLOTS] = (call << 8) | BOARD_OPS[op]
        return call

    def _word(self, r: int, call: int) -> tuple[int, int] | None:
        """(call, operation code) of peer ``r`` in the slot of ``call``, or ``None`` before it got there."""
        w = int(self.peers[r][call % _BOARD_SLOTS])
        return None if w < 0 or (w >> 8) != call else (call, w & 0xFF)

    def check(self, call: int, op: str) -> bool:
        """Raise :class:`EPProtocolError` if a peer is in another operation at ``call``. Returns whether
        every peer has reached ``call``."""
        mine = BOARD_OPS[op]
        slot, want, there = call % _BOARD_SLOTS, (call << 8) | mine, True
        for _, slots in self._peer_words:  # (the common case: every peer in op, or not there yet)
            word = int(slots[slot])
            if word != want:
                if word >= 0 and (word >> 8) == call:
                    break  # another operation at this call: named below
                there = False
        else:
            return there
        words = {r: self._word(r, call) for r in self.peers}
        if any(w is not None and w[1] != mine for w in words.values()):
            ops = {self.rank: f"{op} (call #{call})"}
            for r, w in words.items():
                if w is not None:
                    ops[r] = f"{_BOARD_NAMES.get(w[1], f'operation {w[1]}')} (call #{call})"
            raise EPProtocolError(
                "ep_a2a: ranks called the layer's collectives in different orders: "
                + ", ".join(f"rank {r} is in {what}" for r, what in sorted(ops.items()))
                + f" (this is rank {self.rank}). Every rank must call dispatch, combine and barrier in the "
                "same order; no rank returns data, and the layer is unusable from here: finalize it",
                operations=ops,
            )
        return all(w is not None for w in words.values())

    def wait(self, call: int, op: str, step: str, deadline: float | None = None) -> None:
        """Wait until every peer reached ``call`` (checking, as :meth:`check` does, that it is in ``op``),
        until ``deadline`` (``time.monotonic()``; default ``timeout_s`` from now).

        Raises:
            EPProtocolError: a peer is in another operation; it names every peer's operation at ``call``
                (it waits for the peers not there yet: the misordered ones reach ``call`` as well).
            EPTimeoutError: a peer did not reach ``call`` by the deadline (named).
        """
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        try:
            if poll_until(lambda: self.check(call, op), deadline):
                return
        except EPProtocolError:
            poll_until(lambda: all(self._word(r, call) is not None for r in self.peers), deadline)
            self.check(call, op)
            raise
        missing = [r for r in self.peers if self._word(r, call) is None]
        raise EPTimeoutError(
            f"ep_a2a: rank {self.rank} waited {self.timeout_s:g}s at step {step!r} (call #{call}) but "
            f"rank(s) {missing} never started it",
            step=step,
            missing_ranks=missing,
        )

    def close(self) -> None:
        """Unmap the files and remove this rank's."""
        self.peers.clear()
        self._peer_words = []
        with contextlib.suppress(Exception):
            del self._mine, self.mine
        with contextlib.suppress(OSError):
            os.unlink(self.path)
