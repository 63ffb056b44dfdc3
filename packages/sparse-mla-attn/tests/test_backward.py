"""sparse_mla_bwd and the autograd wrapper against float32/float64 torch references.

CPU: Triton interpreter on tiny shapes, float32, float16 and bfloat16 inputs (under the interpreter the
kernels multiply in float32, its bf16 arithmetic being unreliable). GPU: bf16 at real shapes, plus a small
end-to-end training step.
"""

from __future__ import annotations

import pytest
import torch

from sparse_mla_attn import Config, gluon_supported, reference, sparse_mla_bwd, sparse_mla_bwd_ref
from sparse_mla_attn._inputs import kernel_test_device
from sparse_mla_attn._validate import check_bwd_inputs
from sparse_mla_attn.backward import launch_bwd
from sparse_mla_attn.reference import sparse_mla_ref

# Relative Frobenius error bound per input dtype, for dq and dkv against the float32 autograd reference.
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def bwd_with_tiles(q, kv, out, dout, idx, lse, sm_scale, d_v, tiles, *, return_attn_sum=False, **kw):
    """The backward launched with explicit kernel tiles (kernel options the defaults pick on other shapes)."""
    check_bwd_inputs(q, kv, out, dout, idx, lse, d_v, kw.get("q_start_index", 0), kw.get("k_stride", 1))
    dq, dkv, attn_sum = launch_bwd(q, kv, out, dout, idx, lse, sm_scale, d_v, return_attn_sum=return_attn_sum,
                                   tiles=tiles, **kw)  # fmt: skip
    return (dq, dkv, attn_sum) if return_attn_sum else (dq, dkv)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_case(s_q, h_q, d_qk, s_kv, topk, *, device, dtype, seed, zoo=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, generator=g).to(device=device, dtype=dtype)
    kv = torch.randn(s_kv, 1, d_qk, generator=g).to(device=device, dtype=dtype)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32)
    if zoo:
        if topk >= 4:
            idx[0, 0, 1] = idx[0, 0, 0]  # duplicated row inside one query
            idx[0, 0, 2] = idx[0, 0, 0]
            idx[0, 0, 3] = -1
        if s_q >= 2 and topk >= 3:
            idx[1, 0, 0] = s_kv  # one past the end
            idx[1, 0, 2] = 2**31 - 1  # huge
        if s_q >= 3:
            idx[-1, 0, :] = -1  # a query with no valid index
    return q, kv, idx.to(device)


