"""masked_decode against the float32 reference.

CPU tests run the Triton kernels under TRITON_INTERPRET=1 on tiny shapes; the ``gpu`` tests repeat the
matrix at real sizes and add NaN-poisoned caches and CUDA-graph replay.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_masked_decode import (
    MaskedDecodeConfig,
    choose_num_splits,
    masked_decode,
    masked_decode_ref,
    merge_attention_states,
    pack_mask,
    triton_masked_flash_decoding,
    tuned_defaults,
)

# Output tolerance per input dtype (outputs are compared through float32); LSE is accumulated in float32.
TOL = {
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
LSE_TOL = {"atol": 2e-3, "rtol": 1e-4}


@dataclass
class Case:
    batch: int = 2
    hkv: int = 2
    group: int = 4
    length: int = 45
    dim: int = 32
    dtype: torch.dtype = torch.float16
    mask: str = "bool"  # none | bool | packed
    density: float = 0.5  # fraction of visible positions
    seqlens: str = "none"  # none | int | tensor
    layout: str = "dense"  # dense | strided | paged
    page_size: int = 8
    path: str = "auto"
    num_splits: int | None = None
    clustered: bool = False
    threshold: float | None = None  # sparse_threshold for path="auto" (None: the default)


def make_inputs(c: Case, device: torch.device, seed: int = 0, poison: bool = True):
    """Random inputs for a case; excluded K/V rows and unused pages are NaN when ``poison``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hq = c.hkv * c.group

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(c.dtype).to(device)

    q = rnd(c.batch, hq, c.dim)
    if c.clustered:
        blocks = math.ceil(c.length / 16)
        vis = torch.rand(c.batch, c.hkv, blocks, generator=g) < c.density
        excl = ~vis.repeat_interleave(16, dim=-1)[..., : c.length]
    else:
        excl = torch.rand(c.batch, c.hkv, c.length, generator=g) >= c.density
    if c.seqlens == "int":
        seqlens: torch.Tensor | int | None = max(1, c.length - 3)
        lens = [seqlens] * c.batch
    elif c.seqlens == "tensor":
        lens = [int(x) for x in torch.randint(0, c.length + 1, (c.batch,), generator=g)]
        lens[0] = c.length
        if c.batch > 2:
            lens[1], lens[2] = 0, 1
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    else:
        seqlens = None
        lens = [c.length] * c.batch
    mask_bool = excl.to(device)

    block_table = None
    if c.layout == "paged":
        pages_per_seq = math.ceil(c.length / c.page_size)
        num_pages = c.batch * pages_per_seq + 3
        perm = torch.randperm(num_pages, generator=g)[: c.batch * pages_per_seq]
        block_table = perm.view(c.batch, pages_per_seq).to(torch.int32).to(device)
        k = rnd(num_pages, c.page_size, c.hkv, c.dim)
        v = rnd(num_pages, c.page_size, c.hkv, c.dim)
        length_alloc = pages_per_seq * c.page_size
        if length_alloc != c.length:  # the logical L is max_pages * page_size: pad the mask with "excluded"
            pad = torch.ones(c.batch, c.hkv, length_alloc - c.length, dtype=torch.bool, device=device)
            mask_bool = torch.cat([mask_bool, pad], dim=-1)
    elif c.layout == "strided":
        # [B, L, Hkv, D] buffer seen as [B, Hkv, L, D], plus a padded head dim: non-contiguous K/V.
        kb = rnd(c.batch, c.length, c.hkv, c.dim + 8)
        vb = rnd(c.batch, c.length, c.hkv, c.dim + 8)
        k = kb[..., : c.dim].transpose(1, 2)
        v = vb[..., : c.dim].transpose(1, 2)
    else:
        k = rnd(c.batch, c.hkv, c.length, c.dim)
        v = rnd(c.batch, c.hkv, c.length, c.dim)

    if poison:
        with torch.no_grad():
            for b in range(c.batch):
                for h in range(c.hkv):
                    bad = mask_bool[b, h].clone() if c.mask != "none" else torch.zeros_like(mask_bool[b, h])
                    bad[lens[b] :] = True
                    pos = bad.nonzero().flatten()
                    if c.layout == "paged":
                        assert block_table is not None
                        pages = block_table[b].long()[pos // c.page_size]
                        k[pages, pos % c.page_size, h] = float("nan")
                        v[pages, pos % c.page_size, h] = float("nan")
                    else:
                        k[b, h, pos] = float("nan")
                        v[b, h, pos] = float("nan")
    if c.mask == "none":
        mask = None
        ref_mask = None
    elif c.mask == "packed":
        mask = pack_mask(mask_bool)
        ref_mask = mask_bool
    else:
        mask = mask_bool
        ref_mask = mask_bool
    return q, k, v, mask, ref_mask, seqlens, block_table


def run_launcher(q, k, v, mask, seqlens, block_table, config: MaskedDecodeConfig, two_launch: bool):
    """The launcher on one merge path: ``two_launch`` (split kernel + merge kernel, the path of CUDA graph
    capture) or the one-launch path (the last split of each sequence and KV head merges)."""
    md = sys.modules["triton_masked_decode.masked_decode"]
    sig = md._validate_and_plan(
        q, k, v, mask, seqlens, block_table, None, None, None, None, None, config, cached=True
    )
    assert sig.plan.splits > 1, "both merge paths need several splits"
    seq_t = seqlens if isinstance(seqlens, torch.Tensor) else None
    flag = torch.zeros(1, dtype=torch.int32, device=q.device)
    return md._run(
        q, k, v, mask, seq_t, block_table, flag, md._NO_SCALES, sig.seqlen_const, sig.scale, sig.grid_len,
        sig.threshold, sig.plan, sig.static, two_launch=two_launch,
    )  # fmt: skip


def check_case(c: Case, device: torch.device, seed: int = 0, two_launch: bool | None = None, **knobs) -> None:
    """``knobs``: further :class:`MaskedDecodeConfig` fields. The dense tile is not autotuned unless
    ``autotune=True`` is passed (autotuning every variant would multiply the GPU tests' compile time; the
    candidates the autotuner may pick are tested one by one, and one test runs the autotuned launch).
    ``two_launch``: run the launcher on that merge path instead of calling :func:`masked_decode`."""
    q, k, v, mask, ref_mask, seqlens, block_table = make_inputs(c, device, seed)
    config = MaskedDecodeConfig(
        path=c.path,  # type: ignore[arg-type]
        num_splits=c.num_splits,
        sparse_threshold=c.threshold,
        **{"autotune": False, **knobs},
    )
    if two_launch is None:
        out, lse = masked_decode(q, k, v, mask, seqlens=seqlens, block_table=block_table, config=config)
    else:
        out, lse = run_launcher(q, k, v, mask, seqlens, block_table, config, two_launch)
    ref_out, ref_lse = masked_decode_ref(q, k, v, ref_mask, seqlens=seqlens, block_table=block_table)
    if two_launch is None and device.type == "cuda":
        # A signature's first eager call on a GPU takes the two-launch path (compiling it for graph
        # capture), the second compiles the one-launch kernel through Triton's JIT, later calls launch it
        # bound to the stream's workspace: check the first two, then the third below. Checked outputs are
        # filled with NaN before they are freed, so a later call given their memory must overwrite it.
        for _ in range(2):
            _check_result(c, q, out, lse, ref_out, ref_lse)
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            del out, lse
            out, lse = masked_decode(q, k, v, mask, seqlens=seqlens, block_table=block_table, config=config)
    _check_result(c, q, out, lse, ref_out, ref_lse)


def _check_result(c: Case, q, out, lse, ref_out, ref_lse) -> None:
    assert out.dtype == q.dtype
    assert out.shape == q.shape
    assert lse.dtype == torch.float32
    assert lse.shape == q.shape[:2]
    assert not torch.isnan(out).any(), "NaN in output"
    assert not torch.isnan(lse).any(), "NaN in lse"
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[c.dtype])
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "rows without visible positions must give lse = -inf"
    assert torch.all(out[empty] == 0)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], **LSE_TOL)


