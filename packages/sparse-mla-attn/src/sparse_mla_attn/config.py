"""Tuning options of the kernels: one typed object, passed as ``config=`` to the ops."""

from __future__ import annotations

import functools
from dataclasses import dataclass

BACKENDS = ("auto", "gluon", "triton")
SPLIT_MERGES = ("auto", "last_program", "kernel")
ATTN_DIST_SPLITS = ("blocks", "cols")
FWD_PERSISTENT = ("auto", "on", "off")
ATTN_DIST_ORDERS = ("auto", "slot", "index")
FWD_TAIL_SPLITS = ("auto", "on", "off")


@dataclass(frozen=True)
class Config:
    """Tuning options shared by :func:`~sparse_mla_attn.sparse_mla_fwd`, :func:`~sparse_mla_attn.attn_dist`,
    :func:`~sparse_mla_attn.sparse_mla_decode`, :func:`~sparse_mla_attn.sparse_mla_bwd` and
    :func:`~sparse_mla_attn.sparse_mla`. The defaults are what every op uses without ``config``; the
    results do not depend on them beyond floating-point rounding (the deterministic backward's bits are
    fixed by the inputs and these options: the ``bwd_*`` caps set its chunks of tokens, summed in turn).

    Attributes:
        backend: kernel family of the forward, decode and ``attn_dist``. ``"auto"`` (default) runs the
            warp-specialised Gluon kernels on an sm_90 GPU (H100, H200) where :func:`gluon_supported`
            holds, the forward and decode (bf16 or FP8 cache) only for ``h_q > 32`` and split-K partials
            merged by the merge kernel (not ``split_merge="last_program"``), and the Triton kernels
            everywhere else. ``"triton"`` always runs the Triton kernels. ``"gluon"`` is ``"auto"`` that
            raises :class:`ValueError` where the Gluon kernels cannot run (for tests and benchmarks).
        num_splits: split-K factor of the forward and decode: each query's top-k list is split over this
            many programs whose partial results are merged (an lse-weighted sum). ``0`` (default): the
            rule of :meth:`splits_for`, from the device's multiprocessor count and the shape.
        split_fill: the target of :func:`~sparse_mla_attn.sparse_mla_decode`'s automatic split-K factor,
            in programs per multiprocessor (:meth:`splits_for`; the forward uses 1.0). Default 1.0: split
            only when one program per (token, head tile) leaves at least half of the multiprocessors
            idle.
        split_merge: who merges the split-K partials of :func:`~sparse_mla_attn.sparse_mla_decode`.
            ``"last_program"``: the last split program of each (token, head tile) to finish, in the same
            launch (a per-stream cached counter workspace decides which; no second launch).
            ``"kernel"``: a second kernel, launched after the split kernel, whose programs merge 16 heads
            each. ``"auto"`` (default): ``"kernel"`` where a head tile holds more than 16 heads
            (``h_q > 16``: the merging program would read several merge-kernel programs' data alone,
            after the other splits); otherwise ``"last_program"`` for eager calls, and ``"kernel"`` while
            a CUDA graph is captured (a replay pays no launch cost) and on the first call of a call
            signature on a GPU (so that path is compiled before any capture). Both give the same bits.
            The forward, and the Gluon kernels, always merge with the second kernel.
        bwd_workspace_bytes: cap on the backward's ``dS`` (and ``P``) workspace; the backward processes
            query tokens in chunks that fit (default 2 GiB).
        bwd_deterministic_workspace_bytes: cap on the deterministic backward's per-(token, slot) ``dkv``
            workspace, which also bounds its chunk of tokens (default 4 GiB): ``2 * d_qk`` bytes plus 4 per
            64 channels per (token, slot) for bf16 inputs up to 128 heads (fp16 values with a power-of-two
            factor per 64 channels), ``4 * d_qk`` otherwise (fp32; once per block of 128 heads above 128 heads).
        fwd_persistent: whether :func:`~sparse_mla_attn.sparse_mla_fwd`'s Gluon kernel (sm_90) runs
            persistent: one program per multiprocessor, each taking (token, 64-head tile) work items in
            turn with one shared-memory ring, so that an item's query load, first gathers and output
            stores overlap its neighbours' work. ``"on"``, ``"off"`` (one program per item), or
            ``"auto"`` (default): persistent where a token has more than one head tile (``h_q > 64``),
            and with one head tile where the KV rows (``2 * s_kv * d_qk`` bytes) fit in half of the GPU's
            L2 cache (up to about 22K rows of 576 on an H100 / H200).
        fwd_tail_split: whether :func:`~sparse_mla_attn.sparse_mla_fwd`'s Gluon kernel (sm_90, without
            split-K) splits its last (token, 64-head tile) work items: where the items past the last full
            wave (one item per multiprocessor) are at most half as many as the multiprocessors, each of
            them runs as up to ``topk / 128`` pieces of its top-k list on otherwise idle
            multiprocessors, merged like split-K partials by a second kernel (persistent or one program
            per item, ``fwd_persistent``). ``"auto"`` (default): there; ``"on"``: wherever the last items
            can be split (also more than half as many, or fewer items than multiprocessors); ``"off"``:
            never.
        bwd_dkv_backend: kernel of :func:`~sparse_mla_attn.sparse_mla_bwd`'s ``dkv`` products up to 128
            heads (above, the main kernel forms them). ``"auto"`` (default): a warp-specialised Gluon
            kernel on an sm_90 GPU where :func:`gluon_supported` holds and the shape suits it (``d_v`` and
            ``d_qk`` multiples of 64, ``topk`` a multiple of 8), the Triton kernel elsewhere. ``"triton"``:
            always the Triton kernel. ``"gluon"``: ``"auto"`` that raises :class:`ValueError` where the
            Gluon kernel cannot run. The results are the same up to the order of the fp32 additions
            (bit-identical run to run in the deterministic mode).
        attn_dist_split: how the two consumer warpgroups of the Gluon ``attn_dist`` (sm_90) share a token
            of at most 64 heads: ``"blocks"`` (default), they take alternate 64-row blocks whole;
            ``"cols"``, each computes half of every block's columns. Above 64 heads each warpgroup takes
            64 heads.
        attn_dist_order: the form of the Gluon ``attn_dist`` (sm_90, ``topk <= 8192``; up to 64 heads
            with ``attn_dist_split="blocks"``). ``"index"``: a small kernel groups each token's valid
            slots by KV chunk in index order (chunks of at most an eighth of the L2 cache, at most 8),
            and persistent programs (one per multiprocessor) take pairs of tokens, one per consumer
            warpgroup (above 64 heads: tokens, 64 heads per consumer warpgroup), in waves: the tokens in
            flight, which keep pace, gather from about the same chunk of the KV rows at a time, which
            stays in L2, and the slots that are invalid (out of range, past the causal limit) are
            skipped. Where the KV rows do not fit in L2, alternate waves take the chunks last to first,
            starting on the rows the previous wave ended on. ``"slot"``: one program per token, its
            slots in their order. ``"auto"`` (default): ``"index"`` where there are at least 4 query
            tokens per multiprocessor and, above 64 heads, the KV rows fit in L2, else ``"slot"``. The
            results are the same bits either way.

    Raises:
        ValueError: an unknown ``backend``, ``split_merge``, ``fwd_persistent``, ``attn_dist_split``,
            ``attn_dist_order``, ``bwd_dkv_backend`` or ``fwd_tail_split``, ``num_splits < 0`` or a workspace cap below 1 byte.
    """

    backend: str = "auto"
    num_splits: int = 0
    split_merge: str = "auto"
    split_fill: float = 1.0
    bwd_workspace_bytes: int = 2 << 30
    bwd_deterministic_workspace_bytes: int = 4 << 30
    fwd_persistent: str = "auto"
    attn_dist_split: str = "blocks"
    bwd_dkv_backend: str = "auto"
    attn_dist_order: str = "auto"
    fwd_tail_split: str = "auto"

    def __post_init__(self) -> None:
        choices = {
            "backend": BACKENDS, "split_merge": SPLIT_MERGES, "fwd_persistent": FWD_PERSISTENT,
            "attn_dist_split": ATTN_DIST_SPLITS, "bwd_dkv_backend": BACKENDS, "attn_dist_order": ATTN_DIST_ORDERS,
            "fwd_tail_split": FWD_TAIL_SPLITS,
        }  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"Config.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.num_splits, int) or self.num_splits < 0:
            raise ValueError(f"Config.num_splits must be an int >= 0 (0: automatic), got {self.num_splits!r}")
        if (
            not isinstance(self.split_fill, (int, float))
            or isinstance(self.split_fill, bool)
            or not (0 < self.split_fill <= 64)
        ):
            raise ValueError(f"Config.split_fill must be a number in (0, 64], got {self.split_fill!r}")
        for name in ("bwd_workspace_bytes", "bwd_deterministic_workspace_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Config.{name} must be an int >= 1, got {value!r}")

    def splits_for(self, n_programs: int, topk: int, n_sm: int, block_t: int = 64) -> int:
        """The split-K factor used when ``num_splits`` is 0 (``num_splits`` itself otherwise).

        A grid of ``n_programs`` programs (query tokens x head tiles; one program per multiprocessor fits
        at a time, as the kernels' tiles fill shared memory) on ``n_sm`` multiprocessors is split ``s``
        ways, the largest ``s`` with ``s * n_programs <= split_fill * n_sm`` and at least 4 blocks of
        ``block_t`` top-k slots per split: ``min(floor(split_fill * n_sm / n_programs),
        ceil(topk / (4 * block_t)))``, at least 1. With the default ``split_fill`` 1.0 on an H200 (132
        multiprocessors) one decode token per sequence at h_q 128 (two 64-head tiles) splits 8 ways at
        batch 1 and 8, and not at batch 64 or 128; at h_q 64 (one tile) it splits 2 ways at batch 64.

        Args:
            n_programs: programs of the unsplit grid (``>= 0``).
            topk: top-k slots per query.
            n_sm: multiprocessors of the device (0: not a GPU, no split).
            block_t: top-k slots per kernel block.

        Returns:
            The factor, at least 1.
        """
        if self.num_splits:
            return self.num_splits
        if n_sm <= 0 or n_programs <= 0:
            return 1
        return max(1, min(int(self.split_fill * n_sm) // n_programs, -(-topk // (4 * block_t))))


DEFAULT = Config()


@functools.lru_cache(maxsize=256)
def config_of(
    backend: str = "auto",
    num_splits: int = 0,
    split_merge: str = "auto",
    bwd_workspace_bytes: int = DEFAULT.bwd_workspace_bytes,
    bwd_deterministic_workspace_bytes: int = DEFAULT.bwd_deterministic_workspace_bytes,
    split_fill: float = DEFAULT.split_fill,
    bwd_dkv_backend: str = DEFAULT.bwd_dkv_backend,
) -> Config:
    """The :class:`Config` of these fields, built (and checked) once: the custom ops receive the fields."""
    return Config(backend, num_splits, split_merge, split_fill, bwd_workspace_bytes,
                  bwd_deterministic_workspace_bytes, bwd_dkv_backend=bwd_dkv_backend)  # fmt: skip