def poison_unselected(kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """NaN in every KV row no query selected: the kernel must never read them."""
    kv = kv.clone()
    used = torch.zeros(kv.shape[0], dtype=torch.bool, device=kv.device)
    flat = idx.reshape(-1).long()
    ok = (flat >= 0) & (flat < kv.shape[0])
    used[flat[ok]] = True
    kv[~used] = float("nan")
    return kv


def autograd_grads(q, kv, idx, sm_scale, d_v, dout_seed, **kw):
    """Float32 forward through the reference math, dout, and torch-autograd dq/dkv."""
    qf = q.float().detach().requires_grad_()
    kvf = torch.nan_to_num(kv.float()).detach().requires_grad_()
    out, lse = sparse_mla_ref(qf, kvf, idx, sm_scale, d_v, **kw)
    g = torch.Generator(device="cpu").manual_seed(dout_seed)
    dout = torch.randn(out.shape, generator=g).to(out.device)
    out.backward(dout)
    return out.detach(), lse.detach(), dout, qf.grad, kvf.grad


# ---------------------------------------------------------------------------------------------- references

REF_CASES = [
    pytest.param(3, 2, 24, 16, 10, 5, {}, id="S3-H2-D24-V16-K10-T5"),
    pytest.param(5, 3, 48, 32, 12, 9, {"causal": True, "q_start_index": 2, "k_stride": 2}, id="causal-st2"),
    pytest.param(4, 4, 40, 32, 6, 8, {"causal": True, "q_start_index": 0, "k_stride": 3}, id="causal-st3-q0"),
]


@pytest.mark.parametrize(("s_q", "h_q", "d_qk", "d_v", "s_kv", "topk", "kw"), REF_CASES)
def test_bwd_ref_matches_autograd(s_q, h_q, d_qk, d_v, s_kv, topk, kw):
    q, kv, idx = make_case(s_q, h_q, d_qk, s_kv, topk, device="cpu", dtype=torch.float64, seed=1)
    qd, kvd = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = sparse_mla_ref(qd, kvd, idx, 0.3, d_v, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    dq, dkv = sparse_mla_bwd_ref(q, kv, out.detach(), dout, idx, lse.detach(), 0.3, d_v, **kw)
    assert dq.dtype == torch.float64
    torch.testing.assert_close(dq, qd.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dkv, kvd.grad, rtol=1e-10, atol=1e-12)


class _RefAttention(torch.autograd.Function):
    """Forward: reference math; backward: sparse_mla_bwd_ref. gradcheck compares it with finite differences."""

    @staticmethod
    def forward(ctx, q, kv, idx, sm_scale, d_v, causal):
        with torch.no_grad():
            out, lse = sparse_mla_ref(q, kv, idx, sm_scale, d_v, causal=causal, q_start_index=1, k_stride=2)
        ctx.save_for_backward(q, kv, idx, out, lse)
        ctx.args = (sm_scale, d_v, causal)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, idx, out, lse = ctx.saved_tensors
        sm_scale, d_v, causal = ctx.args
        dq, dkv = sparse_mla_bwd_ref(
            q, kv, out, dout, idx, lse, sm_scale, d_v, causal=causal, q_start_index=1, k_stride=2
        )
        return dq, dkv, None, None, None, None


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bwd_ref_gradcheck_float64(causal):
    q, kv, idx = make_case(3, 2, 12, 6, 5, device="cpu", dtype=torch.float64, seed=2)
    q.requires_grad_()
    kv.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _RefAttention.apply(a, b, idx, 0.5, 8, causal), (q, kv))


def test_bwd_ref_chunking_is_exact(monkeypatch):
    q, kv, idx = make_case(9, 2, 24, 10, 6, device="cpu", dtype=torch.float64, seed=3)
    out, lse = sparse_mla_ref(q, kv, idx, 0.2, 16)
    dout = torch.randn_like(out)
    full = sparse_mla_bwd_ref(q, kv, out, dout, idx, lse, 0.2, 16)
    monkeypatch.setattr(reference, "_chunk_rows", lambda s_q, per, budget=0: 2)
    chunked = sparse_mla_bwd_ref(q, kv, out, dout, idx, lse, 0.2, 16)
    for a, b in zip(full, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- kernels (CPU)

KERNEL_CASES = [
    pytest.param(4, 3, 96, 64, 30, 17, {}, id="S4-H3-D96-V64-K30-T17"),
    pytest.param(3, 2, 576, 512, 40, 9, {}, id="S3-H2-D576-V512-K40-T9"),
    pytest.param(3, 5, 512, 512, 25, 6, {}, id="S3-H5-D512-V512-K25-T6"),
    pytest.param(5, 18, 96, 64, 50, 20, {"causal": True, "q_start_index": 7, "k_stride": 2}, id="causal-H18"),
    pytest.param(
        6, 4, 96, 64, 12, 33, {"causal": True, "q_start_index": 30, "k_stride": 4}, id="causal-q30-st4"
    ),
]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize(("s_q", "h_q", "d_qk", "d_v", "s_kv", "topk", "kw"), KERNEL_CASES)
def test_bwd_kernel_matches_autograd(s_q, h_q, d_qk, d_v, s_kv, topk, kw, dtype):
    dev = kernel_test_device()
    q, kv, idx = make_case(s_q, h_q, d_qk, s_kv, topk, device=dev, dtype=dtype, seed=s_q * 7 + topk)
    kv = poison_unselected(kv, idx)
    out, lse, dout, dq_ref, dkv_ref = autograd_grads(q, kv, idx, 0.125, d_v, dout_seed=5, **kw)
    for det in (False, True):
        dq, dkv = sparse_mla_bwd(
            q, kv, out.to(dtype), dout.to(dtype), idx, lse, 0.125, d_v, deterministic=det, **kw
        )
        assert dq.shape == q.shape
        assert dq.dtype == dtype
        assert dkv.shape == kv.shape
        assert dkv.dtype == dtype
        assert torch.isfinite(dq).all()
        assert torch.isfinite(dkv).all()
        assert rel_err(dq, dq_ref) < REL_TOL[dtype], ("dq", det)
        assert rel_err(dkv, dkv_ref) < REL_TOL[dtype], ("dkv", det)
        # Rows that nobody selected get exactly 0.
        sel = torch.zeros(kv.shape[0], dtype=torch.bool, device=dev)
        flat = idx.reshape(-1).long()
        sel[flat[(flat >= 0) & (flat < kv.shape[0])]] = True
        assert torch.all(dkv[~sel] == 0)
        if s_q >= 3 and not kw:
            assert torch.all(dq[-1] == 0), "a query with no valid index has dq = 0"


SUB = {"BLOCK_H": 16, "N_SUB": 2, "SPLIT_DKV": 0}
# The kernels without the slot sort, the grouped dkv launch, the rope chunk in the loops and the index prefetch.
UNSORTED = {"SORT_IDX": 0, "TOK_GROUP": 1, "ROPE_IN_LOOP": 0, "IDX_PREFETCH": 0, "N_CSPLIT": 2}
CONFIG_CASES = [
    pytest.param(
        18,
        96,
        64,
        {"causal": True, "q_start_index": 7, "k_stride": 2},
        {"SPLIT_DKV": 0},
        id="fused-H18-causal",
    ),
    pytest.param(40, 96, 64, {}, {"BLOCK_H": 16, "N_SUB": 2}, id="split-nsub2-H40"),
    pytest.param(
        18, 576, 512, {"causal": True, "q_start_index": 7}, UNSORTED, id="unsorted-csplit2-d576-causal"
    ),
    pytest.param(7, 96, 64, {}, {**UNSORTED, "N_CSPLIT": 3, "BLOCK_C_DKV": 16}, id="unsorted-csplit3-uneven"),
    pytest.param(130, 96, 64, {}, {}, id="H130-fused-above-128-heads"),
    pytest.param(5, 96, 64, {}, {"BLOCK_T_DKV": 32, "BLOCK_C_DKV": 64}, id="split-T32-C64-H5"),
    pytest.param(7, 96, 64, {"causal": True, "q_start_index": 5}, {"N_CSPLIT": 2}, id="split-csplit2-causal"),
    pytest.param(7, 96, 64, {}, {"N_CSPLIT": 3, "BLOCK_C_DKV": 16}, id="split-csplit3-uneven"),
    pytest.param(
        7,
        96,
        64,
        {"causal": True, "q_start_index": 5, "k_stride": 2},
        {"SORT_IDX": 1, "TOK_GROUP": 3},
        id="sorted-tokgroup3-uneven-causal",
    ),
    pytest.param(
        6,
        576,
        512,
        {"causal": True, "q_start_index": 2},
        {"ROPE_IN_LOOP": 1, "IDX_PREFETCH": 1, "N_CSPLIT": 1},
        id="rope-in-loop-prefetch-d576",
    ),
    pytest.param(
        5,
        96,
        64,
        {},
        {"ROPE_IN_LOOP": 1, "IDX_PREFETCH": 1, "N_CSPLIT": 1, "BLOCK_DV": 32, "BLOCK_C_DKV": 32},
        id="rope-in-loop-prefetch-d96",
    ),
    pytest.param(18, 96, 64, {"causal": True, "q_start_index": 7, "k_stride": 2}, SUB, id="nsub2-H18-causal"),
    pytest.param(40, 96, 64, {}, SUB, id="nsub2-H40-second-half-partial"),
    pytest.param(12, 96, 64, {}, SUB, id="nsub2-H12-second-half-empty"),
]


@pytest.mark.parametrize(("h_q", "d_qk", "d_v", "kw", "cfg"), CONFIG_CASES)
def test_bwd_kernel_options(h_q, d_qk, d_v, kw, cfg):
    """Kernel options the benchmark times: SPLIT_DKV = 0 (dkv products fused into the main kernel, per head
    block; also what h_q > 128 uses), N_SUB = 2 (two head blocks per main program), the dkv kernel's tiles."""
    dev = kernel_test_device()
    q, kv, idx = make_case(4, h_q, d_qk, 30, 17, device=dev, dtype=torch.float32, seed=h_q)
    kv = poison_unselected(kv, idx)
    out, lse, dout, dq_ref, dkv_ref = autograd_grads(q, kv, idx, 0.125, d_v, dout_seed=6, **kw)
    for det in (False, True):
        dq, dkv = bwd_with_tiles(q, kv, out, dout, idx, lse, 0.125, d_v, cfg, deterministic=det, **kw)
        assert torch.isfinite(dq).all()
        assert torch.isfinite(dkv).all()
        assert rel_err(dq, dq_ref) < REL_TOL[torch.float32], ("dq", det)
        assert rel_err(dkv, dkv_ref) < REL_TOL[torch.float32], ("dkv", det)


def head_summed_attention(q, kv, idx, lse, sm_scale, kw):
    """Float64 Σ_h P[h, t] (0 at invalid slots): the indexer target."""
    valid = reference.valid_slots(idx[:, 0], kv.shape[0], kw.get("q_start_index", 0), kw.get("k_stride", 1),
                                  kw.get("causal", False))  # fmt: skip
    rows = torch.nan_to_num(kv[:, 0].double())[idx[:, 0].long().clamp(0, kv.shape[0] - 1)]
    scores = torch.einsum("shd,std->sht", q.double(), rows) * sm_scale
    p = torch.where(valid[:, None, :], torch.exp(scores - lse.double()[..., None]), 0.0)
    return p.sum(1)


@pytest.mark.parametrize(
    ("h_q", "kw", "cfg"),
    [
        pytest.param(18, {"causal": True, "q_start_index": 7, "k_stride": 2}, None, id="H18-causal"),
        pytest.param(40, {}, {"BLOCK_H": 16, "N_SUB": 2}, id="H40-nsub2"),
        pytest.param(
            18, {"causal": True, "q_start_index": 7}, {"SORT_IDX": 1, "TOK_GROUP": 2}, id="H18-sorted"
        ),
    ],
)
def test_bwd_attn_sum_by_product(h_q, kw, cfg):
    """return_attn_sum: Σ_h P from the backward equals the float64 head sum, in both modes; NaN rows unused."""
    dev = kernel_test_device()
    q, kv, idx = make_case(5, h_q, 96, 30, 17, device=dev, dtype=torch.float32, seed=h_q + 1)
    kv = poison_unselected(kv, idx)
    out, lse, dout, dq_ref, _ = autograd_grads(q, kv, idx, 0.125, 64, dout_seed=7, **kw)
    want = head_summed_attention(q, kv, idx, lse, 0.125, kw)
    for det in (False, True):
        dq, _, attn_sum = bwd_with_tiles(
            q, kv, out, dout, idx, lse, 0.125, 64, cfg, deterministic=det, return_attn_sum=True, **kw
        )
        assert attn_sum.shape == (5, 17)
        assert attn_sum.dtype == torch.float32
        torch.testing.assert_close(attn_sum.double(), want, rtol=1e-5, atol=1e-6)
        assert rel_err(dq, dq_ref) < REL_TOL[torch.float32]
    assert torch.all(attn_sum[-1] == 0), "a query with no valid index has attn_sum 0"


def test_bwd_all_duplicates_accumulate():
    dev = kernel_test_device()
    q, kv, idx = make_case(3, 2, 96, 8, 8, device=dev, dtype=torch.float32, seed=11, zoo=False)
    idx[:, :, :5] = 5  # five slots of every query point at row 5
    out, lse, dout, dq_ref, dkv_ref = autograd_grads(q, kv, idx, 0.2, 64, dout_seed=1)
    for det in (False, True):
        dq, dkv = sparse_mla_bwd(q, kv, out, dout, idx, lse, 0.2, 64, deterministic=det)
        assert rel_err(dq, dq_ref) < 1e-5
        assert rel_err(dkv, dkv_ref) < 1e-5


@pytest.mark.parametrize(
    "tiles", [None, UNSORTED, {"DET_HALF": 1}], ids=["default", "unsorted", "half-workspace"]
)
def test_bwd_nan_in_dout_reaches_dkv(tiles):
    """A NaN in one query's dout makes dq of that query and every row it selected NaN, in both modes."""
    dev = kernel_test_device()
    q, kv, idx = make_case(4, 3, 96, 20, 6, device=dev, dtype=torch.float32, seed=13, zoo=False)
    out, lse, dout, _, _ = autograd_grads(q, kv, idx, 0.2, 64, dout_seed=2)
    dout[1, 2, 7] = float("nan")
    for det in (False, True):
        dq, dkv = bwd_with_tiles(q, kv, out, dout, idx, lse, 0.2, 64, tiles, deterministic=det)
        assert torch.isnan(dq[1]).any(), det
        assert torch.isnan(dkv[idx[1, 0].long()]).all(), det
        assert torch.isfinite(dq[0]).all(), det


def test_bwd_slot_order_does_not_change_the_bits():
    """Each token's slots are sorted by index before the kernels run: the same index sets in another slot
    order give the same dq and (deterministic) dkv bits, and attn_sum follows the caller's order."""
    dev = kernel_test_device()
    q, kv, idx = make_case(5, 18, 96, 30, 17, device=dev, dtype=torch.float32, seed=14)
    out, lse, dout, _, _ = autograd_grads(q, kv, idx, 0.125, 64, dout_seed=3)
    perm = torch.randperm(17, generator=torch.Generator().manual_seed(0)).to(dev)
    kw = dict(deterministic=True, return_attn_sum=True)
    dq, dkv, attn_sum = sparse_mla_bwd(q, kv, out, dout, idx, lse, 0.125, 64, **kw)
    dq_p, dkv_p, attn_sum_p = sparse_mla_bwd(
        q, kv, out, dout, idx[:, :, perm].contiguous(), lse, 0.125, 64, **kw
    )
    assert torch.equal(dq_p, dq)
    assert torch.equal(dkv_p, dkv)
    assert torch.equal(attn_sum_p, attn_sum[:, perm])


def test_bwd_all_invalid_gives_zero():
    dev = kernel_test_device()
    q, kv, idx = make_case(3, 2, 96, 8, 5, device=dev, dtype=torch.float32, seed=12, zoo=False)
    idx[:] = -1
    lse = torch.full((3, 2), float("-inf"), device=dev)
    out = torch.zeros(3, 2, 64, device=dev)
    dout = torch.randn(3, 2, 64, device=dev)
    for det in (False, True):
        dq, dkv = sparse_mla_bwd(q, kv, out, dout, idx, lse, 0.2, 64, deterministic=det)
        assert torch.all(dq == 0)
        assert torch.all(dkv == 0)


def test_bwd_deterministic_is_bit_identical_and_chunks(monkeypatch):
    dev = kernel_test_device()
    q, kv, idx = make_case(7, 20, 96, 6, 24, device=dev, dtype=torch.float32, seed=13, zoo=False)
    out, lse, dout, dq_ref, dkv_ref = autograd_grads(q, kv, idx, 0.3, 64, dout_seed=2)
    runs = [sparse_mla_bwd(q, kv, out, dout, idx, lse, 0.3, 64, deterministic=True) for _ in range(2)]
    # Force several token chunks (workspace cap of ~2 tokens): same math, same order within each row.
    small = Config(bwd_workspace_bytes=3 * 20 * 24 * 4, bwd_deterministic_workspace_bytes=2 * 2 * 24 * 96 * 4)
    runs.append(sparse_mla_bwd(q, kv, out, dout, idx, lse, 0.3, 64, deterministic=True, config=small))
    default = sparse_mla_bwd(q, kv, out, dout, idx, lse, 0.3, 64)
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])
    for dq, dkv in (*runs, default):
        assert rel_err(dq, dq_ref) < 1e-5
        assert rel_err(dkv, dkv_ref) < 1e-5


