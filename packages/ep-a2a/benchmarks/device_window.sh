#!/usr/bin/env bash
# One device call on nvidia-h200-x2: the multigpu suite, then the committed benchmark command, then a
# short tuning sweep (each step bounded by `timeout`; logs and JSON under $OUT).
# usage (repository root, .whl carried): EP_A2A_COMMIT=<hash> bash packages/ep-a2a/benchmarks/device_window.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T_TESTS=${T_TESTS:-150} T_BENCH=${T_BENCH:-170} T_TOTAL=${T_TOTAL:-310}  # sweep: what is left of T_TOTAL
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  >/tmp/pip.log 2>&1 || echo "pip install failed (nvshmem heap will be skipped)"
export PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src
if [ "$T_TESTS" -gt 0 ]; then  # T_TESTS=0: benchmark only
  echo "=== multigpu suite ($(($(date +%s) - start)) s)"
  timeout "$T_TESTS" python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m pytest -m multigpu \
    packages/ep-a2a/tests -q -p no:cacheprovider -rfEs >"$OUT/multigpu.log" 2>&1
  echo "multigpu rc=$? ($(($(date +%s) - start)) s)"
  grep -E "passed|failed|error" "$OUT/multigpu.log" | tail -4
fi
echo "=== bench ($(($(date +%s) - start)) s)"
timeout "$T_BENCH" python3 packages/ep-a2a/benchmarks/run.py --out-dir docs/benchmarks --only triton \
  >"$OUT/bench.log" 2>&1
echo "bench rc=$? ($(($(date +%s) - start)) s)"
cp docs/benchmarks/ep-a2a-triton-bench.json docs/benchmarks/ep-a2a.json docs/benchmarks/ep-a2a.md \
  docs/benchmarks/ep-a2a.png "$OUT/" 2>/dev/null
T_SWEEP=$((T_TOTAL - $(date +%s) + start))
if [ "${T_SWEEP}" -gt 20 ]; then
  echo "=== sweep ($(($(date +%s) - start)) s)"
  timeout "$T_SWEEP" python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
    packages/ep-a2a/benchmarks/bench_triton.py --sweep --json "$OUT/ep-a2a-triton-sweep.json" \
    >"$OUT/sweep.log" 2>&1
  echo "sweep rc=$? ($(($(date +%s) - start)) s)"
fi
grep -E "^\| (ours|ce|nccl)" "$OUT/bench.log" | head -80
echo "done ($(($(date +%s) - start)) s)"
