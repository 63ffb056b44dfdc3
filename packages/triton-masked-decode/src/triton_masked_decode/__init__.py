"""Split-KV flash decoding with a per-token KV mask, in Triton."""

from importlib.metadata import PackageNotFoundError, version

from triton_masked_decode.masked_decode import (
    SPARSE_THRESHOLDS,
    choose_num_splits,
    masked_decode,
    triton_masked_flash_decoding,
)
from triton_masked_decode.masks import pack_mask, unpack_mask
from triton_masked_decode.merge import merge_attention_states
from triton_masked_decode.reference import masked_decode_ref, merge_attention_states_ref

try:
    __version__ = version("triton-masked-decode")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+src"

__all__ = [
    "SPARSE_THRESHOLDS",
    "__version__",
    "choose_num_splits",
    "masked_decode",
    "masked_decode_ref",
    "merge_attention_states",
    "merge_attention_states_ref",
    "pack_mask",
    "triton_masked_flash_decoding",
    "unpack_mask",
]