@pytest.mark.parametrize(("half", "tol"), [(0, 1e-5), (1, 1e-3)], ids=["fp32-workspace", "half-workspace"])
def test_bwd_deterministic_dkv_ignores_program_order(half, tol):
    """Another launch order of the dkv programs (the interpreter runs them one after the other, so with
    atomics their additions come in another order) gives the same deterministic dkv bits, with either
    workspace."""
    dev = kernel_test_device()
    q, kv, idx = make_case(7, 5, 96, 12, 24, device=dev, dtype=torch.float32, seed=41, zoo=False)
    out, lse, dout, _, dkv_ref = autograd_grads(q, kv, idx, 0.3, 64, dout_seed=8)
    runs = [
        bwd_with_tiles(q, kv, out, dout, idx, lse, 0.3, 64, {**tiles, "DET_HALF": half}, deterministic=True)[
            1
        ]
        for tiles in ({"TOK_GROUP": 1}, {"TOK_GROUP": 3}, {"TOK_GROUP": 7})
    ]
    for dkv in runs[1:]:
        assert torch.equal(dkv, runs[0])
    assert rel_err(runs[0], dkv_ref) < tol


@pytest.mark.parametrize(("half", "tol"), [(0, 1e-5), (1, 1e-3)], ids=["fp32-workspace", "half-workspace"])
@pytest.mark.parametrize("scale", [2.0**40, 2.0**-40, 2.0**-100], ids=["huge", "tiny", "tinier"])
def test_bwd_extreme_magnitudes(scale, half, tol):
    """Large and small gradients (dkv about 2^40, 2^-40 and 2^-100 times the reference) keep their
    precision in both modes, with either deterministic workspace (the fp16 one scales each group)."""
    dev = kernel_test_device()
    q, kv, idx = make_case(4, 3, 96, 10, 12, device=dev, dtype=torch.float32, seed=42, zoo=False)
    out, lse, dout, dq_ref, dkv_ref = autograd_grads(q, kv, idx, 0.3, 64, dout_seed=9)
    # q and dout times scale, sm_scale over it: the same scores and P, dS and dkv times scale, the same dq.
    q_s = q * scale
    for det in (False, True):
        dq, dkv = bwd_with_tiles(q_s, kv, out, dout * scale, idx, lse, 0.3 / scale, 64, {"DET_HALF": half},
                                 deterministic=det)  # fmt: skip
        assert torch.isfinite(dkv).all()
        assert rel_err(dkv, dkv_ref * scale) < (tol if det else 1e-5), det
        assert rel_err(dq, dq_ref) < 1e-5, det


