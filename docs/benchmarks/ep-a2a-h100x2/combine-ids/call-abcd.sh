#!/usr/bin/env bash
# session 18: combine's id reading, interleaved A/B/C/D of profile_small (graph replays), DeepSeek-V3:
# old = .ab-old (3a9c540, before int64 ids), main = .ab-main (919e3c5, runtime id64 branch),
# fix = working tree (rank bits per chunk, ID64 constexpr), rt = .ab-rt (rank bits per chunk, runtime id64)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
left() { echo $((${BUDGET:-330} - ($(date +%s) - start))); }
mkdir -p /tmp/ab
one() {  # tree dtype sm tokens round
  case $1 in old) root=$PWD/.ab-old ;; main) root=$PWD/.ab-main ;; rt) root=$PWD/.ab-rt ;; *) root=$PWD ;; esac
  PYTHONPATH=$root/packages/ep-a2a/src EP_A2A_COMMIT=$1 timeout 60 python3 -m torch.distributed.run \
    --standalone --nproc-per-node=2 $PWD/packages/ep-a2a/benchmarks/profile_small.py --tokens $4 --iters 30 \
    --shape deepseek-v3 --num-sm $3 --id-dtype $2 --variants default --json /tmp/ab/p-$4-$2-sm$3-$1-$5.json >/tmp/ab/p.log 2>&1
  echo "$1 $2 sm$3 t$4 r$5 rc=$? ($(($(date +%s) - start)) s) $(grep '^==' /tmp/ab/p.log | sed 's/.*graph/graph/')"
}
for round in 1 2; do
  for tree in old main fix rt; do [ "$(left)" -gt 30 ] && one $tree int32 132 4096 $round; done
  for tree in main fix rt; do [ "$(left)" -gt 30 ] && one $tree int64 132 4096 $round; done
done
for td in old:int32 fix:int32 fix:int64 rt:int64; do [ "$(left)" -gt 30 ] && one ${td%:*} ${td#*:} 132 128 1; done
for tree in old fix rt; do [ "$(left)" -gt 30 ] && one $tree int32 32 4096 1; done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/ab/p-*.json"))}
json.dump(runs, open(os.path.join(sys.argv[1], "combine-bits-abcd.json"), "w"), indent=1)
PY
echo "done ($(($(date +%s) - start)) s)"
