#!/usr/bin/env bash
# Grid A/B of main (the working tree, a9817fb) against exp/flag-loads (8861db0, exported with
# `bash packages/ep-a2a/benchmarks/ab_trees.sh export 8861db0 .ab-c5`); carry .whl .ab-c5.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
TREES="main=. c5=.ab-c5" TOKENS="128 4096" ROUNDS=${ROUNDS:-3} BUDGET=${BUDGET:-400} \
  bash packages/ep-a2a/benchmarks/ab_trees.sh grid
