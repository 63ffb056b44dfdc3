#!/usr/bin/env bash
# direct C-launcher launches: multigpu suite on the new tree, host-profile A/B (old = .ab-old), quick bench A/B
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/ab
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$card"
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
NEW=${NEW_COMMIT:-new}
[ "${T_TESTS:-220}" -gt 0 ] && PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src timeout ${T_TESTS:-220} python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m pytest -m multigpu \
  packages/ep-a2a/tests -q -p no:cacheprovider -rfEs >"$OUT/multigpu-tests-$NEW.log" 2>&1
echo "suite rc=$? ($(($(date +%s) - start)) s)"; grep -E "passed|failed|error" $OUT/multigpu-tests-$NEW.log 2>/dev/null | tail -3
for round in 1 2; do
  for tree in old new; do
    root=$PWD; [ "$tree" = old ] && root=$PWD/.ab-old
    PYTHONPATH=$root/packages/ep-a2a/src EP_A2A_COMMIT=$tree timeout 90 python3 -m torch.distributed.run --standalone \
      --nproc-per-node=2 packages/ep-a2a/benchmarks/bench_triton.py --host-profile --iters 60 \
      --json /tmp/ab/host-profile-$tree-$round.json > /tmp/ab/hp-$tree-$round.log 2>&1
    echo "host-profile $tree $round rc=$? ($(($(date +%s) - start)) s)"
    python3 -c "
import json; d=json.load(open('/tmp/ab/host-profile-$tree-$round.json'))
for r in d['host_profile']: m=r['median_us_since_previous_step']; print(' ', r['shape'], r['tokens'], {k: round(v,1) for k,v in m.items()})"
  done
done
OUT=/tmp/ab ROUNDS=2 NEW_COMMIT=$NEW bash packages/ep-a2a/benchmarks/ab_trees.sh run
python3 - <<PY
import json, glob, os
hp = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob('/tmp/ab/host-profile-*.json'))}
json.dump(hp, open('$OUT/host-profile-ab.json', 'w'), indent=1)
ab = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob('/tmp/ab/ab-*.json'))}
json.dump(ab, open('$OUT/ab-bench.json', 'w'), indent=1)
for name, d in ab.items():
    for c in d['cases']:
        r = c['results']
        row = {k: round(v.get('dispatch_ms', 0) * 1e3, 1) for k, v in r.items() if k.startswith('ours')}
        rowc = {k: round(v.get('combine_ms', 0) * 1e3, 1) for k, v in r.items() if k.startswith('ours')}
        host = {k: round(v.get('dispatch_host_ms', 0) * 1e3, 1) for k, v in r.items() if 'dispatch_host_ms' in v}
        print(name, c['shape'], c['tokens'], 'dispatch', row, 'combine', rowc, 'host', host)
PY
echo "done ($(($(date +%s) - start)) s)"
