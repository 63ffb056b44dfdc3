"""Split-KV flash decoding with a per-token KV mask, in Triton."""

from importlib.metadata import PackageNotFoundError, version

from triton_masked_decode.reference import masked_decode_ref

try:
    __version__ = version("triton-masked-decode")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+src"

__all__ = ["__version__", "masked_decode_ref"]
