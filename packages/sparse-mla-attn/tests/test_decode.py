"""sparse_mla_decode (paged cache, indices are sequence positions) against its float32 reference."""

import math

import pytest
import torch

from sparse_mla_attn import Config, quantize_fp8_kv_cache, sparse_mla_decode, sparse_mla_decode_ref
from sparse_mla_attn._inputs import gluon_skip_reason, kernel_test_device
from sparse_mla_attn._runtime import last_launch
from sparse_mla_attn.reference import dequantize_fp8_kv_cache, paged_rows


def cpu_device() -> str:
    """Device for the non-GPU tests: CPU tensors under TRITON_INTERPRET=1, else the GPU."""
    return kernel_test_device()


def paged_problem(b, s_q, h_q, d_qk, block_size, seqlens, topk, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    max_blocks = max(1, max(math.ceil(s / block_size) for s in seqlens))
    num_blocks = b * max_blocks + 3
    q = torch.randn(b, s_q, h_q, d_qk, device=device, generator=g).bfloat16()
    cache = torch.randn(num_blocks, block_size, 1, d_qk, device=device, generator=g).bfloat16()
    perm = torch.randperm(num_blocks, device=device, generator=g)[: b * max_blocks]
    block_table = perm.view(b, max_blocks).int()
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    hi = max(max(seqlens), 1)
    indices = torch.randint(-3, hi + 5, (b, s_q, topk), device=device, generator=g, dtype=torch.int32)
    indices[..., 0] = 2**31 - 1
    # Unused table entries point far outside the cache: they must never be followed.
    for i, s in enumerate(seqlens):
        block_table[i, math.ceil(s / block_size) :] = 10**8
    # Poison every cache row that no valid index reaches.
    rows, valid = paged_rows(indices, block_table, cache_seqlens, block_size)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    used[rows[valid]] = True
    cache = cache.view(-1, d_qk).masked_fill(~used[:, None], float("nan")).view_as(cache)
    return q, cache, block_table, cache_seqlens, indices


def check(got, args, sm_scale, atol, rtol):
    q, cache, bt, sl, idx = args
    ref_out, ref_lse = sparse_mla_decode_ref(q.float(), cache.float(), bt, sl, idx, sm_scale)
    assert not torch.isnan(got[0]).any()
    torch.testing.assert_close(got[0].float(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(got[1], ref_lse, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("b", "s_q", "h_q", "d_qk", "block_size", "seqlens", "topk"),
    [
        pytest.param(3, 1, 16, 576, 16, (70, 5, 0), 21, id="B3-S1-H16-D576-bs16"),
        pytest.param(2, 2, 5, 512, 8, (30, 17), 13, id="B2-S2-H5-D512-bs8"),
        pytest.param(1, 3, 66, 576, 64, (100,), 9, id="B1-S3-H66-D576-bs64"),
    ],
)
def test_decode_matches_reference(b, s_q, h_q, d_qk, block_size, seqlens, topk):
    dev = cpu_device()
    args = paged_problem(b, s_q, h_q, d_qk, block_size, seqlens, topk, dev, seed=b + h_q)
    got = sparse_mla_decode(*args, 1 / math.sqrt(d_qk))
    check(got, args, 1 / math.sqrt(d_qk), 1e-2, 1e-2)
    for i, s in enumerate(seqlens):
        if s == 0:  # an empty sequence: nothing to attend to
            assert torch.all(got[0][i] == 0)
            assert torch.all(got[1][i] == float("-inf"))


def test_decode_split_k_and_table_entries_outside_the_cache():
    dev = cpu_device()
    args = paged_problem(2, 2, 5, 576, 8, (30, 17), 23, dev, seed=7)
    got = sparse_mla_decode(*args, 0.05, config=Config(num_splits=2))
    check(got, args, 0.05, 1e-2, 1e-2)
    assert last_launch("fwd").merge == "last_program"  # the default at h_q <= 16
    # A table entry pointing past the cache is skipped like an invalid position, never followed.
    q, cache, bt, sl, idx = args
    bt = bt.clone()
    bt[0, 0] = 10**8
    idx = idx.clone()
    idx[0, :, :4] = torch.arange(4, dtype=torch.int32, device=dev)  # positions in that block
    out, lse = sparse_mla_decode(q, cache, bt, sl, idx, 0.05)
    keep = idx.clone()
    keep[0][(idx[0] >= 0) & (idx[0] < 8)] = -1  # the reference, told those slots are invalid
    ref_out, ref_lse = sparse_mla_decode_ref(q.float(), cache.float(), bt, sl, keep, 0.05)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-4, rtol=1e-5)


def assert_graph_replays_equal(call, expected, replays):
    """``call()`` captured in a CUDA graph: each replay (outputs NaN-filled before) gives ``expected``'s bits."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replay = call()
    for _ in range(replays):
        for t in replay:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for a, e in zip(replay, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)


def _poisoned_empty(real_empty):
    """``torch.empty`` whose float tensors hold NaN and integer tensors a large garbage value."""

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else 2**30 + 7)

    return empty


def _reusing_scratch(store):
    """``_runtime.scratch`` as on a GPU stream: one buffer set per owner, reused by every later call."""

    def scratch(owner, device, make):
        if id(owner) not in store:
            store[id(owner)] = (owner, make())
        return store[id(owner)][1]

    return scratch


@pytest.mark.parametrize(
    ("n_splits", "h_q", "topk", "seqlens"),
    [
        pytest.param(2, 5, 23, (30, 17), id="splits2-uneven-H5-T23"),
        pytest.param(3, 20, 40, (45, 0), id="splits3-uneven-H20-T40-empty-seq"),
        pytest.param(5, 3, 70, (64, 9), id="splits5-uneven-H3-T70"),
        pytest.param(2, 66, 32, (40, 40), id="splits2-H66-two-head-tiles"),
    ],
)
def test_decode_split_merge_paths_poisoned(monkeypatch, n_splits, h_q, topk, seqlens):
    """Both split-K merges (the last split program, in the same launch; a second kernel) against the
    float32 reference, with every output and workspace buffer NaN-poisoned when allocated and reused by
    the next call, as on a GPU stream; the merge counters are zero again after each call, and both merges
    give the same bits."""
    from sparse_mla_attn import decode

    dev = cpu_device()
    args = paged_problem(2, 2, h_q, 576, 8, seqlens, topk, dev, seed=n_splits + h_q)
    monkeypatch.setattr(torch, "empty", _poisoned_empty(torch.empty))
    store: dict = {}
    monkeypatch.setattr(decode, "scratch", _reusing_scratch(store))
    results = {}
    for merge in ("last_program", "kernel"):
        cfg = Config(num_splits=n_splits, split_merge=merge)
        for _ in range(2):  # the second call reuses the first one's workspace and counters
            got = sparse_mla_decode(*args, 0.05, config=cfg)
            launch = last_launch("fwd")
            assert (launch.splits, launch.merge) == (n_splits, merge)
            check(got, args, 0.05, 1e-2, 1e-2)
            for owner, buffers in store.values():
                if not isinstance(owner, decode.DecodePlan):  # the merge counters
                    assert torch.all(buffers[0] == 0)
        results[merge] = got
        for i, s in enumerate(seqlens):
            if s == 0:
                assert torch.all(got[0][i] == 0)
                assert torch.all(got[1][i] == float("-inf"))
    assert any(not isinstance(o, decode.DecodePlan) for o, _ in store.values())  # the counters were used
    for a, b in zip(results["last_program"], results["kernel"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_decode_default_merge_above_16_heads_is_the_merge_kernel():
    dev = cpu_device()
    args = paged_problem(1, 1, 20, 576, 8, (30,), 20, dev, seed=3)
    got = sparse_mla_decode(*args, 0.05, config=Config(num_splits=2))
    assert (last_launch("fwd").splits, last_launch("fwd").merge) == (2, "kernel")
    check(got, args, 0.05, 1e-2, 1e-2)


def test_decode_custom_op_fake_and_schema():
    dev = cpu_device()
    args = paged_problem(2, 1, 4, 576, 8, (9, 3), 5, dev, seed=1)
    torch.library.opcheck(
        torch.ops.sparse_mla_attn.sparse_mla_decode.default,
        (*args, 0.05, 512, "auto", 0, "auto", 1.0, "positions", float("-inf")),
        test_utils=("test_schema", "test_faketensor"),
    )
    q, cache, _, _, idx = args
    torch.library.opcheck(
        torch.ops.sparse_mla_attn.sparse_mla_decode.default,
        (q, quantize_fp8_kv_cache(cache.nan_to_num()).view(torch.uint8), None, None, idx, 0.05, 512, "auto", 0, "auto", 1.0,
         "cache_rows", float("inf")),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "h_q"), [(1, 128), (8, 128), (1, 16), (8, 16)])
def test_decode_split_merge_eager_and_cuda_graph_gpu(b, h_q):
    """At batch 1 and 8 (split-K): the default merge takes the merge kernel at h_q 128 (the Gluon kernel's
    split on sm_90), and at h_q 16 on a signature's first call and while a CUDA graph is captured, the
    last split program otherwise; every merge of the Triton kernel gives the same bits, eager and
    replayed (twice, so the counters a replay leaves are zero again), and all match the reference."""
    from sparse_mla_attn import gluon_supported

    g = torch.Generator(device="cuda").manual_seed(b)
    seqlens = torch.randint(16384, 32769, (b,), generator=g, device="cuda").tolist()
    args = paged_problem(b, 1, h_q, 576, 64, seqlens, 2048, "cuda", seed=b + h_q)
    scale = 1 / math.sqrt(576)
    gluon = h_q > 32 and gluon_supported() and gluon_skip_reason("gluon") is None
    for backend in ("auto", "triton"):
        first = sparse_mla_decode(*args, scale, config=Config(backend=backend))
        launch = last_launch("fwd")
        assert (launch.backend, launch.merge) == (
            "gluon" if gluon and backend == "auto" else "triton",
            "kernel",
        )
        assert launch.splits > 1
        check(first, args, scale, 8e-4, 2e-2)
        for _ in range(3):  # later calls replay recorded launches: fresh copies check their data pointers
            again = sparse_mla_decode(*[t.clone() for t in args], scale, config=Config(backend=backend))
            assert last_launch("fwd").merge == ("last_program" if h_q <= 16 else "kernel")
            for a, e in zip(again, first, strict=True):
                torch.testing.assert_close(a, e, rtol=0, atol=0)
        if backend == "auto":
            assert_graph_replays_equal(lambda: sparse_mla_decode(*args, scale), first, 2)
    for merge in ("auto", "last_program", "kernel"):  # the Triton kernel's merges, against its `first`
        cfg = Config(backend="triton", split_merge=merge)
        sparse_mla_decode(*args, scale, config=cfg)  # compile outside the capture
        assert_graph_replays_equal(lambda cfg=cfg: sparse_mla_decode(*args, scale, config=cfg), first, 2)
        assert last_launch("fwd").merge == ("kernel" if merge == "auto" else merge)  # the captured call's


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("b", "h_q", "block_size", "seqlen", "topk"),
    [
        pytest.param(64, 128, 64, 8192, 2048, id="B64-H128-bs64-L8K-T2048"),
        pytest.param(8, 128, 64, 65536, 2048, id="B8-H128-bs64-L64K-T2048"),
        pytest.param(16, 16, 32, 3000, 500, id="B16-H16-bs32-L3000-T500"),
        pytest.param(2, 128, 64, 32768, 2048, id="B2-H128-bs64-L32K-T2048-splitK"),
    ],
)
def test_decode_gpu(b, h_q, block_size, seqlen, topk):
    g = torch.Generator(device="cuda").manual_seed(b)
    seqlens = torch.randint(seqlen // 2, seqlen + 1, (b,), generator=g, device="cuda").tolist()
    args = paged_problem(b, 1, h_q, 576, block_size, seqlens, topk, "cuda", seed=b + h_q)
    got = sparse_mla_decode(*args, 1 / math.sqrt(576))
    check(got, args, 1 / math.sqrt(576), 8e-4, 2e-2)
    for _ in range(2):  # the last call replays the launches the second one recorded, on fresh copies
        again = sparse_mla_decode(*[t.clone() for t in args], 1 / math.sqrt(576))
        for a, e in zip(again, got, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
    # New values in new tensors (q and the cache scaled by powers of two): a replayed launch that read
    # the earlier call's tensors would give the earlier result.
    new = ((args[0].float() * -0.5).to(args[0].dtype), args[1] * 0.5, *[t.clone() for t in args[2:]])
    check(sparse_mla_decode(*new, 1 / math.sqrt(576)), new, 1 / math.sqrt(576), 8e-4, 2e-2)


def test_decode_batch_zero_returns_empty():
    dev = cpu_device()
    q = torch.randn(0, 1, 4, 576, device=dev).bfloat16()
    cache = torch.randn(2, 8, 1, 576, device=dev).bfloat16()
    table = torch.zeros(0, 2, dtype=torch.int32, device=dev)
    seqlens = torch.zeros(0, dtype=torch.int32, device=dev)
    idx = torch.zeros(0, 1, 5, dtype=torch.int32, device=dev)
    out, lse = sparse_mla_decode(q, cache, table, seqlens, idx, 0.05)
    assert out.shape == (0, 1, 4, 512)
    assert lse.shape == (0, 1, 4)
    ref_out, ref_lse = sparse_mla_decode_ref(q, cache, table, seqlens, idx, 0.05)
    assert ref_out.shape == out.shape
    assert ref_lse.shape == lse.shape


# FP8 cache (FlashMLA's 656-byte layout). The kernel dequantizes exactly (power-of-two scales), so it is
# compared with the float32 reference of the same dequantized cache; the error is the bf16 output's
# rounding and the bf16 P of the P·V product. Tolerances (atol, rtol) by where the kernel runs:
FP8_TOL = {"interpreter": (1e-2, 1e-2), "gpu": (8e-4, 2e-2), "gpu_short": (2e-3, 2e-2)}  # short: topk < 256
NAN_E4M3 = 0x7F  # float8_e4m3fn NaN


def fp8_paged_problem(b, s_q, h_q, block_size, seqlens, topk, device, seed, *, pad_blocks=0):
    """:func:`paged_problem` with its cache quantized to the FP8 layout (blocks ``pad_blocks`` tokens
    apart beyond ``block_size``, as FlashMLA's quantizer lays them out), every unused token's bytes,
    scales and rope values, and the padding, poisoned with NaN; plus the same indices as cache rows."""
    q, cache, table, seqlens_t, idx = paged_problem(b, s_q, h_q, 576, block_size, seqlens, topk, device, seed)
    unused = torch.isnan(cache).any(-1)  # [num_blocks, block_size, 1]
    num_blocks = cache.shape[0]
    store = torch.empty(num_blocks, block_size + pad_blocks, 1, 656, dtype=torch.uint8, device=device)
    store.view(-1, 4).view(torch.float32).fill_(float("nan"))  # padding: NaN scales and values
    fp8 = store[:, :block_size]
    fp8.copy_(quantize_fp8_kv_cache(cache.nan_to_num()).view(torch.uint8))
    fp8[..., :512].masked_fill_(unused[..., None], NAN_E4M3)
    fp8[..., 512:].view(torch.float32).masked_fill_(unused[..., None], float("nan"))  # scales and rope
    rows, valid = paged_rows(idx, table, seqlens_t, block_size, num_blocks * block_size)
    cache_rows = torch.where(valid, rows, -1).int()
    idx[..., -1] = -5  # an invalid position, and as a row one past the cache: never read
    cache_rows[..., -1] = num_blocks * block_size
    return q, fp8.view(torch.float8_e4m3fn), table, seqlens_t, idx, cache_rows


def check_fp8(got, q, cache, table, seqlens, idx, sm_scale, tol, **kw):
    ref_out, ref_lse = sparse_mla_decode_ref(q.float(), cache, table, seqlens, idx, sm_scale, **kw)
    assert not torch.isnan(got[0]).any()
    torch.testing.assert_close(got[0].float(), ref_out.float(), atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(got[1], ref_lse, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("b", "s_q", "h_q", "block_size", "seqlens", "topk", "pad", "config"),
    [
        pytest.param(3, 1, 16, 16, (70, 5, 0), 21, 1, None, id="B3-S1-H16-bs16-padded-empty-seq"),
        pytest.param(1, 2, 66, 8, (40,), 19, 0, None, id="B1-S2-H66-bs8-two-head-tiles"),
        pytest.param(2, 1, 5, 8, (30, 17), 23, 0, Config(num_splits=2), id="B2-S1-H5-bs8-splitK2"),
    ],
)
def test_decode_fp8_cache_matches_reference(b, s_q, h_q, block_size, seqlens, topk, pad, config):
    """FP8 cache, both index kinds and both lse conventions, against the float32 reference of the
    dequantized cache; unused tokens, scales and padding are NaN, so a wrong read shows."""
    dev = cpu_device()
    q, cache, table, seqlens_t, idx, rows = fp8_paged_problem(
        b, s_q, h_q, block_size, seqlens, topk, dev, seed=b + h_q, pad_blocks=pad
    )
    got = sparse_mla_decode(q, cache, table, seqlens_t, idx, 0.05, config=config)
    check_fp8(got, q, cache, table, seqlens_t, idx, 0.05, FP8_TOL["interpreter"])
    as_rows = sparse_mla_decode(q, cache, None, None, rows, 0.05, index_kind="cache_rows",
                                empty_lse=float("inf"), config=config)  # fmt: skip
    check_fp8(as_rows, q, cache, None, None, rows, 0.05, FP8_TOL["interpreter"], index_kind="cache_rows",
              empty_lse=float("inf"))  # fmt: skip
    torch.testing.assert_close(as_rows[0], got[0], rtol=0, atol=0)  # the same rows: the same bits
    empty = got[1] == float("-inf")
    assert torch.equal(as_rows[1][empty], torch.full_like(as_rows[1][empty], float("inf")))
    torch.testing.assert_close(as_rows[1][~empty], got[1][~empty], rtol=0, atol=0)
    for i, s in enumerate(seqlens):
        if s == 0:
            assert torch.all(got[0][i] == 0)
            assert torch.all(got[1][i] == float("-inf"))


def test_decode_cache_rows_and_plus_inf_lse_on_a_bf16_cache():
    dev = cpu_device()
    q, cache, table, seqlens, idx = paged_problem(2, 1, 4, 576, 8, (20, 0), 9, dev, seed=5)
    rows, valid = paged_rows(idx, table, seqlens, 8, cache.shape[0] * 8)
    rows = torch.where(valid, rows, -1).int()
    got = sparse_mla_decode(
        q, cache, table, None, rows, 0.05, index_kind="cache_rows", empty_lse=float("inf")
    )
    ref = sparse_mla_decode(q, cache, table, seqlens, idx, 0.05)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    assert torch.all(got[1][1] == float("inf"))  # the empty sequence: FlashMLA's convention
    torch.testing.assert_close(got[1][0], ref[1][0], rtol=0, atol=0)


def _fp8_bad_inputs():
    q = torch.randn(1, 1, 4, 576).bfloat16()
    cache = quantize_fp8_kv_cache(torch.randn(2, 8, 1, 576))
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    seqlens = torch.tensor([12], dtype=torch.int32)
    idx = torch.zeros(1, 1, 3, dtype=torch.int32)
    return q, cache, table, seqlens, idx


@pytest.mark.parametrize(
    ("mutate", "kw", "exc", "match"),
    [
        pytest.param(
            lambda a: (a[0], a[1][..., :655], *a[2:]), {}, ValueError, "kv_cache", id="fp8-655-bytes"
        ),
        pytest.param(
            lambda a: (a[0][..., :512], *a[1:]), {}, ValueError, "q must have d_qk = 576", id="fp8-d512"
        ),
        pytest.param(lambda a: (a[0].half(), *a[1:]), {}, TypeError, "q must be bf16", id="fp8-fp16-q"),
        pytest.param(
            lambda a: (a[0], torch.zeros(2, 8, 1, 672, dtype=torch.uint8)[..., :656], *a[2:]),
            {},
            ValueError,
            "656 bytes apart",
            id="fp8-token-stride",
        ),
        pytest.param(
            lambda a: (a[0], torch.zeros(2 * 8 * 656 + 8, dtype=torch.uint8)[8:].view(2, 8, 1, 656), *a[2:]),
            {},
            ValueError,
            "16-byte aligned",
            id="fp8-misaligned",
        ),
        pytest.param(
            lambda a: (a[0], a[1].view(torch.int8), *a[2:]),
            {},
            ValueError,
            "kv_cache must be",
            id="int8-cache",
        ),
        pytest.param(lambda a: a, {"index_kind": "rows"}, ValueError, "index_kind", id="index-kind"),
        pytest.param(lambda a: a, {"empty_lse": 0.0}, ValueError, "empty_lse", id="empty-lse-0"),
        pytest.param(lambda a: (a[0], a[1], None, *a[3:]), {}, TypeError, "block_table", id="no-table"),
        pytest.param(lambda a: (*a[:3], None, a[4]), {}, TypeError, "cache_seqlens", id="no-seqlens"),
    ],
)
def test_decode_fp8_and_option_errors_name_the_argument(mutate, kw, exc, match):
    with pytest.raises(exc, match=match):
        sparse_mla_decode(*mutate(_fp8_bad_inputs()), 0.05, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("b", "s_q", "h_q", "seqlen", "topk", "pad"),
    [
        pytest.param(64, 1, 128, 8192, 2048, 0, id="B64-S1-H128-L8K-T2048"),
        pytest.param(32, 2, 64, 8192, 2048, 1, id="B32-S2-H64-L8K-T2048-padded"),
        pytest.param(2, 1, 128, 32768, 2048, 0, id="B2-S1-H128-L32K-T2048-splitK"),
        pytest.param(8, 1, 16, 3000, 500, 0, id="B8-S1-H16-L3000-T500"),
    ],
)
def test_decode_fp8_gpu(b, s_q, h_q, seqlen, topk, pad):
    """The compiled FP8 decode (both index kinds, eager and replayed) against the float32 reference."""
    g = torch.Generator(device="cuda").manual_seed(b)
    seqlens = torch.randint(seqlen // 2, seqlen + 1, (b,), generator=g, device="cuda").tolist()
    q, cache, table, seqlens_t, idx, rows = fp8_paged_problem(
        b, s_q, h_q, 64, seqlens, topk, "cuda", seed=b + h_q, pad_blocks=pad
    )
    scale = 1 / math.sqrt(576)
    got = sparse_mla_decode(q, cache, table, seqlens_t, idx, scale)
    check_fp8(got, q, cache, table, seqlens_t, idx, scale, FP8_TOL["gpu"])
    for _ in range(2):  # the last call replays the launches the second one recorded, on fresh copies
        again = sparse_mla_decode(*[t.clone() for t in (q, cache, table, seqlens_t, idx)], scale)
        for a, e in zip(again, got, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
    for _ in range(2):
        as_rows = sparse_mla_decode(q, cache, None, None, rows.clone(), scale, index_kind="cache_rows")
        for a, e in zip(as_rows, got, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("b", "s_q", "h_q", "seqlen", "topk", "block_size", "pad", "n_splits"),
    [
        # The benchmark's shapes (batch 64 / 128, s_q 1 / 2, h_q 64 / 128, topk 2048) at small scale.
        pytest.param(4, 1, 128, 4096, 2048, 64, 0, 0, id="B4-S1-H128-T2048"),
        pytest.param(4, 2, 128, 4096, 2048, 64, 1, 0, id="B4-S2-H128-T2048-padded"),
        pytest.param(8, 1, 64, 4096, 2048, 64, 0, 0, id="B8-S1-H64-T2048"),
        pytest.param(8, 2, 64, 4096, 2048, 64, 0, 0, id="B8-S2-H64-T2048"),
        # Edge cases: partial head tiles, a top-k list not a multiple of 64 blocks, small pages, empty
        # sequences (no valid index), split-K with a short last split.
        pytest.param(3, 1, 48, 700, 1000, 16, 3, 0, id="B3-S1-H48-T1000-bs16-padded"),
        pytest.param(2, 2, 96, 300, 130, 64, 0, 0, id="B2-S2-H96-T130"),
        pytest.param(5, 1, 128, 2000, 2048, 64, 0, 3, id="B5-S1-H128-T2048-splits3"),
        pytest.param(2, 1, 64, 5000, 512, 32, 0, 2, id="B2-S1-H64-T512-bs32-splits2"),
    ],
)
def test_decode_fp8_gluon_gpu(b, s_q, h_q, seqlen, topk, block_size, pad, n_splits):
    """The Gluon sm_90 FP8 decode (``Config(backend="gluon")``) against the float32 reference of the
    dequantized cache (unused tokens, scales, rope and padding NaN): both index kinds and ``empty_lse``
    conventions bit-equal to each other, eager, replayed and captured in a CUDA graph bit-equal, and
    close to the Triton FP8 kernel."""
    if reason := gluon_skip_reason("gluon"):
        pytest.skip(reason)
    g = torch.Generator(device="cuda").manual_seed(b + s_q)
    seqlens = torch.randint(seqlen // 2, seqlen + 1, (b,), generator=g, device="cuda").tolist()
    seqlens[-1] = 0 if b > 2 else seqlens[-1]  # a sequence with no valid index
    q, cache, table, seqlens_t, idx, rows = fp8_paged_problem(
        b, s_q, h_q, block_size, seqlens, topk, "cuda", seed=b + h_q, pad_blocks=pad
    )
    scale = 1 / math.sqrt(576)
    cfg = Config(backend="gluon", num_splits=n_splits)
    got = sparse_mla_decode(q, cache, table, seqlens_t, idx, scale, config=cfg)
    launch = last_launch("fwd")
    assert launch.backend == "gluon"
    assert n_splits == 0 or launch.splits == n_splits
    # Few keys per token: the bf16 P's rounding averages out less.
    tol = FP8_TOL["gpu" if topk >= 256 else "gpu_short"]
    check_fp8(got, q, cache, table, seqlens_t, idx, scale, tol)
    if seqlens[-1] == 0:
        assert torch.all(got[0][-1] == 0)
        assert torch.all(got[1][-1] == float("-inf"))
    for _ in range(2):  # the last call replays the launches the second one recorded, on fresh copies
        again = sparse_mla_decode(*[t.clone() for t in (q, cache, table, seqlens_t, idx)], scale, config=cfg)
        for a, e in zip(again, got, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
    for empty_lse in (-math.inf, math.inf):
        as_rows = sparse_mla_decode(q, cache.view(torch.uint8), None, None, rows.clone(), scale,
                                    index_kind="cache_rows", empty_lse=empty_lse, config=cfg)  # fmt: skip
        torch.testing.assert_close(as_rows[0], got[0], rtol=0, atol=0)
        empty = got[1] == -math.inf
        assert torch.all(as_rows[1][empty] == empty_lse)
        torch.testing.assert_close(as_rows[1][~empty], got[1][~empty], rtol=0, atol=0)
    assert_graph_replays_equal(
        lambda: sparse_mla_decode(q, cache, table, seqlens_t, idx, scale, config=cfg), got, 2
    )
    tri = sparse_mla_decode(q, cache, table, seqlens_t, idx, scale, config=Config(backend="triton"))
    assert last_launch("fwd").backend == "triton"
    torch.testing.assert_close(got[0], tri[0], atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(got[1], tri[1], atol=2e-4, rtol=1e-5)


def every_e4m3_code_cache(n_rows: int, device: str) -> torch.Tensor:
    """An FP8 cache of ``n_rows`` tokens (one block) whose latent bytes run through every finite
    float8_e4m3fn code (twice per token, NaN codes replaced by their neighbours), with power-of-two scales
    from ``2**-20`` to ``2**6`` (above and below 1, where the Gluon kernel splits its factor), random rope."""
    code = (torch.arange(n_rows * 512, device=device) % 256).to(torch.uint8).view(n_rows, 512)
    code = torch.where((code & 0x7F) == NAN_E4M3, code - 1, code)
    exps = (torch.arange(n_rows * 4, device=device) % 27 - 20).view(n_rows, 4).float()
    rope = torch.randn(n_rows, 64, device=device).bfloat16()
    raw = torch.cat([code, torch.exp2(exps).view(torch.uint8), rope.view(torch.uint8)], dim=-1)
    return raw.view(1, n_rows, 1, 656).view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("backend", "h_q"),
    [
        pytest.param("triton", 16, id="triton-H16"),
        pytest.param("gluon", 128, marks=pytest.mark.gpu, id="gluon-H128"),
    ],
)
def test_decode_fp8_dequantizes_every_code_exactly(backend, h_q):
    """With one valid index per token the output is that cache row's latent values (a softmax of one
    key): every finite e4m3 code under scales above and below 1 comes out exactly as the float32
    dequantization rounded to bf16 (exact: 4 significant bits), at every head."""
    if reason := gluon_skip_reason(backend):
        pytest.skip(reason)
    dev = cpu_device() if backend == "triton" else "cuda"
    n_rows = 64
    cache = every_e4m3_code_cache(n_rows, dev)
    q = torch.randn(n_rows, 1, h_q, 576, device=dev).bfloat16()
    rows = torch.full((n_rows, 1, 64), -1, dtype=torch.int32, device=dev)
    tok = torch.arange(n_rows, device=dev)
    rows[tok, 0, (tok * 5) % 64] = tok.int()  # token t reads row t, at some slot
    out, lse = sparse_mla_decode(q, cache, None, None, rows, 0.05, index_kind="cache_rows",
                                 config=Config(backend=backend))  # fmt: skip
    want = dequantize_fp8_kv_cache(cache)[0, :, 0, :512].bfloat16()
    assert torch.equal(out[:, 0], want[:, None, :].expand(n_rows, h_q, 512))
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize(
    ("b", "s_q", "h_q", "split_fill", "splits"),
    [
        pytest.param(1, 1, 128, 1.0, 8, id="B1-H128"),
        pytest.param(8, 1, 128, 1.0, 8, id="B8-H128"),
        pytest.param(64, 1, 128, 1.0, 1, id="B64-H128"),
        pytest.param(128, 2, 128, 1.0, 1, id="B128-S2-H128"),
        pytest.param(64, 1, 64, 1.0, 2, id="B64-H64"),
        pytest.param(128, 1, 64, 1.0, 1, id="B128-H64"),
        pytest.param(64, 1, 128, 2.0, 2, id="B64-H128-fill2"),
        pytest.param(128, 1, 64, 2.0, 2, id="B128-H64-fill2"),
        pytest.param(128, 1, 128, 2.0, 1, id="B128-H128-fill2"),
        pytest.param(64, 1, 64, 0.5, 1, id="B64-H64-fill0.5"),
        pytest.param(32, 1, 64, 1.0, 4, id="B32-H64"),
    ],
)
def test_split_rule_on_an_h200(monkeypatch, b, s_q, h_q, split_fill, splits):
    """``Config.splits_for`` at the decode shapes, with an H200's 132 multiprocessors, and the factor
    the forward plan picks from it (tokens x 64-head tiles programs, topk 2048)."""
    from sparse_mla_attn import forward

    cfg = Config(split_fill=split_fill)
    n_programs = b * s_q * math.ceil(h_q / 64)
    assert cfg.splits_for(n_programs, 2048, 132) == splits
    monkeypatch.setattr(forward, "num_sms", lambda device: 132)
    monkeypatch.setattr(forward, "interpreting", lambda: False)
    assert forward.choose_splits(n_programs, 2048, 64, torch.device("cpu"), split_fill) == splits


def test_split_rule_bounds_and_config_checks():
    assert Config().splits_for(1, 2048, 132) == 8  # at least 4 blocks of 64 slots per split
    assert Config().splits_for(1, 100, 132) == 1
    assert Config().splits_for(0, 2048, 132) == 1
    assert Config().splits_for(4, 2048, 0) == 1  # not a GPU
    assert Config(num_splits=3).splits_for(256, 2048, 132) == 3  # a fixed factor wins
    for bad in (0, -1.0, 65, "2", True, float("nan")):
        with pytest.raises(ValueError, match="split_fill"):
            Config(split_fill=bad)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("b", "s_q", "h_q", "n_splits"),
    [
        pytest.param(64, 1, 64, 2, id="B64-S1-H64-splits2"),
        pytest.param(8, 1, 128, 8, id="B8-S1-H128-splits8"),
        pytest.param(16, 2, 128, 3, id="B16-S2-H128-splits3"),
    ],
)
def test_decode_gluon_split_k_gpu(b, s_q, h_q, n_splits):
    """The Gluon decode split over the top-k list (``Config(backend="gluon", num_splits=n)``), eager,
    replayed and captured in a CUDA graph (bit-equal), against the float32 reference."""
    if reason := gluon_skip_reason("gluon"):
        pytest.skip(reason)
    g = torch.Generator(device="cuda").manual_seed(b)
    seqlens = torch.randint(16384, 32769, (b,), generator=g, device="cuda").tolist()
    args = paged_problem(b, s_q, h_q, 576, 64, seqlens, 2048, "cuda", seed=b + h_q)
    scale = 1 / math.sqrt(576)
    cfg = Config(backend="gluon", num_splits=n_splits)
    first = sparse_mla_decode(*args, scale, config=cfg)
    launch = last_launch("fwd")
    assert (launch.backend, launch.splits, launch.merge) == ("gluon", n_splits, "kernel")
    check(first, args, scale, 8e-4, 2e-2)
    for _ in range(2):  # the last call replays the launches the second one recorded, on fresh copies
        again = sparse_mla_decode(*[t.clone() for t in args], scale, config=cfg)
        for a, e in zip(again, first, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert_graph_replays_equal(lambda: sparse_mla_decode(*args, scale, config=cfg), first, 1)