CPU_CASES = [
    pytest.param(Case(group=1, mask="none"), id="gqa1-nomask"),
    pytest.param(Case(group=4), id="gqa4-bool"),
    pytest.param(Case(group=8, mask="packed"), id="gqa8-packed"),
    pytest.param(Case(group=16, hkv=1, dim=16, length=20), id="gqa16-d16"),
    pytest.param(Case(group=4, path="dense"), id="gqa4-dense-path"),
    pytest.param(Case(group=4, path="sparse"), id="gqa4-sparse-path"),
    pytest.param(Case(group=4, path="dense", seqlens="tensor", batch=3), id="dense-path-seqlens"),
    pytest.param(Case(group=4, mask="packed", path="sparse", density=0.2), id="packed-sparse-path"),
    pytest.param(Case(density=0.15, clustered=True), id="clustered-auto-sparse"),
    pytest.param(
        Case(density=0.4, clustered=True, length=96, threshold=0.4, seqlens="tensor", batch=3),
        id="auto-mixed-dense-and-sparse-splits",
    ),
    pytest.param(Case(density=0.9, seqlens="tensor", batch=4), id="seqlens-0-1-tensor"),
    pytest.param(Case(seqlens="int"), id="seqlens-int"),
    pytest.param(Case(density=0.0), id="fully-masked"),
    pytest.param(Case(length=37, num_splits=3), id="odd-L-3-splits"),
    pytest.param(Case(length=33, num_splits=1), id="single-split-direct-write"),
    pytest.param(Case(layout="strided", group=4), id="noncontig-kv"),
    pytest.param(Case(layout="paged", page_size=8, seqlens="tensor", batch=3), id="paged-ps8-shuffled"),
    pytest.param(
        Case(layout="paged", page_size=32, length=70, mask="packed", path="sparse"), id="paged-ps32-packed"
    ),
    pytest.param(Case(dtype=torch.bfloat16, group=8), id="bf16-gqa8"),
    pytest.param(Case(dtype=torch.bfloat16, layout="paged", path="sparse"), id="bf16-paged-sparse"),
    pytest.param(Case(dim=40, group=2), id="d40-padded"),
]


@pytest.mark.parametrize("case", CPU_CASES)
def test_matches_reference_cpu(case: Case, cpu_device: torch.device) -> None:
    check_case(case, cpu_device)


TWO_LAUNCH_CASES = [
    pytest.param(Case(density=0.9, seqlens="tensor", batch=4), id="seqlens-0-1-tensor"),
    pytest.param(Case(length=37, num_splits=3, mask="packed"), id="odd-L-3-splits-packed"),
    pytest.param(Case(density=0.0), id="fully-masked"),
    pytest.param(Case(layout="paged", page_size=8, seqlens="tensor", batch=3), id="paged-ps8-shuffled"),
    pytest.param(Case(group=4, path="dense", seqlens="int"), id="dense-path-seqlens-int"),
    pytest.param(Case(dtype=torch.bfloat16, group=8, num_splits=4), id="bf16-gqa8"),
    pytest.param(Case(dim=40, group=2, num_splits=3), id="d40-padded"),
]


@pytest.mark.parametrize("two_launch", [True, False], ids=["two-launch", "one-launch"])
@pytest.mark.parametrize("case", TWO_LAUNCH_CASES)
def test_merge_paths_match_reference_cpu(case: Case, two_launch: bool, cpu_device: torch.device) -> None:
    """Both merge paths of several splits: the merge kernel (graph capture) and the in-kernel merge."""
    check_case(case, cpu_device, two_launch=two_launch)


def test_merge_paths_give_equal_results_cpu(cpu_device: torch.device) -> None:
    """The two merge paths read the same partials and apply the same rule: results agree to rounding,
    including rows with no visible position (out = 0, lse = -inf) and a NaN row (out = lse = NaN)."""
    c = Case(density=0.6, seqlens="tensor", batch=4, num_splits=4)
    q, k, v, mask, _, seqlens, _ = make_inputs(c, cpu_device, seed=11)
    q[3, 1] = float("nan")
    config = MaskedDecodeConfig(num_splits=4, autotune=False)
    one = run_launcher(q, k, v, mask, seqlens, None, config, two_launch=False)
    two = run_launcher(q, k, v, mask, seqlens, None, config, two_launch=True)
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=1e-5, equal_nan=True)
    assert torch.isnan(two[1][3, 1])
    assert torch.isinf(two[1][1]).all()


