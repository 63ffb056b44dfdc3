#!/usr/bin/env bash
# session 17: multigpu suite (or the K_TESTS subset) at NEW_COMMIT, then A/B (.ab-old = 3a9c540 vs working tree) of profile_small at
# 128 tokens (graph replays), interleaved: the backend with int32 ids (what the int64 reading costs the
# int32 path) and the user's call through EPAll2AllLayer with int64 ids (what the conversion cost)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
if [ "${T_TESTS:-0}" -gt 0 ]; then
PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src timeout ${T_TESTS} python3 -m torch.distributed.run \
  --standalone --nproc-per-node=2 -m pytest -m multigpu packages/ep-a2a/tests -q -p no:cacheprovider -rfEs -k "${K_TESTS:-}" \
  >"$OUT/multigpu-tests-$NEW_COMMIT-${LOG_TAG:-suite}.log" 2>&1
echo "suite rc=$? ($(($(date +%s) - start)) s)"; grep -E "passed|failed|error|FAILED" "$OUT/multigpu-tests-$NEW_COMMIT-${LOG_TAG:-suite}.log" | tail -6
fi
left() { echo $((${BUDGET:-260} - ($(date +%s) - start))); }
mkdir -p /tmp/ab
for round in 1 2; do
  for mode in layer64 backend32; do
    for shape in ${SHAPES:-deepseek-v3 qwen3-30b-a3b}; do
      [ "$mode" = backend32 ] && [ "$shape" = qwen3-30b-a3b ] && continue
      for tree in old new; do
        [ "$(left)" -gt 25 ] || break 4
        if [ "$tree" = old ]; then root=$PWD/.ab-old; else root=$PWD; fi
        if [ "$mode" = layer64 ]; then extra="--layer --id-dtype int64"; else extra=""; fi
        PYTHONPATH=$root/packages/ep-a2a/src EP_A2A_COMMIT=$tree timeout 45 python3 -m torch.distributed.run \
          --standalone --nproc-per-node=2 $PWD/packages/ep-a2a/benchmarks/profile_small.py --tokens 128 --iters 40 \
          --shape $shape --variants default $extra --json /tmp/ab/p-$mode-$shape-$tree-$round.json >/tmp/ab/p.log 2>&1
        echo "$mode $shape $tree $round rc=$? ($(($(date +%s) - start)) s) $(grep '^==' /tmp/ab/p.log | sed 's/.*graph/graph/')"
        grep -A1 "rank0 dispatch" /tmp/ab/p.log | head -1
      done
    done
  done
done
python3 - "$OUT" "${AB_NAME:-int64-ids-ab}" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/ab/p-*.json"))}
json.dump(runs, open(os.path.join(sys.argv[1], sys.argv[2] + ".json"), "w"), indent=1)
PY
echo "done ($(($(date +%s) - start)) s)"
