"""Hopper (sm_90) kernels written in Gluon, Triton's explicit-layout dialect (``triton.experimental.gluon``).

Why Gluon: in the Triton kernels of ``forward.py`` / ``attn_dist.py`` the software pipeliner issues the
``cp.async`` gather of block ``t+1`` only after block ``t``'s products, and with the query tile in shared
memory there is no room for a deeper ring. Here the pipeline is written out.

Both kernels are warp specialised: one producer warpgroup gathers 64-row blocks with ``cp.async`` into a
ring of shared-memory slots guarded by mbarriers, while two consumer warpgroups compute, so that one
warpgroup's softmax / exp runs while the other's products occupy the tensor cores (FlashMLA-style
ping-pong).

* forward: a ring of two slots, the consumers take alternate blocks; one program per (token, head tile)
  with whole slots (``_ws_producer``, ``_pp_consumer_whole``), or persistent (one program per
  multiprocessor taking those items in turn with one ring) with slots gathered and released by halves of
  their channels (``_pp_producer``, ``_pp_consumer``), both ``_sparse_mla_fwd_ws_kernel``;
* attn_dist: a ring of three slots (the query lives in registers), the consumers split the heads (or take
  alternate blocks, or split a block's columns) and issue their products by turns (``_ad_consumer``);
  up to 64 heads it runs persistent instead, each consumer warpgroup taking one token of a pair, over
  each token's slots ordered by KV chunk, so that the tokens of a wave gather from about the same chunk of
  rows (``_attn_dist_index_kernel``).

Rows whose index is invalid are copied with a zero source size (``cp.async`` zero fill): they are never
read.

A consumer issues wgmma on a ring slot right after its mbarrier wait, without a proxy fence: the
producer's ``cp.async`` copies complete through ``cp.async.mbarrier.arrive``, the protocol of
FlashMLA's SM90 sparse kernels and of CUTLASS's ``cp.async`` warp-specialised mainloops. Shared memory
the consumers write from registers (the query tile, P) is fenced before wgmma reads it.

Gluon's API changes between Triton releases: these kernels are written for the releases in
``GLUON_TRITON_VERSIONS`` (the few names that moved between them are bound once below); with any other
Triton (or none with Gluon) :func:`gluon_supported` is false and the ops run their Triton kernels. The
Triton interpreter cannot execute Gluon, so the CPU tests exercise the Triton kernels (and compile these
ahead of time for sm_90), and the GPU tests (``-m gpu``) compare them with the float32 references.
"""

from typing import Any, TypeAlias

import torch
import triton

from sparse_mla_attn._runtime import (
    LaunchContext,
    cdiv,
    is_sm90,
    launch,
    online_softmax_update,
    softmax_output_scale,
)
from sparse_mla_attn._validate import SparseDims

#: Triton releases (major, minor) whose Gluon API these kernels are written for and compiled against.
GLUON_TRITON_VERSIONS = ((3, 6), (3, 7), (3, 8), (3, 9))


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.language.core import _aggregate as aggregate

    HAVE_GLUON = _triton_version() in GLUON_TRITON_VERSIONS
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False


def gluon_supported() -> bool:
    """True when the installed Triton has the Gluon API these kernels are written for
    (``GLUON_TRITON_VERSIONS``); where it is false every op runs its Triton kernels."""
    return HAVE_GLUON


def gluon_usable(t: torch.Tensor, *rows: torch.Tensor) -> bool:
    """True when the Gluon kernels can run here: :func:`gluon_supported`, ``t`` on a CUDA sm_90 GPU
    (H100/H200), and every tensor of ``rows`` (gathered with 16-byte ``cp.async``) 16-byte aligned with a
    row stride of a multiple of 8 elements."""
    if not (HAVE_GLUON and t.is_cuda):
        return False
    if any(r.data_ptr() % 16 or r.stride(0) % 8 for r in rows):
        return False
    return is_sm90(t.device)


def use_gluon(backend: str, eligible: bool, what: str, t: torch.Tensor, *rows: torch.Tensor) -> bool:
    """Whether an op runs its Gluon kernel, for ``Config.backend`` (``"auto"``, ``"gluon"``, ``"triton"``)
    and whether the op's problem suits the Gluon kernel (``eligible``).

    Raises:
        ValueError: ``backend == "gluon"`` where the Gluon kernel cannot run.
    """
    if backend == "triton":
        return False
    usable = eligible and gluon_usable(t, *rows)
    if backend == "gluon" and not usable:
        raise ValueError(
            f"{what}: Config(backend='gluon') needs an sm_90 GPU, a Triton release in {GLUON_TRITON_VERSIONS} "
            f"(installed: {triton.__version__}), aligned rows and a problem the Gluon kernel covers"
        )
    return usable