def abs_contributions(q, kv, out, dout, idx, lse, sm_scale, d_v):
    """Float64 ``Σ |c|`` per dkv element over the (token, slot) contributions ``c`` that the deterministic
    workspace holds (``dS^T q + P^T dout`` per pair, before the sum over pairs)."""
    q, rows_all, out, dout = (t.double() for t in (q, kv[:, 0], out, dout))
    s_kv = kv.shape[0]
    valid = reference.valid_slots(idx[:, 0], s_kv, 0, 1, False)
    i = idx[:, 0].long().clamp(0, s_kv - 1)
    rows = rows_all[i]
    p = torch.where(
        valid[:, None],
        torch.exp(torch.einsum("shd,std->sht", q, rows) * sm_scale - lse.double()[..., None]),
        0,
    )
    dp = torch.einsum("shd,std->sht", dout, rows[..., :d_v])
    ds = p * (dp - (dout * out).sum(-1)[..., None]) * sm_scale
    c = torch.einsum("sht,shd->std", ds, q)
    c[..., :d_v] += torch.einsum("sht,shd->std", p, dout)
    return torch.zeros(s_kv, q.shape[2], dtype=torch.float64, device=q.device).index_add_(
        0, i[valid], c[valid].abs()
    )


@pytest.mark.parametrize(
    ("h_q", "d_qk", "d_v", "tiles"),
    [
        pytest.param(3, 96, 64, None, id="H3-D96-dkv-kernel-groups32"),
        pytest.param(5, 576, 512, None, id="H5-D576-dkv-kernel-groups64"),
        pytest.param(4, 96, 64, {"BLOCK_C_DKV": 16, "ROPE_IN_LOOP": 0}, id="H4-groups16"),
        pytest.param(
            4, 96, 64, {"ROPE_IN_LOOP": 0, "BLOCK_C_DKV": 64, "GROUPS_RED": 1}, id="H4-rope-chunk-groups32"
        ),
    ],
)
def test_bwd_half_workspace_error_bound(h_q, d_qk, d_v, tiles):
    """The fp16 workspace: each stored contribution is within 2^-11 of itself (fp16 rounding after a
    power-of-two scale per channel group), so the deterministic dkv differs from the fp32 workspace's by at
    most 2^-11 Σ|c| per element (plus fp32 summation error); the same bits from run to run."""
    dev = kernel_test_device()
    q, kv, idx = make_case(6, h_q, d_qk, 9, 20, device=dev, dtype=torch.float32, seed=h_q + d_qk, zoo=False)
    out, lse, dout, _, dkv_ref = autograd_grads(q, kv, idx, 0.2, d_v, dout_seed=10)
    tiles = tiles or {}
    fp32_ws = bwd_with_tiles(
        q, kv, out, dout, idx, lse, 0.2, d_v, {**tiles, "DET_HALF": 0}, deterministic=True
    )
    half_ws = bwd_with_tiles(
        q, kv, out, dout, idx, lse, 0.2, d_v, {**tiles, "DET_HALF": 1}, deterministic=True
    )
    again = bwd_with_tiles(q, kv, out, dout, idx, lse, 0.2, d_v, {**tiles, "DET_HALF": 1}, deterministic=True)
    assert torch.equal(half_ws[1], again[1])
    assert torch.equal(half_ws[0], fp32_ws[0]), "dq does not depend on the dkv workspace"
    bound = abs_contributions(q, kv, out, dout, idx, lse, 0.2, d_v) * (2.0**-11 + 64 * 2.0**-24)
    diff = (half_ws[1][:, 0].double() - fp32_ws[1][:, 0].double()).abs()
    assert torch.all(diff <= bound), float((diff - bound).max())
    assert float(diff.max()) > 0, "the fp16 workspace was not used"
    assert rel_err(half_ws[1], dkv_ref) < 1e-3


