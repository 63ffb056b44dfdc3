"""sparse_mla_fwd against its float32 reference (CPU: Triton interpreter, tiny shapes; GPU: real shapes)."""

import math

import pytest
import torch

from sparse_mla_attn import Config, sparse_mla_fwd, sparse_mla_fwd_ref
from sparse_mla_attn._inputs import (
    case_ids,
    gluon_skip_reason,
    kernel_test_device,
    poison_unselected,
    random_problem,
)
from sparse_mla_attn._runtime import last_launch
from sparse_mla_attn._validate import SparseDims, check_sparse_inputs
from sparse_mla_attn.forward import launch_fwd, tail_split


def fwd_with_tiles(q, kv, idx, sm_scale, tiles, **kw):
    """The forward launched with an explicit Triton tile (kernel options the defaults pick on other shapes)."""
    return launch_fwd(
        q, kv[:, 0], idx[:, 0], check_sparse_inputs(q, kv, idx, 512), sm_scale, tiles=tiles, **kw
    )


# (atol, rtol) per quantity. The interpreter multiplies in float32, so only out's bf16 rounding shows on CPU;
# on the GPU the probabilities are rounded to bf16 before P·V (FlashMLA does the same).
TOL = {
    "cpu": {"out": (1e-2, 1e-2), "lse": (1e-4, 1e-5), "max_logits": (1e-4, 1e-5)},
    "gpu": {"out": (8e-4, 2e-2), "lse": (2e-4, 1e-5), "max_logits": (2e-4, 1e-5)},
    "gpu_few": {"out": (6e-3, 2e-2), "lse": (2e-4, 1e-5), "max_logits": (2e-4, 1e-5)},
}
# (h_q, d_qk, topk, s_q) of the Gluon edge-case test: odd block counts, one block, few tokens.
GLUON_EDGE_CASES = [
    (128, 576, 1000, 160),
    (64, 576, 2048, 160),
    (100, 512, 333, 160),
    (48, 576, 129, 97),
    (128, 576, 64, 33),
]
# Kernel-family cases of the GPU backend tests (parametrized by conftest.py).
GPU_BACKEND_CASES = [
    ("triton", 128, 576, 1000),
    ("gluon", 128, 576, 1000),
    ("gluon", 48, 576, 2048),
    ("gluon", 100, 512, 333),
]


cpu_device = kernel_test_device  # CPU tensors under TRITON_INTERPRET=1, else the GPU


def make_problem(s_q, h_q, d_qk, s_kv, topk, device, seed, invalid_frac=0.0):
    return random_problem(s_q, h_q, d_qk, s_kv, topk, device=device, seed=seed, invalid_frac=invalid_frac)


def check_fwd(got, q, kv, idx, sm_scale, where, **kw):
    # The reference runs on the same bf16 values, upcast: out stays float32 so only the kernel rounds it.
    ref = sparse_mla_fwd_ref(q.float(), kv.float(), idx, sm_scale, **kw)
    for name, g, r in zip(("out", "max_logits", "lse"), got, ref, strict=True):
        atol, rtol = TOL[where][name]
        assert not torch.isnan(g).any(), f"{name} has NaN"
        torch.testing.assert_close(
            g.float(), r.float(), atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
        )


SHAPE_ARGS = ("s_q", "h_q", "d_qk", "s_kv", "topk")


def shape_params(*shapes):
    """``pytest.param`` per ``(s_q, h_q, d_qk, s_kv, topk)`` shape, with an id like ``S3-H16-D576-K50-T21``."""
    return [
        pytest.param(*shape, id=case_id)
        for shape, case_id in zip(shapes, case_ids(SHAPE_ARGS, shapes), strict=True)
    ]


CPU_SHAPES = shape_params(
    (3, 16, 576, 50, 21), (4, 5, 512, 40, 37), (2, 70, 576, 30, 9), (3, 2, 576, 7, 1), (2, 3, 576, 20, 33)
)


@pytest.mark.parametrize(SHAPE_ARGS, CPU_SHAPES)
def test_fwd_matches_reference(s_q, h_q, d_qk, s_kv, topk):
    dev = cpu_device()
    q, kv, idx = make_problem(s_q, h_q, d_qk, s_kv, topk, dev, seed=s_q * 1000 + h_q + topk)
    kv = poison_unselected(kv, idx)
    scale = 1 / math.sqrt(d_qk)
    check_fwd(sparse_mla_fwd(q, kv, idx, scale), q, kv, idx, scale, "cpu")


