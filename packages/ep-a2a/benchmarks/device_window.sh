#!/usr/bin/env bash
# One device call on the machine's GPUs: the multigpu suite, then the committed benchmark command, then
# tile variants of profile_small.py (each step bounded by `timeout`; logs and JSON under $OUT).
# The benchmark's output folder follows the cards and their number: on 2 GPUs docs/benchmarks on H200
# (the machine) and docs/benchmarks/ep-a2a-h100x2 on H100; on 4 or 8,
# docs/benchmarks/ep-a2a-scaling/x<N>-<commit> (with --quick unless BENCH_FULL=1); $OUT gets a copy
# of its raw file.
# usage (repository root, .whl carried): EP_A2A_COMMIT=<hash> bash packages/ep-a2a/benchmarks/device_window.sh
#   T_TESTS=0 skips the suite, T_BENCH=0 the benchmark; VARIANTS_32 / VARIANTS_132: profile_small --variants at 4096 tokens,
#   DeepSeek-V3, on 32 / 132 SMs (default: the default tiles, and the same with combine_maxnreg=128;
#   "" skips them), e.g. on 4 GPUs VARIANTS_132="default combine_send_ctas=88"; FIRST_CALL=1 adds the
#   first-call latency with and without use_aot, each in a fresh Triton cache (bench_triton --first-call;
#   two more files under $OUT: set VARIANTS_32="" to stay within the files the device returns);
#   HOST_PROFILE=1 adds the host time per step of the exact-shape dispatch (bench_triton --host-profile,
#   one more file)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T_TESTS=${T_TESTS:-200} T_BENCH=${T_BENCH:-330} T_VARIANTS=${T_VARIANTS:-150}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  >/tmp/pip.log 2>&1 || echo "pip install failed (nvshmem heap will be skipped)"
export PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
ngpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
commit=${EP_A2A_COMMIT:-unknown}
bench_args=(--only triton)
case "$ngpu:$card" in
2:*H200*) BENCH_DIR=docs/benchmarks tag=2xH200 ;;
2:*H100*) BENCH_DIR=docs/benchmarks/ep-a2a-h100x2 tag=2xH100 ;;
[48]:*H[12]00*)
  tag=${ngpu}x$(echo "$card" | grep -o 'H[12]00')
  BENCH_DIR=docs/benchmarks/ep-a2a-scaling/x$ngpu-$commit
  [ "${BENCH_FULL:-0}" = 1 ] || bench_args+=(--quick)
  ;;
*) BENCH_DIR=/tmp/bench-other tag=other ;;
esac
echo "=== $ngpu x $card -> $BENCH_DIR"
if [ "$T_TESTS" -gt 0 ]; then
  timeout "$T_TESTS" python3 -m torch.distributed.run --standalone --nproc-per-node="$ngpu" -m pytest -m multigpu \
    packages/ep-a2a/tests -q -p no:cacheprovider -rfEs >"$OUT/multigpu-tests-$commit-$tag.log" 2>&1
  echo "multigpu rc=$? ($(($(date +%s) - start)) s)"
  grep -E "passed|failed|error" "$OUT/multigpu-tests-$commit-$tag.log" | tail -4
fi
if [ "$T_BENCH" -gt 0 ]; then
  mkdir -p "$BENCH_DIR"
  timeout "$T_BENCH" python3 packages/ep-a2a/benchmarks/run.py --out-dir "$BENCH_DIR" "${bench_args[@]}" \
    >"$OUT/bench-$commit-$tag.log" 2>&1
  echo "bench rc=$? ($(($(date +%s) - start)) s)"
  cp "$BENCH_DIR"/ep-a2a-triton-bench.json "$OUT/" 2>/dev/null  # (the device returns few files)
fi
VARIANTS_32=${VARIANTS_32-"default 32:16:512:8:16:512:128"}
VARIANTS_132=${VARIANTS_132-"default 8:16:1024:8:16:512:128"}
for sm in 32 132; do
  vars=$([ "$sm" = 32 ] && echo "$VARIANTS_32" || echo "$VARIANTS_132")
  [ -n "$vars" ] || continue
  # shellcheck disable=SC2086
  timeout "$T_VARIANTS" python3 -m torch.distributed.run --standalone --nproc-per-node="$ngpu" \
    packages/ep-a2a/benchmarks/profile_small.py --tokens 4096 --iters 20 --num-sm "$sm" --variants $vars \
    --json "$OUT/variants-sm$sm-$tag.json" >"$OUT/variants-sm$sm-$tag.log" 2>&1
  echo "variants sm$sm rc=$? ($(($(date +%s) - start)) s)"
  grep -E "^==" "$OUT/variants-sm$sm-$tag.log"
done
if [ "${FIRST_CALL:-0}" = 1 ]; then
  for mode in jit aot; do
    flag=$([ "$mode" = aot ] && echo --use-aot)
    name=first-call-$mode-$tag
    # shellcheck disable=SC2086
    TRITON_CACHE_DIR=$(mktemp -d) timeout 300 python3 -m torch.distributed.run --standalone \
      --nproc-per-node="$ngpu" packages/ep-a2a/benchmarks/bench_triton.py --first-call $flag \
      --json "$OUT/$name.json" >"/tmp/$name.log" 2>&1
    echo "first call ($mode) rc=$? ($(($(date +%s) - start)) s)"
  done
fi
if [ "${HOST_PROFILE:-0}" = 1 ]; then
  timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node="$ngpu" \
    packages/ep-a2a/benchmarks/bench_triton.py --host-profile --iters 50 \
    --json "$OUT/host-profile-$commit-$tag.json" >/tmp/host-profile.log 2>&1
  echo "host profile rc=$? ($(($(date +%s) - start)) s)"
fi
grep -E "^\| ours-graph" "$OUT/bench-$commit-$tag.log" | head -20
echo "done ($(($(date +%s) - start)) s)"