def test_bwd_half_workspace_not_in_fused_path():
    """The fused path (dkv products per head block, above 128 heads) keeps the fp32 workspace: forcing the
    fp16 one there is an error."""
    dev = kernel_test_device()
    q, kv, idx = make_case(3, 4, 96, 9, 8, device=dev, dtype=torch.float32, seed=5, zoo=False)
    out, lse, dout, _, dkv_ref = autograd_grads(q, kv, idx, 0.2, 64, dout_seed=12)
    with pytest.raises(ValueError, match="DET_HALF"):
        bwd_with_tiles(
            q, kv, out, dout, idx, lse, 0.2, 64, {"SPLIT_DKV": 0, "DET_HALF": 1}, deterministic=True
        )
    assert rel_err(bwd_with_tiles(q, kv, out, dout, idx, lse, 0.2, 64, {"SPLIT_DKV": 0}, deterministic=True)[1],
                   dkv_ref) < 1e-5  # fmt: skip


def test_bwd_deterministic_bf16_as_accurate_as_default():
    """With bf16 inputs (the fp16 workspace) the deterministic dkv is as accurate as the default mode's
    against the float64 reference of the same inputs: the workspace's rounding (2^-11 per contribution) is
    small beside the bf16 roundings both modes share (dS, P and the output)."""
    dev = kernel_test_device()
    q, kv, idx = make_case(8, 4, 96, 6, 32, device=dev, dtype=torch.bfloat16, seed=77, zoo=False)
    out, lse, dout, _, _ = autograd_grads(q, kv, idx, 0.2, 64, dout_seed=11)
    out, dout = out.bfloat16(), dout.bfloat16()
    _, dkv_ref = sparse_mla_bwd_ref(
        q.double(), kv.double(), out.double(), dout.double(), idx, lse.double(), 0.2, 64
    )
    errs = {}
    for det in (False, True):
        dkv = sparse_mla_bwd(q, kv, out, dout, idx, lse, 0.2, 64, deterministic=det)[1]
        errs[det] = rel_err(dkv.float(), dkv_ref)
    assert errs[True] <= 1.05 * errs[False], errs
    assert errs[True] < REL_TOL[torch.bfloat16], errs


