import pytest
import torch

from triton_masked_decode import masked_decode_ref


@pytest.mark.parametrize("group", [1, 4])
def test_ref_matches_naive_softmax(group: int) -> None:
    torch.manual_seed(0)
    b, hkv, length, d = 2, 2, 17, 16
    q = torch.randn(b, hkv * group, d)
    k = torch.randn(b, hkv, length, d)
    v = torch.randn(b, hkv, length, d)
    mask = torch.rand(b, hkv, length) < 0.5
    mask[0, 0] = True  # one fully masked row
    out, lse = masked_decode_ref(q, k, v, mask)
    for bi in range(b):
        for h in range(hkv * group):
            kh = h // group
            vis = ~mask[bi, kh]
            if not vis.any():
                assert lse[bi, h] == float("-inf")
                assert torch.all(out[bi, h] == 0)
                continue
            s = (k[bi, kh, vis] @ q[bi, h]) * d**-0.5
            p = torch.softmax(s.double(), 0)
            torch.testing.assert_close(out[bi, h].double(), p @ v[bi, kh, vis].double(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                lse[bi, h].double(), torch.logsumexp(s.double(), 0), rtol=1e-5, atol=1e-5
            )
