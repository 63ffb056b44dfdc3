"""Launch defaults of the split kernel, chosen by ``benchmarks/tune_masked_decode.py`` on an H100.

``tune_masked_decode.py --write-defaults`` rewrites this file from its measurements (the sweep, the
selection rule and the figures are in ``docs/benchmarks/triton-masked-decode-tune-3.json`` and
``benchmarks/NOTES.md``). "One wave" launches are those whose programs all fit on the GPU at once
(small batch: the split count is set to fill the GPU); "multi wave" ones have more programs than that.

Written 2026-11-22T11:16:50+00:00 on NVIDIA H100 80GB HBM3 (one-wave pick ns64-s2-psm4, multi-wave pick ns64-s3-mc2048).
"""

# Programs per SM the split count aims at when the batch alone does not fill the GPU.
PROGRAMS_PER_SM = 4
# Sparse-loop gather tile (rows per tile at head dim 128, pipelining depth) per launch class.
SPARSE_TILE_ONE_WAVE = (64, 2)
SPARSE_TILE_MULTI_WAVE = (64, 3)
# Most positions per split when a mask is given (without a mask the limit is 4096).
MAX_CHUNK_MASKED = 2048
# Default largest visible fraction of a split that takes the sparse loop (path="auto"), per launch class.
SPARSE_THRESHOLD_ONE_WAVE = 1.0
SPARSE_THRESHOLD_MULTI_WAVE = 1.0