if HAVE_GLUON:
    # A barrier of the program's threads: ``gl.thread_barrier`` in Triton 3.6, ``gl.barrier`` later.
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # cp.async of a pointer tensor into shared memory: ``async_load`` from Triton 3.8 on.
    async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared

    # How the warp-specialised attn_dist's two consumer warpgroups share a token (``_ad_consumer``).
    AD_SPLIT_HEADS = gl.constexpr(0)
    AD_SPLIT_COLS = gl.constexpr(1)
    AD_SPLIT_BLOCKS = gl.constexpr(2)

    @gluon.jit
    def _online_softmax(s, t_idx, hi, m_i, l_i, sm_scale_log2):
        """One block of the online softmax in base 2: scores ``s`` scaled, columns whose index ``t_idx`` is
        invalid masked; returns P, the factor ``alpha`` that rescales the earlier sums, the new row maxima
        and sums."""
        valid = (t_idx >= 0) & (t_idx < hi)
        s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
        m_new, alpha, l_new, p = online_softmax_update(s, m_i, l_i)  # (the Triton kernels' step too)
        return p, alpha, m_new, l_new

    @gluon.jit
    def opaque_zero(x):
        """0, computed from ``x`` in a way the compiler cannot see through. Added to shared-memory indices or
        offsets that would otherwise be constants, it keeps the compiler from hoisting every address or
        wgmma descriptor computed from them out of the loop or partition (where they take registers and
        spill)."""
        return gl.inline_asm_elementwise(
            "and.b32 $0, $1, 0;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1
        )

    @gluon.jit
    def _issue_gather_cols(
        k_buf, KV, stride_kv_row, idx, hi, COL0: gl.constexpr, N_COLS: gl.constexpr, ld_l: gl.constexpr
    ):
        """cp.async the columns ``[COL0, COL0 + N_COLS)`` of the rows ``idx`` ([BLOCK_T] int32,
        ``SliceLayout(1, ld_l)``) into ``k_buf`` ([BLOCK_T, N_COLS]).

        Invalid rows (index < 0 or >= hi) get a zero source size: the buffer is zero-filled, the row is
        not read. ``ld_l`` gives each thread 16-byte vectors and a warp 4 rows x 128 bytes.
        """
        valid = (idx >= 0) & (idx < hi)
        row = gl.where(valid, idx, 0).to(gl.int64) * stride_kv_row
        cols = COL0 + gl.arange(0, N_COLS, layout=gl.SliceLayout(0, ld_l))
        async_load(k_buf, KV + row[:, None] + cols[None, :], mask=valid[:, None] & (cols[None, :] >= 0))

    @gluon.jit
    def _issue_gather(
        kn_buf,
        kr_buf,
        KV,
        stride_kv_row,
        idx,
        hi,
        D_NOPE: gl.constexpr,
        D_ROPE: gl.constexpr,
        ld_l: gl.constexpr,
    ):
        """cp.async the rows ``idx`` whole into one ring slot: the latent part into ``kn_buf``, the rope
        part into ``kr_buf`` (see ``_issue_gather_cols``)."""
        _issue_gather_cols(kn_buf, KV, stride_kv_row, idx, hi, 0, D_NOPE, ld_l)
        if D_ROPE > 0:
            _issue_gather_cols(kr_buf, KV, stride_kv_row, idx, hi, D_NOPE, D_ROPE, ld_l)

    @gluon.jit
    def _causal_hi(s_kv, pid_s, q_start_index, k_stride, CAUSAL: gl.constexpr):
        """Exclusive upper bound of the valid KV indices of token ``pid_s``: ``s_kv``, or with ``CAUSAL``
        at most ``(q_start_index + pid_s + 1 - k_stride) // k_stride + 1`` (C division of a non-negative
        numerator; a negative one allows index 0 only, as the CUDA kernel does)."""
        hi = s_kv
        if CAUSAL:
            num = q_start_index + pid_s + 1 - k_stride
            hi = gl.minimum(hi, gl.maximum(num, 0) // k_stride + 1)
        return hi

    @gluon.jit
    def _ws_ring_barriers(NUM_BUF: gl.constexpr, READERS: gl.constexpr, PARTS: gl.constexpr = 1):
        """mbarriers of a warp-specialised ring: ``full[s]`` completes when the producer's 128 threads'
        copies into slot ``s`` landed (one deferred arrive each), ``empty[s]`` when the ``READERS``
        consumer warpgroups that read the slot's block released it (one arrive per warpgroup). With
        ``PARTS`` > 1 a slot is gathered in parts of its channels, and ``full[PARTS s + j]`` completes when
        part ``j`` landed (see ``_ws_producer``)."""
        full_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF * PARTS, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(NUM_BUF):
            for part in gl.static_range(PARTS):
                mbarrier.init(full_bars.index(PARTS * j + part), count=128)
            mbarrier.init(empty_bars.index(j), count=READERS)
        return full_bars, empty_bars

    @gluon.jit
    def _ws_wait_full(full_bars, b, NUM_BUF: gl.constexpr):
        """Consumer side of the ring: wait until block ``b`` landed in slot ``b % NUM_BUF`` (no proxy fence:
        see the module's docstring). Returns the slot."""
        slot = b % NUM_BUF
        mbarrier.wait(full_bars.index(slot), (b // NUM_BUF) & 1)
        return slot

    @gluon.jit
    def _ws_producer(
        kn_smem,
        kr_smem,
        full_bars,
        empty_bars,
        KV,
        stride_kv_row,
        idx_row,
        n_t,
        hi,
        n_blocks,
        D_NOPE: gl.constexpr,
        D_ROPE: gl.constexpr,
        BLOCK_T: gl.constexpr,
        NUM_BUF: gl.constexpr,
        PARTS: gl.constexpr = 1,
    ):
        """Producer warpgroup of attn_dist and of the per-item forward: gathers block ``b`` into slot
        ``b % NUM_BUF`` once its readers released that slot's previous block, and arms
        ``full_bars[b % NUM_BUF]`` with one deferred arrive per thread (``cp.async.mbarrier.arrive.noinc``:
        it fires when this thread's copies landed). With ``PARTS`` > 1 it gathers the slot in ``PARTS``
        parts of ``D_NOPE / PARTS`` channels (the rope part with the last) and arms ``full_bars[PARTS slot +
        j]`` after part ``j``, so that a consumer can start on a block's first channels while the rest
        land."""
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_t = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, ld_l))
        idx_next = gl.load(idx_row + offs_t, mask=offs_t < n_t, other=-1)
        for b in range(n_blocks):
            slot = b % NUM_BUF
            idx_cur = idx_next
            nxt = (b + 1) * BLOCK_T + offs_t
            idx_next = gl.load(idx_row + nxt, mask=nxt < n_t, other=-1)
            # Slot free: its readers arrived for block b - NUM_BUF (a fresh barrier passes parity 1 at once).
            mbarrier.wait(empty_bars.index(slot), ((b // NUM_BUF) & 1) ^ 1)
            D_PART: gl.constexpr = D_NOPE // PARTS
            for j in gl.static_range(PARTS):
                kn = kn_smem.index(slot).slice(j * D_PART, D_PART, dim=1)
                _issue_gather_cols(kn, KV, stride_kv_row, idx_cur, hi, j * D_PART, D_PART, ld_l)
                if j == PARTS - 1 and D_ROPE > 0:
                    kr = kr_smem.index(slot)
                    _issue_gather_cols(kr, KV, stride_kv_row, idx_cur, hi, D_NOPE, D_ROPE, ld_l)
                # (Fires once this thread's copies so far landed: parts 0 .. j.)
                cp.mbarrier_arrive(full_bars.index(PARTS * slot + j), increment_count=False)

    @gluon.constexpr_function
    def _pp_layouts(BLOCK_T: Any, D_HALF: Any) -> tuple[Any, Any]:
        """The ping-pong consumers' wgmma layouts (one warpgroup): S ``[64, BLOCK_T]`` and the accumulator of
        its ``D_HALF`` value channels ``[64, D_HALF]``."""
        s_l = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_T, 16])
        o_l = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_HALF, 16])
        return s_l, o_l

    @gluon.jit
    def _pp_other_pv(
        smem, OTHER: gl.constexpr, WG: gl.constexpr, ph, m_i, l_i, acc, row_l: gl.constexpr, o_l: gl.constexpr
    ):
        """Consumer warpgroup ``WG``'s share of the other warpgroup's block (ring slot ``OTHER``) in the
        ping-pong forward: waits for its P and row max (``smem.p_bars[OTHER]``, pair phase ``ph``), moves
        the running max ``m_i`` to that max (rescaling the row sums ``l_i`` and the accumulator ``acc``)
        and issues, asynchronously, the product of P with this warpgroup's value channels of the block.
        Returns the new ``m_i, l_i, acc``."""
        D_HALF: gl.constexpr = acc.shape[1]
        mbarrier.wait(smem.p_bars.index(OTHER), ph)
        m_b = smem.m.index(OTHER).load(row_l)
        alpha = gl.exp2(m_i - gl.where(m_b == float("-inf"), 0.0, m_b))
        l_i = l_i * alpha
        m_i = m_b
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        acc = warpgroup_mma(
            smem.p, smem.kn.index(OTHER).slice(WG * D_HALF, D_HALF, dim=1), acc, is_async=True
        )
        return m_i, l_i, acc

    @gluon.jit
    def _whole_issue_s(smem, SLOT: gl.constexpr, b, z, s, D_ROPE: gl.constexpr):
        """Issue, asynchronously, S = Q K^T of the per-item forward's block ``b`` (ring slot ``SLOT``) part by
        part of its channels, each once it landed (``smem.full_bars``: ``PARTS`` per slot, see
        ``_ws_producer``), the rope part with the last: ``PARTS`` + 1 commit groups (``PARTS`` without a
        rope part). ``s``: the accumulator to overwrite; ``z``: an opaque zero added to the shared-memory
        indices (see ``_pp_consumer_whole``)."""
        PARTS: gl.constexpr = smem.full_bars.shape[0] // 2
        D_PART: gl.constexpr = smem.kn.shape[2] // PARTS
        for j in gl.static_range(PARTS):
            mbarrier.wait(smem.full_bars.index(PARTS * SLOT + j), (b // 2) & 1)
            s = warpgroup_mma(
                smem.qn.index(z).slice(j * D_PART, D_PART, dim=1),
                smem.kn.index(SLOT + z).slice(j * D_PART, D_PART, dim=1).permute((1, 0)),
                s,
                use_acc=j > 0,
                is_async=True,
            )
        if D_ROPE > 0:
            s = warpgroup_mma(smem.qr.index(z), smem.kr.index(SLOT + z).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _pp_consumer_whole(
        WG: gl.constexpr,
        smem,
        item,
        OUT,
        MAX_LOGITS,
        LSE,
        SINK,
        sm_scale_log2,
        D_ROPE: gl.constexpr,
        BLOCK_T: gl.constexpr,
        HAS_SINK: gl.constexpr,
        kk0=0,
        end_ph=0,
    ):
        """Ping-pong forward over a ring of whole slots (the per-item kernel), consumer warpgroup ``WG`` (0 or
        1) of a token's 64 heads; the persistent kernel runs ``_pp_consumer`` (half slots). Each form has
        the schedule that was the faster of the two for it on sm_90.

        Blocks ``2k + WG`` are this warpgroup's own: it computes their whole S (m64n64, Q and K from shared
        memory), the online softmax with the running row max of the block before (read from the other
        warpgroup through ``smem.m``), publishes P (bf16, ``smem.p``) and the new max (``smem.p_bars[WG]``),
        and accumulates its P·V from registers. Blocks of the other warpgroup are consumed from
        ``smem.p``. Each warpgroup owns 256 of the 512 value channels (acc 64 x 256 fp32). With
        ``item.TURNS`` the two issue their S strictly by turns (``smem.turn_bar``: warpgroup 1 issues
        S(2k+1) once warpgroup 0 issued S(2k)), so S(2k+1) queues behind S(2k) instead of sharing the
        tensor cores with it, and warpgroup 0's softmax runs while S(2k+1) computes. A slot is gathered in
        parts of its channels (``smem.full_bars``: one barrier per part, see ``_ws_producer``), and S is
        issued part by part as they land (``_whole_issue_s``): its first products run while the block's
        last channels are still being gathered.

        Waits are bounded by construction: each of ``full_bars`` completes once per gather (128 producer
        arrivals), ``empty_bars[s]`` once per block (one arrive per consumer warpgroup), ``p_bars[w]`` and
        ``turn_bar`` once per pair; no barrier can run more than one phase ahead of its waiters. ``kk0``:
        pairs the ring already carried and ``end_ph``: the phase of ``end_bar`` (a persistent program's
        earlier items).

        With ``item.SPLIT_K`` (``item``: a ``_FwdItem``) the program covers one split of the token's top-k
        list and writes the split-K partials as the Triton forward does: the fp32 output normalised by this
        split's own sum (no sink), the base-2 lse and row max (merged by ``_split_combine_kernel``).
        """
        BLOCK_H: gl.constexpr = 64
        D_NOPE: gl.constexpr = smem.kn.shape[2]
        D_HALF: gl.constexpr = D_NOPE // 2
        s_l: gl.constexpr = _pp_layouts(BLOCK_T, D_HALF)[0]
        o_l: gl.constexpr = _pp_layouts(BLOCK_T, D_HALF)[1]
        pa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_l)
        dtype: gl.constexpr = smem.p.dtype

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BLOCK_H], gl.float32, row_l)
        acc = gl.zeros([BLOCK_H, D_HALF], gl.float32, o_l)
        offs_c = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, s_l))
        for k in range(item.n_pairs):
            ph = (kk0 + k) & 1
            # Own block b = 2k + WG in slot WG: issue its S first (warpgroup 1 thus computes S(2k+1)
            # while warpgroup 0 runs the softmax of block 2k).
            b = 2 * k + WG
            # (Without it the compiler hoists all 2 x 36 wgmma descriptors of S out of the loop and spills.)
            z = opaque_zero(k)
            t_idx = gl.load(
                item.idx_row + b * BLOCK_T + offs_c, mask=b * BLOCK_T + offs_c < item.n_t, other=-1
            )
            if item.TURNS and WG == 1:
                mbarrier.wait(smem.turn_bar, ph)  # warpgroup 0 issued S(2k)
            s = gl.zeros([BLOCK_H, BLOCK_T], gl.float32, s_l)
            s = _whole_issue_s(smem, WG, 2 * (kk0 + k) + WG, z, s, D_ROPE)
            if item.TURNS and WG == 0:
                mbarrier.arrive(smem.turn_bar)  # (all 4 warps issued it)
            if WG == 1:
                # The other warpgroup's block 2k (its softmax ran while S(2k+1) was computed): P and its
                # row max from shared memory; its P·V queues behind S.
                m_i, l_i, acc = _pp_other_pv(smem, 0, WG, ph, m_i, l_i, acc, row_l, o_l)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S done, P·V(2k) may still run
            else:
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_i, l_i = _online_softmax(s, t_idx, item.hi, m_i, l_i, sm_scale_log2)
            p16 = p.to(dtype)
            if WG == 1:
                # P(2k) must be read before P(2k+1) overwrites it; then slot 0 is done for this warpgroup.
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(smem.empty_bars.index(0))
            smem.p.store(p16)
            smem.m.index(WG).store(m_i)
            fence_async_shared()
            mbarrier.arrive(smem.p_bars.index(WG))
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            acc = warpgroup_mma(
                gl.convert_layout(p16, pa_l),
                smem.kn.index(WG).slice(WG * D_HALF, D_HALF, dim=1),
                acc,
                is_async=True,
            )

            if WG == 0:
                # Release slot 0 as soon as this warpgroup is done with block 2k (S and P·V), before
                # waiting for the other's block 2k+1: the gather of block 2k+2 starts earlier.
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(smem.empty_bars.index(0))
                m_i, l_i, acc = _pp_other_pv(smem, 1, WG, ph, m_i, l_i, acc, row_l, o_l)
            # (The loop carries acc as a tensor: wait here.) Done with block 2k+1: release slot 1.
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(smem.empty_bars.index(1))
        _pp_epilogue(WG, smem, m_i, l_i, acc, item, OUT, MAX_LOGITS, LSE, SINK, HAS_SINK, end_ph)

    @gluon.jit
    def _pp_gather_half(smem, SLOT: gl.constexpr, HALF: gl.constexpr, pair, KV, stride_kv_row, idx, hi,
                        D_NOPE: gl.constexpr, D_ROPE: gl.constexpr, ld_l: gl.constexpr):  # fmt: skip
        """Forward producer: gather half ``HALF`` of ring slot ``SLOT`` (0: value channels ``[0, D_NOPE/2)``;
        1: ``[D_NOPE/2, D_NOPE)`` and the rope part) for the ring's pair ``pair``, once its reader released
        it, and arm ``full_bars[2 SLOT + HALF]`` with one deferred arrive per thread."""
        D_HALF: gl.constexpr = D_NOPE // 2
        bar: gl.constexpr = 2 * SLOT + HALF
        # Free: its reader released it for the previous pair (a fresh barrier passes parity 1 at once).
        mbarrier.wait(smem.empty_bars.index(bar), (pair & 1) ^ 1)
        kn = smem.kn.index(SLOT).slice(HALF * D_HALF, D_HALF, dim=1)
        _issue_gather_cols(kn, KV, stride_kv_row, idx, hi, HALF * D_HALF, D_HALF, ld_l)
        if HALF == 1 and D_ROPE > 0:
            _issue_gather_cols(smem.kr.index(SLOT), KV, stride_kv_row, idx, hi, D_NOPE, D_ROPE, ld_l)
        cp.mbarrier_arrive(smem.full_bars.index(bar), increment_count=False)

    @gluon.jit
    def _pp_producer(smem, KV, stride_kv_row, idx_row, n_t, hi, n_pairs, D_NOPE: gl.constexpr,
                     D_ROPE: gl.constexpr, BLOCK_T: gl.constexpr, pair0=0):  # fmt: skip
        """Producer warpgroup of the forward: gathers each pair of blocks ``2k, 2k + 1`` into ring slots 0 and
        1 by halves, each once its one reader is done with it (see ``_pp_consumer``), slot 0 first (slot 0's
        first half, its second, slot 1's second, slot 1's first): warpgroup 0 issues its next S, on slot 0,
        right behind the pair's last P·V, and a half takes long to issue, so slot 0's second half does not
        wait behind slot 1's. ``pair0``: pairs the ring already carried (a persistent program's earlier
        items)."""
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_t = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, ld_l))
        for k in range(n_pairs):
            pair = pair0 + k
            t0 = 2 * k * BLOCK_T + offs_t
            idx0 = gl.load(idx_row + t0, mask=t0 < n_t, other=-1)
            idx1 = gl.load(idx_row + BLOCK_T + t0, mask=BLOCK_T + t0 < n_t, other=-1)
            _pp_gather_half(smem, 0, 0, pair, KV, stride_kv_row, idx0, hi, D_NOPE, D_ROPE, ld_l)
            _pp_gather_half(smem, 0, 1, pair, KV, stride_kv_row, idx0, hi, D_NOPE, D_ROPE, ld_l)
            _pp_gather_half(smem, 1, 1, pair, KV, stride_kv_row, idx1, hi, D_NOPE, D_ROPE, ld_l)
            _pp_gather_half(smem, 1, 0, pair, KV, stride_kv_row, idx1, hi, D_NOPE, D_ROPE, ld_l)

    @gluon.jit
    def _pp_issue_s(smem, WG: gl.constexpr, z, ph, s, D_NOPE: gl.constexpr, D_ROPE: gl.constexpr):
        """Issue, asynchronously, S = Q K^T of warpgroup ``WG``'s block (ring slot ``WG``) in two halves of
        the channels, each once it landed (pair phase ``ph``): the half the producer fills first
        (warpgroup 0: the first, warpgroup 1: the second, with the rope part) goes first. ``z``: an opaque
        zero added to the shared-memory indices (see ``_pp_consumer``)."""
        s = _pp_issue_s_half(smem, WG, WG, z, ph, s, False, D_NOPE, D_ROPE)
        return _pp_issue_s_half(smem, WG, 1 - WG, z, ph, s, True, D_NOPE, D_ROPE)

    @gluon.jit
    def _pp_issue_s_half(smem, WG: gl.constexpr, HALF: gl.constexpr, z, ph, s, USE_ACC: gl.constexpr,
                         D_NOPE: gl.constexpr, D_ROPE: gl.constexpr):  # fmt: skip
        """Half ``HALF`` of ``_pp_issue_s``: wait until it landed, then issue its products."""
        D_HALF: gl.constexpr = D_NOPE // 2
        mbarrier.wait(smem.full_bars.index(2 * WG + HALF), ph)
        s = warpgroup_mma(
            smem.qn.index(z).slice(HALF * D_HALF, D_HALF, dim=1),
            smem.kn.index(WG + z).slice(HALF * D_HALF, D_HALF, dim=1).permute((1, 0)),
            s,
            use_acc=USE_ACC,
            is_async=True,
        )
        if HALF == 1 and D_ROPE > 0:
            s = warpgroup_mma(smem.qr.index(z), smem.kr.index(WG + z).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _pp_consumer(
        WG: gl.constexpr,
        smem,
        item,
        OUT,
        MAX_LOGITS,
        LSE,
        SINK,
        sm_scale_log2,
        D_ROPE: gl.constexpr,
        BLOCK_T: gl.constexpr,
        HAS_SINK: gl.constexpr,
        kk0=0,
        end_ph=0,
    ):
        """Ping-pong forward over a ring of half slots (the persistent kernel), consumer warpgroup ``WG`` (0 or
        1) of a token's 64 heads; the per-item kernel runs ``_pp_consumer_whole``.

        Blocks ``2k + WG`` (ring slot ``WG``) are this warpgroup's own: it computes their whole S (m64n64,
        Q and K from shared memory) and the online softmax. Each warpgroup owns half of the value channels
        (acc 64 x 256 fp32) and multiplies its own P from registers with its half of its own block, and the
        other warpgroup's P from shared memory with its half of the other block. Per pair of blocks:

        * warpgroup 0: softmax of block 2k against the running max, publishes its max (``p_bars[0]``),
          issues its own P·V; waits for warpgroup 1's max (``p_bars[1]``), rescales its P to it and
          publishes it in slot 0's rope part (``s_bars[0]``: S no longer needs it) while that P·V runs,
          then releases slot 0's first half once it is done; waits for warpgroup 1's P (``s_bars[1]``),
          rescales the accumulator, issues that P·V and behind it the next block's S, and releases slot 1's
          first half once that P·V is done (with ``item.FREE_EARLY`` before issuing the second half of that
          S, whose gather, behind the release of slot 0's second half by warpgroup 1, may still be in
          flight: the producer refills slot 1's first half meanwhile);
        * warpgroup 1: S of block 2k+1, then, with warpgroup 0's max, its softmax against the larger of
          the two maxima (so both warpgroups end a pair at the same max), publishes that max, own P·V,
          publishes its P (``smem.p``), issues warpgroup 0's P·V and releases slot 1's second half and
          slot 0's second half as the products finish.

        While one warpgroup runs its softmax the other's wgmma occupy the tensor cores, and every half slot
        is refilled as soon as its last reader is done with it (``_pp_producer``). With ``item.TURNS``
        warpgroup 1 issues S(2k+1) only once warpgroup 0 issued S(2k) (``smem.turn_bar``), so the two S
        never share the tensor cores (see ``_pp_consumer_whole``). Waits are bounded by construction:
        every barrier completes once per pair and none can run a phase ahead of its waiters. ``kk0``: pairs
        the ring already carried and ``end_ph``: the phase of ``end_bar`` (a persistent program's earlier
        items).

        ``item`` (a ``_FwdItem``) with ``SPLIT_K``: as in ``_pp_consumer_whole``.
        """
        BLOCK_H: gl.constexpr = 64
        D_NOPE: gl.constexpr = smem.kn.shape[2]
        D_HALF: gl.constexpr = D_NOPE // 2
        s_l: gl.constexpr = _pp_layouts(BLOCK_T, D_HALF)[0]
        o_l: gl.constexpr = _pp_layouts(BLOCK_T, D_HALF)[1]
        pa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_l)
        alpha_l: gl.constexpr = gl.SliceLayout(1, o_l)
        dtype: gl.constexpr = smem.p.dtype
        # Warpgroup 0's P for warpgroup 1 lives in slot 0's rope part, [64, BLOCK_T] like ``smem.p``.
        gl.static_assert(BLOCK_T == 64)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BLOCK_H], gl.float32, row_l)
        acc = gl.zeros([BLOCK_H, D_HALF], gl.float32, o_l)
        s = gl.zeros([BLOCK_H, BLOCK_T], gl.float32, s_l)
        offs_c = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, s_l))
        # Each block's indices are loaded before its S is waited for (warpgroup 0: right behind the issue
        # of its next S, at the end of the pair before), so that the global load's latency is hidden behind
        # the products instead of standing between S and the softmax. (Warpgroup 0 carries them in a
        # layout of one index per thread, converted where used: in S's column layout they would take 16
        # registers a thread, and the consumer would spill.)
        idx_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        offs_n = gl.arange(0, BLOCK_T, layout=idx_l)
        if WG == 0:
            t_next = gl.load(item.idx_row + offs_n, mask=offs_n < item.n_t, other=-1)
        for k in range(item.n_pairs):
            ph = (kk0 + k) & 1
            b = 2 * k + WG
            # (Without it the compiler hoists all 2 x 36 wgmma descriptors of S out of the loop and spills.)
            z = opaque_zero(k)
            if WG == 0:
                t_idx = gl.convert_layout(t_next, gl.SliceLayout(0, s_l))
            else:
                t_at = b * BLOCK_T + offs_c
                t_idx = gl.load(item.idx_row + t_at, mask=t_at < item.n_t, other=-1)
            if WG == 1:
                if item.TURNS:
                    mbarrier.wait(smem.turn_bar, ph)  # warpgroup 0 issued S(2k)
                s = _pp_issue_s(smem, WG, z, ph, s, D_NOPE, D_ROPE)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            elif k == 0:
                # (Warpgroup 0 issues its later S behind the other block's P·V, at the end of a pair.)
                s = _pp_issue_s(smem, WG, z, ph, s, D_NOPE, D_ROPE)
                if item.TURNS:
                    mbarrier.arrive(smem.turn_bar)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if WG == 0:
                p, alpha, m_i, l_i = _online_softmax(s, t_idx, item.hi, m_i, l_i, sm_scale_log2)
                smem.m.index(0).store(m_i)
                mbarrier.arrive(smem.p_bars.index(0))
                acc = acc * gl.convert_layout(alpha, alpha_l)[:, None]
                acc = warpgroup_mma(
                    gl.convert_layout(p.to(dtype), pa_l),
                    smem.kn.index(0).slice(0, D_HALF, dim=1),
                    acc,
                    is_async=True,
                )
                # Move P to warpgroup 1's max, the pair's max, and publish it while the own P·V runs.
                mbarrier.wait(smem.p_bars.index(1), ph)
                m_1 = smem.m.index(1).load(row_l)
                rescale = gl.exp2(m_i - gl.where(m_1 == float("-inf"), 0.0, m_1))
                smem.kr.index(0).store((p * rescale[:, None]).to(dtype))
                fence_async_shared()
                mbarrier.arrive(smem.s_bars.index(0))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(smem.empty_bars.index(0))  # slot 0, first half: read by no one else
                # ... and the accumulator and the sums.
                m_i = m_1
                l_i = l_i * rescale
                acc = acc * gl.convert_layout(rescale, alpha_l)[:, None]
                mbarrier.wait(smem.s_bars.index(1), ph)
                pv_b = smem.kn.index(1).slice(0, D_HALF, dim=1)
                if k + 1 < item.n_pairs:
                    acc = warpgroup_mma(smem.p, pv_b, acc, is_async=True)
                    if item.FREE_EARLY:  # the first half of S, then free slot 1's first half, then the rest
                        s = _pp_issue_s_half(smem, 0, 0, z, ph ^ 1, s, False, D_NOPE, D_ROPE)
                    else:
                        s = _pp_issue_s(smem, 0, z, ph ^ 1, s, D_NOPE, D_ROPE)
                        if item.TURNS:
                            mbarrier.arrive(smem.turn_bar)
                    t_at = (b + 2) * BLOCK_T + offs_n
                    t_next = gl.load(item.idx_row + t_at, mask=t_at < item.n_t, other=-1)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # (S may still run)
                    mbarrier.arrive(smem.empty_bars.index(2))  # slot 1, first half
                    if item.FREE_EARLY:
                        s = _pp_issue_s_half(smem, 0, 1, z, ph ^ 1, s, True, D_NOPE, D_ROPE)
                        if item.TURNS:
                            mbarrier.arrive(smem.turn_bar)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                else:
                    acc = warpgroup_mma(smem.p, pv_b, acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(smem.empty_bars.index(2))
            else:
                valid = (t_idx >= 0) & (t_idx < item.hi)
                s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
                mbarrier.wait(smem.p_bars.index(0), ph)
                m_new = gl.maximum(smem.m.index(0).load(row_l), gl.max(s, 1))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_use)
                p = gl.exp2(s - m_use[:, None])
                l_i = l_i * alpha + gl.sum(p, 1)
                p16 = p.to(dtype)
                m_i = m_new
                smem.m.index(1).store(m_i)
                mbarrier.arrive(smem.p_bars.index(1))
                acc = acc * gl.convert_layout(alpha, alpha_l)[:, None]
                acc = warpgroup_mma(
                    gl.convert_layout(p16, pa_l),
                    smem.kn.index(1).slice(D_HALF, D_HALF, dim=1),
                    acc,
                    is_async=True,
                )
                smem.p.store(p16)
                mbarrier.wait(smem.s_bars.index(0), ph)
                acc = warpgroup_mma(smem.kr.index(0), smem.kn.index(0).slice(D_HALF, D_HALF, dim=1), acc,
                                    is_async=True)  # fmt: skip
                fence_async_shared()
                mbarrier.arrive(smem.s_bars.index(1))
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(smem.empty_bars.index(3))  # slot 1, second half
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(smem.empty_bars.index(1))  # slot 0, second half (and the P in it)
        _pp_epilogue(WG, smem, m_i, l_i, acc, item, OUT, MAX_LOGITS, LSE, SINK, HAS_SINK, end_ph)

    @gluon.jit
    def _pp_epilogue(WG: gl.constexpr, smem, m_i, l_i, acc, item, OUT, MAX_LOGITS, LSE, SINK,
                     HAS_SINK: gl.constexpr, end_ph):  # fmt: skip
        """The end of a forward work item for consumer warpgroup ``WG`` (both consumers): exchange the row
        sums (each summed its own blocks' P) through ``smem.l`` / ``end_bar`` (phase ``end_ph``), then write
        the lse and row max (warpgroup 0) and this warpgroup's output channels (``_pp_write``): split-K
        items and tail pieces as partials."""
        row_l: gl.constexpr = m_i.type.layout
        smem.l.index(WG).store(l_i)
        mbarrier.arrive(smem.end_bar)
        mbarrier.wait(smem.end_bar, end_ph)
        l_i = l_i + smem.l.index(1 - WG).load(row_l)
        if item.SPLIT_K:
            _pp_write(WG, smem, m_i, l_i, acc, item, OUT, MAX_LOGITS, LSE, SINK, False, True)
        elif item.TAIL:
            if item.piece:
                _pp_write(
                    WG,
                    smem,
                    m_i,
                    l_i,
                    acc,
                    item,
                    item.PART_O,
                    item.PART_MAX,
                    item.PART_LSE,
                    SINK,
                    False,
                    True,
                )
            else:
                _pp_write(WG, smem, m_i, l_i, acc, item, OUT, MAX_LOGITS, LSE, SINK, HAS_SINK, False)
        else:
            _pp_write(WG, smem, m_i, l_i, acc, item, OUT, MAX_LOGITS, LSE, SINK, HAS_SINK, False)

    @gluon.jit
    def _pp_write(WG: gl.constexpr, smem, m_i, l_i, acc, item, OUT, MAX_LOGITS, LSE, SINK, ADD_SINK: gl.constexpr,
                  PARTIAL: gl.constexpr):  # fmt: skip
        """Write consumer warpgroup ``WG``'s output channels of a work item (at ``item.out_base``), and
        (warpgroup 0) its lse and row max (at ``item.lse_base``): final (natural log, normalised with the
        sink where ``ADD_SINK``) or, with ``PARTIAL``, split-K partials (fp32 output normalised by this
        split's own sum, base 2; the merge kernel adds the sink)."""
        BLOCK_H: gl.constexpr = acc.shape[0]
        D_HALF: gl.constexpr = acc.shape[1]
        o_l: gl.constexpr = acc.type.layout
        row_l: gl.constexpr = m_i.type.layout
        offs_hs = item.h0 + gl.arange(0, BLOCK_H, layout=row_l)
        hs_ok = offs_hs < item.h_q
        m_use, has_any, scale = softmax_output_scale(m_i, l_i, SINK, offs_hs, hs_ok, ADD_SINK)
        if PARTIAL:
            to_out = 1.0
        else:
            to_out = 0.6931471805599453
        if WG == 0:
            lse2 = gl.where(has_any, m_use + gl.log2(gl.where(has_any, l_i, 1.0)), float("-inf"))
            gl.store(LSE + item.lse_base + offs_hs, lse2 * to_out, mask=hs_ok)
            gl.store(MAX_LOGITS + item.lse_base + offs_hs, m_i * to_out, mask=hs_ok)
        out = acc * gl.convert_layout(scale, gl.SliceLayout(1, o_l))[:, None]
        if PARTIAL:  # fp32, read back by the merge kernel
            offs_ho = item.h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l))
            offs_d = WG * D_HALF + gl.arange(0, D_HALF, layout=gl.SliceLayout(0, o_l))
            o_ptr = OUT + item.out_base + offs_ho[:, None] * item.stride_o_h + offs_d[None, :]
            gl.store(
                o_ptr,
                out.to(OUT.dtype.element_ty),
                mask=(offs_ho < item.h_q)[:, None] & (offs_d[None, :] >= 0),
            )
        else:
            _pp_store_out(WG, smem, out.to(OUT.dtype.element_ty), OUT, item)

    @gluon.jit
    def _pp_store_out(WG: gl.constexpr, smem, out, OUT, item):
        """Store consumer warpgroup ``WG``'s output channels ``out`` ([64, D_NOPE / 2], the accumulator's
        layout) through shared memory: staged in its own channels of the query tile (no S reads it any
        more), then written with 16-byte row-contiguous stores marked L2 evict-first (streamed: L2 is
        left to the gathered rows)."""
        D_HALF: gl.constexpr = out.shape[1]
        stage = smem.qn.index(0).slice(WG * D_HALF, D_HALF, dim=1)
        stage.store(out)
        cta_barrier()  # this warpgroup's writes, before its threads read other threads' rows
        st_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        vals = stage.load(st_l)
        offs_h = item.h0 + gl.arange(0, out.shape[0], layout=gl.SliceLayout(1, st_l))
        offs_d = WG * D_HALF + gl.arange(0, D_HALF, layout=gl.SliceLayout(0, st_l))
        o_ptr = OUT + item.out_base + offs_h[:, None] * item.stride_o_h + offs_d[None, :]
        gl.store(
            o_ptr,
            vals,
            mask=(offs_h < item.h_q)[:, None] & (offs_d[None, :] >= 0),
            eviction_policy="evict_first",
        )
        cta_barrier()  # read back by every thread before the tile is written again

    def _aggregate_of_fields(cls: Any) -> Any:
        """``cls`` as a Gluon aggregate (a struct of values that jit functions take and pass on as one)
        whose constructor takes its annotated fields in order; a Python value (e.g. an int argument of 1,
        which Triton passes as a constant) is stored as a constexpr."""
        names = tuple(cls.__annotations__)

        @gluon.constexpr_function
        def __init__(self: Any, *values: Any) -> None:
            for name, value in zip(names, values, strict=True):
                setattr(self, name, value if isinstance(value, gl.base_value) else gl.constexpr(value))

        cls.__init__ = __init__
        return aggregate(cls)

    _Int: TypeAlias = gl.tensor | gl.constexpr  # an int kernel argument (1 and None come as constants)

    @_aggregate_of_fields
    class _FwdItem:
        """One forward work item, located (``_FwdItems.get``): what its producer and consumers read and where
        its outputs go."""

        pid_s: gl.tensor  # the query token
        h0: gl.tensor  # its first head
        idx_row: gl.tensor  # its index row (with SPLIT_K: the split's first slot)
        n_t: gl.tensor  # valid slots of the row
        hi: gl.tensor  # the causal bound: keys below it are visible
        n_pairs: gl.tensor  # pairs of BLOCK_T-slot blocks to consume
        out_base: gl.tensor  # the token's offset in OUT
        lse_base: gl.tensor  # ... and in LSE / MAX_LOGITS
        stride_o_h: _Int  # OUT's head stride
        h_q: _Int
        piece: _Int  # with TAIL: the item is a split of a tail item, written as partials to PART_*
        PART_O: _Int  # with TAIL: the tail pieces' partial outputs, row maxima and lse (else None)
        PART_MAX: _Int
        PART_LSE: _Int
        SPLIT_K: gl.constexpr
        TURNS: gl.constexpr  # the consumers issue their S by turns (``_pp_consumer_whole``)
        FREE_EARLY: gl.constexpr  # warpgroup 0 frees slot 1's first half within its next S (``_pp_consumer``)
        TAIL: gl.constexpr

    @_aggregate_of_fields
    class _FwdItems:
        """The forward's work items: (token, 64-head tile) pairs, with ``SPLIT_K`` one per split of the
        token's top-k list too, with ``TAIL`` the pairs below ``n_main`` whole and then ``tail_splits``
        pieces of each later pair (see ``_sparse_mla_fwd_ws_kernel``); :meth:`get` locates one."""

        IDX: gl.tensor
        TOPK_LEN: gl.tensor
        stride_idx_s: _Int
        stride_o_s: _Int
        stride_o_h: _Int
        h_q: _Int
        n_head_tiles: _Int
        topk: _Int
        s_kv: _Int
        q_start_index: _Int
        k_stride: _Int
        n_tok: _Int
        split_len: _Int
        n_items: _Int
        PART_O: _Int
        PART_MAX: _Int
        PART_LSE: _Int
        n_main: _Int
        tail_splits: _Int
        tail_len: _Int
        D_NOPE: gl.constexpr
        BLOCK_T: gl.constexpr
        HAS_TOPK_LEN: gl.constexpr
        CAUSAL: gl.constexpr
        SPLIT_K: gl.constexpr
        TURNS: gl.constexpr
        FREE_EARLY: gl.constexpr
        TAIL: gl.constexpr

        @gluon.jit
        def get(self, item):
            """Work item ``item`` (a ``_FwdItem``)."""
            piece = False
            if self.TAIL:
                # Piece k of pair n_main + j is item n_main + j * tail_splits + k.
                tail = item - self.n_main
                piece = tail >= 0
                pid_k = gl.where(piece, tail % self.tail_splits, 0)
                item = gl.where(piece, self.n_main + tail // self.tail_splits, item)
            pid_h = item % self.n_head_tiles
            pid_s = item // self.n_head_tiles
            if self.SPLIT_K:
                pid_k = pid_s // self.n_tok  # the split
                pid_s = pid_s % self.n_tok
            n_t = self.topk
            if self.HAS_TOPK_LEN:
                n_t = gl.minimum(gl.load(self.TOPK_LEN + pid_s), self.topk)
            hi = _causal_hi(self.s_kv, pid_s, self.q_start_index, self.k_stride, self.CAUSAL)
            idx_row = self.IDX + pid_s.to(gl.int64) * self.stride_idx_s
            if self.SPLIT_K:
                # This split's slots, as a list of its own (the producer and consumers index it from 0).
                t_start = pid_k * self.split_len
                idx_row += t_start
                n_t = gl.maximum(gl.minimum(n_t - t_start, self.split_len), 0)
                lse_base = (pid_k.to(gl.int64) * self.n_tok + pid_s) * self.h_q
                out_base = lse_base * self.D_NOPE
                so_h = self.D_NOPE
            else:
                out_base = pid_s.to(gl.int64) * self.stride_o_s
                lse_base = pid_s.to(gl.int64) * self.h_q
                so_h = self.stride_o_h
                if self.TAIL:
                    # A piece: its slots as a list of their own, its partials at [pid_k, tail token, head].
                    t_start = pid_k * self.tail_len
                    idx_row += t_start
                    n_t = gl.where(piece, gl.maximum(gl.minimum(n_t - t_start, self.tail_len), 0), n_t)
                    tok0 = self.n_main // self.n_head_tiles
                    part = (pid_k.to(gl.int64) * (self.n_tok - tok0) + pid_s - tok0) * self.h_q
                    lse_base = gl.where(piece, part, lse_base)
                    out_base = gl.where(piece, part * self.D_NOPE, out_base)
                    so_h = gl.where(piece, self.D_NOPE, so_h)
            n_pairs = gl.cdiv(n_t, 2 * self.BLOCK_T)
            return _FwdItem(  # type: ignore[call-arg]
                pid_s, pid_h * 64, idx_row, n_t, hi, n_pairs, out_base, lse_base, so_h, self.h_q, piece, self.PART_O,
                self.PART_MAX, self.PART_LSE, self.SPLIT_K, self.TURNS, self.FREE_EARLY, self.TAIL,
            )  # fmt: skip

    @_aggregate_of_fields
    class _FwdSmem:
        """The forward's shared memory, which every partition takes as one value (see ``_fwd_smem``)."""

        qn: gl.shared_memory_descriptor  # the query tile [1, 64, D_NOPE] (leading axis: see opaque_zero)
        qr: gl.shared_memory_descriptor  # its rope part [1, 64, D_ROPE] (``qn`` where there is none)
        kn: gl.shared_memory_descriptor  # the ring: two gathered blocks [2, BLOCK_T, D_NOPE]
        kr: gl.shared_memory_descriptor  # their rope parts [2, BLOCK_T, 64] (half slots: also WG 0's P)
        p: gl.shared_memory_descriptor  # P [64, BLOCK_T] (half slots: warpgroup 1's)
        m: gl.shared_memory_descriptor  # each consumer's published row max [2, 64]
        l: gl.shared_memory_descriptor  # noqa: E741 - each consumer's row sums, exchanged at the end [2, 64]
        full_bars: gl.shared_memory_descriptor  # ring: slot s (half slots: half h of s, 2 s + h) landed
        empty_bars: gl.shared_memory_descriptor  # ring: slot s (half h of s) released by its readers
        p_bars: gl.shared_memory_descriptor  # consumer w published its row max (and P, whole slots)
        s_bars: gl.shared_memory_descriptor  # consumer w published its P (half slots)
        end_bar: gl.shared_memory_descriptor  # both consumers published their row sums (count 2)
        turn_bar: gl.shared_memory_descriptor  # warpgroup 0 issued the pair's S (count 1; item.TURNS)

    @gluon.jit
    def _load_q_rows(
        WG: gl.constexpr,
        qn_smem,
        qr_smem,
        Q,
        stride_q_s,
        stride_q_h,
        pid_s,
        h0,
        h_q,
        D_NOPE: gl.constexpr,
        D_ROPE: gl.constexpr,
    ):
        """Consumer warpgroup ``WG``'s half of the query tile: heads ``h0 + 32 WG ..`` of token ``pid_s``
        (zero past ``h_q``) copied with cp.async into rows ``32 WG ..`` of the tile; returns once they
        landed."""
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_h = h0 + 32 * WG + gl.arange(0, 32, layout=gl.SliceLayout(1, ld_l))
        h_ok = offs_h < h_q
        q_row = Q + pid_s.to(gl.int64) * stride_q_s + offs_h[:, None] * stride_q_h
        cols = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, ld_l))
        async_load(
            qn_smem.index(0).slice(32 * WG, 32, dim=0),
            q_row + cols[None, :],
            mask=h_ok[:, None] & (cols[None, :] >= 0),
        )
        if D_ROPE > 0:
            cols_r = D_NOPE + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ld_l))
            async_load(
                qr_smem.index(0).slice(32 * WG, 32, dim=0),
                q_row + cols_r[None, :],
                mask=h_ok[:, None] & (cols_r[None, :] >= 0),
            )
        cp.commit_group()
        cp.wait_group(0)

    @gluon.jit
    def _load_q_half(WG: gl.constexpr, qn_smem, qr_smem, Q, stride_q_s, stride_q_h, pid_s, h0, h_q,
                     D_NOPE: gl.constexpr, D_ROPE: gl.constexpr):  # fmt: skip
        """Consumer warpgroup ``WG``'s half of the query tile of the forward: channels
        ``[WG D_NOPE/2, (WG + 1) D_NOPE/2)`` of heads ``h0 ..`` (zero past ``h_q``) of token ``pid_s``, and
        for warpgroup 1 the rope part; the warpgroup's own part of the tile, which it also stages its
        output in (``_pp_store_out``). Loaded through registers, every load issued before the first store
        (one round trip to memory), marked L2 evict-first (the query is read once: L2 is left to the
        gathered rows)."""
        D_HALF: gl.constexpr = D_NOPE // 2
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_h = h0 + gl.arange(0, qn_smem.shape[1], layout=gl.SliceLayout(1, ld_l))
        h_ok = offs_h[:, None] < h_q
        q_row = Q + pid_s.to(gl.int64) * stride_q_s + offs_h[:, None] * stride_q_h
        cols = gl.arange(0, D_HALF, layout=gl.SliceLayout(0, ld_l))[None, :]
        q = gl.load(
            q_row + WG * D_HALF + cols, mask=h_ok & (cols >= 0), other=0.0, eviction_policy="evict_first"
        )
        if WG == 1 and D_ROPE > 0:
            cols_r = gl.arange(0, 64, layout=gl.SliceLayout(0, ld_l))[None, :]
            q_r = gl.load(
                q_row + D_NOPE + cols_r,
                mask=h_ok & (cols_r < D_ROPE),
                other=0.0,
                eviction_policy="evict_first",
            )
            qr_smem.index(0).store(q_r)
        qn_smem.index(0).slice(WG * D_HALF, D_HALF, dim=1).store(q)

    @gluon.jit
    def _meet_on_query(
        WG: gl.constexpr,
        smem,
        q_bar,
        phase,
        Q,
        stride_q_s,
        stride_q_h,
        pid_s,
        h0,
        h_q,
        D_NOPE: gl.constexpr,
        D_ROPE: gl.constexpr,
    ):
        """Consumer warpgroup ``WG`` loads its half of a query tile (``_load_q_half``) and waits at ``q_bar``
        (phase ``phase``) until the other warpgroup has stored its half, so both can run wgmma on the whole
        tile."""
        _load_q_half(WG, smem.qn, smem.qr, Q, stride_q_s, stride_q_h, pid_s, h0, h_q, D_NOPE, D_ROPE)
        fence_async_shared()  # the stores, before wgmma of either warpgroup reads them
        mbarrier.arrive(q_bar)
        mbarrier.wait(q_bar, phase)
        fence_async_shared()  # the query tile, before wgmma reads it

    @gluon.jit
    def _pp_consumer_persistent(
        WG: gl.constexpr,
        smem,
        q_bar,
        items,
        Q,
        OUT,
        MAX_LOGITS,
        LSE,
        SINK,
        stride_q_s,
        stride_q_h,
        sm_scale_log2,
        D_ROPE: gl.constexpr,
        HAS_SINK: gl.constexpr,
    ):
        """Consumer warpgroup ``WG`` of the persistent forward: the items ``program_id, program_id +
        num_programs, ...`` one after the other (``_pp_consumer`` each, the ring's pairs and ``end_bar``'s
        phase carried on). Before each item both warpgroups, past the previous item's last product, load
        their half of its query tile and meet at ``q_bar``; meanwhile the producer already gathers the
        item's first blocks."""
        D_NOPE: gl.constexpr = items.D_NOPE
        kk0 = gl.program_id(0) * 0  # pairs the ring carried so far
        it = gl.program_id(0) * 0
        for i in range(gl.program_id(0), items.n_items, gl.num_programs(0)):
            item = items.get(i)
            _meet_on_query(
                WG,
                smem,
                q_bar,
                it & 1,
                Q,
                stride_q_s,
                stride_q_h,
                item.pid_s,
                item.h0,
                items.h_q,
                D_NOPE,
                D_ROPE,
            )
            _pp_consumer(
                WG, smem, item, OUT, MAX_LOGITS, LSE, SINK, sm_scale_log2, D_ROPE, items.BLOCK_T, HAS_SINK, kk0, it & 1
            )  # fmt: skip
            kk0 += item.n_pairs
            it += 1

    @gluon.jit
    def _pp_consumer_item(
        WG: gl.constexpr,
        smem,
        q_bar,
        item,
        Q,
        OUT,
        MAX_LOGITS,
        LSE,
        SINK,
        stride_q_s,
        stride_q_h,
        sm_scale_log2,
        D_ROPE: gl.constexpr,
        BLOCK_T: gl.constexpr,
        HAS_SINK: gl.constexpr,
    ):
        """Consumer warpgroup ``WG`` of the per-item forward with ``Q_IN_CONSUMERS``: loads its half of the
        item's query tile (``_load_q_half``), meets the other warpgroup at ``q_bar`` as the persistent
        consumers do (``_pp_consumer_persistent``) and runs ``_pp_consumer_whole``. The query is loaded here
        rather than before the partitions start so that the producer's first gathers overlap its load."""
        _meet_on_query(
            WG,
            smem,
            q_bar,
            0,
            Q,
            stride_q_s,
            stride_q_h,
            item.pid_s,
            item.h0,
            item.h_q,
            smem.kn.shape[2],
            D_ROPE,
        )
        _pp_consumer_whole(
            WG, smem, item, OUT, MAX_LOGITS, LSE, SINK, sm_scale_log2, D_ROPE, BLOCK_T, HAS_SINK
        )

    @gluon.jit
    def _pp_producer_persistent(smem, KV, stride_kv_row, items, D_ROPE: gl.constexpr):
        """Producer of the persistent forward: ``_pp_producer`` over the program's items in turn, the ring's
        pair count carried on, so the next item's first blocks are gathered while the consumers finish
        the current one."""
        pair0 = gl.program_id(0) * 0  # pairs the ring carried so far
        for i in range(gl.program_id(0), items.n_items, gl.num_programs(0)):
            item = items.get(i)
            _pp_producer(
                smem, KV, stride_kv_row, item.idx_row, item.n_t, item.hi, item.n_pairs, items.D_NOPE, D_ROPE,
                items.BLOCK_T, pair0,
            )  # fmt: skip
            pair0 += item.n_pairs

    @gluon.jit
    def _fwd_smem_consumer_query(
        dtype: gl.constexpr, BLOCK_H: gl.constexpr, D_NOPE: gl.constexpr, D_ROPE: gl.constexpr,
        BLOCK_T: gl.constexpr, HALF_SLOTS: gl.constexpr, TURNS: gl.constexpr, PARTS: gl.constexpr,
    ):  # fmt: skip
        """The forward's shared memory (``_fwd_smem``) for consumer warpgroups that load the query tile
        themselves (``_meet_on_query``): the tile left unfilled (leading axis of 1: consumers index it with
        opaque_zero) and ``q_bar`` (count 2), where they meet once both halves are stored; initialised."""
        smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        qn_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_NOPE], smem_l)
        if D_ROPE > 0:
            qr_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_ROPE], smem_l)
        else:
            qr_smem = qn_smem  # unused
        smem = _fwd_smem(qn_smem, qr_smem, BLOCK_T, HALF_SLOTS, TURNS, PARTS)
        q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
        mbarrier.init(q_bar, count=2)
        fence_async_shared()  # barrier initialisation, before any partition uses them
        return smem, q_bar

    @gluon.jit
    def _fwd_smem(
        qn, qr, BLOCK_T: gl.constexpr, HALF_SLOTS: gl.constexpr, TURNS: gl.constexpr, PARTS: gl.constexpr = 1
    ):
        """The forward's shared memory (``_FwdSmem``) around the query tile ``qn`` / ``qr``: the ring of two
        gathered blocks (latent and rope parts) with an mbarrier pair per slot (whose full barrier is one
        per ``PARTS`` part, see ``_ws_producer``) or, with ``HALF_SLOTS``, per half slot, a P tile, the
        consumers' exchanged row max / sum, ``p_bars`` and ``s_bars`` (one each per consumer warpgroup,
        count 1), ``end_bar`` (count 2) and, with ``TURNS``, ``turn_bar`` (count 1), initialised."""
        BLOCK_H: gl.constexpr = qn.shape[1]
        D_NOPE: gl.constexpr = qn.shape[2]
        smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        stat_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        kn = gl.allocate_shared_memory(qn.dtype, [2, BLOCK_T, D_NOPE], smem_l)
        kr = gl.allocate_shared_memory(qn.dtype, [2, BLOCK_T, 64], smem_l)
        p = gl.allocate_shared_memory(qn.dtype, [BLOCK_H, BLOCK_T], smem_l)
        m = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], stat_l)
        l = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], stat_l)  # noqa: E741
        if HALF_SLOTS:  # each half has one last reader (see _pp_consumer)
            full_bars, empty_bars = _ws_ring_barriers(4, 1)
        else:  # both consumers read every block (S and P·V; see _pp_consumer_whole), gathered in PARTS
            full_bars, empty_bars = _ws_ring_barriers(2, 2, PARTS)
        p_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        s_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        end_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
        for j in gl.static_range(2):
            mbarrier.init(p_bars.index(j), count=1)
            mbarrier.init(s_bars.index(j), count=1)
        mbarrier.init(end_bar, count=2)
        turn_bar = end_bar  # (not used without TURNS)
        if TURNS:
            turn_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
            mbarrier.init(turn_bar, count=1)
        return _FwdSmem(qn, qr, kn, kr, p, m, l, full_bars, empty_bars, p_bars, s_bars, end_bar, turn_bar)  # type: ignore[call-arg]

    @gluon.jit
    def _sparse_mla_fwd_ws_kernel(
        Q,
        KV,
        IDX,
        OUT,
        MAX_LOGITS,
        LSE,
        SINK,
        TOPK_LEN,
        stride_q_s,
        stride_q_h,
        stride_kv_row,
        stride_idx_s,
        stride_o_s,
        stride_o_h,
        h_q,
        n_head_tiles,
        topk,
        s_kv,
        q_start_index,
        k_stride,
        sm_scale_log2,
        n_tok,
        split_len,
        n_items,
        PART_O,
        PART_MAX,
        PART_LSE,
        n_main,
        tail_splits,
        tail_len,
        D_NOPE: gl.constexpr,
        D_ROPE: gl.constexpr,
        BLOCK_T: gl.constexpr,
        HAS_SINK: gl.constexpr,
        HAS_TOPK_LEN: gl.constexpr,
        CAUSAL: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
        SPLIT_K: gl.constexpr = False,
        PERSISTENT: gl.constexpr = False,
        TURNS: gl.constexpr = False,
        FREE_EARLY: gl.constexpr = False,
        SLOT_PARTS: gl.constexpr = 1,
        TAIL: gl.constexpr = False,
        Q_IN_CONSUMERS: gl.constexpr = False,
    ):
        """Forward for (token, 64-head tile) work items, warp specialised (FlashMLA-style ping-pong, 12
        warps).

        Default partition = consumer warpgroup 0, worker 0 = consumer warpgroup 1, worker 1 = a
        producer warpgroup gathering rows with cp.async into a ring of two 64-row slots. Block ``b``
        always lands in slot ``b % 2``; the number of blocks is rounded up to even (the padding block
        has only invalid indices: zero fills, all-masked S). See ``_pp_consumer``.

        Without ``PERSISTENT`` program ``pid`` runs work item ``pid`` (``n_items`` is not read: pass
        ``None``). With ``PERSISTENT`` (``Config.fwd_persistent``) the grid has at most one program per
        multiprocessor, each running the items ``program_id, program_id + num_programs, ...`` below
        ``n_items`` with one shared-memory ring, so that an item's query load, first gathers and output
        stores overlap the neighbouring items' work instead of a program's start and end.

        With ``SPLIT_K`` item ``pid`` covers split ``pid // (n_head_tiles * n_tok)`` of its token's top-k
        list, slots ``[k * split_len, (k + 1) * split_len)``, and ``OUT`` / ``MAX_LOGITS`` / ``LSE`` are
        the fp32 partial buffers ``[splits, n_tok, h_q(, D_NOPE)]`` (see ``_pp_consumer``).

        With ``TURNS`` (set by the launcher for one head tile, ``h_q <= 64``) the two consumer warpgroups
        issue their S by turns (see ``_pp_consumer_whole``); ``FREE_EARLY`` (set for the persistent form
        with more than one head tile): see ``_pp_consumer``. ``SLOT_PARTS``: the parts in which the per-item
        kernel gathers a slot (``_ws_producer``). With ``Q_IN_CONSUMERS`` (per item only) the consumer
        warpgroups load the query tile (``_pp_consumer_item``) while the producer gathers the first rows;
        else the kernel loads it before the partitions start.

        With ``TAIL`` (not with ``SPLIT_K``) the items below ``n_main`` are whole; the rest are pieces:
        item ``n_main + j tail_splits + k`` covers slots ``[k tail_len, (k + 1) tail_len)`` of whole item
        ``n_main + j`` and writes its split-K partials to ``PART_O`` / ``PART_MAX`` / ``PART_LSE``
        (``[tail_splits, n_tok - n_main / n_head_tiles, h_q(, D_NOPE)]``), so that the last items, fewer
        than the multiprocessors, are spread over more of them (merged by the merge kernel). Without
        ``TAIL`` these six arguments are not read (pass ``None``).
        """
        gl.static_assert(num_warps == 4)
        gl.static_assert(BLOCK_T == 64)
        BLOCK_H: gl.constexpr = 64
        smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        dtype: gl.constexpr = Q.dtype.element_ty
        # (Argument tuples written inline: a tuple assigned to a variable turns its constexprs into tensors;
        # constexpr variables such as WG0 stay constexprs.)
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        items = _FwdItems(  # type: ignore[call-arg]
            IDX, TOPK_LEN, stride_idx_s, stride_o_s, stride_o_h, h_q, n_head_tiles, topk, s_kv, q_start_index,
            k_stride, n_tok, split_len, n_items, PART_O, PART_MAX, PART_LSE, n_main, tail_splits, tail_len, D_NOPE,
            BLOCK_T, HAS_TOPK_LEN, CAUSAL, SPLIT_K, TURNS, FREE_EARLY, TAIL,
        )  # fmt: skip
        if PERSISTENT:
            smem, q_bar = _fwd_smem_consumer_query(dtype, BLOCK_H, D_NOPE, D_ROPE, BLOCK_T, True, TURNS, 1)
            gl.warp_specialize(
                [
                    (_pp_consumer_persistent, (
                        WG0, smem, q_bar, items, Q, OUT, MAX_LOGITS, LSE, SINK, stride_q_s, stride_q_h, sm_scale_log2,
                        D_ROPE, HAS_SINK,
                    )),
                    (_pp_consumer_persistent, (
                        WG1, smem, q_bar, items, Q, OUT, MAX_LOGITS, LSE, SINK, stride_q_s, stride_q_h, sm_scale_log2,
                        D_ROPE, HAS_SINK,
                    )),
                    (_pp_producer_persistent, (smem, KV, stride_kv_row, items, D_ROPE)),
                ],
                [4, 4],
                [CONSUMER_REGS, PRODUCER_REGS],
            )  # fmt: skip
        elif Q_IN_CONSUMERS:
            item = items.get(gl.program_id(0))
            smem, q_bar = _fwd_smem_consumer_query(
                dtype, BLOCK_H, D_NOPE, D_ROPE, BLOCK_T, False, TURNS, SLOT_PARTS
            )
            gl.warp_specialize(
                [
                    (_pp_consumer_item, (
                        WG0, smem, q_bar, item, Q, OUT, MAX_LOGITS, LSE, SINK, stride_q_s, stride_q_h, sm_scale_log2,
                        D_ROPE, BLOCK_T, HAS_SINK,
                    )),
                    (_pp_consumer_item, (
                        WG1, smem, q_bar, item, Q, OUT, MAX_LOGITS, LSE, SINK, stride_q_s, stride_q_h, sm_scale_log2,
                        D_ROPE, BLOCK_T, HAS_SINK,
                    )),
                    (_ws_producer, (
                        smem.kn, smem.kr, smem.full_bars, smem.empty_bars, KV, stride_kv_row, item.idx_row, item.n_t,
                        item.hi, 2 * item.n_pairs, D_NOPE, D_ROPE, BLOCK_T, 2, SLOT_PARTS,
                    )),
                ],
                [4, 4],
                [CONSUMER_REGS, PRODUCER_REGS],
            )  # fmt: skip
        else:
            item = items.get(gl.program_id(0))
            pid_s, h0 = item.pid_s, item.h0
            ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
            offs_h = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_l))
            h_ok = offs_h < h_q
            q_row = Q + pid_s.to(gl.int64) * stride_q_s + offs_h[:, None] * stride_q_h
            cols = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, ld_l))
            q_nope = gl.load(
                q_row + cols[None, :],
                mask=h_ok[:, None] & (cols[None, :] >= 0),
                other=0.0,
                eviction_policy="evict_first",
            )
            # Leading axis of 1: consumers index it with opaque_zero. (Both parts loaded before either is
            # stored: one round trip to memory.)
            qn_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_NOPE], smem_l)
            if D_ROPE > 0:
                cols_r = D_NOPE + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ld_l))
                q_rope = gl.load(
                    q_row + cols_r[None, :],
                    mask=h_ok[:, None] & (cols_r[None, :] >= 0),
                    other=0.0,
                    eviction_policy="evict_first",
                )
                qr_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_ROPE], smem_l)
                qr_smem.index(0).store(q_rope)
            else:
                qr_smem = qn_smem  # unused
            qn_smem.index(0).store(q_nope)
            smem = _fwd_smem(qn_smem, qr_smem, BLOCK_T, False, TURNS, SLOT_PARTS)
            fence_async_shared()  # the query tile, before wgmma reads it
            gl.warp_specialize(
                [
                    (_pp_consumer_whole, (
                        WG0, smem, item, OUT, MAX_LOGITS, LSE, SINK, sm_scale_log2, D_ROPE, BLOCK_T, HAS_SINK,
                    )),
                    (_pp_consumer_whole, (
                        WG1, smem, item, OUT, MAX_LOGITS, LSE, SINK, sm_scale_log2, D_ROPE, BLOCK_T, HAS_SINK,
                    )),
                    (_ws_producer, (
                        smem.kn, smem.kr, smem.full_bars, smem.empty_bars, KV, stride_kv_row, item.idx_row, item.n_t,
                        item.hi, 2 * item.n_pairs, D_NOPE, D_ROPE, BLOCK_T, 2, SLOT_PARTS,
                    )),
                ],
                [4, 4],
                [CONSUMER_REGS, PRODUCER_REGS],
            )  # fmt: skip

    @gluon.jit
    def _ad_consumer(
        WG: gl.constexpr,
        kn_smem,
        kr_smem,
        full_bars,
        empty_bars,
        turn_bars,
        red_smem,
        Q,
        LSE,
        q_base,
        lse_base,
        out_row,
        idx_row,
        stride_q_h,
        h_q,
        n_t,
        hi,
        n_blocks,
        sm_scale_log2,
        lse_to_log2,
        D_ROPE: gl.constexpr,
        SPLIT: gl.constexpr,
    ):
        """Warp-specialised attn_dist, consumer warpgroup ``WG`` (0 or 1) of a token.

        64 heads of the query live in its registers (the wgmma A operand). ``SPLIT`` says how the two
        warpgroups share the work:

        * ``AD_SPLIT_HEADS`` (h_q > 64): warpgroup ``WG`` owns heads ``64 WG ..`` and reads every block; its
          column sums over those heads are added with an fp32 atomic into the zeroed output (two addends
          onto 0: the sum does not depend on their order, so it is deterministic);
        * ``AD_SPLIT_BLOCKS`` (h_q <= 64, the default there): both hold the same 64 heads and take
          alternate blocks, warpgroup ``WG`` computing blocks ``2j + WG`` whole (m64n64), each block read
          by one warpgroup;
        * ``AD_SPLIT_COLS``: both hold the same 64 heads and read every block, warpgroup ``WG`` computing
          the block's columns ``32 WG ..`` (m64n32).

        The warpgroups only meet at the ring, so one's exp and column sums can run while the other's S
        occupies the tensor cores. They issue S strictly by turns (``turn_bars[w]``: one arrive per S of
        the other warpgroup), so each S runs alone and the other's exp overlaps it (the ping-pong of
        FlashAttention-3 / FlashMLA); left alone, both S would interleave on the tensor cores and both
        warpgroups would then run their exp at once.
        """
        NUM_BUF: gl.constexpr = kn_smem.shape[0]  # the ring: [NUM_BUF, BLOCK_T, D_NOPE]
        BLOCK_T: gl.constexpr = kn_smem.shape[1]
        D_NOPE: gl.constexpr = kn_smem.shape[2]
        N: gl.constexpr = BLOCK_T // 2 if SPLIT == AD_SPLIT_COLS else BLOCK_T  # columns per warpgroup
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
        )
        qa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
        H0: gl.constexpr = 64 * WG if SPLIT == AD_SPLIT_HEADS else 0
        C0: gl.constexpr = N * WG if SPLIT == AD_SPLIT_COLS else 0

        # Query tile loaded straight into the wgmma A layout (a layout conversion would need shared scratch
        # next to the ring). Padding heads are 0; their lse is +inf, so their probabilities are 0.
        offs_h = H0 + gl.arange(0, 64, layout=gl.SliceLayout(1, qa_l))
        h_ok = offs_h < h_q
        q_row = Q + q_base + offs_h[:, None] * stride_q_h
        cols = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, qa_l))
        q_nope = gl.load(q_row + cols[None, :], mask=h_ok[:, None] & (cols[None, :] >= 0), other=0.0)
        if D_ROPE > 0:
            cols_r = D_NOPE + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, qa_l))
            q_rope = gl.load(q_row + cols_r[None, :], mask=h_ok[:, None] & (cols_r[None, :] >= 0), other=0.0)
        else:
            q_rope = q_nope  # unused
        offs_hm = H0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_l))
        lse2 = gl.load(LSE + lse_base + offs_hm, mask=offs_hm < h_q, other=float("inf")) * lse_to_log2

        # Column sums, indices and output addresses one column per thread (the S layout would hold 16 per
        # thread: 64-bit addresses for 16 columns do not fit next to the 144 registers of the query).
        red_l: gl.constexpr = gl.BlockedLayout([4, 1], [1, 32], [1, 4], [0, 1])
        col_l: gl.constexpr = gl.SliceLayout(0, red_l)
        offs_c = C0 + gl.arange(0, N, layout=col_l)
        STEP: gl.constexpr = 2 if SPLIT == AD_SPLIT_BLOCKS else 1
        n_iter = n_blocks
        if SPLIT == AD_SPLIT_BLOCKS:
            n_iter = (n_blocks + 1 - WG) // 2  # blocks WG, WG + 2, ...
        for j in range(0, n_iter, 1):
            b = j * STEP + (WG if SPLIT == AD_SPLIT_BLOCKS else 0)
            offs_t = b * BLOCK_T + offs_c
            t_idx = gl.load(idx_row + offs_t, mask=offs_t < n_t, other=-1)  # in flight during the wait and S
            slot = _ws_wait_full(full_bars, b, NUM_BUF)
            # Iteration j waits for the other's S of its iteration j - 1 + WG (warpgroup 0 goes first).
            mbarrier.wait(turn_bars.index(WG), (j + 1 - WG) & 1)
            s = gl.zeros([64, N], gl.float32, s_l)
            kn = kn_smem.index(slot).slice(C0, N, dim=0).permute((1, 0))
            s = warpgroup_mma(q_nope, kn, s, use_acc=False, is_async=True)
            if D_ROPE > 0:
                kr = kr_smem.index(slot).slice(C0, N, dim=0).permute((1, 0))
                s = warpgroup_mma(q_rope, kr, s, is_async=True)
            mbarrier.arrive(turn_bars.index(1 - WG))  # this S is issued (all 4 warps): the other's turn
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.arrive(empty_bars.index(slot))  # S is the slot's only reader: refill it now
            # Each warp sums its 16 rows of S, then the 4 warps' partial rows meet in shared memory: one
            # barrier (a generic sum over rows plus layout conversion takes several). Two buffers per
            # warpgroup, so a warp can write the next block's while another still reads this one's.
            p = gl.exp2(s * sm_scale_log2 - lse2[:, None])
            red = red_smem.index(2 * WG + (j & 1))
            red.store(gl.sum(gl.reshape(p, [4, 16, N]), axis=1))
            cta_barrier()
            col = gl.sum(red.load(red_l), axis=0)
            valid = (t_idx >= 0) & (t_idx < hi)
            if SPLIT == AD_SPLIT_HEADS:
                gl.atomic_add(out_row + offs_t, col, mask=valid, sem="relaxed")
            else:
                gl.store(out_row + offs_t, gl.where(valid, col, 0.0), mask=offs_t < n_t)

    @gluon.jit
    def _attn_dist_ws_kernel(
        Q,
        KV,
        IDX,
        LSE,
        OUT,
        stride_q_s,
        stride_q_h,
        stride_kv_row,
        stride_idx_s,
        stride_lse_s,
        h_q,
        topk,
        s_kv,
        q_start_index,
        k_stride,
        sm_scale_log2,
        lse_to_log2,
        D_NOPE: gl.constexpr,
        D_ROPE: gl.constexpr,
        BLOCK_T: gl.constexpr,
        NUM_BUF: gl.constexpr,
        SPLIT: gl.constexpr,
        CAUSAL: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """attn_dist for one token and all its heads, warp specialised like the forward (12 warps).

        Default partition = consumer warpgroup 0, worker 0 = consumer warpgroup 1, worker 1 = the
        producer warpgroup (``_ws_producer``) gathering 64-row blocks into a ring of ``NUM_BUF`` slots.
        With ``AD_SPLIT_HEADS`` the output must be zeroed (see ``_ad_consumer``).
        """
        gl.static_assert(num_warps == 4)
        pid_s = gl.program_id(0)
        smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        dtype: gl.constexpr = Q.dtype.element_ty
        kn_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_T, D_NOPE], smem_l)
        kr_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_T, 64], smem_l)
        full_bars, empty_bars = _ws_ring_barriers(NUM_BUF, 1 if SPLIT == AD_SPLIT_BLOCKS else 2)
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(2):
            mbarrier.init(turn_bars.index(j), count=1)
        # Per consumer warpgroup, two buffers of its 4 warps' partial column sums (``_ad_consumer``).
        N_RED: gl.constexpr = BLOCK_T // 2 if SPLIT == AD_SPLIT_COLS else BLOCK_T
        red_smem = gl.allocate_shared_memory(
            gl.float32, [4, 4, N_RED], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        )
        fence_async_shared()  # barrier initialisation, before any partition uses them

        hi = _causal_hi(s_kv, pid_s, q_start_index, k_stride, CAUSAL)
        n_blocks = gl.cdiv(topk, BLOCK_T)
        idx_row = IDX + pid_s.to(gl.int64) * stride_idx_s
        out_row = OUT + pid_s.to(gl.int64) * topk
        q_base = pid_s.to(gl.int64) * stride_q_s
        lse_base = pid_s.to(gl.int64) * stride_lse_s
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        gl.warp_specialize(
            [
                (_ad_consumer, (
                    WG0, kn_smem, kr_smem, full_bars, empty_bars, turn_bars, red_smem, Q, LSE, q_base, lse_base,
                    out_row, idx_row, stride_q_h, h_q, topk, hi, n_blocks, sm_scale_log2, lse_to_log2, D_ROPE, SPLIT,
                )),
                (_ad_consumer, (
                    WG1, kn_smem, kr_smem, full_bars, empty_bars, turn_bars, red_smem, Q, LSE, q_base, lse_base,
                    out_row, idx_row, stride_q_h, h_q, topk, hi, n_blocks, sm_scale_log2, lse_to_log2, D_ROPE, SPLIT,
                )),
                (_ws_producer, (
                    kn_smem, kr_smem, full_bars, empty_bars, KV, stride_kv_row, idx_row, topk, hi, n_blocks,
                    D_NOPE, D_ROPE, BLOCK_T, NUM_BUF,
                )),
            ],
            [4, 4],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip

    @gluon.jit
    def _adp_producer(
        kn_smem, kr_smem, full_bars, empty_bars, KV, stride_kv_row, IDX_S, COUNT, topk, s_q,
        D_NOPE: gl.constexpr, D_ROPE: gl.constexpr, TOKENS: gl.constexpr,
    ):  # fmt: skip
        """Producer warpgroup of the index-order attn_dist: for each item of this program (``TOKENS`` 2: a
        pair of tokens; 1: one token), block ``b`` of the first token then block ``b`` of the second, for
        ``b`` up to the longer token's blocks (the shorter token's missing blocks are all padding rows,
        zero-filled), one ring across items (block ``g`` of the program into slot ``g % NUM_BUF``, as
        ``_ws_producer``). The ordered lists hold valid slots only, so there is no upper bound to check."""
        NUM_BUF: gl.constexpr = kn_smem.shape[0]
        BLOCK_T: gl.constexpr = kn_smem.shape[1]
        NO_BOUND: gl.constexpr = 2**31 - 1
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_t = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, ld_l))
        g = 0
        n_items = gl.cdiv(s_q, TOKENS)
        for k in range(gl.cdiv(n_items - gl.program_id(0), gl.num_programs(0))):  # this program's items
            t0 = TOKENS * (gl.program_id(0) + k * gl.num_programs(0))
            n0 = gl.load(COUNT + t0)
            n1 = 0
            if TOKENS == 2:
                n1 = gl.load(COUNT + t0 + 1, mask=t0 + 1 < s_q, other=0)
            row0 = IDX_S + t0.to(gl.int64) * topk
            for b in range(gl.cdiv(gl.maximum(n0, n1), BLOCK_T)):
                for w in gl.static_range(TOKENS):
                    offs = b * BLOCK_T + offs_t
                    idx = gl.load(row0 + w * topk + offs, mask=offs < (n1 if w == 1 else n0), other=-1)
                    slot = g % NUM_BUF
                    mbarrier.wait(empty_bars.index(slot), ((g // NUM_BUF) & 1) ^ 1)
                    _issue_gather(
                        kn_smem.index(slot), kr_smem.index(slot), KV, stride_kv_row, idx, NO_BOUND, D_NOPE, D_ROPE,
                        ld_l,
                    )  # fmt: skip
                    cp.mbarrier_arrive(full_bars.index(slot), increment_count=False)
                    g += 1

    @gluon.jit
    def _adp_consumer(
        WG: gl.constexpr, kn_smem, kr_smem, full_bars, empty_bars, turn_bars, red_smem, Q, LSE, POS, COUNT, OUT,
        stride_q_s, stride_q_h, stride_lse_s, h_q, topk, s_q, sm_scale_log2, lse_to_log2,
        D_ROPE: gl.constexpr, TOKENS: gl.constexpr,
    ):  # fmt: skip
        """Consumer warpgroup ``WG`` of the index-order attn_dist, its query tile in registers (the wgmma A
        operand, as in ``_ad_consumer``). ``TOKENS`` 2 (at most 64 heads): token ``WG`` of each of this
        program's pairs, whole; the two warpgroups compute their tokens' blocks by turns (the ring's blocks
        ``2 j + WG``), padding blocks computed and not stored. ``TOKENS`` 1 (65 to 128 heads): heads ``64 WG
        ..`` of each of this program's tokens; both read every block (the ring's block ``j``) and add
        their column sums into the zeroed output (as ``AD_SPLIT_HEADS``). S is issued by turns. Column
        sums go to the slots ``POS`` names."""
        NUM_BUF: gl.constexpr = kn_smem.shape[0]
        BLOCK_T: gl.constexpr = kn_smem.shape[1]
        D_NOPE: gl.constexpr = kn_smem.shape[2]
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_T, 16]
        )
        qa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
        red_l: gl.constexpr = gl.BlockedLayout([4, 1], [1, 32], [1, 4], [0, 1])
        offs_c = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, red_l))
        offs_h = gl.arange(0, 64, layout=gl.SliceLayout(1, qa_l))
        h_ok = offs_h < h_q
        cols = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, qa_l))
        if D_ROPE > 0:
            cols_r = D_NOPE + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, qa_l))
        else:
            cols_r = cols  # unused
        offs_hm = gl.arange(0, 64, layout=gl.SliceLayout(1, s_l))
        if TOKENS == 1:
            offs_h += 64 * WG
            offs_hm += 64 * WG
            h_ok = offs_h < h_q
        j = 0  # this warpgroup's blocks so far (the ring's block TOKENS j + WG, or j)
        n_items = gl.cdiv(s_q, TOKENS)
        for k in range(gl.cdiv(n_items - gl.program_id(0), gl.num_programs(0))):  # this program's items
            t0 = TOKENS * (gl.program_id(0) + k * gl.num_programs(0))
            n0 = gl.load(COUNT + t0)
            if TOKENS == 2:
                n1 = gl.load(COUNT + t0 + 1, mask=t0 + 1 < s_q, other=0)
                pid_s = gl.minimum(t0 + WG, s_q - 1)  # (no second token: its count is 0, nothing is stored)
                n_t = n1 if WG == 1 else n0
            else:
                n1 = n0
                pid_s = t0
                n_t = n0
            q_row = Q + pid_s.to(gl.int64) * stride_q_s + offs_h[:, None] * stride_q_h
            q_nope = gl.load(q_row + cols[None, :], mask=h_ok[:, None] & (cols[None, :] >= 0), other=0.0)
            if D_ROPE > 0:
                q_rope = gl.load(
                    q_row + cols_r[None, :], mask=h_ok[:, None] & (cols_r[None, :] >= 0), other=0.0
                )
            else:
                q_rope = q_nope  # unused
            lse_row = LSE + pid_s.to(gl.int64) * stride_lse_s
            lse2 = gl.load(lse_row + offs_hm, mask=offs_hm < h_q, other=float("inf")) * lse_to_log2
            pos_row = POS + pid_s.to(gl.int64) * topk
            out_row = OUT + pid_s.to(gl.int64) * topk
            for b in range(gl.cdiv(gl.maximum(n0, n1), BLOCK_T)):
                offs_t = b * BLOCK_T + offs_c
                pos = gl.load(pos_row + offs_t, mask=offs_t < n_t, other=0)  # in flight during the wait and S
                slot = _ws_wait_full(full_bars, 2 * j + WG if TOKENS == 2 else j, NUM_BUF)
                mbarrier.wait(turn_bars.index(WG), (j + 1 - WG) & 1)
                s = gl.zeros([64, BLOCK_T], gl.float32, s_l)
                s = warpgroup_mma(
                    q_nope, kn_smem.index(slot).permute((1, 0)), s, use_acc=False, is_async=True
                )
                if D_ROPE > 0:
                    s = warpgroup_mma(q_rope, kr_smem.index(slot).permute((1, 0)), s, is_async=True)
                mbarrier.arrive(turn_bars.index(1 - WG))
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                mbarrier.arrive(empty_bars.index(slot))
                p = gl.exp2(s * sm_scale_log2 - lse2[:, None])
                red = red_smem.index(2 * WG + (j & 1))
                red.store(gl.sum(gl.reshape(p, [4, 16, BLOCK_T]), axis=1))
                cta_barrier()
                col = gl.sum(red.load(red_l), axis=0)
                if TOKENS == 2:
                    gl.store(out_row + pos, col, mask=offs_t < n_t)
                else:
                    gl.atomic_add(out_row + pos, col, mask=offs_t < n_t, sem="relaxed")
                j += 1

    @gluon.jit
    def _attn_dist_index_kernel(
        Q, KV, IDX_S, POS, COUNT, LSE, OUT,
        stride_q_s, stride_q_h, stride_kv_row, stride_lse_s,
        h_q, topk, s_q, sm_scale_log2, lse_to_log2,
        D_NOPE: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_T: gl.constexpr, NUM_BUF: gl.constexpr,
        TOKENS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """attn_dist over ordered slots, persistent: program ``p`` of ``P`` (one per multiprocessor) takes
        the items ``r = p, p + P, ...``: with ``TOKENS`` 2 (at most 64 heads) the token pairs ``(2 r, 2 r +
        1)``, each consumer warpgroup one token of the pair, so the programs run the tokens in waves of ``2
        P``; with ``TOKENS`` 1 (65 to 128 heads) the tokens ``r``, each consumer warpgroup 64 of the heads,
        in waves of ``P``. Each token's valid slots come ordered (``IDX_S`` their indices, ``POS`` the
        slots, ``COUNT`` how many) by KV chunk in index order: the tokens of a wave, which start together
        and keep pace, then gather from about the same chunk of the KV rows at any time, which stays in L2
        where the whole KV would not.
        Warp specialised as ``_attn_dist_ws_kernel`` (producer ``_adp_producer``, consumers
        ``_adp_consumer``); one ring carries across a program's items."""
        gl.static_assert(num_warps == 4)
        smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        dtype: gl.constexpr = Q.dtype.element_ty
        kn_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_T, D_NOPE], smem_l)
        kr_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_T, 64], smem_l)
        full_bars, empty_bars = _ws_ring_barriers(NUM_BUF, 3 - TOKENS)  # a pair's block: one reader
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(2):
            mbarrier.init(turn_bars.index(j), count=1)
        red_smem = gl.allocate_shared_memory(
            gl.float32, [4, 4, BLOCK_T], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        )
        fence_async_shared()  # barrier initialisation, before any partition uses them
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        gl.warp_specialize(
            [
                (_adp_consumer, (
                    WG0, kn_smem, kr_smem, full_bars, empty_bars, turn_bars, red_smem, Q, LSE, POS, COUNT, OUT,
                    stride_q_s, stride_q_h, stride_lse_s, h_q, topk, s_q, sm_scale_log2, lse_to_log2, D_ROPE, TOKENS,
                )),
                (_adp_consumer, (
                    WG1, kn_smem, kr_smem, full_bars, empty_bars, turn_bars, red_smem, Q, LSE, POS, COUNT, OUT,
                    stride_q_s, stride_q_h, stride_lse_s, h_q, topk, s_q, sm_scale_log2, lse_to_log2, D_ROPE, TOKENS,
                )),
                (_adp_producer, (
                    kn_smem, kr_smem, full_bars, empty_bars, KV, stride_kv_row, IDX_S, COUNT, topk, s_q,
                    D_NOPE, D_ROPE, TOKENS,
                )),
            ],
            [4, 4],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


#: Register split of the warp-specialised kernels (``setmaxnreg``): 4 warps x (232 + 232 + 40) of the
#: 2,048 per-warp register units.
CONSUMER_REGS = 232
PRODUCER_REGS = 40
#: Ring depth of the attn_dist kernel (64-row blocks); the forward's ring has two slots.
ATTN_DIST_NUM_BUF = 3
#: Parts (of the 512 latent channels) in which the per-item forward gathers a slot and issues its S.
FWD_SLOT_PARTS = 2
#: Register split of the index-order attn_dist: its producer's pair loop needs more than 40 registers, its
#: consumers fit in 224 (4 warps x (224 + 224 + 56) units, the same total).
INDEX_CONSUMER_REGS = 224
INDEX_PRODUCER_REGS = 56


def attn_dist_adds_partials(h_q: int) -> bool:
    """Whether the Gluon attn_dist adds into its output (which must then be zeroed): above 64 heads each
    consumer warpgroup adds its 64 heads' column sums."""
    return h_q > 64


def launch_fwd_gluon(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    max_logits: torch.Tensor,
    lse: torch.Tensor,
    sink: torch.Tensor,
    topk_length: torch.Tensor | None,
    dims: SparseDims,
    sm_scale_log2: float,
    *,
    has_sink: bool,
    q_start_index: int,
    k_stride: int,
    causal: bool,
    persistent_programs: int = 0,
    slots: dict[Any, Any] | None = None,
    strides: tuple[int, ...] | None = None,
    ctx: LaunchContext | None = None,
    splits: tuple[int, int] = (1, 0),
    tail: tuple[Any, ...] | None = None,
    q_in_consumers: bool = False,
) -> Any:
    """Forward on sm_90: one program per token and 64-head tile, 12 warp-specialised warps (see
    ``_sparse_mla_fwd_ws_kernel``); same arguments and outputs as the Triton launch (``slots``: see
    :func:`sparse_mla_attn._runtime.launch`). ``strides``: the token and head strides of ``q``, the row
    strides of ``kv_rows`` and ``idx``, the token and head strides of ``out`` (then the tensors may be any
    views of the same memory, e.g. before a reshape); else read off the tensors. ``ctx``: the call's
    :func:`~sparse_mla_attn._runtime.launch_context`. ``splits``: ``(n_splits, split_len)``; with more
    than one split ``out`` / ``max_logits`` / ``lse`` are the fp32 split-K partial buffers.
    ``persistent_programs``: run the kernel persistent on at most this many programs
    (``Config.fwd_persistent``: the multiprocessor count), else (0) one program per work item. ``tail``:
    ``(n_main, tail_splits, tail_len, part_o, part_max, part_lse)``, the work items from ``n_main`` on run
    in pieces (see ``_sparse_mla_fwd_ws_kernel``; without split-K), their partials for the merge kernel.
    ``q_in_consumers``: one program per item, whose consumer warpgroups load the query tile while the
    producer gathers the first rows (``_sparse_mla_fwd_ws_kernel``'s ``Q_IN_CONSUMERS``)."""
    n_head_tiles = cdiv(dims.h_q, 64)
    n_splits, split_len = splits
    if strides is None:
        strides = (q.stride(0), q.stride(1), kv_rows.stride(0), idx.stride(0), out.stride(0), out.stride(1))
    consts = dict(D_NOPE=512, D_ROPE=dims.d_qk - 512, BLOCK_T=64,
                  HAS_SINK=has_sink, HAS_TOPK_LEN=topk_length is not None, CAUSAL=causal,
                  CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)  # fmt: skip
    if n_splits > 1:
        consts["SPLIT_K"] = True
    if n_head_tiles == 1:  # S by turns (``_pp_consumer_whole``) where a token has one head tile
        consts["TURNS"] = True
    elif persistent_programs > 0:  # slot 1's first half freed within the next S (``_pp_consumer``)
        consts["FREE_EARLY"] = True
    n_items = n_splits * dims.s_q * n_head_tiles
    args = (q, kv_rows, idx, out, max_logits, lse, sink, topk_length if topk_length is not None else idx,
            *strides, dims.h_q, n_head_tiles, dims.topk, dims.s_kv, q_start_index, k_stride, sm_scale_log2,
            dims.s_q, split_len if n_splits > 1 else dims.topk)  # fmt: skip
    tail_args: tuple[Any, ...] = (None,) * 6
    name = "gluon_fwd" if n_splits == 1 else "gluon_fwd_split"
    if tail is not None:
        n_main, tail_splits, tail_len, part_o, part_max, part_lse = tail
        n_items = n_main + (n_items - n_main) * tail_splits
        tail_args = (part_o, part_max, part_lse, n_main, tail_splits, tail_len)
        consts["TAIL"] = True
        name += "_tail"
    if persistent_programs > 0:
        return launch(
            _sparse_mla_fwd_ws_kernel, (min(n_items, persistent_programs),), slots, name + "_persistent",
            (*args, n_items, *tail_args), {**consts, "PERSISTENT": True}, ctx,
        )  # fmt: skip
    if q_in_consumers:
        consts["Q_IN_CONSUMERS"] = True
        name += "_q_in_consumers"
    return launch(
        _sparse_mla_fwd_ws_kernel, (n_items,), slots, name, (*args, None, *tail_args),
        {**consts, "SLOT_PARTS": FWD_SLOT_PARTS}, ctx,
    )  # fmt: skip


def launch_attn_dist_gluon(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    idx: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    dims: SparseDims,
    sm_scale_log2: float,
    lse_to_log2: float,
    *,
    q_start_index: int,
    k_stride: int,
    causal: bool,
    split_blocks: bool = True,
    slots: dict[Any, Any] | None = None,
) -> Any:
    """attn_dist on sm_90: one program per token holding all heads. ``out`` must be zeroed where
    :func:`attn_dist_adds_partials` says so. ``split_blocks``: at most 64 heads, the consumer warpgroups
    take alternate blocks (``Config(attn_dist_split="blocks")``, the default), else halves of each block."""
    split = AD_SPLIT_BLOCKS if split_blocks else AD_SPLIT_COLS
    return launch(
        _attn_dist_ws_kernel, (dims.s_q,), slots, "gluon_attn_dist",
        (q, kv_rows, idx, lse, out,
         q.stride(0), q.stride(1), kv_rows.stride(0), idx.stride(0), lse.stride(0),
         dims.h_q, dims.topk, dims.s_kv, q_start_index, k_stride, sm_scale_log2, lse_to_log2),
        dict(D_NOPE=512, D_ROPE=dims.d_qk - 512, BLOCK_T=64, NUM_BUF=ATTN_DIST_NUM_BUF,
             SPLIT=AD_SPLIT_HEADS if attn_dist_adds_partials(dims.h_q) else split, CAUSAL=causal,
             CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4),
    )  # fmt: skip


def launch_attn_dist_index_gluon(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    order: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    dims: SparseDims,
    sm_scale_log2: float,
    lse_to_log2: float,
    *,
    n_programs: int,
    slots: dict[Any, Any] | None = None,
) -> Any:
    """Index-order attn_dist on sm_90 (see ``_attn_dist_index_kernel``) on at most ``n_programs``
    programs (each takes pairs of tokens up to 64 heads, else tokens). ``order``: each token's valid slots
    in the order to take them, ``(indices, slots, counts)`` int32 ``[s_q, topk]``, ``[s_q, topk]`` and
    ``[s_q]``; the kernel writes the valid slots of ``out`` only (adds into them where
    :func:`attn_dist_adds_partials` says so)."""
    idx_s, pos, counts = order
    return launch(
        _attn_dist_index_kernel, (index_programs(dims.s_q, dims.h_q, n_programs),), slots, "gluon_attn_dist_index",
        (q, kv_rows, idx_s, pos, counts, lse, out, q.stride(0), q.stride(1), kv_rows.stride(0), lse.stride(0),
         dims.h_q, dims.topk, dims.s_q, sm_scale_log2, lse_to_log2),
        dict(D_NOPE=512, D_ROPE=dims.d_qk - 512, BLOCK_T=64, NUM_BUF=ATTN_DIST_NUM_BUF, TOKENS=index_tokens(dims.h_q),
             CONSUMER_REGS=INDEX_CONSUMER_REGS, PRODUCER_REGS=INDEX_PRODUCER_REGS, num_warps=4),
    )  # fmt: skip


def index_tokens(h_q: int) -> int:
    """Tokens per item of the index-order attn_dist: a pair up to 64 heads (a token per consumer
    warpgroup), else one (64 heads per consumer warpgroup)."""
    return 1 if attn_dist_adds_partials(h_q) else 2


def index_programs(s_q: int, h_q: int, n_programs: int) -> int:
    """Programs of the index-order attn_dist: at most ``n_programs``, one per item."""
    return max(1, min(n_programs, cdiv(s_q, index_tokens(h_q))))
