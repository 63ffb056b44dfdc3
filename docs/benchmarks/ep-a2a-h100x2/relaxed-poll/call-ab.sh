#!/usr/bin/env bash
# session 17: multigpu suite at NEW_COMMIT, then A/B (.ab-old = 86e511e vs working tree) of profile_small at
# 128 tokens (graph replays), interleaved, DeepSeek-V3 and Qwen3, while the call's budget lasts
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src timeout ${T_TESTS:-150} python3 -m torch.distributed.run \
  --standalone --nproc-per-node=2 -m pytest -m multigpu packages/ep-a2a/tests -q -p no:cacheprovider -rfEs \
  >"$OUT/multigpu-tests-$NEW_COMMIT-suite.log" 2>&1
echo "suite rc=$? ($(($(date +%s) - start)) s)"; grep -E "passed|failed|error|FAILED" "$OUT/multigpu-tests-$NEW_COMMIT-suite.log" | tail -6
left() { echo $((${BUDGET:-260} - ($(date +%s) - start))); }
mkdir -p /tmp/ab
for round in 1 2 3; do
  for tree in old new; do
    for shape in deepseek-v3 qwen3-30b-a3b; do
      [ "$(left)" -gt 25 ] || break 3
      if [ "$tree" = old ]; then root=$PWD/.ab-old; else root=$PWD; fi
      PYTHONPATH=$root/packages/ep-a2a/src EP_A2A_COMMIT=$tree timeout 45 python3 -m torch.distributed.run \
        --standalone --nproc-per-node=2 $PWD/packages/ep-a2a/benchmarks/profile_small.py --tokens 128 --iters 40 \
        --shape $shape --variants default --json /tmp/ab/p-$shape-$tree-$round.json >/tmp/ab/p.log 2>&1
      echo "$shape $tree $round rc=$? ($(($(date +%s) - start)) s) $(grep '^==' /tmp/ab/p.log | sed 's/.*graph/graph/')"
    done
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/ab/p-*.json"))}
json.dump(runs, open(os.path.join(sys.argv[1], "relaxed-poll-ab.json"), "w"), indent=1)
PY
echo "done ($(($(date +%s) - start)) s)"