BAD_INPUTS = [
    pytest.param("q", lambda t: t["q"][0], "q must be", id="q-rank"),
    pytest.param("kv", lambda t: t["kv"][:, :, :64], "kv must be", id="kv-dim"),
    pytest.param("kv", lambda t: t["kv"].double(), "kv must have q's dtype", id="kv-dtype"),
    pytest.param("indices", lambda t: t["indices"].long(), "indices must be int32", id="idx-dtype"),
    pytest.param("indices", lambda t: t["indices"][:2], "indices must be", id="idx-shape"),
    pytest.param("lse", lambda t: t["lse"].double(), "lse must be float32", id="lse-dtype"),
    pytest.param("dout", lambda t: t["dout"][:, :, :32], "dout must be", id="dout-shape"),
    pytest.param(
        "q", lambda t: t["q"].transpose(1, 2).contiguous().transpose(1, 2), "contiguous", id="q-stride"
    ),
]


@pytest.mark.parametrize(("name", "mutate", "msg"), BAD_INPUTS)
def test_bwd_rejects_bad_inputs(name, mutate, msg):
    q, kv, idx = make_case(3, 2, 96, 8, 4, device="cpu", dtype=torch.float32, seed=0, zoo=False)
    t = {
        "q": q,
        "kv": kv,
        "out": torch.randn(3, 2, 64),
        "dout": torch.randn(3, 2, 64),
        "indices": idx,
        "lse": torch.randn(3, 2),
    }
    t[name] = mutate(t)
    with pytest.raises((ValueError, TypeError), match=msg):
        sparse_mla_bwd(t["q"], t["kv"], t["out"], t["dout"], t["indices"], t["lse"], 0.1, 64)


def test_bwd_rejects_bad_d_v():
    q, kv, idx = make_case(3, 2, 96, 8, 4, device="cpu", dtype=torch.float32, seed=0, zoo=False)
    with pytest.raises(ValueError, match="d_v must be"):
        sparse_mla_bwd(q, kv, torch.randn(3, 2, 48), torch.randn(3, 2, 48), idx, torch.randn(3, 2), 0.1, 48)
    with pytest.raises(ValueError, match="k_stride"):
        sparse_mla_bwd(
            q, kv, torch.randn(3, 2, 64), torch.randn(3, 2, 64), idx, torch.randn(3, 2), 0.1, 64, k_stride=0
        )


