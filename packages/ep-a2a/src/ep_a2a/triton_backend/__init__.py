"""Fast intra-node path: Triton kernels over a symmetric heap (``backend="triton"``)."""
