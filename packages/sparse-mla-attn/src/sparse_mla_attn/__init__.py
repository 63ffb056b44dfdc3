"""DeepSeek sparse attention (top-k indices) for MLA, in Triton."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from sparse_mla_attn.attn_dist import attn_dist, indexer_target
from sparse_mla_attn.autograd import SparseMLAAttention, sparse_mla
from sparse_mla_attn.backends.gluon_sm90 import gluon_supported
from sparse_mla_attn.backward import sparse_mla_bwd
from sparse_mla_attn.config import Config
from sparse_mla_attn.decode import sparse_mla_decode
from sparse_mla_attn.forward import sparse_mla_fwd
from sparse_mla_attn.fp8_cache import quantize_fp8_kv_cache
from sparse_mla_attn.indexer import indexer_kl_loss, indexer_logits, indexer_logits_at, indexer_topk
from sparse_mla_attn.reference import (
    attn_dist_ref,
    dequantize_fp8_kv_cache,
    indexer_kl_loss_ref,
    indexer_logits_ref,
    sparse_mla_bwd_ref,
    sparse_mla_decode_ref,
    sparse_mla_fwd_ref,
)

try:
    __version__ = _version("sparse-mla-attn")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+src"
del PackageNotFoundError

__all__ = [
    "Config",
    "SparseMLAAttention",
    "__version__",
    "attn_dist",
    "attn_dist_ref",
    "dequantize_fp8_kv_cache",
    "gluon_supported",
    "indexer_kl_loss",
    "indexer_kl_loss_ref",
    "indexer_logits",
    "indexer_logits_at",
    "indexer_logits_ref",
    "indexer_target",
    "indexer_topk",
    "quantize_fp8_kv_cache",
    "sparse_mla",
    "sparse_mla_bwd",
    "sparse_mla_bwd_ref",
    "sparse_mla_decode",
    "sparse_mla_decode_ref",
    "sparse_mla_fwd",
    "sparse_mla_fwd_ref",
]
