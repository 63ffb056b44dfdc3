#!/usr/bin/env bash
# One device call for the training path: GPU tests, the committed benchmark commands (written to
# docs/benchmarks in the device's copy of the tree, then copied to $OUT), and the indexer-backward sweep.
# Usage (repository root): bash packages/sparse-mla-attn/benchmarks/_bwd_gpu_check.sh [tests] [ab] [bench] [ixsweep]
export PYTHONPATH=packages/sparse-mla-attn/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bwd_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
for step in "$@"; do
  case $step in
    tests)
      timeout 170 python3 -m pytest packages/sparse-mla-attn/tests/test_backward.py \
        packages/sparse-mla-attn/tests/test_indexer.py -m gpu -q -p no:cacheprovider 2>&1 | tail -40 > "$OUT/gpu_tests.log"
      tail -3 "$OUT/gpu_tests.log" ;;
    bench)
      timeout 230 python3 packages/sparse-mla-attn/benchmarks/bench_backward.py --out-dir docs/benchmarks --sweep \
        2>&1 | tee "$OUT/bench_bwd.log"
      timeout 70 python3 packages/sparse-mla-attn/benchmarks/bench_indexer.py --out-dir docs/benchmarks \
        2>&1 | tee "$OUT/bench_indexer.log"
      cp docs/benchmarks/sparse-mla-attn-training.json docs/benchmarks/sparse-mla-attn-training.md "$OUT/" ;;
    ab)  # A/B of kernel configurations at the main shape (JSON list of [config, deterministic] in $AB_CONFIGS),
         # and the per-kernel device time of the default configuration in both modes
      timeout 300 python3 packages/sparse-mla-attn/benchmarks/bench_backward.py --quick --configs "$AB_CONFIGS" \
        2>&1 | tee "$OUT/ab.log"
      timeout 60 python3 -c "import sys; sys.path.insert(0, 'packages/sparse-mla-attn/benchmarks'); import bench_backward as b
for det in (False, True): print('breakdown det', det, b.kernel_breakdown(4096, 128, 32768, 2048, det))" 2>&1 | tee -a "$OUT/ab.log" ;;
    ixsweep)
      timeout 50 python3 packages/sparse-mla-attn/benchmarks/bench_indexer.py --bwd-sweep 2>&1 | tee "$OUT/ix_bwd_sweep.log" ;;
  esac
done
