"""``TritonTuning``: every knob of the Triton backend, in one typed object."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

#: heaps the Triton backend can run over
HEAP_KINDS = ("torch", "nvshmem")


def _check_pow2(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1 or value & (value - 1)):
        raise ValueError(f"TritonTuning.{name} must be None or a power of 2, got {value!r}")


def _check_positive(name: str, value: int | None, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise ValueError(f"TritonTuning.{name} must be None or an int >= {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TritonTuning:
    """Launch and flow options of ``backend="triton"`` (ignored by the torch backend).

    Every field has a default that suits the layer's shape; ``None`` means "picked from the layer's
    shape and ``num_sm``" by the rule given with the field. Pass one object to the layer
    (``EPLayer(..., tuning=TritonTuning(num_sm=132))``); every rank must pass an equal one (checked).

    Which flow an exact-shape ``dispatch`` runs (the rule that ``overlap_bytes`` and
    ``speculative_rows`` set; every flow returns the same tensors):

    * worst case within ``overlap_bytes`` (decode-sized layers, e.g. hidden 7168, top-8, 128 tokens on
      2 ranks: 29 MB): every call launches the row kernel right after the layout kernel, into
      worst-case outputs; the host reads the counts from pinned memory the row kernel writes (no
      stream synchronisation) and returns views of the first ``R`` rows.
    * larger layers with ``speculative_rows``: the first call waits for the counts before launching
      the row kernel (one device-to-host copy); later calls run as above into outputs sized from the
      last calls' rows.
    * remote peers, ``copy_engine`` or ``speculative_rows=False``: the counts first on every call.

    Attributes:
        num_sm: CTAs of the dispatch and combine kernels, i.e. the SMs they occupy while they run
            (capped at the device's SM count). Default (``None``): every SM of the device, the fastest
            all-to-all at every layer size measured; pass fewer (e.g. 20) to leave SMs to computation
            that runs at the same time.
        chunk: tokens per work item (and per ready flag) of the dispatch kernel, a power of 2.
            Default: 8 for ``hidden >= 1024`` and ``max_tokens > 1024``, 1 for ``hidden >= 1024`` and at
            most 256 tokens, 2 up to 1024 tokens; 16 / 4 for narrower rows. Large layers
            (``hidden >= 1024``, ``max_tokens > 1024``) with ``chunk``, ``block_h`` and ``num_warps`` all
            unset take: 32 tokens, 16 warps, 512-wide tiles below 64 SMs; 16 tokens and 16 warps
            below 96 SMs or for rows narrower than 4096; 8 tokens and 16 warps otherwise.
        block_h: tile width along ``hidden`` of the dispatch kernel, a power of 2 (default 1024, or
            the whole row for chunks of at most 2 tokens).
        num_warps: warps per CTA of the dispatch kernel (default 8; 4 for one-token chunks
            and for ``block_h`` below 512).
        combine_chunk, combine_warps, combine_block_h: the same for the combine kernel. Default: the
            dispatch kernel's chunk and warps; large layers with all three unset take 8 tokens and 16
            warps; the tile width defaults to the widest of at most 64 elements per thread.
        combine_maxnreg: register limit per thread of the combine kernel (16-255; default: ptxas's).
        send_ctas: CTAs of the dispatch kernel that only send to the peers while the others only
            write this rank's output; 0: every CTA does both, in turn. Default: ``num_sm // 3`` when
            ``num_sm >= 64`` and ``max_tokens > 1024``, else 0. Must be 0 or in ``[1, num_sm)``.
        combine_send_ctas: the same for the combine kernel; default ``num_sm // 2`` under the same
            conditions.
        steal: with the dispatch split, CTAs claim chunks from a shared counter per role and take the
            other role's chunks once their own queue is empty. Default: on for token rows of at
            least 8 KiB.
        overlap_bytes: an exact-shape dispatch whose worst-case output (``world_size * max_tokens *
            topk`` rows) fits in this many bytes launches its row kernel before the host knows the
            counts, into worst-case buffers, and returns views of their first rows. Default 256 MiB.
        speculative_rows: larger layers do the same from their second call on, into outputs sized
            from the most rows of the last 8 calls plus an eighth (a call that receives more gets
            exact outputs and a second writing pass). Default on; not with remote peers or
            ``copy_engine``.
        copy_engine: dispatch moves this rank's token rows to the peers with copy-engine copies on a
            side stream instead of SM stores (every row goes to every peer). Default off; needs
            ``send_ctas`` 0 and no remote peers.
        ce_pieces: pieces of a copy-engine dispatch, each followed by a flag (default 4).
        pdl: launch the dispatch kernel with programmatic dependent launch on sm_90 and newer, so its
            CTAs are resident while the layout kernel runs. Default on.
        early_send: decode-sized dispatch kernels that build the receive layout send their first
            chunk to the peers while program 0 builds it. Default on.
        eager_graphs: an exact-shape dispatch whose tensors (input, ids, weights) are at the addresses,
            and of the token count, of an earlier call that wrote the same outputs launches its two
            kernels as one CUDA graph, captured at the second such call (at most 64 per workspace of
            outputs), and so does a combine whose rows, descriptor and output repeat their addresses:
            the same kernels and results, one driver call. Default on.
        heap: the symmetric heap, ``"torch"`` (``torch.distributed._symmetric_memory``) or
            ``"nvshmem"`` (nvshmem4py). Default: ``"nvshmem"`` when some ranks are on other nodes
            (they need it), else ``"torch"``.
        force_remote: treat ranks outside this rank's block of ``force_remote`` consecutive ranks as
            on another node (the remote path on one node, for testing). Must divide ``world_size`` and
            be at most ``local_world_size``. Default: the real nodes.
        low_latency: the low-latency mode (decode-sized batches, DeepEP's low-latency design): dispatch
            and combine are one kernel each that stores rows straight into fixed receive slots on the
            peers (sized for ``max_tokens``, two sets used in turn), with the per-expert counts sent
            with the rows, so that no count or layout exchange precedes the data and consecutive calls
            need no barrier. Outputs as in the CUDA-graph mode (``dispatch_static``: worst-case buffers
            of ``world_size * max_tokens * topk`` rows, the first ``num_recv_rows`` valid, the layer's
            usual order); ``dispatch`` / ``combine`` run the same kernels and wait once for the counts.
            Needs every rank on one node; no ``full_scatter_indices`` and no autograd. It allocates a
            second symmetric heap of about ``2 * world_size * max_tokens * (row bytes + hidden * 2)``
            bytes. Default off.

    Raises:
        ValueError: a field out of its range (named in the message).
    """

    num_sm: int | None = None
    chunk: int | None = None
    block_h: int | None = None
    num_warps: int | None = None
    combine_chunk: int | None = None
    combine_warps: int | None = None
    combine_block_h: int | None = None
    combine_maxnreg: int | None = None
    send_ctas: int | None = None
    combine_send_ctas: int | None = None
    steal: bool | None = None
    overlap_bytes: int = 256 << 20
    speculative_rows: bool = True
    copy_engine: bool = False
    ce_pieces: int = 4
    pdl: bool = True
    early_send: bool = True
    eager_graphs: bool = True
    heap: str | None = None
    force_remote: int | None = None
    low_latency: bool = False

    def __post_init__(self) -> None:
        _check_positive("num_sm", self.num_sm)
        num_sm = self.num_sm if self.num_sm is not None else 1 << 30
        for name in ("chunk", "block_h", "combine_chunk", "combine_block_h"):
            _check_pow2(name, getattr(self, name))
        for name in ("num_warps", "combine_warps", "ce_pieces", "force_remote"):
            _check_positive(name, getattr(self, name))
        for name in ("send_ctas", "combine_send_ctas", "overlap_bytes"):
            _check_positive(name, getattr(self, name), allow_zero=True)
        for name in ("send_ctas", "combine_send_ctas"):
            value = getattr(self, name)
            if value and value >= num_sm:
                raise ValueError(
                    f"TritonTuning.{name} must be 0 or in [1, num_sm={self.num_sm}), got {value}"
                )
        if self.combine_maxnreg is not None and not 16 <= self.combine_maxnreg <= 255:
            raise ValueError(f"TritonTuning.combine_maxnreg must be in [16, 255], got {self.combine_maxnreg}")
        if self.heap is not None and self.heap not in HEAP_KINDS:
            raise ValueError(f"TritonTuning.heap must be None or one of {HEAP_KINDS}, got {self.heap!r}")
        if self.copy_engine and self.send_ctas:
            raise ValueError(
                f"TritonTuning: copy_engine=True leaves nothing for sending CTAs: send_ctas must be 0, got "
                f"{self.send_ctas}"
            )

    def for_device(self, device_sms: int) -> TritonTuning:
        """This tuning with ``num_sm`` resolved on a device of ``device_sms`` SMs (``None``: all of them)."""
        return self if self.num_sm is not None else replace(self, num_sm=device_sms)

    def fingerprint(self) -> tuple[object, ...]:
        """The fields, in order (compared across ranks at construction)."""
        return tuple(asdict(self).values())
