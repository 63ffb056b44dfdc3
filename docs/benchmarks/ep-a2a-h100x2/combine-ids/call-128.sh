#!/usr/bin/env bash
# session 18: multigpu subset at the working tree (combine: rank bits per chunk, runtime id64), then
# profile_small at 128 tokens (graph replays), DeepSeek-V3, interleaved: old = .ab-old (3a9c540) int32,
# new int32, new int64
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src timeout ${T_TESTS:-200} python3 -m torch.distributed.run \
  --standalone --nproc-per-node=2 -m pytest -m multigpu packages/ep-a2a/tests -q -p no:cacheprovider -rfEs \
  -k "against_reference or capture_replay or invalid or combine_per_slot or forced_remote or split or autograd" \
  >"$OUT/multigpu-tests-${NEW_COMMIT:-new}-subset.log" 2>&1
echo "subset rc=$? ($(($(date +%s) - start)) s)"; grep -E "passed|failed|error|FAILED" "$OUT/multigpu-tests-${NEW_COMMIT:-new}-subset.log" | tail -6
left() { echo $((${BUDGET:-400} - ($(date +%s) - start))); }
mkdir -p /tmp/ab
one() {  # tree dtype round
  case $1 in old) root=$PWD/.ab-old ;; *) root=$PWD ;; esac
  PYTHONPATH=$root/packages/ep-a2a/src EP_A2A_COMMIT=$1 timeout 45 python3 -m torch.distributed.run \
    --standalone --nproc-per-node=2 $PWD/packages/ep-a2a/benchmarks/profile_small.py --tokens 128 --iters 40 \
    --shape deepseek-v3 --id-dtype $2 --variants default --json /tmp/ab/p-128-$2-$1-$3.json >/tmp/ab/p.log 2>&1
  echo "$1 $2 t128 r$3 rc=$? ($(($(date +%s) - start)) s) $(grep '^==' /tmp/ab/p.log | sed 's/.*graph/graph/')"
}
for round in 1 2 3; do
  for td in old:int32 new:int32 new:int64; do [ "$(left)" -gt 25 ] && one ${td%:*} ${td#*:} $round; done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/ab/p-*.json"))}
json.dump(runs, open(os.path.join(sys.argv[1], "combine-bits-128.json"), "w"), indent=1)
PY
echo "done ($(($(date +%s) - start)) s)"
