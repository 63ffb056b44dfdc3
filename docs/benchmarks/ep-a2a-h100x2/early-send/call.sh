#!/usr/bin/env bash
# session 16 call: whole multigpu suite at NEW_COMMIT, then early sends on/off (EP_A2A_TRITON_EARLY_SEND),
# interleaved rounds of profile_small.py at 128 tokens (graph replays), both shapes; one merged JSON
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
if [ "${T_TESTS:-330}" -gt 0 ]; then
EP_A2A_COMMIT=$NEW_COMMIT T_TESTS=${T_TESTS:-330} T_BENCH=0 VARIANTS_32="" VARIANTS_132="" \
  bash packages/ep-a2a/benchmarks/device_window.sh
f=$(ls $OUT/multigpu-tests-*.log); grep -E "FAILED|ERROR" "$f" | head -10
else
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
fi
left() { echo $((${BUDGET:-585} - ($(date +%s) - start))); }
mkdir -p /tmp/es
for round in 1 2 3; do
  for es in 1 0; do
    for shape in deepseek-v3 qwen3-30b-a3b; do
      [ "$(left)" -gt 45 ] || break 3
      EP_A2A_TRITON_EARLY_SEND=$es EP_A2A_COMMIT=$NEW_COMMIT PYTHONPATH=$PWD/packages/ep-a2a/src timeout 60 \
        python3 -m torch.distributed.run --standalone --nproc-per-node=2 packages/ep-a2a/benchmarks/profile_small.py \
        --tokens 128 --iters 40 --shape $shape --variants default --json /tmp/es/p-$shape-es$es-$round.json \
        >/tmp/es/p-$shape-es$es-$round.log 2>&1
      echo "$shape es=$es round $round rc=$? ($(($(date +%s) - start)) s) $(grep '^==' /tmp/es/p-$shape-es$es-$round.log | sed 's/.*graph/graph/' | tr '\n' ' ')"
    done
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/es/p-*.json"))}
json.dump(runs, open(os.path.join(sys.argv[1], "early-send-ab.json"), "w"), indent=1)
PY
echo "done ($(($(date +%s) - start)) s)"
