#!/usr/bin/env bash
# One device call: GPU tests of the training path, then a config sweep of the backward and indexer kernels.
# Usage (repository root): bash packages/sparse-mla-attn/benchmarks/_bwd_gpu_check.sh [tests] [sweep] [bench]
export PYTHONPATH=packages/sparse-mla-attn/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bwd_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
for step in "$@"; do
  case $step in
    tests)
      timeout 200 python3 -m pytest packages/sparse-mla-attn/tests/test_backward.py \
        packages/sparse-mla-attn/tests/test_indexer.py -m gpu -q -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_tests.log" ;;
    sweep)
      timeout 230 python3 packages/sparse-mla-attn/benchmarks/bench_backward.py --sweep 2>&1 | tee "$OUT/sweep_bwd.log"
      timeout 80 python3 packages/sparse-mla-attn/benchmarks/bench_indexer.py --sweep 2>&1 | tee "$OUT/sweep_indexer.log" ;;
    bench)
      timeout 300 python3 packages/sparse-mla-attn/benchmarks/bench_backward.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_bwd.log"
      timeout 120 python3 packages/sparse-mla-attn/benchmarks/bench_indexer.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_indexer.log" ;;
  esac
done
