"""Out-of-range values with the checks skipped, and non-finite inputs: what masked_decode guarantees
(docs: "Errors and guarantees").

- A used ``block_table`` entry outside ``[0, num_pages)`` is never dereferenced: its rows count as excluded.
- A ``seqlens`` value outside ``[0, L]`` is clamped into it.
- Both are recorded in the device's error word: :func:`check_errors` raises (and clears it).
- A NaN or ``+inf`` score (non-finite ``q`` or visible K row) gives ``out = NaN``, ``lse = NaN`` for its
  row, as the reference does (``merge_attention_states``'s rules: test_merge_and_masks.py).
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_masked_decode import (
    MaskedDecodeConfig,
    check_errors,
    masked_decode,
    masked_decode_ref,
    pack_mask,
    unpack_mask,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
OUT_TOL = {"atol": 3e-3, "rtol": 3e-3}
LSE_TOL = {"atol": 2e-3, "rtol": 1e-4}


def paged_inputs(
    gen: torch.Generator, batch: int, hkv: int, group: int, pages_per_seq: int, page: int, dim: int
):
    num_pages = batch * pages_per_seq + 2
    q = torch.randn(batch, hkv * group, dim, generator=gen).half()
    k = torch.randn(num_pages, page, hkv, dim, generator=gen).half()
    v = torch.randn(num_pages, page, hkv, dim, generator=gen).half()
    perm = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq]
    block_table = perm.view(batch, pages_per_seq).to(torch.int32)
    return q, k, v, block_table


def reference_on_sanitized(q, k, v, mask, seqlens, block_table):
    """The reference on what the kernel computes: lengths clamped to [0, L], rows behind out-of-range page
    ids excluded."""
    batch, hkv, page = q.shape[0], k.shape[2], k.shape[1]
    length = block_table.shape[1] * page
    lens = seqlens.clamp(0, length)
    bad_page = (block_table < 0) | (block_table >= k.shape[0])
    excl = bad_page.repeat_interleave(page, dim=1)[:, None, :].expand(batch, hkv, length)
    full = excl if mask is None else (unpack_mask(mask, length) if mask.dtype == torch.uint8 else mask) | excl
    return masked_decode_ref(q, k, v, full, seqlens=lens, block_table=block_table.clamp(0, k.shape[0] - 1))


def assert_matches(out, lse, ref, ref_lse):
    torch.testing.assert_close(out.float(), ref.float(), **OUT_TOL, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL, equal_nan=True)


@pytest.fixture(autouse=True)
def _clear_error_word() -> None:
    """Each test starts with a clear error word (a failing earlier test may have left bits set)."""
    devices = ["cpu"] if INTERPRET else (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        with contextlib.suppress(ValueError):
            check_errors(device)


def check_page_id_never_read(device: torch.device, bad_id: int, path: str) -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v, block_table = paged_inputs(gen, batch=2, hkv=2, group=4, pages_per_seq=4, page=8, dim=32)
    block_table[0, 1] = bad_id  # a used slot: sequence 0 is 30 long
    seqlens = torch.tensor([30, 32], dtype=torch.int32)
    mask = torch.rand(2, 2, 32, generator=gen) < 0.3
    ref, ref_lse = reference_on_sanitized(q, k, v, mask, seqlens, block_table)
    q, k, v, mask, seqlens, block_table = (t.to(device) for t in (q, k, v, mask, seqlens, block_table))
    out, lse = masked_decode(
        q, k, v, mask, seqlens=seqlens, block_table=block_table, check_values=False,
        config=MaskedDecodeConfig(path=path),  # type: ignore[arg-type]
    )  # fmt: skip
    assert_matches(out.cpu(), lse.cpu(), ref, ref_lse)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match=r"block_table held page ids outside \[0, num_pages\)"):
        check_errors(device)
    check_errors(device)  # cleared


@pytest.mark.parametrize("bad_id", [pytest.param(10**6, id="id-1e6"), pytest.param(-7, id="id-minus-7")])
@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_out_of_range_page_id_is_never_read(bad_id: int, path: str, cpu_device: torch.device) -> None:
    check_page_id_never_read(cpu_device, bad_id, path)


@pytest.mark.gpu
@pytest.mark.parametrize("bad_id", [pytest.param(10**6, id="id-1e6"), pytest.param(-7, id="id-minus-7")])
@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_out_of_range_page_id_is_never_read_gpu(bad_id: int, path: str, cuda_device: torch.device) -> None:
    check_page_id_never_read(cuda_device, bad_id, path)


@pytest.mark.gpu
def test_checked_calls_report_without_a_sync_gpu(cuda_device: torch.device) -> None:
    """With check_values (the default) a GPU call does not wait for its own record: a later call raises
    once the record has reached the host (copied at most once per millisecond), then calls go on."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, block_table = (
        t.to(cuda_device) for t in paged_inputs(gen, 2, 2, 4, pages_per_seq=4, page=8, dim=32)
    )
    bad = block_table.clone()
    bad[1, 0] = 10**6
    masked_decode(q, k, v, block_table=block_table)  # a clean call first
    torch.cuda.synchronize()
    out, _ = masked_decode(q, k, v, block_table=bad)  # records the bad id; returns before it is read back
    assert torch.isfinite(out).all()
    torch.cuda.synchronize()
    reported = []
    for _ in range(4):  # read back at most once per millisecond: landed by the second call after 2 ms
        time.sleep(0.002)
        try:
            masked_decode(q, k, v, block_table=block_table)
        except ValueError as err:
            reported.append(str(err))
            break
        torch.cuda.synchronize()
    assert reported, "a later checked call must report the out-of-range page id"
    assert "block_table held page ids outside [0, num_pages)" in reported[0]
    for _ in range(3):  # reported once: clean calls go on
        masked_decode(q, k, v, block_table=block_table)
        torch.cuda.synchronize()
    check_errors(cuda_device)  # cleared by the report


