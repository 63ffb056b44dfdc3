"""Kernel families beside the portable Triton kernels: ``gluon_sm90``, warp-specialised Hopper kernels."""

from sparse_mla_attn.backends.gluon_sm90 import gluon_supported

__all__ = ["gluon_supported"]
