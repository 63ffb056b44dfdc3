"""DeepSeek sparse attention (top-k indices) for MLA, in Triton."""

from importlib.metadata import PackageNotFoundError, version

from sparse_mla_attn.attn_dist import attn_dist, indexer_target
from sparse_mla_attn.decode import sparse_mla_decode
from sparse_mla_attn.forward import sparse_mla_fwd
from sparse_mla_attn.reference import attn_dist_ref, sparse_mla_decode_ref, sparse_mla_fwd_ref

try:
    __version__ = version("sparse-mla-attn")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+src"

__all__ = [
    "__version__",
    "attn_dist",
    "attn_dist_ref",
    "indexer_target",
    "sparse_mla_decode",
    "sparse_mla_decode_ref",
    "sparse_mla_fwd",
    "sparse_mla_fwd_ref",
]
