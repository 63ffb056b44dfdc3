"""attn_dist and indexer_target against the float32 reference."""

import importlib
import math

import pytest
import torch

from sparse_mla_attn import Config, attn_dist, attn_dist_ref, indexer_target, sparse_mla_fwd
from sparse_mla_attn._inputs import (
    case_ids,
    gluon_skip_reason,
    kernel_test_device,
    poison_unselected,
    random_problem,
)
from sparse_mla_attn._runtime import last_launch
from sparse_mla_attn._validate import check_sparse_inputs

TOL = {"cpu": (1e-5, 1e-4), "gpu": (1e-4, 2e-3)}  # (atol, rtol) on attn_sum
# (s_q, h_q, s_kv, topk) of the d_qk 576 GPU test.
GPU_SHAPES = [(256, 128, 8192, 2048), (128, 64, 131072, 2048), (64, 20, 4096, 300)]
# Kernel-family cases of the GPU backend tests (parametrized by conftest.py).
GPU_BACKEND_CASES = [
    ("triton", 128, 576, 1000),
    ("gluon", 128, 576, 1000),
    ("gluon", 64, 576, 2048),
    ("gluon", 37, 512, 333),
    ("gluon", 96, 512, 130),
    ("gluon", 40, 576, 129),
    ("gluon", 64, 576, 64),
    ("gluon", 48, 576, 192),
]


def attn_dist_with_tiles(q, kv, idx, lse, sm_scale, tiles, **kw):
    """attn_dist's Triton kernel launched with an explicit tile (e.g. two head tiles)."""
    from sparse_mla_attn.attn_dist import launch_attn_dist

    dims = check_sparse_inputs(q, kv, idx, 1)
    return launch_attn_dist(q, kv[:, 0], idx[:, 0], lse, dims, sm_scale, 1.4426950408889634,
                            config=Config(backend="triton"), tiles=tiles, **kw)  # fmt: skip


cpu_device = kernel_test_device  # CPU tensors under TRITON_INTERPRET=1, else the GPU


def problem(s_q, h_q, d_qk, s_kv, topk, device, seed, invalid_frac=0.2):
    q, kv, idx = random_problem(
        s_q, h_q, d_qk, s_kv, topk, device=device, seed=seed, invalid_frac=invalid_frac
    )
    return q, poison_unselected(kv, idx), idx


@pytest.mark.parametrize(
    ("s_q", "h_q", "d_qk", "s_kv", "topk", "q_start_index", "k_stride"),
    [
        pytest.param(5, 16, 576, 40, 23, 0, 1, id="S5-H16-D576-T23-start0"),
        pytest.param(4, 3, 512, 30, 17, 6, 1, id="S4-H3-D512-T17-start6"),
        pytest.param(3, 70, 576, 25, 11, 4, 3, id="S3-H70-D576-T11-stride3"),
        pytest.param(6, 9, 576, 20, 5, 1, 4, id="S6-H9-D576-T5-stride4"),
    ],
)
def test_attn_dist_matches_reference(s_q, h_q, d_qk, s_kv, topk, q_start_index, k_stride):
    dev = cpu_device()
    q, kv, idx = problem(s_q, h_q, d_qk, s_kv, topk, dev, seed=s_q + 10 * h_q)
    kw = {"causal": True, "q_start_index": q_start_index, "k_stride": k_stride}
    _, _, lse = sparse_mla_fwd(q, kv, idx, 0.05, **kw)
    got = attn_dist(q, kv, idx, lse, 0.05, q_start_index=q_start_index, k_stride=k_stride)
    ref = attn_dist_ref(q, kv, idx, lse, 0.05, q_start_index=q_start_index, k_stride=k_stride)
    atol, rtol = TOL["cpu"]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    # With the forward's lse (same causal settings) every head's probabilities sum to 1.
    has_any = torch.isfinite(lse).all(-1)
    torch.testing.assert_close(
        got.sum(-1)[has_any], torch.full_like(got.sum(-1)[has_any], float(h_q)), rtol=1e-4, atol=1e-4
    )
    assert torch.all(got.sum(-1)[~has_any] == 0)


def test_attn_dist_lse_base2_and_non_causal():
    dev = cpu_device()
    q, kv, idx = problem(4, 8, 576, 30, 13, dev, seed=7)
    _, _, lse = sparse_mla_fwd(q, kv, idx, 0.05)
    got_e = attn_dist(q, kv, idx, lse, 0.05, causal=False)
    got_2 = attn_dist(q, kv, idx, lse * math.log2(math.e), 0.05, causal=False, lse_base="2")
    ref = attn_dist_ref(q, kv, idx, lse, 0.05, causal=False)
    torch.testing.assert_close(got_e, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_2, ref, atol=1e-5, rtol=1e-4)
    # Invalid slots are exactly 0.
    invalid = (idx[:, 0] < 0) | (idx[:, 0] >= 30)
    assert torch.all(got_e[invalid] == 0)


