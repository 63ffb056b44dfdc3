"""Bad inputs fail before any launch, with a message naming the argument."""

import pytest
import torch

from sparse_mla_attn import attn_dist, sparse_mla_decode, sparse_mla_fwd, sparse_mla_fwd_ref


def good(s_q=2, h_q=4, d_qk=576, s_kv=8, topk=3):
    q = torch.randn(s_q, h_q, d_qk).bfloat16()
    kv = torch.randn(s_kv, 1, d_qk).bfloat16()
    idx = torch.zeros(s_q, 1, topk, dtype=torch.int32)
    return q, kv, idx


@pytest.mark.parametrize(
    ("mutate", "exc", "match"),
    [
        pytest.param(lambda q, kv, i: (q[0], kv, i), ValueError, "q must be", id="q-2d"),
        pytest.param(lambda q, kv, i: (q, kv[:, :, :512], i), ValueError, "kv must be", id="kv-dim"),
        pytest.param(lambda q, kv, i: (q, kv.expand(8, 2, 576), i), ValueError, "kv must be", id="kv-heads"),
        pytest.param(lambda q, kv, i: (q, kv, i.long()), TypeError, "indices must be int32", id="idx-int64"),
        pytest.param(lambda q, kv, i: (q, kv, i[:1]), ValueError, "indices must be", id="idx-rows"),
        pytest.param(lambda q, kv, i: (q, kv.half(), i), TypeError, "kv must have q's dtype", id="kv-dtype"),
        pytest.param(
            lambda q, kv, i: (q.float(), kv.float(), i), TypeError, "q must have dtype in", id="fp32"
        ),
        pytest.param(
            lambda q, kv, i: (q[..., :500], kv[..., :500], i), ValueError, "d_v must be", id="dqk-500"
        ),
        pytest.param(
            lambda q, kv, i: (q.transpose(0, 2).contiguous().transpose(0, 2), kv, i),
            ValueError,
            "contiguous",
            id="q-stride",
        ),
        pytest.param(
            lambda q, kv, i: (torch.zeros(2, 129, 576).bfloat16(), kv, i),
            ValueError,
            "h_q must be",
            id="h129",
        ),
    ],
)
def test_fwd_rejects(mutate, exc, match):
    q, kv, idx = mutate(*good())
    with pytest.raises(exc, match=match):
        sparse_mla_fwd(q, kv, idx, 0.1)


def test_fwd_rejects_options():
    q, kv, idx = good()
    with pytest.raises(ValueError, match="attn_sink"):
        sparse_mla_fwd(q, kv, idx, 0.1, attn_sink=torch.zeros(5))
    with pytest.raises(ValueError, match="topk_length"):
        sparse_mla_fwd(q, kv, idx, 0.1, topk_length=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="k_stride"):
        sparse_mla_fwd(q, kv, idx, 0.1, k_stride=0)
    with pytest.raises(ValueError, match="q_start_index"):
        sparse_mla_fwd(q, kv, idx, 0.1, q_start_index=-1)
    with pytest.raises(ValueError, match="sm_scale"):
        sparse_mla_fwd(q, kv, idx, float("nan"))
    with pytest.raises(ValueError, match="d_v must be 512"):
        sparse_mla_fwd(q, kv, idx, 0.1, d_v=256)
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_fwd_ref(q, kv, idx, 0.1, d_v=600)


def test_attn_dist_rejects():
    q, kv, idx = good()
    with pytest.raises(ValueError, match="lse must be"):
        attn_dist(q, kv, idx, torch.zeros(2, 5), 0.1)
    with pytest.raises(ValueError, match="lse_base"):
        attn_dist(q, kv, idx, torch.zeros(2, 4), 0.1, lse_base="10")


def test_decode_rejects():
    q = torch.randn(2, 1, 4, 576).bfloat16()
    cache = torch.randn(4, 16, 1, 576).bfloat16()
    bt = torch.zeros(2, 2, dtype=torch.int32)
    sl = torch.ones(2, dtype=torch.int32)
    idx = torch.zeros(2, 1, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table must be int32"):
        sparse_mla_decode(q, cache, bt.long(), sl, idx, 0.1)
    with pytest.raises(ValueError, match="cache_seqlens"):
        sparse_mla_decode(q, cache, bt, sl[:1], idx, 0.1)
    with pytest.raises(ValueError, match="cache_seqlens must be contiguous"):  # one length, expanded
        sparse_mla_decode(q, cache, bt, sl[:1].expand(2), idx, 0.1)
    with pytest.raises(ValueError, match="kv_cache must be"):
        sparse_mla_decode(q, cache[:, :, 0], bt, sl, idx, 0.1)
    with pytest.raises(ValueError, match="indices must be int32"):
        sparse_mla_decode(q, cache, bt, sl, idx[:1], 0.1)


def test_checks_are_cached_per_call_signature_only():
    """A call signature that passed once is not checked again, but any change of shape, stride, dtype or
    argument is a new signature: the same mistakes still raise after a good call."""
    from sparse_mla_attn._inputs import kernel_test_device

    dev = kernel_test_device()
    q, kv, idx = (t.to(dev) for t in good())
    for _ in range(2):  # the second call takes the cached signature
        *_, lse = sparse_mla_fwd(q, kv, idx, 0.1)
    q_strided = q.transpose(0, 2).contiguous().transpose(0, 2)
    with pytest.raises(ValueError, match="contiguous"):
        sparse_mla_fwd(q_strided, kv, idx, 0.1)
    with pytest.raises(TypeError, match="kv must have q's dtype"):
        sparse_mla_fwd(q, kv.half(), idx, 0.1)
    with pytest.raises(ValueError, match="k_stride"):
        sparse_mla_fwd(q, kv, idx, 0.1, k_stride=0)
    with pytest.raises(ValueError, match="sm_scale"):
        sparse_mla_fwd(q, kv, idx, float("nan"))
    attn_dist(q, kv, idx, lse, 0.1)
    with pytest.raises(ValueError, match="lse must be"):
        attn_dist(q, kv, idx, lse[:, :2].contiguous(), 0.1)
    with pytest.raises(ValueError, match="lse_base"):
        attn_dist(q, kv, idx, lse, 0.1, lse_base="10")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        pytest.param({"fwd_persistent": True}, "Config.fwd_persistent must be one of", id="persistent-bool"),
        pytest.param({"attn_dist_split": "heads"}, "Config.attn_dist_split must be one of", id="ad-split"),
        pytest.param({"attn_dist_order": "chunks"}, "Config.attn_dist_order must be one of", id="ad-order"),
    ],
)
def test_config_rejects_bad_kernel_options(fields, match):
    from sparse_mla_attn import Config

    with pytest.raises(ValueError, match=match):
        Config(**fields)
    # The options are accepted by the ops on every backend (they only tune the sm_90 Gluon kernels).
    Config(fwd_persistent="off", attn_dist_split="cols", attn_dist_order="index")