def test_out_of_range_seqlens_are_clamped(cpu_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 8, 32, generator=gen).half()
    k = torch.randn(3, 2, 40, 32, generator=gen).half()
    v = torch.randn(3, 2, 40, 32, generator=gen).half()
    seqlens = torch.tensor([-5, 1000, 17], dtype=torch.int32)
    out, lse = masked_decode(q, k, v, None, seqlens=seqlens, check_values=False)
    ref, ref_lse = masked_decode_ref(q, k, v, None, seqlens=seqlens.clamp(0, 40))
    assert_matches(out, lse, ref, ref_lse)
    with pytest.raises(ValueError, match=r"seqlens held values outside \[0, L\]"):
        check_errors(cpu_device)


def test_checked_call_names_the_entry_cpu(cpu_device: torch.device) -> None:
    """On the CPU the record is final when the call returns: the call itself raises, naming the entry."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, block_table = paged_inputs(gen, batch=2, hkv=2, group=4, pages_per_seq=4, page=8, dim=32)
    block_table[1, 2] = -7
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = -7 is out of range"):
        masked_decode(q, k, v, None, block_table=block_table)
    check_errors(cpu_device)  # reported once


def check_non_finite(device: torch.device, poison: str) -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 8, 32, generator=gen).half()
    k = torch.randn(2, 2, 48, 32, generator=gen).half()
    v = torch.randn(2, 2, 48, 32, generator=gen).half()
    mask = torch.rand(2, 2, 48, generator=gen) < 0.5
    mask[0, 1, 5] = False  # the poisoned row is visible
    if poison == "k+inf":
        k[0, 1, 5] = float("inf")
    elif poison == "k-inf":
        k[0, 1, 5] = float("-inf")
    elif poison == "k-nan":
        k[0, 1, 5, 3] = float("nan")
    else:
        q[1, 2, 0] = float("nan")
    ref, ref_lse = masked_decode_ref(q, k, v, mask)
    out, lse = masked_decode(*(t.to(device) for t in (q, k, v, mask)))
    out, lse = out.cpu(), lse.cpu()
    assert_matches(out, lse, ref, ref_lse)
    poisoned = torch.isnan(ref_lse)
    if poison in ("k+inf", "k-nan", "q-nan"):
        assert poisoned.any(), "a NaN or +inf score must poison its rows"
    assert not (torch.isneginf(lse) & torch.isnan(out).any(-1)).any(), "a poisoned row must not read as empty"
    assert torch.isfinite(lse[~poisoned & ~torch.isneginf(ref_lse)]).all()


POISONS = [
    pytest.param("k+inf", id="plus-inf-in-visible-k-row"),
    pytest.param("k-inf", id="minus-inf-in-visible-k-row"),
    pytest.param("q-nan", id="nan-in-q"),
    pytest.param("k-nan", id="nan-in-visible-k-row"),
]


@pytest.mark.parametrize("poison", POISONS)
def test_non_finite_inputs_match_the_reference(poison: str, cpu_device: torch.device) -> None:
    check_non_finite(cpu_device, poison)


@pytest.mark.gpu
@pytest.mark.parametrize("poison", POISONS)
def test_non_finite_inputs_match_the_reference_gpu(poison: str, cuda_device: torch.device) -> None:
    check_non_finite(cuda_device, poison)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    page=st.sampled_from([4, 8, 16]),
    pages_per_seq=st.integers(1, 4),
    group=st.sampled_from([1, 2, 8]),
    packed=st.booleans(),
)
def test_fuzz_bad_block_tables_and_seqlens(
    data, batch: int, page: int, pages_per_seq: int, group: int, packed: bool, cpu_device: torch.device
) -> None:
    """Any page ids and lengths with the checks skipped: no crash, the sanitized reference's result, and
    the error word set exactly when a used slot or a length was out of range."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q, k, v, block_table = paged_inputs(
        gen, batch, hkv=2, group=group, pages_per_seq=pages_per_seq, page=page, dim=16
    )
    length = pages_per_seq * page
    ids = st.one_of(
        st.integers(0, k.shape[0] - 1), st.sampled_from([-1, -7, k.shape[0], 10**6, 2**31 - 1, -(2**31)])
    )
    for b in range(batch):
        for s in range(pages_per_seq):
            block_table[b, s] = data.draw(ids)
    lens = [
        data.draw(st.one_of(st.integers(0, length), st.sampled_from([-3, length + 1, 2**31 - 1])))
        for _ in range(batch)
    ]
    seqlens = torch.tensor(lens, dtype=torch.int32)
    mask = torch.rand(batch, 2, length, generator=gen) < data.draw(st.sampled_from([0.0, 0.5, 1.0]))
    out, lse = masked_decode(
        q,
        k,
        v,
        pack_mask(mask) if packed else mask,
        seqlens=seqlens,
        block_table=block_table,
        check_values=False,
    )
    assert_matches(out, lse, *reference_on_sanitized(q, k, v, mask, seqlens, block_table))
    assert torch.isfinite(out).all()
    clamped = seqlens.clamp(0, length).long()
    used = torch.arange(pages_per_seq)[None, :] < (clamped[:, None] + page - 1) // page
    bad = bool((used & ((block_table < 0) | (block_table >= k.shape[0]))).any()) or (seqlens != clamped).any()
    if bad:
        with pytest.raises(ValueError, match="out-of-range"):
            check_errors(cpu_device)
    else:
        check_errors(cpu_device)