def test_q4d_return_lse_false_and_scale(cpu_device: torch.device) -> None:
    c = Case()
    q, k, v, mask, ref_mask, _, _ = make_inputs(c, cpu_device, seed=3)
    out = masked_decode(q.unsqueeze(2), k, v, mask, sm_scale=0.3, return_lse=False)
    assert isinstance(out, torch.Tensor)
    assert out.shape == (c.batch, c.hkv * c.group, 1, c.dim)
    ref, _ = masked_decode_ref(q, k, v, ref_mask, sm_scale=0.3)
    torch.testing.assert_close(out.squeeze(2).float(), ref.float(), **TOL[c.dtype])


def test_noncontiguous_bool_mask(cpu_device: torch.device) -> None:
    c = Case(mask="none")
    q, k, v, _, _, _, _ = make_inputs(c, cpu_device, seed=4, poison=False)
    excl = (torch.rand(c.batch, c.length, c.hkv) < 0.5).transpose(1, 2)  # strides (L*Hkv, 1, Hkv)
    out, lse = masked_decode(q, k, v, excl)
    ref, ref_lse = masked_decode_ref(q, k, v, excl)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[c.dtype])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


def check_compat(q, kf, vf, mf, valid: int, hkv: int, lse: torch.Tensor, out: torch.Tensor) -> None:
    """triton_masked_flash_decoding's (lse, out) against the reference on the buffers' leading elements."""
    bsz, _, _, dim = q.shape
    n = bsz * hkv * valid
    ref, ref_lse = masked_decode_ref(
        q.squeeze(2),
        kf[: n * dim].view(bsz, hkv, valid, dim),
        vf[: n * dim].view(bsz, hkv, valid, dim),
        mf[:n].view(bsz, hkv, valid),
    )
    torch.testing.assert_close(out.squeeze(2).float(), ref.float(), **TOL[torch.float16])
    torch.testing.assert_close(lse.squeeze(-1), ref_lse, **LSE_TOL)


def test_compat_entry(cpu_device: torch.device) -> None:
    bsz, hkv, group, dim, valid, alloc = 2, 2, 4, 32, 37, 64
    g = torch.Generator().manual_seed(5)
    q = torch.randn(bsz, hkv * group, 1, dim, generator=g).half()
    kf = torch.randn(bsz * hkv * alloc * dim, generator=g).half()
    vf = torch.randn(bsz * hkv * alloc * dim, generator=g).half()
    mf = torch.rand(bsz * hkv * alloc, generator=g) < 0.5
    lse, out = triton_masked_flash_decoding(q, kf, vf, mf, valid, hkv)
    assert lse.shape == (bsz, hkv * group, 1)
    assert lse.dtype == torch.float32
    assert out.shape == (bsz, hkv * group, 1, dim)
    assert out.dtype == torch.float16
    check_compat(q, kf, vf, mf, valid, hkv, lse, out)


def test_custom_op_fake_and_schema(cpu_device: torch.device) -> None:
    c = Case()
    q, k, v, mask, _, _, _ = make_inputs(c, cpu_device, seed=6, poison=False)
    md = sys.modules["triton_masked_decode.masked_decode"]
    plan, threshold = md._plan_launch(
        c.batch,
        c.hkv * c.group,
        c.hkv,
        c.dim,
        c.length,
        True,
        MaskedDecodeConfig(),
        md._device_facts(q.device),
    )
    args = (
        q,
        k,
        v,
        mask,
        None,
        None,
        torch.zeros(1, dtype=torch.int32),
        None,
        None,
        None,
        None,
        1.0,
        1.0,
        c.length,
        c.dim**-0.5,
        c.length,
        threshold,
        list(plan),
    )
    torch.library.opcheck(
        torch.ops.triton_masked_decode.masked_decode.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )


def test_signature_cache_keeps_validation(cpu_device: torch.device) -> None:
    """Validation and the plan are cached per signature; a call that differs in anything validation looks
    at (dtype, strides, the host-int length's type) is validated again."""
    md = sys.modules["triton_masked_decode.masked_decode"]
    c = Case()
    q, k, v, mask, ref_mask, _, _ = make_inputs(c, cpu_device, seed=7, poison=False)
    md._SIGNATURES.clear()
    for _ in range(3):
        out, _lse = masked_decode(q, k, v, mask, seqlens=17)
    assert len(md._SIGNATURES) == 1
    torch.testing.assert_close(
        out.float(), masked_decode_ref(q, k, v, ref_mask, seqlens=17)[0].float(), **TOL[c.dtype]
    )
    with pytest.raises(ValueError, match="k dtype"):
        masked_decode(q, k.bfloat16(), v, mask, seqlens=17)
    with pytest.raises(ValueError, match="bool"):
        masked_decode(q, k, v, mask, seqlens=True)  # type: ignore[arg-type]
    k_strided = k.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, head dim not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        masked_decode(q, k_strided, v, mask, seqlens=17)


