#!/usr/bin/env bash
# session 17: interleaved A/B/C of profile_small at 128 tokens (graph replays), DeepSeek-V3 and Qwen3:
# old = .ab-old (86e511e, acquire atomics), b9 = .ab-b9 (b9d85e7, relaxed polls + fence in every spin),
# new = working tree (relaxed polls, no fence in the row kernel's base-row spin)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
left() { echo $((${BUDGET:-260} - ($(date +%s) - start))); }
mkdir -p /tmp/ab
for round in 1 2 3; do
  for tree in old b9 new; do
    for shape in deepseek-v3 qwen3-30b-a3b; do
      [ "$(left)" -gt 25 ] || break 3
      case $tree in old) root=$PWD/.ab-old ;; b9) root=$PWD/.ab-b9 ;; *) root=$PWD ;; esac
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
json.dump(runs, open(os.path.join(sys.argv[1], "relaxed-poll-abc.json"), "w"), indent=1)
PY
echo "done ($(($(date +%s) - start)) s)"
