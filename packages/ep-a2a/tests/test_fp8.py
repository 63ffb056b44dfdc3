"""FP8 dispatch in DeepEP's format (per-128-channel float32 scales) on the torch backend, over gloo, and the
reference quantizer."""

from __future__ import annotations

import re

import pytest
import torch

from ep_a2a.reference import FP8_BLOCK, dequantize_fp8, quantize_fp8
from ep_a2a.testing import run_local

H, K, E_PER_RANK, T = 256, 3, 2, 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantizer_matches_deepep_scaling(dtype: torch.dtype) -> None:
    """Each 128-channel block: scale = max(amax, 1e-4) / 448 as torch computes it on CUDA (amax times
    float32(1 / 448)), bytes as DeepEP's ``per_token_cast_to_fp8`` computes them, its largest element
    becomes +-448, and the dequantized rows are within FP8 e4m3's rounding (3 mantissa bits) of the
    input."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 3 * FP8_BLOCK, generator=gen) * torch.logspace(-3, 3, 5)[:, None]).to(dtype)
    x[1, FP8_BLOCK : 2 * FP8_BLOCK] = 0  # an all-zero block: the 1e-4 floor keeps the scale finite
    q, s = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn
    assert q.shape == x.shape
    assert s.dtype == torch.float32
    assert s.shape == (5, 3)
    amax = x.float().view(5, 3, FP8_BLOCK).abs().amax(2).clamp(min=1e-4)
    torch.testing.assert_close(s, amax * torch.tensor(1 / 448.0, dtype=torch.float32), rtol=0, atol=0)
    # (s differs from amax / 448 divided exactly in the last bit of some scales; the bytes are DeepEP's)
    deepep = (x.view(5, 3, FP8_BLOCK) * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(5, -1)
    assert torch.equal(q.view(torch.uint8), deepep.view(torch.uint8))
    peak = q.float().view(5, 3, FP8_BLOCK).abs().amax(2)
    assert torch.equal(peak[amax > 1e-4], torch.full_like(peak[amax > 1e-4], 448.0))
    err = (dequantize_fp8(q, s) - x.float()).abs()
    bound = x.float().abs() * 2.0**-4 + s.repeat_interleave(FP8_BLOCK, 1) * 2.0**-9
    assert bool((err <= bound).all()), float((err - bound).max())
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_fp8(torch.zeros(2, 100))


def test_quantizer_inf_nan_policy() -> None:
    """A block with an infinity: scale inf, the infinity NaN, the rest zeros of their sign; a block with a
    NaN: NaN scale and bytes; NaN in one encoding each (0x7F, 0x7FC00000)."""
    x = torch.ones(1, 3 * FP8_BLOCK)
    x[0, 1], x[0, 2] = float("-inf"), -3.0
    x[0, FP8_BLOCK + 4] = -float("nan")
    q, s = quantize_fp8(x)
    b = q.view(torch.uint8)[0]
    assert s[0, 0] == float("inf")
    assert (int(b[1]), int(b[2]), int(b[0])) == (0x7F, 0x80, 0x00)
    assert bool((b[FP8_BLOCK : 2 * FP8_BLOCK] == 0x7F).all())
    assert int(s.view(torch.int32)[0, 1]) == 0x7FC00000
    assert bool((b[2 * FP8_BLOCK :] == 0x7E).all())  # (448: the block maximum)


def _bytes(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.cat([q.view(torch.uint8), s.view(torch.uint8)], 1)


def run_fp8(rank: int, world: int) -> list[str]:
    """FP8 rows and scales arrive bit for bit in the layer's row order; quantize-on-send equals the
    reference quantizer; combine takes the layer's bf16 rows; bad FP8 arguments name themselves."""
    from ep_a2a import EPLayer
    from ep_a2a.reference import combine_ref, dispatch_ref

    gen = torch.Generator().manual_seed(11)
    experts = E_PER_RANK * world
    xs = [(torch.randn(T - r, H, generator=gen) * 10).to(torch.bfloat16) for r in range(world)]
    ids = [torch.randint(-1, experts, (T - r, K), generator=gen, dtype=torch.int32) for r in range(world)]
    ws = [torch.rand(T - r, K, generator=gen) for r in range(world)]
    qs = [quantize_fp8(x) for x in xs]
    received, scatter = dispatch_ref([_bytes(q, s) for q, s in qs], ids, ws, num_tot_experts=experts)
    mine = received[rank]
    seen = []
    with EPLayer(
        None, max_tokens=T, hidden=H, topk=K, num_experts=experts, backend="torch", timeout_s=30
    ) as layer:
        (rows, scales), w, desc = layer.dispatch(qs[rank], ids[rank], ws[rank])
        assert rows.dtype == torch.float8_e4m3fn
        assert scales.dtype == torch.float32
        assert torch.equal(_bytes(rows, scales), mine.output)
        assert torch.equal(w, mine.weights)
        assert torch.equal(desc.recv_expert_indices.long(), mine.local_expert)
        seen.append("fp8")
        (rows2, scales2), _, desc2 = layer.dispatch(xs[rank], ids[rank], ws[rank], fp8=True)
        assert torch.equal(_bytes(rows2, scales2), mine.output)
        seen.append("quantize-on-send")
        # combine: the expert's bf16 outputs, summed as for a bf16 dispatch
        ys = [
            (dequantize_fp8(r.output[:, :H].view(torch.float8_e4m3fn), r.output[:, H:].contiguous().view(torch.float32))
             * (r.local_expert[:, None] + 1)).to(torch.bfloat16)
            for r in received
        ]  # fmt: skip
        out = layer.combine(ys[rank], desc2)
        want = combine_ref(ys, ids, scatter, num_tot_experts=experts)[rank]
        assert torch.equal(out, want)
        seen.append("combine")
        q, s = qs[rank]
        for args, exc, match in (
            ((q, s, s), ValueError, "must be (x_fp8, scales)"),
            ((q.view(torch.uint8), s), TypeError, "input must have dtype torch.float8_e4m3fn"),
            ((q, s[:, :1]), ValueError, "scales must have shape"),
            ((q, s.double()), TypeError, "scales must have dtype torch.float32"),
        ):
            with pytest.raises(exc, match=re.escape(match)):
                layer.dispatch(args, ids[rank])
        seen.append("errors")
    with (
        EPLayer(
            None, max_tokens=T, hidden=64, topk=K, num_experts=experts, backend="torch", timeout_s=30
        ) as narrow,
        pytest.raises(ValueError, match="multiple of 128"),
    ):
        narrow.dispatch(torch.zeros(2, 64, dtype=torch.bfloat16), ids[rank][:2], fp8=True)
    # a layer of FP8 rows: the same bytes; quantize-on-send from bf16 / fp16 / fp32 rows
    with EPLayer(
        None, max_tokens=T, hidden=H, topk=K, num_experts=experts, dtype=torch.float8_e4m3fn,
        backend="torch", timeout_s=30,
    ) as fp8_layer:  # fmt: skip
        (rows, scales), w, desc = fp8_layer.dispatch(qs[rank], ids[rank], ws[rank])
        assert torch.equal(_bytes(rows, scales), mine.output)
        for dt in (torch.bfloat16, torch.float32):
            (rows, scales), _, desc = fp8_layer.dispatch(xs[rank].to(dt), ids[rank], ws[rank], fp8=True)
            assert torch.equal(_bytes(rows, scales), mine.output)  # (bf16 rows, exact in float32)
        assert torch.equal(fp8_layer.combine(ys[rank], desc), want)
        with pytest.raises(TypeError, match=re.escape("input must have dtype torch.float8_e4m3fn")):
            fp8_layer.dispatch(xs[rank], ids[rank])  # bf16 rows without fp8=True
        with pytest.raises(TypeError, match="input must have a dtype in"):
            fp8_layer.dispatch(qs[rank][0], ids[rank], fp8=True)  # FP8 rows to quantize
        seen.append("fp8-layer")
    # a layer of another one-byte dtype: refused by name, whichever form the FP8 rows take
    with EPLayer(
        None, max_tokens=T, hidden=H, topk=K, num_experts=experts, dtype=torch.float8_e5m2,
        backend="torch", timeout_s=30,
    ) as e5m2_layer:  # fmt: skip
        for args, kw in (((qs[rank], ids[rank]), {}), ((xs[rank], ids[rank]), {"fp8": True})):
            with pytest.raises(ValueError, match=re.escape("got dtype=torch.float8_e5m2")):
                e5m2_layer.dispatch(*args, **kw)
        seen.append("one-byte-layer")
    with pytest.raises(ValueError, match="hidden to be a multiple of 128, got hidden=64"):
        EPLayer(None, max_tokens=T, hidden=64, topk=K, num_experts=experts, dtype=torch.float8_e4m3fn,
                backend="torch")  # fmt: skip
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3], ids=["gloo-2", "gloo-3"])
def test_fp8_dispatch_moves_rows_and_scales_bit_for_bit(world: int) -> None:
    got = run_local(f"{__file__}:run_fp8", world, timeout_s=110)
    assert got == [["fp8", "quantize-on-send", "combine", "errors", "fp8-layer", "one-byte-layer"]] * world


