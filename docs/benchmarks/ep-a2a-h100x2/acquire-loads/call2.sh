#!/usr/bin/env bash
# session 19: the whole multigpu suite at the working tree (ld.acquire polls, st.relaxed pushes, layout
# scans without transpose), then a grid A/B against .ab-base (HEAD + stamps) with the time left
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
EP_A2A_COMMIT=${NEW_COMMIT:-new} T_TESTS=${T_TESTS:-390} T_BENCH=0 VARIANTS_32="" VARIANTS_132="" \
  bash packages/ep-a2a/benchmarks/device_window.sh
left=$((${END:-560} - ($(date +%s) - start)))
echo "grid gets $left s"
TREES="base=.ab-base new=." TOKENS="128 4096" ROUNDS=2 BUDGET=$left bash packages/ep-a2a/benchmarks/ab_trees.sh grid
echo "done ($(($(date +%s) - start)) s)"
