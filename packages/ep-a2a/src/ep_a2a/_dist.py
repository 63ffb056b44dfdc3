"""Bounded waits for the layer: store check-ins, a CPU side group, and post-mortems naming missing ranks."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


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
    time out after ``timeout_s``; small host-side exchanges (token counts) run on it. Collectives wrapped
    in :meth:`guard` that fail (a peer closed its connection, or the wait ran out) trigger a post-mortem:
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

    @contextlib.contextmanager
    def guard(self, step: str) -> Iterator[None]:
        """Run a collective; on failure name the ranks that did not reach ``step``."""
        call = self._next(step)
        try:
            yield
        except Exception as exc:
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