def test_direct_launch_passes_every_kernel_argument(cpu_device: torch.device) -> None:
    """After a signature's first launch on a GPU, eager calls launch its compiled kernel directly: the
    launcher gets the grid, the stream, the kernel handle and its metadata, no hooks, then every kernel
    argument in signature order (constexprs included), as Triton's JIT passes them."""
    md = sys.modules["triton_masked_decode.masked_decode"]
    c = Case(num_splits=2)
    q, k, v, mask, _, _, _ = make_inputs(c, cpu_device, seed=8, poison=False)
    md._SIGNATURES.clear()
    masked_decode(q, k, v, mask)  # first call: Triton's JIT (a CPU entry keeps no launcher)
    (entry,) = md._SIGNATURES.values()
    assert entry.launcher is None
    calls: list[tuple] = []

    class Compiled:  # stands in for triton.compiler.CompiledKernel
        function, packed_metadata = "function", "packed_metadata"

        @property
        def run(self):
            return lambda *args: calls.append(args)

    st = entry.sig.static
    entry.launcher = md._direct_launcher(Compiled(), md._constexprs(st.meta, {}))
    masked_decode(q, k, v, mask)
    (args,) = calls
    assert args[:3] == st.grid
    assert args[4:9] == ("function", "packed_metadata", None, None, None)
    names = md._masked_decode_split_kernel.arg_names
    kernel_args = dict(zip(names, args[9:], strict=True))
    # FP fusion is an option of the JIT launch that compiled the kernel, not one of its arguments
    assert st.meta["enable_fp_fusion"] is True
    assert kernel_args["Q"] is q
    assert kernel_args["K"] is k
    assert kernel_args["Mask"].data_ptr() == mask.data_ptr()
    assert all(kernel_args[n] == val for n, val in st.meta.items() if n in kernel_args)
    md._SIGNATURES.clear()


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case(num_splits=3, seqlens="tensor"), id="bool-seqlens-3splits"),
        pytest.param(Case(batch=3, mask="packed", layout="paged", seqlens="tensor"), id="packed-paged"),
        pytest.param(Case(mask="none", num_splits=1), id="nomask-1split"),
        pytest.param(Case(num_splits=2), id="fp8-tensor-and-token-scales"),
    ],
)
def test_bound_launch_matches_reference_cpu(
    case: Case, cpu_device: torch.device, request: pytest.FixtureRequest
) -> None:
    """Eager calls after a signature's first launch pass the compiled kernel's launcher the pointers of the
    cached buffers (workspace, counters, error word, stand-ins) as ints: run with exactly those arguments,
    the kernel gives the reference result, every int is the pointer of the buffer its argument names, and
    a second call reuses the binding."""
    md = sys.modules["triton_masked_decode.masked_decode"]
    q, k, v, mask, ref_mask, seqlens, block_table = make_inputs(case, cpu_device, seed=31)
    scales: dict = {}
    if "fp8" in request.node.callspec.id:  # an FP8 cache with per-tensor scale tensors and per-token scales
        k, v = (k.float() / 0.5).to(torch.float8_e4m3fn), (v.float() / 0.25).to(torch.float8_e4m3fn)
        g = torch.Generator().manual_seed(32)
        scales = {
            "k_scale": torch.tensor(0.5),
            "v_scale": torch.tensor([0.25]),
            "k_token_scale": torch.rand(case.batch, case.hkv, case.length, generator=g) + 0.5,
            "v_token_scale": torch.rand(case.batch, case.hkv, case.length, generator=g) + 0.5,
        }
    config = MaskedDecodeConfig(num_splits=case.num_splits)
    md._SIGNATURES.clear()
    masked_decode(q, k, v, mask, seqlens=seqlens, block_table=block_table, config=config, **scales)
    (entry,) = md._SIGNATURES.values()
    st = entry.sig.static
    names = md._masked_decode_split_kernel.arg_names
    launches: list[dict] = []

    def buffers() -> dict[str, torch.Tensor]:
        """The cached tensor behind every argument the bound launch passes as an int."""
        (idx, o_part, l_part), counters, _ = md._scratch(
            cpu_device, -1, 0, st, capturing=False, counters=True
        )
        u8, i32, f32 = md._dummies(cpu_device)
        return {
            "Mask": u8, "Seqlens": i32, "BlockTable": i32, "Idx": i32 if idx is None else idx,
            "OutPart": f32 if o_part is None else o_part, "LsePart": f32 if l_part is None else l_part,
            "Counter": counters, "Err": md._error_flag(cpu_device), "KScale": f32, "VScale": f32,
            "KTokScale": f32, "VTokScale": f32,
        }  # fmt: skip

    def launch(g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter, leave, *args):
        assert (g0, g1, g2) == st.grid
        assert (launch_metadata, enter, leave) == (None, None, None)
        kw = dict(zip(names, args, strict=True))
        cached = buffers()
        for name, val in kw.items():
            if isinstance(val, int) and name in cached:
                assert val == cached[name].data_ptr(), name
                kw[name] = cached[name]
        kernel_names = {
            "k_scale": "KScale", "v_scale": "VScale", "k_token_scale": "KTokScale", "v_token_scale": "VTokScale",
        }  # fmt: skip
        for name, tensor in scales.items():  # the call's own scale tensors are passed as they are
            assert kw[kernel_names[name]] is tensor, name
        if kw["Mask"].dtype == torch.bool:
            kw["Mask"] = kw["Mask"].view(torch.uint8)  # as the first launch passed it
        launches.append(kw)
        consts = {n: kw.pop(n) for n in list(kw) if n in st.meta}
        md._masked_decode_split_kernel[st.grid](**kw, **consts)

    class Compiled:  # stands in for triton.compiler.CompiledKernel: runs the kernel with what it is given
        function, packed_metadata = "function", "packed_metadata"
        run = staticmethod(launch)

    entry.launcher = md._direct_launcher(Compiled(), md._constexprs(st.meta, {}))
    ref_out, ref_lse = masked_decode_ref(
        q, k, v, ref_mask, seqlens=seqlens, block_table=block_table, **scales
    )
    for _ in range(2):
        out, lse = masked_decode(
            q, k, v, mask, seqlens=seqlens, block_table=block_table, config=config, **scales
        )
        _check_result(case, q, out, lse, ref_out, ref_lse)
        assert out.stride() == (out.shape[1] * out.shape[2], out.shape[2], 1)
    assert len(launches) == 2
    assert entry.bound is not None
    assert launches[0]["Q"] is q
    assert launches[0]["K"] is k
    assert launches[0]["V"] is v
    md._SIGNATURES.clear()


