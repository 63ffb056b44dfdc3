"""Tuned launch defaults, written by ``benchmarks/tune_masked_decode.py --write-defaults``.

Keys are device names as ``torch.cuda.get_device_name()`` reports them; ``"default"`` serves every
device without its own entry. Per device: programs per SM the split count aims at, the most positions per
split when a mask is given, and per launch class ("one_wave": every program fits on the GPU at once;
"multi_wave": more programs than that) the sparse gather tile at head dim 128 (rows, pipelining depth)
and the default ``sparse_threshold``.
"""

TUNED = {
    "default": {
        "measured_on": "NVIDIA H100 80GB HBM3",
        "programs_per_sm": 4,
        "max_chunk_masked": 2048,
        "one_wave": {"block_ns": 64, "sparse_stages": 2, "sparse_threshold": 1.0},
        "multi_wave": {"block_ns": 64, "sparse_stages": 3, "sparse_threshold": 1.0},
    },
}
