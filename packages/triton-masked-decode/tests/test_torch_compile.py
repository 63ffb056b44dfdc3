"""The public ops inside ``torch.compile(fullgraph=True)``: no graph break, and the compiled function gives
the eager function's result.

The ``gpu`` tests compile with the default (Inductor) backend and compare with eager calls; the CPU tests
trace with the ``eager`` / ``aot_eager`` backends under the Triton interpreter (the custom ops' fake
implementations and schemas).
"""

from __future__ import annotations

import pytest
import torch

from triton_masked_decode import (
    masked_decode,
    merge_attention_states,
    pack_mask,
    unpack_mask,
)


def _inputs(device: torch.device, batch: int, hkv: int, group: int, length: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hkv * group, dim, generator=g).half().to(device)
    k = torch.randn(batch, hkv, length, dim, generator=g).half().to(device)
    v = torch.randn(batch, hkv, length, dim, generator=g).half().to(device)
    mask = (torch.rand(batch, hkv, length, generator=g) < 0.5).to(device)
    seqlens = torch.randint(1, length + 1, (batch,), generator=g).to(torch.int32).to(device)
    return q, k, v, mask, seqlens


def _fp8_inputs(device: torch.device, k: torch.Tensor, v: torch.Tensor, seed: int):
    g = torch.Generator().manual_seed(seed)
    k8 = (k.float() / 0.05).to(torch.float8_e4m3fn)
    v8 = (v.float() / 0.05).to(torch.float8_e4m3fn)
    k_tok = (torch.rand(k.shape[:3], generator=g) + 0.5).to(device)
    v_tok = (torch.rand(v.shape[:3], generator=g) + 0.5).to(device)
    return k8, v8, k_tok, v_tok


def _step(q, k, v, mask, seqlens):
    """A decode step around the op: work before and after it must fuse into one graph with it."""
    out, lse = masked_decode(q * 1.0, k, v, mask, seqlens=seqlens, check_values=False)
    merged, merged_lse = merge_attention_states(out, lse, out, lse)
    bits = unpack_mask(pack_mask(mask), mask.shape[-1])
    return merged * 2, merged_lse, bits


def _fp8_step(q, k8, v8, mask, k_scale, v_scale, k_tok, v_tok):
    return masked_decode(
        q, k8, v8, mask, k_scale=k_scale, v_scale=v_scale, k_token_scale=k_tok, v_token_scale=v_tok,
        check_values=False,
    )  # fmt: skip


@pytest.mark.gpu
def test_compiled_matches_eager_gpu(cuda_device: torch.device) -> None:
    q, k, v, mask, seqlens = _inputs(cuda_device, 2, 8, 4, 4096, 128, seed=1)
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True)
    got = compiled(q, k, v, mask, seqlens)
    want = _step(q, k, v, mask, seqlens)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-5)
    assert torch.equal(got[2], want[2])
    seqlens.copy_(torch.tensor([17, 4096], dtype=torch.int32))  # same graph, new lengths
    got = compiled(q, k, v, mask, seqlens)
    want = _step(q, k, v, mask, seqlens)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_compiled_fp8_matches_eager_gpu(cuda_device: torch.device) -> None:
    q, k, v, mask, _ = _inputs(cuda_device, 2, 8, 4, 4096, 128, seed=2)
    k8, v8, k_tok, v_tok = _fp8_inputs(cuda_device, k, v, seed=3)
    k_scale = torch.tensor(0.05, device=cuda_device)
    torch._dynamo.reset()
    compiled = torch.compile(_fp8_step, fullgraph=True)
    got = compiled(q, k8, v8, mask, k_scale, 0.05, k_tok, v_tok)
    want = _fp8_step(q, k8, v8, mask, k_scale, 0.05, k_tok, v_tok)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_traced_without_graph_break_cpu(backend: str, cpu_device: torch.device) -> None:
    q, k, v, mask, seqlens = _inputs(cpu_device, 2, 2, 2, 24, 16, seed=4)
    torch._dynamo.reset()
    got = torch.compile(_step, fullgraph=True, backend=backend)(q, k, v, mask, seqlens)
    want = _step(q, k, v, mask, seqlens)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(got[2], want[2])


def test_merge_op_schema_and_fake_cpu(cpu_device: torch.device) -> None:
    g = torch.Generator().manual_seed(5)
    o = torch.randn(3, 4, 16, generator=g).half()
    lse = torch.randn(3, 4, generator=g)
    torch.library.opcheck(
        torch.ops.triton_masked_decode.merge_attention_states.default,
        (o, lse, o.clone(), lse.clone()),
        test_utils=("test_schema", "test_faketensor"),
    )
