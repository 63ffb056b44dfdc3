#!/usr/bin/env bash
# session 16: on 2x H200 the committed benchmark of main (the machine); on anything else the
# %globaltimer stamps of the 128-token graph dispatch (early sends on / off) for the next step
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); ngpu=$(nvidia-smi -L | wc -l); echo "$ngpu x $card"
if [ "$ngpu" = 2 ] && echo "$card" | grep -q H200; then
  EP_A2A_COMMIT=$NEW_COMMIT T_TESTS=0 T_BENCH=330 HOST_PROFILE=1 VARIANTS_32="" VARIANTS_132="" \
    bash packages/ep-a2a/benchmarks/device_window.sh
  exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
for run in "deepseek-v3 1" "deepseek-v3 0" "qwen3-30b-a3b 1"; do
  set -- $run
  EP_A2A_TRITON_EARLY_SEND=$2 EP_A2A_COMMIT=$NEW_COMMIT PYTHONPATH=$PWD/packages/ep-a2a/src timeout 70 \
    python3 -m torch.distributed.run --standalone --nproc-per-node=2 packages/ep-a2a/benchmarks/profile_small.py \
    --tokens 128 --iters 40 --shape $1 --variants default --probe --json $OUT/probe-$1-es$2.json > /tmp/probe-$1-$2.log 2>&1
  echo "== $1 es=$2 rc=$? ($(($(date +%s) - start)) s)"; grep -A30 "^==" /tmp/probe-$1-$2.log | head -40
done
