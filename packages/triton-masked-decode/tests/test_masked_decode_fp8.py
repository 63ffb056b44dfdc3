"""masked_decode with FP8 (``float8_e4m3fn``) K/V caches against the float32 reference of the dequantized
cache.

The kernel converts FP8 rows exactly to q's dtype, applies the per-tensor K scale to the scores and the V
scale to the output, and per-(position, KV head) scales to each row's score (K) or probability (V); the
probabilities are rounded to q's dtype for the P·V product, as in the fp16/bf16 path. Excluded rows, and
their per-position scales, hold NaN: they must never be read. CPU tests run under the Triton interpreter
(its FP8 conversions run there), the ``gpu`` tests at real sizes.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_masked_decode import MaskedDecodeConfig, masked_decode, masked_decode_ref, pack_mask

# Output tolerance per q dtype (compared through float32 with the reference of the dequantized cache).
TOL = {
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 2.5e-2, "rtol": 2.5e-2},
}
LSE_TOL = {"atol": 2e-3, "rtol": 1e-4}
FP8 = torch.float8_e4m3fn


def fp8_inputs(
    device: torch.device,
    *,
    batch: int,
    hkv: int,
    group: int,
    length: int,
    dim: int,
    dtype: torch.dtype = torch.float16,
    paged: int = 0,
    density: float = 0.5,
    seqlens: bool = False,
    packed: bool = False,
    scale_kind: str = "float",  # float | tensor0d | tensor1 | none
    token_scales: bool = False,
    seed: int = 0,
):
    """Random FP8 caches (quantized from N(0, 1) rows), a mask, scales; excluded rows and their
    per-position scales are NaN. Returns (q, k8, v8, mask, ref_mask, seqlens, block_table, scale kwargs)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hkv * group, dim, generator=g).to(dtype)
    excl = torch.rand(batch, hkv, length, generator=g) >= density
    lens = [length] * batch
    seq = None
    if seqlens:
        lens = [int(x) for x in torch.randint(0, length + 1, (batch,), generator=g)]
        lens[0] = length
        seq = torch.tensor(lens, dtype=torch.int32)
    k_s, v_s = 0.04, 0.03
    block_table = None
    if paged:
        pages_per_seq = math.ceil(length / paged)
        num_pages = batch * pages_per_seq + 2
        perm = torch.randperm(num_pages, generator=g)[: batch * pages_per_seq]
        block_table = perm.view(batch, pages_per_seq).to(torch.int32)
        shape = (num_pages, paged, hkv, dim)
        tok_shape = (num_pages, paged, hkv)
        alloc = pages_per_seq * paged
        if alloc != length:
            excl = torch.cat([excl, torch.ones(batch, hkv, alloc - length, dtype=torch.bool)], dim=-1)
    else:
        shape = (batch, hkv, length, dim)
        tok_shape = (batch, hkv, length)
    k8 = (torch.randn(shape, generator=g) / k_s).to(FP8)
    v8 = (torch.randn(shape, generator=g) / v_s).to(FP8)
    k_tok = (torch.rand(tok_shape, generator=g) + 0.5) if token_scales else None
    v_tok = (torch.rand(tok_shape, generator=g) + 0.5) if token_scales else None
    # Poison every excluded row and every position past its sequence's length (and their scales).
    for b in range(batch):
        for h in range(hkv):
            bad = excl[b, h].clone()
            bad[lens[b] :] = True
            pos = bad.nonzero().flatten()
            if paged:
                assert block_table is not None
                idx = (block_table[b].long()[pos // paged], pos % paged, h)
            else:
                idx = (b, h, pos)
            k8[idx] = float("nan")
            v8[idx] = float("nan")
            if k_tok is not None and v_tok is not None:
                k_tok[idx] = float("nan")
                v_tok[idx] = float("nan")
    scales: dict = {}
    if scale_kind == "float":
        scales = {"k_scale": k_s, "v_scale": v_s}
    elif scale_kind == "tensor0d":
        scales = {"k_scale": torch.tensor(k_s), "v_scale": torch.tensor(v_s)}
    elif scale_kind == "tensor1":
        scales = {"k_scale": torch.tensor([k_s]), "v_scale": v_s}
    if token_scales:
        scales.update(k_token_scale=k_tok, v_token_scale=v_tok)
    mask = pack_mask(excl) if packed else excl

    def dev(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    scales = {name: dev(x) for name, x in scales.items()}
    return (
        dev(q), dev(k8), dev(v8), dev(mask), dev(excl), dev(seq), dev(block_table), scales,
    )  # fmt: skip


def check_fp8(device: torch.device, *, config: MaskedDecodeConfig | None = None, **kw) -> None:
    """On a GPU, three calls: the two-launch path, the one-launch kernel's JIT launch, its bound launch."""
    q, k8, v8, mask, ref_mask, seq, bt, scales = fp8_inputs(device, **kw)
    ref, ref_lse = masked_decode_ref(q, k8, v8, ref_mask, seqlens=seq, block_table=bt, **scales)
    for _ in range(3 if device.type == "cuda" else 1):
        out, lse = masked_decode(q, k8, v8, mask, seqlens=seq, block_table=bt, config=config, **scales)
        _check_fp8_result(q, out, lse, ref, ref_lse)
        out.fill_(float("nan"))  # a later call given this memory must overwrite it
        lse.fill_(float("nan"))
        del out, lse


def _check_fp8_result(q, out, lse, ref, ref_lse) -> None:
    assert out.dtype == q.dtype
    assert out.shape == q.shape
    assert not torch.isnan(out).any(), "NaN in output: an excluded FP8 row or scale was read"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[q.dtype])
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "rows without visible positions must give lse = -inf"
    assert torch.all(out[empty] == 0)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], **LSE_TOL)


