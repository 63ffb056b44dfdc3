import torch

from sparse_mla_attn import sparse_mla_fwd_ref


def test_ref_against_dense_softmax_with_invalid_indices() -> None:
    torch.manual_seed(0)
    s_q, h_q, d_qk, d_v, s_kv, topk = 3, 2, 24, 16, 10, 5
    q = torch.randn(s_q, h_q, d_qk)
    kv = torch.randn(s_kv, 1, d_qk)
    indices = torch.randint(0, s_kv, (s_q, 1, topk), dtype=torch.int32)
    indices[1, 0, 2] = -1
    indices[1, 0, 4] = s_kv
    indices[2, 0, :] = -1  # no valid index
    out, max_logits, lse = sparse_mla_fwd_ref(q, kv, indices, 0.1, d_v)
    for s in range(2):
        sel = [int(i) for i in indices[s, 0] if 0 <= i < s_kv]
        k = kv[sel, 0]
        logits = q[s] @ k.T * 0.1
        torch.testing.assert_close(lse[s], torch.logsumexp(logits, -1))
        torch.testing.assert_close(max_logits[s], logits.amax(-1))
        torch.testing.assert_close(out[s], torch.softmax(logits, -1) @ k[:, :d_v])
    assert torch.all(out[2] == 0)
    assert torch.all(lse[2] == float("-inf"))