def test_bwd_custom_op_fake_and_schema():
    dev = kernel_test_device()
    q, kv, idx = make_case(3, 2, 96, 10, 6, device=dev, dtype=torch.float32, seed=31)
    out, lse, dout, _, _ = autograd_grads(q, kv, idx, 0.1, 64, dout_seed=4)
    torch.library.opcheck(
        torch.ops.sparse_mla_attn.sparse_mla_bwd.default,
        (q, kv, out, dout, idx, lse, 0.1, 64, 0, 1, False, False, True, 2 << 30, 4 << 30, "auto"),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_sparse_mla_autograd_end_to_end():
    """Forward through the package's Triton sparse_mla_fwd, backward through ours, against autograd."""
    from sparse_mla_attn.autograd import sparse_mla

    dev = kernel_test_device()
    dtype = torch.float16 if dev == "cpu" else torch.bfloat16
    q, kv, idx = make_case(3, 4, 576, 30, 11, device=dev, dtype=dtype, seed=21)
    kw = {"causal": True, "q_start_index": 20, "k_stride": 1}
    out_ref, _, dout, dq_ref, dkv_ref = autograd_grads(q, kv, idx, 0.05, 512, dout_seed=3, **kw)
    qa, kva = q.clone().requires_grad_(), kv.clone().requires_grad_()
    attn_sum = torch.full((3, 11), float("nan"), device=dev)
    out, lse = sparse_mla(qa, kva, idx, 0.05, 512, return_lse=True, attn_sum_out=attn_sum, **kw)
    assert not lse.requires_grad
    out.backward(dout.to(dtype))
    want = head_summed_attention(q, kv, idx, lse, 0.05, kw)
    torch.testing.assert_close(attn_sum.double(), want, rtol=1e-2, atol=1e-3)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    assert rel_err(out, out_ref) < tol
    assert rel_err(qa.grad, dq_ref) < tol
    assert rel_err(kva.grad, dkv_ref) < tol


# ---------------------------------------------------------------------------------------------- GPU

GPU_CASES = [
    pytest.param(256, 128, 576, 8192, 2048, {}, id="S256-H128-D576-K8K-T2048"),
    pytest.param(
        128,
        64,
        576,
        4096,
        1000,
        {"causal": True, "q_start_index": 3000, "k_stride": 1},
        id="H64-T1000-causal",
    ),
    pytest.param(96, 16, 512, 2048, 333, {}, id="H16-D512-T333"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("s_q", "h_q", "d_qk", "s_kv", "topk", "kw"), GPU_CASES)
def test_bwd_gpu_matches_reference(s_q, h_q, d_qk, s_kv, topk, kw):
    q, kv, idx = make_case(s_q, h_q, d_qk, s_kv, topk, device="cuda", dtype=torch.bfloat16, seed=s_q + topk)
    kv = poison_unselected(kv, idx)
    sm_scale = d_qk**-0.5
    out, lse = sparse_mla_ref(q.float(), torch.nan_to_num(kv.float()), idx, sm_scale, 512, **kw)
    dout = torch.randn(out.shape, device="cuda").bfloat16()
    out = out.bfloat16()
    dq_ref, dkv_ref = sparse_mla_bwd_ref(q, torch.nan_to_num(kv), out, dout, idx, lse, sm_scale, 512, **kw)
    dq, dkv, attn_sum = sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, 512, return_attn_sum=True, **kw)
    torch.testing.assert_close(
        attn_sum.double(), head_summed_attention(q, kv, idx, lse, sm_scale, kw), rtol=1e-3, atol=1e-4
    )
    dq2, dkv2 = sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, 512, deterministic=True, **kw)
    dq3, dkv3 = sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, 512, deterministic=True, **kw)
    assert torch.equal(dq2, dq3), "deterministic dq changed between runs"
    assert torch.equal(dkv2, dkv3), "deterministic dkv changed between runs"
    # bf16 inputs: the fp16 workspace, about as accurate as the default mode's fp32 atomics.
    assert rel_err(dkv2, dkv_ref) <= 1.1 * rel_err(dkv, dkv_ref), (
        rel_err(dkv2, dkv_ref),
        rel_err(dkv, dkv_ref),
    )
    # Four chunks of tokens, their reductions on the side stream beside the next chunk's kernels (the
    # default) and on the main stream: the same bits; and the fp32 workspace.
    four = Config(bwd_deterministic_workspace_bytes=(s_q // 4) * topk * (d_qk * 2 + d_qk // 64 * 4))
    dq10, dkv10 = bwd_with_tiles(
        q, kv, out, dout, idx, lse, sm_scale, 512, {}, deterministic=True, config=four, **kw
    )
    dkv11 = bwd_with_tiles(
        q, kv, out, dout, idx, lse, sm_scale, 512, {}, deterministic=True, config=four, **kw
    )[1]
    same_stream = {"DET_OVERLAP": 0}
    dkv13 = bwd_with_tiles(
        q, kv, out, dout, idx, lse, sm_scale, 512, same_stream, deterministic=True, config=four, **kw
    )[1]
    assert torch.equal(dkv10, dkv11), "deterministic dkv (side-stream reductions) changed between runs"
    assert torch.equal(dkv10, dkv13), "deterministic dkv depends on the stream of its reductions"
    dq12, dkv12 = bwd_with_tiles(
        q, kv, out, dout, idx, lse, sm_scale, 512, {"DET_HALF": 0}, deterministic=True, **kw
    )
    # The fused kernel (dkv per head block in the main kernel; the path of h_q > 128) with two 64-head
    # halves per program, both modes; and the fused kernel's own default.
    sub = {"BLOCK_H": 64, "N_SUB": 2, "SPLIT_DKV": 0, "BLOCK_T": 128}  # the fused kernel's own slot blocks
    dq4, dkv4 = bwd_with_tiles(q, kv, out, dout, idx, lse, sm_scale, 512, sub, **kw)
    dq5, dkv5 = bwd_with_tiles(q, kv, out, dout, idx, lse, sm_scale, 512, sub, deterministic=True, **kw)
    dq6, dkv6 = bwd_with_tiles(
        q, kv, out, dout, idx, lse, sm_scale, 512, {"SPLIT_DKV": 0, "BLOCK_T": 128}, **kw
    )
    # The kernels without the slot sort and the other launch options of the defaults (128-slot main blocks).
    dq7, dkv7 = bwd_with_tiles(q, kv, out, dout, idx, lse, sm_scale, 512, {**UNSORTED, "BLOCK_T": 128}, **kw)
    outs = [
        (dq, dkv),
        (dq2, dkv2),
        (dq4, dkv4),
        (dq5, dkv5),
        (dq6, dkv6),
        (dq7, dkv7),
        (dq10, dkv10),
        (dq12, dkv12),
    ]
    # Both dkv kernels explicitly (Config.bwd_dkv_backend; the default picks one), both modes.
    for backend in ("triton", "gluon"):
        cfg = Config(bwd_dkv_backend=backend)
        if backend == "gluon" and not (gluon_supported() and topk % 8 == 0):
            with pytest.raises(ValueError, match="bwd_dkv_backend"):
                sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, 512, config=cfg, **kw)
            continue
        outs.append(sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, 512, config=cfg, **kw))
        dq8, dkv8 = sparse_mla_bwd(
            q, kv, out, dout, idx, lse, sm_scale, 512, deterministic=True, config=cfg, **kw
        )
        dkv9 = sparse_mla_bwd(
            q, kv, out, dout, idx, lse, sm_scale, 512, deterministic=True, config=cfg, **kw
        )[1]
        assert torch.equal(dkv8, dkv9), f"deterministic dkv ({backend} dkv kernel) changed between runs"
        outs.append((dq8, dkv8))
    for a, b in outs:
        assert torch.isfinite(a).all()
        assert torch.isfinite(b).all()
        assert rel_err(a, dq_ref) < REL_TOL[torch.bfloat16], rel_err(a, dq_ref)
        assert rel_err(b, dkv_ref) < REL_TOL[torch.bfloat16], rel_err(b, dkv_ref)


