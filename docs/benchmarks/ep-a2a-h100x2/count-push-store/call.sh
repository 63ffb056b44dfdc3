#!/usr/bin/env bash
# Grid A/B at 128 tokens: main (8d88b3a: `bash packages/ep-a2a/benchmarks/ab_trees.sh export 8d88b3a .ab-main`) against the working tree (exp/count-push-store:
# program 0's token-count push as st.relaxed.sys), then a multigpu subset at the working tree.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
TREES="main=.ab-main new=." TOKENS="128" ROUNDS=${ROUNDS:-4} BUDGET=${BUDGET:-170} \
  bash packages/ep-a2a/benchmarks/ab_trees.sh grid
t=$((${END:-290} - ($(date +%s) - start)))
echo "tests get $t s"
if [ "$t" -gt 50 ]; then
  PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src timeout $t python3 -m torch.distributed.run \
    --standalone --nproc-per-node=2 -m pytest -m multigpu packages/ep-a2a/tests -q -p no:cacheprovider -rfEs -x \
    -k "against_reference or capture_replay or timeout" >"$OUT/multigpu-tests-subset.log" 2>&1
  echo "subset rc=$? ($(($(date +%s) - start)) s)"; grep -E "passed|failed|error|FAILED" "$OUT/multigpu-tests-subset.log" | tail -6
fi
echo "done ($(($(date +%s) - start)) s)"
# The 4096-token grid ran in a second call on the same machine:
#   TREES="main=.ab-main new=." TOKENS=4096 ROUNDS=2 BUDGET=100 bash packages/ep-a2a/benchmarks/ab_trees.sh grid
