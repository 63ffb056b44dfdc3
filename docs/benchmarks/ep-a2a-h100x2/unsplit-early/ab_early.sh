#!/usr/bin/env bash
# A/B: main (1a112e7, .ab-old) against exp/unsplit-early, interleaved; then the multigpu suite on the new tree
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/logs
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
prof=$PWD/packages/ep-a2a/benchmarks/profile_small.py
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
for round in 1 2 3; do
  for tree in old new; do
    root=$PWD; [ "$tree" = old ] && root=$PWD/.ab-old
    for spec in "deepseek-v3 128 132" "qwen3-30b-a3b 128 132" "deepseek-v3 4096 32"; do
      set -- $spec
      [ "$round" = 3 ] && [ "$1:$2" != deepseek-v3:128 ] && continue
      log=/tmp/logs/ab-$1-$2-sm$3-$tree-$round.log
      PYTHONPATH=/tmp/site:$root/packages/ep-a2a/src EP_A2A_COMMIT=$tree timeout 60 python3 -m torch.distributed.run \
        --standalone --nproc-per-node=2 "$prof" --tokens $2 --num-sm $3 --iters 40 --shape $1 --variants default default \
        --json "/tmp/logs/ab-$1-$2-sm$3-$tree-$round.json" >"$log" 2>&1
      echo "$1 $2 sm$3 $tree $round rc=$? $(($(date +%s) - start)) s: $(grep '^==' $log | sed 's/.*graph/graph/' | tr '\n' ' ')"
    done
  done
done
tar -czf $OUT/ab-early-logs.tgz -C /tmp/logs .
if [ "${SUITE:-1}" = 1 ]; then
  PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src timeout 170 python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m pytest -m multigpu \
    packages/ep-a2a/tests -q -p no:cacheprovider -rfEs >"$OUT/multigpu-tests-early.log" 2>&1
  echo "suite rc=$? ($(($(date +%s) - start)) s)"; grep -E "passed|failed|error" $OUT/multigpu-tests-early.log | tail -3
fi