CPU_CASES = [
    pytest.param({"scale_kind": "float"}, id="dense-fp16-float-scales"),
    pytest.param({"scale_kind": "tensor0d", "dtype": torch.bfloat16}, id="dense-bf16-0d-tensor-scales"),
    pytest.param({"scale_kind": "tensor1", "packed": True}, id="dense-packed-1elem-and-float"),
    pytest.param({"scale_kind": "none", "density": 1.0}, id="dense-no-scales-all-visible"),
    pytest.param({"token_scales": True, "seqlens": True, "batch": 3}, id="dense-token-scales-seqlens"),
    pytest.param({"paged": 8, "token_scales": True, "seqlens": True, "batch": 3}, id="paged8-token-scales"),
    pytest.param(
        {
            "paged": 16,
            "scale_kind": "tensor0d",
            "token_scales": True,
            "dtype": torch.bfloat16,
            "packed": True,
        },
        id="paged16-bf16-all-scales",
    ),
    pytest.param({"density": 0.0}, id="fully-masked"),
]


@pytest.mark.parametrize("case", CPU_CASES)
def test_fp8_matches_reference_cpu(case: dict, cpu_device: torch.device) -> None:
    kw = {"batch": 2, "hkv": 2, "group": 4, "length": 45, "dim": 32, **case}
    check_fp8(cpu_device, **kw)


@pytest.mark.parametrize("two_launch", [True, False], ids=["two-launch", "one-launch"])
def test_fp8_merge_paths_cpu(two_launch: bool, cpu_device: torch.device) -> None:
    """Both merge paths of several splits over a paged FP8 cache with every kind of scale: the merge
    kernel (graph capture) and the in-kernel merge."""
    md = sys.modules["triton_masked_decode.masked_decode"]
    q, k8, v8, mask, ref_mask, seq, bt, scales = fp8_inputs(
        cpu_device, batch=3, hkv=2, group=4, length=45, dim=32, paged=8, seqlens=True,
        scale_kind="tensor0d", token_scales=True, seed=5,
    )  # fmt: skip
    config = MaskedDecodeConfig(num_splits=3, autotune=False)
    sig = md._validate_and_plan(
        q, k8, v8, mask, seq, bt, None, scales["k_scale"], scales["v_scale"], scales["k_token_scale"],
        scales["v_token_scale"], config, cached=True,
    )  # fmt: skip
    assert sig.plan.splits == 3
    sc = md._scales(scales["k_scale"], scales["v_scale"], scales["k_token_scale"], scales["v_token_scale"])
    flag = torch.zeros(1, dtype=torch.int32)
    out, lse = md._run(
        q, k8, v8, mask, seq, bt, flag, sc, sig.seqlen_const, sig.scale, sig.grid_len, sig.threshold,
        sig.plan, sig.static, two_launch=two_launch,
    )  # fmt: skip
    ref, ref_lse = masked_decode_ref(q, k8, v8, ref_mask, seqlens=seq, block_table=bt, **scales)
    assert not torch.isnan(out).any(), "NaN in output: an excluded FP8 row or scale was read"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[q.dtype])
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], **LSE_TOL)


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_fp8_both_loops_cpu(path: str, cpu_device: torch.device) -> None:
    check_fp8(
        cpu_device, batch=2, hkv=1, group=2, length=60, dim=16, token_scales=True, seed=3,
        config=MaskedDecodeConfig(path=path, num_splits=3),  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"k_scale": float("nan")}, "k_scale", id="nan-scale"),
        pytest.param({"v_scale": "1"}, "v_scale", id="str-scale"),
        pytest.param({"k_scale": torch.ones(2)}, "k_scale", id="two-element-scale"),
        pytest.param({"v_scale": torch.ones(1, dtype=torch.int32)}, "v_scale", id="int-tensor-scale"),
        pytest.param({"k_token_scale": torch.ones(2, 2, 9)}, "k_token_scale", id="token-scale-shape"),
        pytest.param(
            {"v_token_scale": torch.ones(2, 2, 10, dtype=torch.float16)},
            "v_token_scale",
            id="token-scale-dtype",
        ),
    ],
)
def test_fp8_bad_scales(kwargs: dict, match: str, cpu_device: torch.device) -> None:
    q = torch.randn(2, 8, 16, dtype=torch.float16)
    k = torch.randn(2, 2, 10, 16).to(FP8)
    with pytest.raises(ValueError, match=match):
        masked_decode(q, k, k, None, **kwargs)


