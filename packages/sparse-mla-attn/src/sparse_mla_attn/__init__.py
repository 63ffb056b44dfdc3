"""DeepSeek sparse attention (top-k indices) for MLA, in Triton."""

from importlib.metadata import PackageNotFoundError, version

from sparse_mla_attn.reference import sparse_mla_fwd_ref

try:
    __version__ = version("sparse-mla-attn")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+src"

__all__ = ["__version__", "sparse_mla_fwd_ref"]