@pytest.mark.gpu
def test_bwd_deterministic_cuda_graph_gpu():
    """The deterministic backward in 4 chunks (reductions on the side stream) captured in a CUDA graph:
    the replay gives the eager call's bits."""
    q, kv, idx = make_case(256, 64, 576, 4096, 512, device="cuda", dtype=torch.bfloat16, seed=8, zoo=False)
    sm_scale = 576**-0.5
    out, lse = sparse_mla_ref(q.float(), kv.float(), idx, sm_scale, 512)
    out, dout = out.bfloat16(), torch.randn(out.shape, device="cuda").bfloat16()
    four = Config(bwd_deterministic_workspace_bytes=64 * 512 * (576 * 2 + 9 * 4))

    def run():
        return sparse_mla_bwd(q, kv, out, dout, idx, lse, sm_scale, 512, deterministic=True, config=four)

    eager = run()
    side = torch.cuda.Stream()  # warm-up off the default stream, as before any capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0])
    assert torch.equal(captured[1], eager[1])


@pytest.mark.gpu
@pytest.mark.parametrize("target_from_bwd", [False, True], ids=["torch-target", "attn_sum_out"])
def test_training_step_lowers_loss_gpu(target_from_bwd):
    """A small random model (projections into q/kv and the indexer) trained for a few steps: forward,
    indexer top-k, sparse attention, indexer KL loss, backward. The combined loss must go down.

    ``attn_sum_out``: the indexer target is the by-product of the attention backward (filled by
    ``attn_loss.backward()``, then the KL loss is built on it and back-propagated), checked against the
    torch computation of the same target."""
    from sparse_mla_attn.autograd import sparse_mla
    from sparse_mla_attn.indexer import indexer_kl_loss, indexer_logits, indexer_topk

    torch.manual_seed(0)
    dev = "cuda"
    s, d_model, h_q, d_qk, topk, h_idx, d_idx = 512, 256, 16, 576, 64, 4, 64
    x = torch.randn(s, d_model, device=dev)
    target = torch.randn(s, h_q, 512, device=dev) * 0.1
    wq = torch.nn.Linear(d_model, h_q * d_qk, bias=False, device=dev)
    wkv = torch.nn.Linear(d_model, d_qk, bias=False, device=dev)
    wqi = torch.nn.Linear(d_model, h_idx * d_idx, bias=False, device=dev)
    wki = torch.nn.Linear(d_model, d_idx, bias=False, device=dev)
    ww = torch.nn.Linear(d_model, h_idx, bias=False, device=dev)
    params = [p for m in (wq, wkv, wqi, wki, ww) for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for _ in range(8):
        q = wq(x).view(s, h_q, d_qk).bfloat16()
        kv = wkv(x).view(s, 1, d_qk).bfloat16()
        qi = wqi(x).view(s, h_idx, d_idx).bfloat16()
        ki = wki(x).bfloat16()
        w = ww(x)
        logits = indexer_logits(qi, ki, w, causal=True)
        idx = indexer_topk(logits, topk, causal=True)
        attn_sum_out = torch.full((s, topk), float("nan"), device=dev) if target_from_bwd else None
        out, lse = sparse_mla(
            q, kv, idx, d_qk**-0.5, 512, causal=True, return_lse=True, attn_sum_out=attn_sum_out
        )
        attn_loss = (out.float() - target).pow(2).mean()
        with torch.no_grad():  # the indexer target: attention summed over heads at the selected slots
            valid = reference.valid_slots(idx[:, 0], s, 0, 1, True)
            rows = kv[:, 0].float()[idx[:, 0].long().clamp(0, s - 1)]
            sc = torch.einsum("shd,std->sht", q.float(), rows) * d_qk**-0.5
            attn_sum = torch.where(valid[:, None], torch.exp(sc - lse[..., None]), 0.0).sum(1)
        at_topk = logits.gather(1, idx[:, 0].long().clamp_min(0)).masked_fill(idx[:, 0] < 0, float("-inf"))
        opt.zero_grad()
        if attn_sum_out is not None:  # two backward passes: attention first (fills the target), then KL
            attn_loss.backward()
            torch.testing.assert_close(attn_sum_out, attn_sum, rtol=2e-2, atol=2e-3)
            kl = indexer_kl_loss(at_topk, attn_sum_out)
            kl.backward()
        else:
            kl = indexer_kl_loss(at_topk, attn_sum)
            (attn_loss + kl).backward()
        loss = attn_loss.detach() + kl.detach()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses
