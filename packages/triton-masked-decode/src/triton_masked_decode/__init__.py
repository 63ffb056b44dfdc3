"""Split-KV flash decoding with a per-token KV mask, in Triton."""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from triton_masked_decode.compat import triton_masked_flash_decoding
from triton_masked_decode.config import MaskedDecodeConfig, tuned_defaults
from triton_masked_decode.masked_decode import check_errors, choose_num_splits, masked_decode
from triton_masked_decode.masks import pack_mask, unpack_mask
from triton_masked_decode.merge import merge_attention_states
from triton_masked_decode.reference import masked_decode_ref, merge_attention_states_ref

try:
    __version__ = _version("triton-masked-decode")
except _PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+src"

__all__ = [
    "MaskedDecodeConfig",
    "__version__",
    "check_errors",
    "choose_num_splits",
    "masked_decode",
    "masked_decode_ref",
    "merge_attention_states",
    "merge_attention_states_ref",
    "pack_mask",
    "triton_masked_flash_decoding",
    "tuned_defaults",
    "unpack_mask",
]