def test_fp8_cache_dtype_rules(cpu_device: torch.device) -> None:
    q = torch.randn(2, 8, 16, dtype=torch.float16)
    k = torch.randn(2, 2, 10, 16).to(FP8)
    with pytest.raises(ValueError, match="same dtype"):
        masked_decode(q, k, k.half(), None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        masked_decode(q, k.to(torch.float8_e5m2), k.to(torch.float8_e5m2), None)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 3),
    group=st.sampled_from([1, 3, 4]),
    dim=st.sampled_from([16, 24]),
    length=st.integers(1, 40),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    paged=st.sampled_from([0, 8]),
    density=st.sampled_from([0.0, 0.3, 1.0]),
    seqlens=st.booleans(),
    packed=st.booleans(),
    scale_kind=st.sampled_from(["float", "tensor0d", "tensor1", "none"]),
    token_scales=st.booleans(),
    path=st.sampled_from(["auto", "dense", "sparse"]),
    seed=st.integers(0, 999),
)
def test_fp8_fuzz_matches_reference(
    batch, group, dim, length, dtype, paged, density, seqlens, packed, scale_kind, token_scales, path, seed,
    cpu_device,
) -> None:  # fmt: skip
    """Random FP8 shapes, layouts, masks, lengths, scale kinds and loops, NaN in every excluded row and its
    scales: the reference's result, never a NaN."""
    check_fp8(
        cpu_device, batch=batch, hkv=2, group=group, length=length, dim=dim, dtype=dtype, paged=paged,
        density=density, seqlens=seqlens, packed=packed, scale_kind=scale_kind, token_scales=token_scales,
        seed=seed, config=MaskedDecodeConfig(path=path),
    )  # fmt: skip


# ------------------------------------------------------------------ GPU (real sizes)

GPU_CASES = [
    pytest.param({"batch": 1, "length": 65536, "scale_kind": "tensor0d"}, id="B1-L64K-tensor-scales"),
    pytest.param({"batch": 8, "length": 16384, "density": 0.1}, id="B8-L16K-10pct-float-scales"),
    pytest.param({"batch": 4, "length": 8192, "density": 1.0, "scale_kind": "tensor1"}, id="B4-all-visible"),
    pytest.param(
        {"batch": 4, "length": 8000, "paged": 16, "token_scales": True, "seqlens": True},
        id="paged16-token-scales",
    ),
    pytest.param(
        {
            "batch": 3,
            "length": 8192,
            "paged": 64,
            "dtype": torch.bfloat16,
            "packed": True,
            "token_scales": True,
        },
        id="paged64-bf16-packed-token-scales",
    ),
    pytest.param({"batch": 16, "length": 16384, "density": 0.25, "seqlens": True}, id="B16-multi-wave"),
    pytest.param({"batch": 2, "length": 4096, "density": 0.0}, id="fully-masked"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_fp8_matches_reference_gpu(case: dict, cuda_device: torch.device) -> None:
    kw = {"hkv": 8, "group": 4, "dim": 128, "seed": 11, **case}
    check_fp8(cuda_device, **kw)


@pytest.mark.gpu
def test_fp8_dense_loop_gpu(cuda_device: torch.device) -> None:
    check_fp8(
        cuda_device, batch=3, hkv=8, group=4, length=8192, dim=128, token_scales=True, seed=12,
        config=MaskedDecodeConfig(path="dense", autotune=False),
    )  # fmt: skip


@pytest.mark.gpu
def test_fp8_graph_replay_reads_the_scale_tensors(cuda_device: torch.device) -> None:
    """Scale tensors are read by the kernel: a replayed CUDA graph uses their current values."""
    q, k8, v8, mask, ref_mask, _, _, _ = fp8_inputs(
        cuda_device, batch=2, hkv=8, group=4, length=8192, dim=128, scale_kind="none", seed=13
    )
    k_scale = torch.tensor(0.04, device=cuda_device)
    v_scale = torch.tensor([0.03], device=cuda_device)
    masked_decode(q, k8, v8, mask, k_scale=k_scale, v_scale=v_scale)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = masked_decode(q, k8, v8, mask, k_scale=k_scale, v_scale=v_scale, check_values=False)
    for ks, vs in ((0.04, 0.03), (0.08, 0.5)):
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = masked_decode_ref(q, k8, v8, ref_mask, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[q.dtype])
        torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
