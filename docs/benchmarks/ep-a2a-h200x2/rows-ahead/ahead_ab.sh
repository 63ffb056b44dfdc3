#!/usr/bin/env bash
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/ab
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$card"
tag=$(echo "$card" | grep -q H200 && echo 2xH200 || echo 2xH100)
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m pytest -m multigpu \
  packages/ep-a2a/tests -q -p no:cacheprovider -rfEs -k "exact or side_streams or split or forced_remote" >"$OUT/multigpu-tests-$NEW-$tag.log" 2>&1
echo "suite rc=$? ($(($(date +%s) - start)) s)"; grep -E "passed|failed|error" $OUT/multigpu-tests-$NEW-$tag.log | tail -3
for round in 1 2; do
  for tree in old new; do
    root=$PWD; [ "$tree" = old ] && root=$PWD/.ab-old
    PYTHONPATH=$root/packages/ep-a2a/src EP_A2A_COMMIT=$tree timeout 60 python3 -m torch.distributed.run --standalone \
      --nproc-per-node=2 packages/ep-a2a/benchmarks/bench_triton.py --host-profile --iters 60 \
      --json /tmp/ab/host-profile-$tree-$round.json > /tmp/ab/hp-$tree-$round.log 2>&1
    echo "host-profile $tree $round rc=$? ($(($(date +%s) - start)) s)"
    python3 -c "
import json; d=json.load(open('/tmp/ab/host-profile-$tree-$round.json'))
for r in d['host_profile']:
    m=r['median_us_since_previous_step']
    if r['tokens'] > 128: print(' ', r['shape'], r['tokens'], {k: round(v,1) for k,v in m.items()})"
  done
done
python3 - <<PY
import json, glob, os
hp = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob('/tmp/ab/host-profile-*.json'))}
json.dump(hp, open('$OUT/host-profile-ab-$tag.json', 'w'), indent=1)
PY
echo "done ($(($(date +%s) - start)) s)"