@pytest.mark.parametrize("hidden", [128, 384, 512, 7168])
def test_packed_fp8_rows(hidden: int) -> None:
    """The Triton backend's packed FP8 row: FP8 bytes, scale bytes, padding to 16 bytes; unpacked as
    views (no copy) that give the bytes back. Heap rows: a bf16 layer's hold it, an FP8 layer's are
    sized for it, another 1-byte dtype's are not."""
    from ep_a2a.backends.triton.engine import (
        FP8_ROW_DTYPE,
        fp8_row_bytes,
        heap_row_bytes,
        pack_fp8_rows,
        unpack_fp8_rows,
    )

    nb = fp8_row_bytes(hidden)
    assert nb % 16 == 0
    assert 0 <= nb - (hidden + 4 * hidden // FP8_BLOCK) < 16
    gen = torch.Generator().manual_seed(hidden)
    q = torch.randint(0, 256, (5, hidden), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.randint(-(2**31), 2**31 - 1, (5, hidden // FP8_BLOCK), generator=gen, dtype=torch.int32)
    s = s.view(torch.float32)
    packed = pack_fp8_rows(q, s)
    assert (packed.dtype, tuple(packed.shape)) == (FP8_ROW_DTYPE, (5, nb // 2))
    q2, s2 = unpack_fp8_rows(packed, hidden)
    assert q2.data_ptr() == packed.data_ptr()
    assert s2.data_ptr() == packed.data_ptr() + hidden
    assert (q2.stride(), s2.stride()) == ((nb, 1), (nb // 4, 1))
    assert torch.equal(_bytes(q2, s2), _bytes(q, s))
    into = torch.full((5, nb // 2), -1, dtype=FP8_ROW_DTYPE)  # (packed into given rows: the same bytes)
    assert pack_fp8_rows(q, s, out=into) is into
    assert torch.equal(_bytes(*unpack_fp8_rows(into, hidden)), _bytes(q, s))
    assert heap_row_bytes(hidden, torch.bfloat16) == 2 * hidden >= nb
    assert heap_row_bytes(hidden, torch.float8_e4m3fn) == nb
    assert heap_row_bytes(hidden, torch.float8_e5m2) == hidden < nb


def test_packed_fp8_rows_round_trip_any_width() -> None:
    """For any ``hidden`` multiple of 128 and any token count (zero included), packing and unpacking give
    the FP8 bytes and scale bytes back, and the packed row is 16-byte aligned with under 16 bytes of
    padding."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ep_a2a.backends.triton.engine import fp8_row_bytes, pack_fp8_rows, unpack_fp8_rows

    @settings(max_examples=40, deadline=None)
    @given(blocks=st.integers(1, 64), n=st.integers(0, 5), seed=st.integers(0, 2**16))
    def check(blocks: int, n: int, seed: int) -> None:
        hidden = blocks * FP8_BLOCK
        gen = torch.Generator().manual_seed(seed)
        q = torch.randint(0, 256, (n, hidden), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
        s = torch.randint(-(2**31), 2**31 - 1, (n, blocks), generator=gen, dtype=torch.int32)
        s = s.view(torch.float32)
        nb = fp8_row_bytes(hidden)
        assert nb % 16 == 0
        assert 0 <= nb - (hidden + 4 * blocks) < 16
        q2, s2 = unpack_fp8_rows(pack_fp8_rows(q, s), hidden)
        assert (tuple(q2.shape), tuple(s2.shape)) == ((n, hidden), (n, blocks))
        assert torch.equal(_bytes(q2, s2), _bytes(q, s))

    check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("tokens", "chunk", "merged", "send_ctas"),
    [
        pytest.param(256, 1, True, 0, id="T256-whole-rows-merged"),
        pytest.param(256, 2, False, 0, id="T256-whole-rows-counts-launch"),
        pytest.param(1024, 8, True, 0, id="T1024-tiles-merged"),
        pytest.param(1024, 8, False, 4, id="T1024-tiles-counts-launch-split"),
    ],
)
def test_quantize_on_send_compiled_one_gpu(tokens: int, chunk: int, merged: bool, send_ctas: int) -> None:
    """The compiled row kernel quantizing bf16 rows on send, on one GPU: two simulated ranks whose heaps
    are buffers of this GPU (each step's sending launches before its receiving ones), DeepSeek-V3 width;
    received bytes and scales equal the reference quantizer's run on the GPU, bit for bit (zero, tiny,
    infinite and NaN blocks included)."""
    from ep_a2a.backends.triton.simulate import SimWorld
    from ep_a2a.reference import dispatch_ref

    world, hidden, topk, experts = 2, 7168, 8, 32
    sim = SimWorld(
        world_size=world, device="cuda", max_tokens=tokens, hidden=hidden, topk=topk, num_tot_experts=experts,
        token_dtype=torch.float8_e4m3fn, num_sm=16, chunk=chunk, timeout_s=20.0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(tokens + chunk)
    ns = [tokens, tokens - 37]
    xs = [(torch.randn(n, hidden, generator=gen) * torch.logspace(-3, 4, n)[:, None]) for n in ns]
    for x in xs:
        x[1, :FP8_BLOCK] = 0
        x[2, -FP8_BLOCK:] *= 1e-35
        x[3, 5], x[4, -7] = float("-inf"), float("nan")
    xs = [x.to(torch.bfloat16).cuda() for x in xs]
    ids = [torch.randint(-1, experts, (n, topk), generator=gen, dtype=torch.int32).cuda() for n in ns]
    ws = [torch.rand(n, topk, generator=gen).cuda() for n in ns]
    res = sim.dispatch(xs, ids, ws, quantize=True, merged=merged, send_ctas=send_ctas)
    torch.cuda.synchronize()
    sent = [_bytes(*quantize_fp8(x)).cpu() for x in xs]
    ref, _ = dispatch_ref(sent, [i.cpu() for i in ids], [w.cpu() for w in ws], num_tot_experts=experts)
    for r in range(world):
        got = _bytes(*(t.contiguous() for t in res[r].output)).cpu()
        want = ref[r].output
        assert got.shape == want.shape
        bad = (got != want).any(1).nonzero().flatten()
        if bad.numel():  # which part differs, at which byte offsets, on the first bad row
            row = int(bad[0])
            cols = (got[row] != want[row]).nonzero().flatten()
            values_bad = int(((got[:, :hidden] != want[:, :hidden]).any(1)).sum())
            scales_bad = int(((got[:, hidden:] != want[:, hidden:]).any(1)).sum())
            raise AssertionError(
                f"rank {r}: {bad.numel()} rows differ from the reference quantizer's ({values_bad} in the FP8 "
                f"bytes, {scales_bad} in the scales); row {row}: {cols.numel()} bytes at {cols[:8].tolist()} "
                f"(offsets mod 4: {sorted(set((cols % 4).tolist()))}), got {got[row, :16].tolist()} want "
                f"{want[row, :16].tolist()}"
            )
        assert torch.equal(res[r].weights.cpu(), ref[r].weights)