def test_attn_dist_causal_masks_future_slots():
    dev = cpu_device()
    s_q, s_kv = 4, 16
    q, kv, idx = problem(s_q, 4, 576, s_kv, 16, dev, seed=8, invalid_frac=0.0)
    lse = torch.zeros(s_q, 4, device=dev)
    got = attn_dist(q, kv, idx, lse, 0.05, q_start_index=2, k_stride=1)
    limit = torch.arange(s_q, device=dev) + 2  # (pos + 1 - 1) / 1
    future = idx[:, 0] > limit[:, None]
    assert future.any()
    assert torch.all(got[future] == 0)
    assert torch.all(got[~future] > 0)


def test_indexer_target_normalises_and_detaches():
    a = torch.tensor([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    t = indexer_target(a)
    assert not t.requires_grad
    torch.testing.assert_close(t, torch.tensor([[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="attn_sum"):
        indexer_target(torch.ones(3))


def test_attn_dist_custom_op_fake_and_schema():
    dev = cpu_device()
    q, kv, idx = problem(2, 4, 576, 9, 5, dev, seed=9)
    lse = torch.zeros(2, 4, device=dev)
    torch.library.opcheck(
        torch.ops.sparse_mla_attn.attn_dist.default,
        (q, kv, idx, lse, 0.05, 0, 1, "e", True, "auto"),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("s_q", "h_q", "s_kv", "topk"), GPU_SHAPES, ids=case_ids(("s_q", "h_q", "s_kv", "topk"), GPU_SHAPES)
)
def test_attn_dist_gpu(s_q, h_q, s_kv, topk):
    q, kv, idx = problem(s_q, h_q, 576, s_kv, topk, "cuda", seed=h_q, invalid_frac=0.05)
    start = s_kv - s_q  # queries at the end of the sequence: the causal limit bites for some slots
    _, _, lse = sparse_mla_fwd(q, kv, idx, 0.0416, causal=True, q_start_index=start)
    got = attn_dist(q, kv, idx, lse, 0.0416, q_start_index=start)
    ref = attn_dist_ref(q, kv, idx, lse, 0.0416, q_start_index=start)
    atol, rtol = TOL["gpu"]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(
        got.sum(-1), torch.full((s_q,), float(h_q), device="cuda"), rtol=2e-3, atol=2e-3
    )


TWO_TILES = {"BLOCK_H": 64, "num_warps": 4}


@pytest.mark.gpu
def test_attn_dist_gpu_two_head_tiles():
    """The 2-tile path (fp32 atomic_add of two partial sums onto 0) is exact and order-independent."""
    q, kv, idx = problem(128, 128, 576, 8192, 2048, "cuda", seed=3, invalid_frac=0.05)
    _, _, lse = sparse_mla_fwd(q, kv, idx, 0.0416, causal=True, q_start_index=8000)
    got = attn_dist_with_tiles(q, kv, idx, lse, 0.0416, TWO_TILES, q_start_index=8000)
    again = attn_dist_with_tiles(q, kv, idx, lse, 0.0416, TWO_TILES, q_start_index=8000)
    ref = attn_dist_ref(q, kv, idx, lse, 0.0416, q_start_index=8000)
    torch.testing.assert_close(got, ref, atol=TOL["gpu"][0], rtol=TOL["gpu"][1])
    assert torch.equal(got, again)


@pytest.mark.gpu
def test_attn_dist_gpu_backends(backend, h_q, d_qk, topk):
    """Both kernel families against the reference (invalid indices, causal limit with k_stride 2, NaN in
    every unselected KV row, a query with no valid slot); the result is bitwise reproducible (above 64
    heads the warp-specialised Gluon kernel adds two partial sums onto a zeroed output)."""
    check_attn_dist_gpu(backend, h_q, d_qk, topk, Config(backend=backend))


# (h_q, d_qk, topk) of the Gluon kernel's column split (the block split is the default up to 64 heads, in
# GPU_BACKEND_CASES): odd block counts, one block.
SPLIT_COLS_CASES = [(64, 576, 2048), (37, 512, 333), (40, 576, 129), (64, 576, 64), (48, 576, 192)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("h_q", "d_qk", "topk"), SPLIT_COLS_CASES, ids=case_ids(("h_q", "d_qk", "topk"), SPLIT_COLS_CASES)
)
def test_attn_dist_gpu_split_cols(h_q, d_qk, topk):
    """The Gluon kernel with ``Config(attn_dist_split="cols")`` (its warpgroups split each block's
    columns) against the reference, as :func:`test_attn_dist_gpu_backends` checks the default."""
    if reason := gluon_skip_reason("gluon"):
        pytest.skip(reason)
    check_attn_dist_gpu("gluon", h_q, d_qk, topk, Config(backend="gluon", attn_dist_split="cols"))


# (h_q, d_qk, topk) of the Gluon kernel's persistent index-order form: a full row, fewer heads than a
# tile, one block, odd block counts (with the causal limit the pair's tokens differ in length); above 64
# heads (each consumer warpgroup 64 heads of one token).
INDEX_ORDER_CASES = [
    (64, 576, 2048), (37, 512, 333), (64, 576, 64), (40, 576, 129), (48, 576, 192), (128, 576, 1000), (96, 512, 130),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("h_q", "d_qk", "topk"), INDEX_ORDER_CASES, ids=case_ids(("h_q", "d_qk", "topk"), INDEX_ORDER_CASES)
)
def test_attn_dist_gpu_index_order(h_q, d_qk, topk):
    """The Gluon kernel's persistent index-order form (``Config(attn_dist_order="index")``) against the
    reference, as :func:`test_attn_dist_gpu_backends` checks the default, and bitwise equal to the
    per-token kernel."""
    if reason := gluon_skip_reason("gluon"):
        pytest.skip(reason)
    got = check_attn_dist_gpu("gluon", h_q, d_qk, topk, Config(backend="gluon", attn_dist_order="index"))
    assert last_launch("attn_dist").kernel.name == "_attn_dist_index_kernel"
    per_token = check_attn_dist_gpu("gluon", h_q, d_qk, topk, Config(backend="gluon", attn_dist_order="slot"))
    assert last_launch("attn_dist").kernel.name == "_attn_dist_ws_kernel"
    assert torch.equal(got, per_token)


@pytest.mark.gpu
@pytest.mark.parametrize(("h_q", "s_q"), [(64, 300), (64, 1000), (128, 300), (128, 1000)])
def test_attn_dist_gpu_index_order_flipped(monkeypatch, h_q, s_q):
    """The index-order form where the KV rows do not fit in L2 (a small L2 pretended), which takes
    alternate waves' chunks last to first: against the reference and bitwise equal to the per-token
    kernel, over several waves of items (the last one partial)."""
    if reason := gluon_skip_reason("gluon"):
        pytest.skip(reason)
    ad = importlib.import_module("sparse_mla_attn.attn_dist")  # (the package's attn_dist is the function)
    monkeypatch.setattr(ad, "l2_cache_bytes", lambda device: 1 << 20)
    d_qk, topk, s_kv = 576, 512, 8192
    q, kv, idx = problem(s_q, h_q, d_qk, s_kv, topk, "cuda", seed=s_q + h_q, invalid_frac=0.05)
    kw = {"q_start_index": s_kv - s_q}
    _, _, lse = sparse_mla_fwd(q, kv, idx, 0.0416, causal=True, **kw)
    got = attn_dist(q, kv, idx, lse, 0.0416, config=Config(backend="gluon", attn_dist_order="index"), **kw)
    assert last_launch("attn_dist").kernel.name == "_attn_dist_index_kernel"
    torch.testing.assert_close(got, attn_dist_ref(q, kv, idx, lse, 0.0416, **kw), atol=TOL["gpu"][0],
                               rtol=TOL["gpu"][1])  # fmt: skip
    per_token = attn_dist(
        q, kv, idx, lse, 0.0416, config=Config(backend="gluon", attn_dist_order="slot"), **kw
    )
    assert last_launch("attn_dist").kernel.name == "_attn_dist_ws_kernel"
    assert torch.equal(got, per_token)


@pytest.mark.parametrize(
    ("s_q", "s_kv", "topk", "n_chunks", "start", "k_stride", "flip_every"),
    [
        (5, 100, 37, 3, 50, 1, 0),
        (4, 1000, 300, 4, 0, 2, 0),
        (2, 5000, 700, 32, 0, 1, 0),
        (3, 64, 64, 64, 0, 1, 0),
        (2, 3000, 2048, 7, 2000, 1, 0),
        (7, 1000, 300, 5, 0, 1, 2),
        (5, 5000, 700, 16, 100, 1, 1),
    ],
)
def test_index_order_matches_python(s_q, s_kv, topk, n_chunks, start, k_stride, flip_every):
    """The index-order form's ordering kernel: each token's valid slots (in range, causal) grouped by KV
    chunk in index order (last chunk first in the alternate groups of ``flip_every`` tokens), in slot
    order within a chunk, with their indices and number; 0 written at the invalid slots only."""
    from sparse_mla_attn._validate import causal_limit
    from sparse_mla_attn.attn_dist import index_order

    dev = cpu_device()
    _, _, idx = random_problem(s_q, 1, 512, s_kv, topk, device=dev, seed=topk, invalid_frac=0.2)
    idx = idx[:, 0].contiguous()
    dims = check_sparse_inputs(
        torch.zeros(s_q, 1, 512, device=dev), torch.zeros(s_kv, 1, 512, device=dev), idx[:, None], 1
    )
    out = torch.full((s_q, topk), float("nan"), device=dev)
    idx_s, pos, counts = index_order(
        idx, out, dims, n_chunks, q_start_index=start, k_stride=k_stride, causal=True, flip_every=flip_every
    )
    rows = -(-s_kv // n_chunks)
    for s in range(s_q):
        hi = min(s_kv, int(causal_limit(torch.tensor(start + s), k_stride)) + 1)
        slots = [j for j in range(topk) if 0 <= int(idx[s, j]) < hi]
        flip = flip_every > 0 and (s // flip_every) % 2 == 1
        # Stable sort: slot order within a chunk.
        want = sorted(slots, key=lambda j: -(int(idx[s, j]) // rows) if flip else int(idx[s, j]) // rows)
        n = len(want)
        assert int(counts[s]) == n
        assert pos[s, :n].tolist() == want
        assert idx_s[s, :n].tolist() == [int(idx[s, j]) for j in want]
        invalid = [j for j in range(topk) if j not in set(slots)]
        assert torch.all(out[s, invalid] == 0)
        assert torch.all(out[s, slots].isnan())


def check_attn_dist_gpu(backend, h_q, d_qk, topk, config):
    """The checks of :func:`test_attn_dist_gpu_backends` with ``config`` (whose kernel family is
    ``backend``); returns the result."""
    s_q, s_kv, start = 128, 8192, 16000
    q, kv, idx = problem(s_q, h_q, d_qk, s_kv, topk, "cuda", seed=h_q + topk, invalid_frac=0.05)
    idx[3] = -1
    kw = {"q_start_index": start, "k_stride": 2}
    _, _, lse = sparse_mla_fwd(q, kv, idx, 0.0416, causal=True, **kw)
    got = attn_dist(q, kv, idx, lse, 0.0416, config=config, **kw)
    assert last_launch("attn_dist").backend == backend
    ref = attn_dist_ref(q, kv, idx, lse, 0.0416, **kw)
    torch.testing.assert_close(got, ref, atol=TOL["gpu"][0], rtol=TOL["gpu"][1])
    assert torch.all(got[3] == 0)
    assert torch.equal(got, attn_dist(q, kv, idx, lse, 0.0416, config=config, **kw))
    fresh = lambda: (q.clone(), kv.clone(), idx.clone(), lse.clone())
    for _ in range(2):  # the last call replays the launches the one before recorded, on fresh copies
        assert torch.equal(got, attn_dist(*fresh(), 0.0416, config=config, **kw))
    assert last_launch("attn_dist").backend == backend
    # Another scale on fresh copies: a replay that kept the recorded call's scale or tensors would differ.
    ref2 = attn_dist_ref(q, kv, idx, lse, 0.03, **kw)
    torch.testing.assert_close(
        attn_dist(*fresh(), 0.03, config=config, **kw), ref2, atol=TOL["gpu"][0], rtol=TOL["gpu"][1]
    )
    return got


def test_indexer_target_rejects_negative_and_nan():
    with pytest.raises(ValueError, match="attn_sum must hold probabilities"):
        indexer_target(torch.tensor([[0.5, -0.1]]))
    with pytest.raises(ValueError, match="attn_sum must hold probabilities"):
        indexer_target(torch.tensor([[0.5, float("nan")]]))
    assert indexer_target(torch.zeros(0, 4)).shape == (0, 4)


@pytest.mark.gpu
def test_indexer_target_under_cuda_graph_capture_gpu():
    """Captured without its value check, replayed on new values: the eager call's result."""
    a = torch.rand(64, 256, device="cuda")
    indexer_target(a)  # (eager first: checks and warms up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = indexer_target(a)
    a.copy_(torch.rand_like(a))
    graph.replay()
    torch.testing.assert_close(out, indexer_target(a), rtol=0, atol=0)
    with pytest.raises(ValueError, match="attn_sum must hold probabilities"):
        indexer_target(-a)