def test_fwd_invalid_index_zoo_and_empty_rows():
    dev = cpu_device()
    s_kv = 24
    q, kv, idx = make_problem(5, 8, 576, s_kv, 13, dev, seed=1, invalid_frac=0.4)
    zoo = torch.tensor([-1, s_kv, s_kv + 1, 2**31 - 1, -(2**31), 10**9], dtype=torch.int32)
    idx[0, 0, : len(zoo)] = zoo.to(dev)  # every kind of invalid index in one row
    idx[2, 0, :] = -1  # a query with no valid index
    idx[3, 0, :] = s_kv  # another, out of range on the other side
    kv = poison_unselected(kv, idx)
    out, max_logits, lse = sparse_mla_fwd(q, kv, idx, 0.04)
    check_fwd((out, max_logits, lse), q, kv, idx, 0.04, "cpu")
    for s in (2, 3):
        assert torch.all(out[s] == 0)
        assert torch.all(lse[s] == float("-inf"))
        assert torch.all(max_logits[s] == float("-inf"))


def test_fwd_duplicates_count_twice():
    dev = cpu_device()
    q, kv, idx = make_problem(2, 4, 576, 16, 6, dev, seed=2)
    idx[:, 0, :] = torch.tensor([3, 3, 3, 5, 5, 9], dtype=torch.int32)
    out, _, lse = sparse_mla_fwd(q, kv, idx, 0.05)
    check_fwd((out, _, lse), q, kv, idx, 0.05, "cpu")
    logits = torch.einsum("shd,td->sht", q.float(), kv[[3, 5, 9], 0].float()) * 0.05
    weights = torch.tensor([3.0, 2.0, 1.0], device=dev)
    torch.testing.assert_close(lse, torch.logsumexp(logits + weights.log(), -1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("q_start_index", "k_stride"),
    [
        pytest.param(0, 1, id="start0-stride1"),
        pytest.param(5, 1, id="start5-stride1"),
        pytest.param(3, 4, id="start3-stride4"),
    ],
)
def test_fwd_causal_limit(q_start_index, k_stride):
    dev = cpu_device()
    s_q, s_kv = 6, 12
    q, kv, idx = make_problem(s_q, 6, 576, s_kv, 12, dev, seed=3 + k_stride)
    out, max_logits, lse = sparse_mla_fwd(
        q, kv, idx, 0.05, causal=True, q_start_index=q_start_index, k_stride=k_stride
    )
    check_fwd(
        (out, max_logits, lse),
        q,
        kv,
        idx,
        0.05,
        "cpu",
        causal=True,
        q_start_index=q_start_index,
        k_stride=k_stride,
    )
    # Independent check of the limit for one query: entries above (pos + 1 - k_stride) / k_stride (C division) are skipped.
    s = s_q - 1
    pos = q_start_index + s
    limit = int((pos + 1 - k_stride) / k_stride)
    sel = [int(i) for i in idx[s, 0] if 0 <= int(i) <= limit]
    logits = q[s].float() @ kv[sel, 0].float().T * 0.05
    torch.testing.assert_close(lse[s], torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-5)


def test_fwd_attn_sink_and_topk_length():
    dev = cpu_device()
    s_q, h_q, topk = 4, 6, 19
    q, kv, idx = make_problem(s_q, h_q, 576, 30, topk, dev, seed=4)
    sink = torch.randn(h_q, device=dev) * 3
    topk_length = torch.tensor([19, 7, 0, 30], dtype=torch.int32, device=dev)
    # Slots past topk_length may hold anything, even rows that must not be read.
    idx[1, 0, 7:] = 2**31 - 1
    got = sparse_mla_fwd(q, kv, idx, 0.05, attn_sink=sink, topk_length=topk_length)
    check_fwd(got, q, kv, idx, 0.05, "cpu", attn_sink=sink, topk_length=topk_length)
    assert torch.all(got[0][2] == 0)
    assert torch.all(got[2][2] == float("-inf"))
    # lse ignores the sink; out is scaled by 1 / (1 + exp(sink - lse)).
    plain = sparse_mla_fwd(q, kv, idx, 0.05, topk_length=topk_length)
    torch.testing.assert_close(got[2], plain[2])
    factor = torch.sigmoid(plain[2] - sink[None, :])[0]
    torch.testing.assert_close(
        got[0][0].float(), (plain[0][0].float() * factor[:, None]), atol=1e-2, rtol=1e-2
    )


@pytest.mark.parametrize(
    ("n_splits", "s_split"),
    [
        pytest.param(2, False, id="splits2"),
        pytest.param(3, False, id="splits3"),
        pytest.param(1, True, id="splits1-s_split"),
        pytest.param(2, True, id="splits2-s_split"),
    ],
)
def test_fwd_split_k_matches_reference(n_splits, s_split):
    # Split-K (used when the grid is small): partial outputs merged by lse weight, including rows whose
    # splits are partly or wholly invalid, a sink, topk_length and the causal limit.
    dev = cpu_device()
    s_q, h_q, topk, s_kv = 4, 6, 37, 40
    q, kv, idx = make_problem(s_q, h_q, 576, s_kv, topk, dev, seed=20 + n_splits, invalid_frac=0.3)
    idx[1, 0, :20] = -1  # first split(s) of this row see nothing
    idx[2, 0, :] = -1  # no valid index at all
    kv = poison_unselected(kv, idx)
    sink = torch.randn(h_q, device=dev)
    topk_length = torch.tensor([37, 30, 37, 5], dtype=torch.int32, device=dev)
    kw = {"attn_sink": sink, "topk_length": topk_length, "causal": True, "q_start_index": 30, "k_stride": 1}
    got = fwd_with_tiles(q, kv, idx, 0.05, {"S_SPLIT": s_split}, config=Config(num_splits=n_splits), **kw)
    check_fwd(got, q, kv, idx, 0.05, "cpu", **kw)
    assert torch.all(got[0][2] == 0)
    assert torch.all(got[2][2] == float("-inf"))


def test_fwd_custom_op_fake_and_schema():
    dev = cpu_device()
    q, kv, idx = make_problem(2, 4, 576, 9, 5, dev, seed=5)
    sink = torch.zeros(4, device=dev)
    torch.library.opcheck(
        torch.ops.sparse_mla_attn.sparse_mla_fwd.default,
        (q, kv, idx, 0.05, 512, sink, None, 0, 1, False, "auto", 0),
        test_utils=("test_schema", "test_faketensor"),
    )


# ---------------------------------------------------------------- GPU, real shapes

# The last shape's grid is small enough for the launcher to pick split-K.
GPU_SHAPES = shape_params(
    (256, 128, 576, 8192, 2048),
    (128, 64, 576, 131072, 2048),
    (64, 16, 576, 32768, 1000),
    (96, 100, 512, 4096, 777),
    (33, 1, 576, 2048, 65),
    (8, 128, 576, 65536, 2048),
)


@pytest.mark.gpu
@pytest.mark.parametrize(SHAPE_ARGS, GPU_SHAPES)
def test_fwd_gpu(s_q, h_q, d_qk, s_kv, topk):
    q, kv, idx = make_problem(s_q, h_q, d_qk, s_kv, topk, "cuda", seed=topk + h_q, invalid_frac=0.05)
    idx[0, 0, :] = -1
    kv = poison_unselected(kv, idx)
    scale = 1 / math.sqrt(d_qk)
    got = sparse_mla_fwd(q, kv, idx, scale)
    check_fwd(got, q, kv, idx, scale, "gpu")
    assert torch.all(got[0][0] == 0)
    assert torch.all(got[2][0] == float("-inf"))
    assert_repeats_equal(lambda: sparse_mla_fwd(q.clone(), kv.clone(), idx.clone(), scale), got)
    # New values in new tensors (scaled by powers of two): a replayed launch that read the earlier call's
    # tensors would give the earlier result.
    q2, kv2 = (q.float() * -0.5).bfloat16(), kv * 0.5
    check_fwd(sparse_mla_fwd(q2, kv2, idx.clone(), scale), q2, kv2, idx, scale, "gpu")


def assert_repeats_equal(call, expected):
    """Two more eager calls on fresh copies of the inputs (the last replays the launches the second one
    recorded, with the new tensors) give the same bits as ``expected``."""
    for _ in range(2):
        for a, e in zip(call(), expected, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
def test_fwd_gpu_causal_sink_topk_length():
    s_q, h_q, s_kv, topk = 200, 128, 4096, 512
    q, kv, idx = make_problem(s_q, h_q, 576, s_kv, topk, "cuda", seed=11)
    sink = torch.randn(h_q, device="cuda")
    topk_length = torch.randint(0, topk + 1, (s_q,), dtype=torch.int32, device="cuda")
    kw = {"attn_sink": sink, "topk_length": topk_length, "causal": True, "q_start_index": 3000, "k_stride": 2}
    # Rows keeping only a few slots have out ≈ one V row (|v| up to ~4); the bf16 rounding of P
    # (relative 2**-9) then gives up to ~4e-3 absolute, so this test uses a wider out tolerance.
    check_fwd(sparse_mla_fwd(q, kv, idx, 0.04, **kw), q, kv, idx, 0.04, "gpu_few", **kw)
    # The same through split-K (the path small grids take).
    got = sparse_mla_fwd(q, kv, idx, 0.04, config=Config(num_splits=3), **kw)
    check_fwd(got, q, kv, idx, 0.04, "gpu_few", **kw)
    fresh = lambda: {**kw, "attn_sink": sink.clone(), "topk_length": topk_length.clone()}
    assert_repeats_equal(
        lambda: sparse_mla_fwd(
            q.clone(), kv.clone(), idx.clone(), 0.04, config=Config(num_splits=3), **fresh()
        ),
        got,
    )
    q2, kw2 = (q.float() * -0.5).bfloat16(), {**fresh(), "attn_sink": sink * 0.5}  # replayed on new values
    got2 = sparse_mla_fwd(q2, kv, idx, 0.04, config=Config(num_splits=3), **kw2)
    check_fwd(got2, q2, kv, idx, 0.04, "gpu_few", **kw2)


@pytest.mark.gpu
def test_fwd_gpu_torch_compile():
    q, kv, idx = make_problem(64, 128, 576, 4096, 256, "cuda", seed=12)
    compiled = torch.compile(lambda a, b, c: sparse_mla_fwd(a, b, c, 0.05)[0] * 2, fullgraph=True)
    torch.testing.assert_close(compiled(q, kv, idx), sparse_mla_fwd(q, kv, idx, 0.05)[0] * 2)


@pytest.mark.gpu
def test_fwd_gpu_backends(backend, h_q, d_qk, topk):
    """Both kernel families (Gluon on sm_90, Triton everywhere) against the reference, with causal limit,
    sink, topk_length, invalid indices and NaN in every KV row that no valid index selects."""
    s_q, s_kv = 160, 8192
    q, kv, idx = make_problem(s_q, h_q, d_qk, s_kv, topk, "cuda", seed=h_q + topk, invalid_frac=0.05)
    kv = poison_unselected(kv, idx)
    sink = torch.randn(h_q, device="cuda")
    topk_length = torch.randint(0, topk + 1, (s_q,), dtype=torch.int32, device="cuda")
    kw = {"attn_sink": sink, "topk_length": topk_length, "causal": True, "q_start_index": 8000, "k_stride": 1}
    scale = 1 / math.sqrt(d_qk)
    got = sparse_mla_fwd(q, kv, idx, scale, config=Config(backend=backend), **kw)
    assert last_launch("fwd").backend == backend
    check_fwd(got, q, kv, idx, scale, "gpu_few", **kw)
    plain = sparse_mla_fwd(q, kv, idx, scale, config=Config(backend=backend))
    check_fwd(plain, q, kv, idx, scale, "gpu")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("h_q", "d_qk", "topk", "s_q"), GLUON_EDGE_CASES, ids=case_ids(("h_q", "d_qk", "topk"), GLUON_EDGE_CASES)
)
def test_fwd_gpu_gluon_edge_cases(h_q, d_qk, topk, s_q):
    """The warp-specialised Gluon forward against the reference: odd block counts (a padding block, one
    block only), causal limit, sink, topk_length (0 included: no block at all), invalid indices, an
    all-invalid row, NaN in every KV row that no valid index selects; launched twice, so that a barrier
    phase left over from an earlier launch would show."""
    check_gluon_edge_case(h_q, d_qk, topk, s_q, Config(backend="gluon", num_splits=1))


GLUON_PERSISTENT_SHAPES = [*GLUON_EDGE_CASES, (128, 576, 2048, 64), (64, 576, 2048, 400)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize(
    ("h_q", "d_qk", "topk", "s_q"),
    GLUON_PERSISTENT_SHAPES,
    ids=case_ids(("h_q", "d_qk", "topk"), GLUON_PERSISTENT_SHAPES),
)
def test_fwd_gpu_gluon_persistent(h_q, d_qk, topk, s_q, mode):
    """The Gluon forward with ``Config(fwd_persistent="on")`` (at most one program per multiprocessor,
    several (token, head tile) items each) and ``"off"`` (one program per item), whatever the default for
    the head count, on the edge cases above, the full top-k at 128 heads and 400 tokens at 64 heads,
    against the reference, launched twice."""
    check_gluon_edge_case(h_q, d_qk, topk, s_q, Config(backend="gluon", num_splits=1, fwd_persistent=mode))


def check_gluon_edge_case(h_q, d_qk, topk, s_q, cfg):
    """The checks of :func:`test_fwd_gpu_gluon_edge_cases` with the Gluon config ``cfg``."""
    if reason := gluon_skip_reason("gluon"):
        pytest.skip(reason)
    # With one or two blocks the softmax is peaked and the bf16 rounding of P alone exceeds abs 8e-4 (up
    # to 1.7e-3 on ~0.005% of the elements; measured): the "gpu_few" tolerance there.
    where = "gpu" if topk >= 256 else "gpu_few"
    check_gluon_fwd(cfg, h_q, d_qk, topk, s_q, 11 * h_q + topk, where)


def check_gluon_fwd(cfg, h_q, d_qk, topk, s_q, seed, where):
    """The Gluon forward under ``cfg`` against the reference, launched twice (a barrier phase left over
    from an earlier launch would show): invalid indices, an all-invalid row, NaN in every KV row no valid
    index selects; then with sink, topk_length (0 included), causal limit."""
    q, kv, idx = make_problem(s_q, h_q, d_qk, 8192, topk, "cuda", seed=seed, invalid_frac=0.05)
    idx[0, 0, :] = -1
    kv = poison_unselected(kv, idx)
    scale = 1 / math.sqrt(d_qk)
    for _ in range(2):
        plain = sparse_mla_fwd(q, kv, idx, scale, config=cfg)
        assert last_launch("fwd").backend == "gluon"
        check_fwd(plain, q, kv, idx, scale, where)
        assert torch.all(plain[0][0] == 0)
        assert torch.all(plain[2][0] == float("-inf"))
    sink = torch.randn(h_q, device="cuda")
    topk_length = torch.randint(0, topk + 1, (s_q,), dtype=torch.int32, device="cuda")
    topk_length[1] = 0
    kw = {"attn_sink": sink, "topk_length": topk_length, "causal": True, "q_start_index": 8000, "k_stride": 1}
    got = sparse_mla_fwd(q, kv, idx, scale, config=cfg, **kw)
    check_fwd(got, q, kv, idx, scale, "gpu_few", **kw)
    assert torch.all(got[0][1] == 0)
    assert torch.all(got[2][1] == float("-inf"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("h_q", "topk", "n_splits"),
    [
        pytest.param(128, 1000, 3, id="H128-T1000-splits3"),
        pytest.param(64, 2048, 2, id="H64-T2048-splits2"),
        pytest.param(96, 300, 4, id="H96-T300-splits4-as-3"),
    ],
)
def test_fwd_gpu_gluon_split_k(h_q, topk, n_splits):
    """The Gluon forward split over the top-k list (``Config(backend="gluon", num_splits=n)``), merged by
    the merge kernel, against the reference: sink, topk_length (0 included), causal limit, invalid
    indices, an all-invalid row, NaN in the rows no valid index selects."""
    if reason := gluon_skip_reason("gluon"):
        pytest.skip(reason)
    cfg = Config(backend="gluon", num_splits=n_splits)
    check_gluon_fwd(cfg, h_q, 576, topk, 6, h_q + topk, "gpu")
    assert last_launch("fwd").merge == "kernel"
    assert last_launch("fwd").splits > 1


@pytest.mark.gpu
def test_fwd_gpu_gluon_split_k_persistent():
    """The split-K Gluon forward made persistent (``fwd_persistent``), against the reference."""
    if reason := gluon_skip_reason("gluon"):
        pytest.skip(reason)
    cfg = Config(backend="gluon", num_splits=3, fwd_persistent="on")
    check_gluon_fwd(cfg, 128, 576, 1000, 100, 1129, "gpu")
    assert last_launch("fwd").splits > 1


GLUON_TAIL_CASES = [
    pytest.param(64, 2048, 140, "off", "on", id="H64-T2048-S140-per-item"),
    pytest.param(64, 2048, 140, "off", "auto", id="H64-T2048-S140-per-item-default"),
    pytest.param(64, 2048, 400, "on", "auto", id="H64-T2048-S400-persistent"),
    pytest.param(48, 333, 135, "off", "on", id="H48-T333-S135-per-item"),
    pytest.param(128, 1000, 70, "on", "auto", id="H128-T1000-S70-persistent"),
    pytest.param(128, 1000, 70, "off", "on", id="H128-T1000-S70-per-item"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("h_q", "topk", "s_q", "persistent", "tail"), GLUON_TAIL_CASES)
def test_fwd_gpu_gluon_tail_split(h_q, topk, s_q, persistent, tail):
    """The Gluon forward with its last work items in pieces (``Config.fwd_tail_split``: the items past
    the last full wave), per item and persistent, against the reference, as
    :func:`test_fwd_gpu_gluon_edge_cases`."""
    if reason := gluon_skip_reason("gluon"):
        pytest.skip(reason)
    cfg = Config(backend="gluon", num_splits=1, fwd_persistent=persistent, fwd_tail_split=tail)
    check_gluon_fwd(cfg, h_q, 576, topk, s_q, 7 * h_q + topk, "gpu")
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    split = tail_split(s_q, -(-h_q // 64), topk, n_sm, tail == "on") is not None
    assert last_launch("fwd").merge == ("kernel" if split else None)


@pytest.mark.parametrize(
    ("n_tok", "n_head_tiles", "topk", "force", "expected"),
    [
        (4096, 1, 2048, False, (4092, 16, 128)),  # 31 full waves and 4 items: 16 pieces of one pair each
        (4092, 1, 2048, False, None),  # full waves only
        (200, 1, 2048, False, None),  # 68 items past the wave: more than half of the multiprocessors
        (140, 1, 512, False, (132, 4, 128)),
        (4096, 1, 129, False, (4092, 2, 128)),  # one slot in the second piece
        (4096, 1, 128, False, None),  # one pair: nothing to split
        (70, 2, 1000, True, (132, 8, 128)),  # whole tokens' head tiles
        (2, 1, 256, True, (0, 2, 128)),  # forced, fewer items than multiprocessors: all in pieces
        (100, 1, 2048, True, None),  # 100 items: pieces of 2 would not fit in one wave
    ],
)
def test_fwd_tail_split_rule(n_tok, n_head_tiles, topk, force, expected):
    """``Config.fwd_tail_split``: which of the Gluon forward's last work items run in pieces."""
    assert tail_split(n_tok, n_head_tiles, topk, 132, force) == expected


@pytest.mark.parametrize(
    ("h_q", "s_kv", "mode", "persistent"),
    [
        (128, 131072, "auto", True),  # two head tiles per token
        (64, 8192, "auto", True),  # one tile, 9.4 MB of KV rows: within half of a 50 MB L2
        (64, 32768, "auto", False),
        (64, 131072, "on", True),
        (128, 8192, "off", False),
    ],
)
def test_fwd_persistent_rule(monkeypatch, h_q, s_kv, mode, persistent):
    """``Config.fwd_persistent``: which Gluon forwards run persistent (one program per multiprocessor)."""
    from sparse_mla_attn import forward

    monkeypatch.setattr(forward, "num_sms", lambda device: 132)
    monkeypatch.setattr(forward, "l2_cache_bytes", lambda device: 50 << 20)
    plan = forward.FwdPlan(SparseDims(4, h_q, 576, s_kv, 2048, 512), True, 1, (1,), (), {}, (1,), {}, {})
    forward.set_gluon_options(plan, Config(fwd_persistent=mode), torch.device("cpu"))
    assert plan.gluon_options["persistent_programs"] == (132 if persistent else 0)


@pytest.mark.parametrize(
    ("h_q", "s_kv", "persistent", "tail", "expected"),
    [
        (64, 32768, "auto", "auto", (4092, 16, 128)),  # one program per item: 4 items past 31 waves of 132
        (64, 8192, "auto", "auto", (4092, 16, 128)),  # persistent
        (128, 131072, "off", "auto", (8184, 16, 128)),  # 8 items (4 tokens) past 62 waves
        (64, 131072, "auto", "off", None),
    ],
)
def test_fwd_tail_split_default(monkeypatch, h_q, s_kv, persistent, tail, expected):
    """``Config.fwd_tail_split="auto"`` splits the last work items of persistent and per-item forwards
    alike (4096 tokens on 132 multiprocessors)."""
    from sparse_mla_attn import forward

    monkeypatch.setattr(forward, "num_sms", lambda device: 132)
    monkeypatch.setattr(forward, "l2_cache_bytes", lambda device: 50 << 20)
    plan = forward.FwdPlan(SparseDims(4096, h_q, 576, s_kv, 2048, 512), True, 1, (1,), (), {}, (1,), {}, {})
    forward.set_gluon_options(
        plan, Config(fwd_persistent=persistent, fwd_tail_split=tail), torch.device("cpu")
    )
    assert plan.tail == expected


@pytest.mark.parametrize(
    ("h_q", "s_kv", "mode", "expected"),
    [
        (64, 131072, "auto", True),  # 151 MB of KV rows past a 50 MB L2, one program per item
        (64, 32768, "auto", False),  # 38 MB: within L2
        (48, 65536, "off", True),
        (64, 131072, "on", False),  # persistent
        (128, 131072, "off", False),  # two head tiles
    ],
)
def test_fwd_query_in_consumers_rule(monkeypatch, h_q, s_kv, mode, expected):
    """Which per-item Gluon forwards load the query tile in the consumer warpgroups (up to 64 heads, KV rows
    past L2)."""
    from sparse_mla_attn import forward

    monkeypatch.setattr(forward, "num_sms", lambda device: 132)
    monkeypatch.setattr(forward, "l2_cache_bytes", lambda device: 50 << 20)
    plan = forward.FwdPlan(SparseDims(4, h_q, 576, s_kv, 2048, 512), True, 1, (1,), (), {}, (1,), {}, {})
    forward.set_gluon_options(plan, Config(fwd_persistent=mode), torch.device("cpu"))
    assert plan.gluon_options.get("q_in_consumers", False) is expected


@pytest.mark.gpu
@pytest.mark.parametrize("tail", ["off", "on"])
@pytest.mark.parametrize(("h_q", "topk", "s_q"), [(64, 1000, 77), (40, 333, 29)])
def test_fwd_gpu_gluon_query_in_consumers(monkeypatch, h_q, topk, s_q, tail):
    """The per-item Gluon forward whose consumer warpgroups load the query tile (chosen where the KV rows do
    not fit in L2: here an L2 of 1 MB is pretended), its last items whole or in pieces
    (``fwd_tail_split``), against the reference, as :func:`test_fwd_gpu_gluon_edge_cases`."""
    from sparse_mla_attn import forward

    if reason := gluon_skip_reason("gluon"):
        pytest.skip(reason)
    monkeypatch.setattr(forward, "l2_cache_bytes", lambda device: 1 << 20)
    cfg = Config(backend="gluon", num_splits=1, fwd_persistent="off", fwd_tail_split=tail)
    check_gluon_fwd(cfg, h_q, 576, topk, s_q, 3 * h_q + topk, "gpu")
    plans = [p for p in forward._PLANS.values() if p.dims.s_q == s_q and p.dims.h_q == h_q]
    assert plans
    assert all(p.gluon_options.get("q_in_consumers") for p in plans)
