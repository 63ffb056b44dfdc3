from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_masked_decode import (
    masked_decode,
    masked_decode_ref,
    merge_attention_states,
    merge_attention_states_ref,
    pack_mask,
    unpack_mask,
)


@pytest.mark.parametrize("length", [pytest.param(n, id=f"L{n}") for n in (1, 8, 13, 64)])
def test_pack_mask_matches_numpy_little_endian(length: int) -> None:
    mask = torch.rand(3, 2, length) < 0.5
    packed = pack_mask(mask)
    want = np.packbits(
        np.pad(mask.numpy(), [(0, 0), (0, 0), (0, (-length) % 8)], constant_values=True),
        axis=-1,
        bitorder="little",
    )
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 2, (length + 7) // 8)
    np.testing.assert_array_equal(packed.numpy(), want)
    assert torch.equal(unpack_mask(packed, length), mask)


@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")]
)
def test_merge_matches_reference(dtype: torch.dtype, cpu_device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    oa = torch.randn(3, 5, 24, generator=g).to(dtype)
    ob = torch.randn(3, 5, 24, generator=g).to(dtype)
    la = torch.randn(3, 5, generator=g) * 3
    lb = torch.randn(3, 5, generator=g) * 3
    la[0, 0] = float("-inf")  # one side empty: its output is garbage and must not be read
    oa[0, 0] = float("nan")
    la[1, 1] = lb[1, 1] = float("-inf")  # both empty
    out, lse = merge_attention_states(oa, la, ob, lb)
    ref, ref_lse = merge_attention_states_ref(oa, la, ob, lb)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, ref_lse)
    assert lse[1, 1] == float("-inf")
    assert torch.all(out[1, 1] == 0)


def test_merge_recombines_split_cache(cpu_device: torch.device) -> None:
    """Decode over a prefix and a suffix separately, merge, and compare with decoding the whole cache."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 32, generator=g).half()
    k = torch.randn(2, 2, 48, 32, generator=g).half()
    v = torch.randn(2, 2, 48, 32, generator=g).half()
    mask = torch.rand(2, 2, 48, generator=g) < 0.3
    oa, la = masked_decode(q, k[:, :, :20], v[:, :, :20], mask[:, :, :20])
    ob, lb = masked_decode(q, k[:, :, 20:], v[:, :, 20:], mask[:, :, 20:])
    out, lse = merge_attention_states(oa, la, ob, lb)
    ref, ref_lse = masked_decode_ref(q, k, v, mask)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)


def test_merge_validation() -> None:
    o = torch.zeros(2, 3, 8)
    lse = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="must match"):
        merge_attention_states(o, lse, o[:, :2], lse)
    with pytest.raises(ValueError, match="float32"):
        merge_attention_states(o, lse.half(), o, lse)
    with pytest.raises(ValueError, match="without the last dim"):
        merge_attention_states(o, lse[:, :2], o, lse)


@pytest.mark.parametrize(
    "value", [pytest.param(float("inf"), id="plus-inf"), pytest.param(float("nan"), id="nan")]
)
def test_merge_with_non_finite_lse_matches_the_reference(value: float, cpu_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    oa, ob = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 4, 16, generator=gen)
    la, lb = torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen)
    la[0, 1] = value
    lb[1, 2] = value
    la[1, 3] = lb[1, 3] = value
    out, lse = merge_attention_states(oa, la, ob, lb)
    ref, ref_lse = merge_attention_states_ref(oa, la, ob, lb)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, equal_nan=True)
    for row in ((0, 1), (1, 2), (1, 3)):
        assert torch.isnan(lse[row])
        assert torch.isnan(out[row]).all()
    assert torch.isfinite(lse[0, 0])
    assert torch.isfinite(out[0, 0]).all()


@pytest.mark.parametrize("length", [-3, 17, 2.5, True])
def test_unpack_mask_rejects_bad_length(length) -> None:
    packed = pack_mask(torch.zeros(2, 13, dtype=torch.bool))  # 2 bytes: lengths 0..16
    with pytest.raises(ValueError, match="length"):
        unpack_mask(packed, length)


def test_unpack_mask_prefix_lengths() -> None:
    mask = torch.rand(3, 13) < 0.5
    packed = pack_mask(mask)
    for length in (0, 5, 13):
        assert torch.equal(unpack_mask(packed, length), mask[:, :length])
