#!/usr/bin/env bash
# One device call for the forward side: GPU tests (forward, attn_dist, decode), the Gluon/Triton sweep
# (tune.py), then the committed benchmark (run.py) if the tests passed.
# Usage (repository root): OUT=... SPARSE_MLA_COMMIT=<sha> bash packages/sparse-mla-attn/benchmarks/_fwd_gpu_check.sh
export PYTHONPATH=$PWD/packages/sparse-mla-attn/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fwd_out}
mkdir -p "$OUT"
B=packages/sparse-mla-attn/benchmarks
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest packages/sparse-mla-attn/tests/test_forward.py packages/sparse-mla-attn/tests/test_attn_dist.py \
  packages/sparse-mla-attn/tests/test_decode.py -m gpu -q -p no:cacheprovider -x 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
[ "${SKIP_TUNE:-0}" = 1 ] || (cd $B && timeout 130 python3 tune.py --only fwd,attn_dist --out "$OUT/tune.json" 2>&1 | grep -v "^ *$" | tee "$OUT/tune.log")
if [ "$tests_rc" = 0 ]; then
  timeout 220 python3 $B/run.py --out-dir "$OUT" 2>&1 | tail -60 > "$OUT/bench.log"
else
  echo "GPU tests failed (rc $tests_rc): benchmark skipped" | tee "$OUT/bench.log"
fi