def test_captured_two_launch_allocates_no_counters_cpu(
    cpu_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call captured into a CUDA graph (split kernel + merge kernel) allocates no merge counters: zeroing
    them would be one more node in every replay. The in-kernel merge still gets zeroed counters."""
    md = sys.modules["triton_masked_decode.masked_decode"]
    made: list[int] = []
    workspace = md._Workspace

    def recording(nbytes: int, ncounters: int, device: torch.device):
        made.append(ncounters)
        return workspace(nbytes, ncounters, device)

    monkeypatch.setattr(md, "_Workspace", recording)
    c = Case(batch=2, length=70, dim=32, num_splits=3)
    q, k, v, mask, ref_mask, _, _ = make_inputs(c, cpu_device, seed=33)
    config = MaskedDecodeConfig(num_splits=3)
    sig = md._validate_and_plan(q, k, v, mask, None, None, None, None, None, None, None, config, cached=True)
    flag = torch.zeros(1, dtype=torch.int32)
    ref_out, ref_lse = masked_decode_ref(q, k, v, ref_mask)
    for two_launch, want in ((True, 0), (False, c.batch * c.hkv)):
        out, lse = md._run(
            q, k, v, mask, None, None, flag, md._NO_SCALES, sig.seqlen_const, sig.scale, sig.grid_len,
            sig.threshold, sig.plan, sig.static, two_launch=two_launch, capturing=True,
        )  # fmt: skip
        assert made[-1] == want
        _check_result(c, q, out, lse, ref_out, ref_lse)


def test_every_launch_asks_for_fp_fusion_cpu(
    cpu_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every kernel launch passes ``enable_fp_fusion=True`` (fused multiply-add, as the kernels are tuned and
    tested, whatever Triton's default): the split kernel on both merge paths, autotuned or not, and both
    merge kernels. The launches are recorded, not run."""
    md = sys.modules["triton_masked_decode.masked_decode"]
    merge = sys.modules["triton_masked_decode.merge"]
    launches: list[tuple[str, dict]] = []

    class Recorded:  # a kernel whose launches ``kernel[grid](...)`` are recorded (every Triton line launches so)
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: launches.append((self.name, kwargs))

    for module, name in (
        (md, "_masked_decode_split_kernel"),
        (md, "_merge_splits_kernel"),
        (merge, "_merge_two_kernel"),
    ):
        monkeypatch.setattr(module, name, Recorded(name))

    class Tuned:  # stands in for the autotuner (built from the GPU driver), which forwards launch options
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(("autotuned", kwargs))

    monkeypatch.setattr(md, "_split_kernel_tuned", Tuned)
    c = Case(batch=2, length=70, dim=32, num_splits=3)
    q, k, v, mask, _, _, _ = make_inputs(c, cpu_device, seed=34)
    sig = md._validate_and_plan(
        q, k, v, mask, None, None, None, None, None, None, None, MaskedDecodeConfig(num_splits=3), cached=True
    )
    flag = torch.zeros(1, dtype=torch.int32)
    for autotune in (0, 1):
        for two_launch in (True, False):
            md._run(
                q, k, v, mask, None, None, flag, md._NO_SCALES, sig.seqlen_const, sig.scale, sig.grid_len,
                sig.threshold, sig.plan._replace(autotune=autotune), sig.static, two_launch=two_launch,
            )  # fmt: skip
    o, lse = torch.zeros(2, 4, 32, dtype=torch.float16), torch.zeros(2, 4)
    merge_attention_states(o, lse, o, lse)
    split, merge_splits = "_masked_decode_split_kernel", "_merge_splits_kernel"
    want = [split, merge_splits, split, "autotuned", merge_splits, "autotuned", "_merge_two_kernel"]
    assert [name for name, _ in launches] == want
    assert all(kw.get("enable_fp_fusion") is True for _, kw in launches), launches


# ------------------------------------------------------------------ validation (no kernel launch needed)


def _valid(device: torch.device):
    q = torch.randn(2, 8, 32, dtype=torch.float16, device=device)
    k = torch.randn(2, 2, 40, 32, dtype=torch.float16, device=device)
    return q, k, k.clone()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        pytest.param(lambda q, k, v: (q.float(), k, v, {}), "float16 or bfloat16", id="q-dtype"),
        pytest.param(lambda q, k, v: (q, k.bfloat16(), v, {}), "k dtype", id="k-dtype"),
        pytest.param(lambda q, k, v: (q[:, :7], k, v, {}), "multiple of KV heads", id="gqa-ratio"),
        pytest.param(lambda q, k, v: (q, k, v[:, :, :20], {}), "same shape", id="kv-shape"),
        pytest.param(
            lambda q, k, v: (q, k.transpose(2, 3).contiguous().transpose(2, 3), v, {}),
            "contiguous",
            id="kv-stride",
        ),
        pytest.param(
            lambda q, k, v: (q, k, v, {"mask": torch.zeros(2, 2, 39, dtype=torch.bool)}),
            "shape",
            id="mask-shape",
        ),
        pytest.param(
            lambda q, k, v: (q, k, v, {"mask": torch.zeros(2, 2, 40, dtype=torch.int32)}),
            "bit-packed",
            id="mask-dtype",
        ),
        pytest.param(
            lambda q, k, v: (q, k, v, {"mask": torch.zeros(2, 2, 40, dtype=torch.uint8)}),
            r"ceil\(L/8\)|shape",
            id="packed-shape",
        ),
        pytest.param(lambda q, k, v: (q, k, v, {"seqlens": 41}), "seqlens", id="seqlens-int-gt-L"),
        pytest.param(
            lambda q, k, v: (q, k, v, {"seqlens": torch.tensor([3, 41], dtype=torch.int32)}),
            "seqlens values",
            id="seqlens-tensor-gt-L",
        ),
        pytest.param(
            lambda q, k, v: (q, k, v, {"seqlens": torch.tensor([3, 4])}), "int32", id="seqlens-dtype"
        ),
    ],
)
def test_invalid_inputs(mutate, match, cpu_device: torch.device) -> None:
    q, k, v = _valid(cpu_device)
    q2, k2, v2, kw = mutate(q, k, v)
    mask = kw.pop("mask", None)
    with pytest.raises(ValueError, match=match):
        masked_decode(q2, k2, v2, mask, **kw)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        pytest.param({"path": "fast"}, "path", id="path"),
        pytest.param({"sparse_threshold": 1.5}, "sparse_threshold", id="threshold"),
        pytest.param({"num_splits": 0}, "num_splits", id="num-splits"),
        pytest.param({"block_n": 48}, "block_n", id="block-n-not-pow2"),
        pytest.param({"merge_splits": 3}, "merge_splits", id="merge-splits-not-pow2"),
    ],
)
def test_invalid_config(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MaskedDecodeConfig(**fields)


def test_config_must_be_the_config_type(cpu_device: torch.device) -> None:
    q, k, v = _valid(cpu_device)
    with pytest.raises(TypeError, match="config"):
        masked_decode(q, k, v, config={"path": "dense"})  # type: ignore[arg-type]


def test_invalid_block_table(cpu_device: torch.device) -> None:
    q = torch.randn(2, 8, 32, dtype=torch.float16)
    k = torch.randn(6, 16, 2, 32, dtype=torch.float16)
    bt = torch.tensor([[0, 1, 2], [3, 4, 6]], dtype=torch.int32)  # page 6 does not exist
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = 6 is out of range"):
        masked_decode(q, k, k, None, block_table=bt)
    # Unused entries (past seqlens) may hold anything, e.g. -1 padding.
    bt_pad = torch.tensor([[0, 1, -1], [3, 4, -1]], dtype=torch.int32)
    out, _ = masked_decode(
        q, k, k, None, block_table=bt_pad, seqlens=torch.tensor([30, 32], dtype=torch.int32)
    )
    assert not torch.isnan(out).any()
    with pytest.raises(ValueError, match="int32"):
        masked_decode(q, k, k, None, block_table=bt.long())


@pytest.mark.parametrize(
    ("batch", "hkv", "length"),
    [
        pytest.param(1, 8, 65536, id="B1-Hkv8-L64K"),
        pytest.param(8, 8, 65536, id="B8-Hkv8-L64K"),
        pytest.param(64, 8, 32768, id="B64-Hkv8-L32K"),
        pytest.param(1, 1, 100, id="B1-Hkv1-L100"),
        pytest.param(3, 2, 0, id="L0"),
    ],
)
def test_split_heuristic(batch: int, hkv: int, length: int) -> None:
    sms, block_n = 132, 64
    splits, chunk = choose_num_splits(batch, hkv, length, block_n, sms)
    assert chunk % block_n == 0
    assert splits >= 1
    assert splits * chunk >= length
    assert (splits - 1) * chunk < max(length, 1)
    assert chunk <= 4096
    if length >= 4 * sms * block_n // (batch * hkv):
        assert batch * hkv * splits >= 2 * sms, "long sequences must fill the GPU"


def one_wave(batch: int, hkv: int, length: int, masked: bool, sms: int) -> bool:
    """The launch class masked_decode gives a shape (Hq = 4 Hkv, D = 128) on a device with ``sms`` SMs."""
    md = sys.modules["triton_masked_decode.masked_decode"]
    dev = md._Device(sms, "default")
    plan, _ = md._plan_launch(batch, 4 * hkv, hkv, 128, length, masked, MaskedDecodeConfig(), dev)
    return bool(plan.one_wave)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        pytest.param((0, 8, 100, 64, 132), "batch", id="batch0"),
        pytest.param((1, 0, 100, 64, 132), "num_kv_heads", id="hkv0"),
        pytest.param((1, 8, -1, 64, 132), "max_len", id="negative-L"),
        pytest.param((1, 8, 100, 64, 0), "num_sms", id="sms0"),
    ],
)
def test_split_heuristic_rejects_bad_arguments(args: tuple, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        choose_num_splits(*args)


def test_launch_class() -> None:
    """Batch 1 at Hq 32, Hkv 8, L 64K fills the GPU through splits (one wave); batch 8 needs several waves."""
    assert one_wave(1, 8, 65536, True, 132)
    assert one_wave(2, 8, 65536, True, 132)
    assert not one_wave(8, 8, 65536, True, 132)
    assert not one_wave(64, 8, 32768, False, 132)
    tuned = tuned_defaults()
    assert all(0.0 <= c.sparse_threshold <= 1.0 for c in (tuned.one_wave, tuned.multi_wave))


# ------------------------------------------------------------------ GPU (real sizes)

GPU_CASES = [
    pytest.param(Case(batch=1, hkv=8, group=4, length=65536, dim=128), id="B1-Hq32-Hkv8-L64K-d128-bool"),
    pytest.param(Case(batch=4, hkv=8, group=4, length=8192, dim=128, mask="packed"), id="B4-L8K-packed"),
    pytest.param(Case(batch=2, hkv=4, group=1, length=4096, dim=64), id="gqa1-d64"),
    pytest.param(Case(batch=2, hkv=2, group=8, length=5000, dim=256), id="gqa8-d256-oddL"),
    pytest.param(Case(batch=2, hkv=2, group=16, length=3000, dim=128, mask="none"), id="gqa16-nomask"),
    pytest.param(Case(batch=2, hkv=4, group=4, length=3000, dim=96), id="d96"),
    pytest.param(Case(batch=3, hkv=8, group=4, length=16384, dim=128, density=0.1), id="sparse10-auto"),
    pytest.param(
        Case(batch=3, hkv=8, group=4, length=16384, density=0.25, clustered=True, dim=128), id="clustered25"
    ),
    pytest.param(
        Case(batch=2, hkv=8, group=4, length=16384, density=0.3, clustered=True, dim=128, threshold=0.3),
        id="auto-threshold-0.3-mixed",
    ),
    pytest.param(Case(batch=3, hkv=8, group=4, length=8192, dim=128, path="sparse"), id="forced-sparse"),
    pytest.param(
        Case(batch=3, hkv=8, group=4, length=8192, dim=128, path="dense", density=0.1), id="forced-dense"
    ),
    pytest.param(Case(batch=6, hkv=8, group=4, length=9000, dim=128, seqlens="tensor"), id="seqlens-tensor"),
    pytest.param(Case(batch=4, hkv=8, group=4, length=8192, dim=128, layout="strided"), id="noncontig"),
    pytest.param(
        Case(batch=4, hkv=8, group=4, length=8000, dim=128, layout="paged", page_size=16, seqlens="tensor"),
        id="paged16",
    ),
    pytest.param(
        Case(batch=4, hkv=8, group=4, length=8000, dim=128, layout="paged", page_size=128, mask="packed"),
        id="paged128-packed",
    ),
    pytest.param(Case(batch=2, hkv=8, group=4, length=8192, dim=128, dtype=torch.bfloat16), id="bf16"),
    pytest.param(
        Case(batch=2, hkv=8, group=4, length=8192, dim=128, dtype=torch.bfloat16, path="sparse", density=0.1),
        id="bf16-sparse",
    ),
    pytest.param(Case(batch=2, hkv=8, group=4, length=4096, dim=128, density=0.0), id="fully-masked"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_matches_reference_gpu(case: Case, cuda_device: torch.device) -> None:
    """Every excluded K/V row (and every position past seqlens) holds NaN: results must stay exact."""
    check_case(case, cuda_device, seed=11)


MULTI_WAVE_CASES = [  # 16 sequences x 8 KV heads x 16K: more programs than fit on the GPU at once
    pytest.param(
        Case(
            batch=16,
            hkv=8,
            group=4,
            length=16384,
            dim=128,
            density=0.25,
            clustered=True,
            seqlens="tensor",
            layout="paged",
            page_size=64,
            mask="packed",
        ),
        id="B16-paged64-packed-clustered25-seqlens",
    ),
    pytest.param(
        Case(batch=16, hkv=8, group=4, length=16384, dim=128, density=0.1, dtype=torch.bfloat16),
        id="B16-bf16-random10",
    ),
    pytest.param(Case(batch=16, hkv=8, group=4, length=16384, dim=128, density=0.7), id="B16-random70"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MULTI_WAVE_CASES)
def test_multi_wave_launches_gpu(case: Case, cuda_device: torch.device) -> None:
    """The multi-wave defaults (split length with a mask, gather tile) on NaN-poisoned caches."""
    sms = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    assert not one_wave(case.batch, case.hkv, case.length, True, sms)
    check_case(case, cuda_device, seed=14)


def _candidate_params():
    md = sys.modules["triton_masked_decode.masked_decode"]
    return [
        pytest.param(d, cand, id=f"d{d}-BN{cand[0]}-w{cand[1]}-s{cand[2]}")
        for d in (64, 128, 256)
        for cand in md._CANDIDATES[d]
    ]


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "cand"), _candidate_params())
def test_every_autotune_candidate(dim: int, cand: tuple[int, int, int], cuda_device: torch.device) -> None:
    """Each tile the autotuner may pick computes the same function (dense and sparse splits in one call)."""
    bn, nw, ns = cand
    for dens, seed in ((0.15, 21), (0.7, 22)):
        case = Case(batch=3, hkv=4, group=4, length=3000, dim=dim, density=dens, seqlens="tensor")
        check_case(case, cuda_device, seed=seed, block_n=bn, num_warps=nw, num_stages=ns)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("block_ns", "stages"),
    [
        pytest.param(bn, ns, id=f"NS{bn}-s{ns}")
        for bn, ns in ((16, 4), (32, 2), (32, 3), (32, 4), (64, 2), (64, 3))
    ],
)
def test_sparse_gather_tiles(block_ns: int, stages: int, cuda_device: torch.device) -> None:
    """Each sparse gather tile / pipelining depth (the tuning sweep's candidates) computes the same function."""
    for dens, clustered, seed in ((0.1, False, 31), (0.25, True, 32)):
        case = Case(
            batch=2, hkv=8, group=4, length=6000, dim=128, density=dens, clustered=clustered, seqlens="tensor"
        )
        check_case(case, cuda_device, seed=seed, block_ns=block_ns, sparse_stages=stages)


@pytest.mark.parametrize(
    ("case", "merge_splits"),
    [
        pytest.param(Case(batch=3, length=70, dim=40, seqlens="tensor", num_splits=3), 1, id="S3-step1"),
        pytest.param(Case(batch=2, hkv=1, group=3, length=300, dim=24, num_splits=19), 4, id="G3-S19-step4"),
        pytest.param(Case(batch=2, hkv=2, group=2, length=300, dim=16, num_splits=19), 32, id="S19-one-step"),
    ],
)
def test_in_kernel_merge_cpu(case: Case, merge_splits: int, cpu_device: torch.device) -> None:
    """The last split of each (sequence, KV head) merges the partials: in one step or several (online
    rescaling across steps), for a group that is not a power of two, with lengths that leave splits idle."""
    check_case(case, cpu_device, seed=41, merge_splits=merge_splits)


def test_merge_counters_reset_cpu(cpu_device: torch.device) -> None:
    """The merge's arrival counters are back at zero after a launch, so the next call merges again."""
    md = sys.modules["triton_masked_decode.masked_decode"]
    c = Case(batch=3, length=70, dim=32, seqlens="tensor", num_splits=4)
    for seed in (45, 46):
        check_case(c, cpu_device, seed=seed)
    assert all(int(ws.counters.abs().sum()) == 0 for ws in md._WORKSPACES.values())


@pytest.mark.gpu
@pytest.mark.parametrize("merge_splits", [pytest.param(1, id="step1"), pytest.param(64, id="step64")])
def test_in_kernel_merge_gpu(merge_splits: int, cuda_device: torch.device) -> None:
    """Merge steps other than the default, on NaN-poisoned caches with idle splits (short seqlens)."""
    for dim, group, seed in ((128, 4, 42), (96, 3, 43)):
        check_case(
            Case(batch=3, hkv=8, group=group, length=6000, dim=dim, seqlens="tensor"),
            cuda_device,
            seed=seed,
            merge_splits=merge_splits,
        )


@pytest.mark.gpu
def test_autotuned_launch(cuda_device: torch.device) -> None:
    # A threshold below 1 keeps the dense loop in the kernel, so its tile is autotuned (with the default
    # threshold 1.0 every split is sparse and the launch is not autotuned; the next call checks that too).
    check_case(
        Case(batch=2, hkv=8, group=4, length=8192, dim=128, density=0.3, threshold=0.5),
        cuda_device,
        seed=23,
        autotune=True,
    )
    check_case(
        Case(batch=2, hkv=8, group=4, length=8192, dim=128, density=0.3), cuda_device, seed=24, autotune=True
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_splits", [pytest.param(None, id="default-splits"), pytest.param(64, id="64-splits")]
)
def test_cuda_graph_replay_with_changing_seqlens(num_splits: int | None, cuda_device: torch.device) -> None:
    """Replays with new lengths (a captured call takes the split kernel + merge kernel path)."""
    config = MaskedDecodeConfig(num_splits=num_splits, autotune=False)
    c = Case(batch=4, hkv=8, group=4, length=8192, dim=128, seqlens="tensor")
    q, k, v, mask, ref_mask, seqlens, _ = make_inputs(c, cuda_device, seed=12, poison=False)
    assert isinstance(seqlens, torch.Tensor)
    static_seqlens = seqlens.clone()
    masked_decode(q, k, v, mask, seqlens=static_seqlens, config=config)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = masked_decode(q, k, v, mask, seqlens=static_seqlens, config=config)
    for trial, lens in enumerate(([8192, 0, 1, 5000], [17, 8192, 4096, 3], [100, 200, 8191, 0])):
        static_seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = masked_decode_ref(q, k, v, ref_mask, seqlens=static_seqlens)
        torch.testing.assert_close(
            out.float(), ref.float(), **TOL[c.dtype], msg=lambda m, t=trial: f"replay {t}: {m}"
        )
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        torch.testing.assert_close(lse[fin], ref_lse[fin], **LSE_TOL)


@pytest.mark.gpu
def test_captured_call_is_two_kernels_gpu(cuda_device: torch.device, tmp_path) -> None:
    """A captured call with several splits replays the split kernel and the merge kernel, nothing else (no
    node zeroing merge counters the captured launches do not use)."""
    c = Case(batch=1, hkv=8, group=4, length=65536, dim=128)
    q, k, v, mask, _, _, _ = make_inputs(c, cuda_device, seed=13, poison=False)
    masked_decode(q, k, v, mask)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # (else capture_end frees the graph before the dump)
    graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        masked_decode(q, k, v, mask)
    path = tmp_path / "graph.dot"
    graph.debug_dump(str(path))
    dot = path.read_text()
    assert "_masked_decode_split_kernel" in dot, dot[:2000]
    assert "_merge_splits_kernel" in dot, dot[:2000]
    assert "FillFunctor" not in dot, dot[:4000]
    assert "MEMSET" not in dot.upper(), dot[:4000]


@pytest.mark.gpu
def test_compat_entry_gpu(cuda_device: torch.device) -> None:
    bsz, hkv, hq, dim, alloc = 2, 8, 32, 128, 16384
    valid = alloc // 2
    q = torch.randn(bsz, hq, 1, dim, dtype=torch.float16, device=cuda_device)
    kf = torch.randn(bsz * hkv * alloc * dim, dtype=torch.float16, device=cuda_device)
    vf = torch.randn_like(kf)
    mf = torch.randint(0, 2, (bsz * hkv * alloc,), dtype=torch.bool, device=cuda_device)
    lse, out = triton_masked_flash_decoding(q, kf, vf, mf, valid, hkv)
    check_compat(q, kf, vf, mf, valid, hkv, lse, out)


def test_empty_batch(cpu_device: torch.device) -> None:
    q = torch.randn(0, 8, 32, dtype=torch.float16)
    k = torch.randn(0, 2, 40, 32, dtype=torch.float16)
    out, lse = masked_decode(q, k, k, None)
    assert out.shape == (0, 8, 32)
    assert lse.shape == (0, 8)


# ------------------------------------------------------------------ property test over the public API


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    batch=st.integers(0, 3),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 3, 8]),
    dim=st.sampled_from([16, 24, 40]),
    length=st.integers(1, 40),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    mask_kind=st.sampled_from(["none", "bool", "packed"]),
    layout=st.sampled_from(["dense", "strided", "paged"]),
    seqlens_kind=st.sampled_from(["none", "int", "tensor"]),
    path=st.sampled_from(["auto", "dense", "sparse"]),
)
def test_fuzz_matches_reference(
    data, batch, hkv, group, dim, length, dtype, mask_kind, layout, seqlens_kind, path, cpu_device
) -> None:
    """Random shapes, layouts, masks, lengths and loop choices, with NaN in every excluded row and huge or
    non-finite values in some visible ones: the result is the reference's (NaN where it has NaN), and
    rows the reference finds finite are finite."""
    c = Case(
        batch=batch, hkv=hkv, group=group, dim=dim, length=length, dtype=dtype, mask=mask_kind,
        density=data.draw(st.sampled_from([0.0, 0.3, 1.0])), layout=layout, page_size=8,
        seqlens=seqlens_kind if batch else "none", path=path,
    )  # fmt: skip
    q, k, v, mask, ref_mask, seqlens, block_table = make_inputs(
        c, cpu_device, seed=data.draw(st.integers(0, 999))
    )
    scale = data.draw(st.sampled_from([1.0, 100.0]))
    q = q * scale  # large logits: the online softmax must stay finite
    if batch and data.draw(st.booleans()):
        q[0, 0, 0] = data.draw(st.sampled_from([float("nan"), float("inf")]))
    out, lse = masked_decode(
        q, k, v, mask, seqlens=seqlens, block_table=block_table, config=MaskedDecodeConfig(path=path)
    )
    ref, ref_lse = masked_decode_ref(q, k, v, ref_mask, seqlens=seqlens, block_table=block_table)
    assert out.shape == q.shape
    assert lse.shape == q.shape[:2]
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype], equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, equal_nan=True)
    assert torch.isfinite(out[torch.isfinite(ref_lse) | torch.isneginf(ref_lse)]).all()
