#!/usr/bin/env bash
# session 19: grid A/B at 128 and 4096 tokens (base = HEAD + stamps, c3 = + layout scans without
# transpose, new = working tree: + ld.acquire polls, st.relaxed pushes), probe stamps at 128 tokens,
# then a multigpu subset at the working tree with the time left
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
TREES="base=.ab-base c3=.ab-c3 new=." TOKENS="128 4096" ROUNDS=2 PROBE_TOKENS=128 BUDGET=${BUDGET:-330} \
  bash packages/ep-a2a/benchmarks/ab_trees.sh grid
python3 - "$OUT/grid.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
for name, r in runs.items():
    if not name.endswith("probe"):
        continue
    st = r["variants"][0].get("stamps_us", {}).get("rank0", {})
    print(name)
    for k, v in st.items():
        print(f"  {k:32s} " + " ".join(f"{x:6.1f}" for x in v))
PY
t=$((${END:-545} - ($(date +%s) - start)))
echo "tests get $t s"
if [ "$t" -gt 60 ]; then
  PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src timeout $t python3 -m torch.distributed.run \
    --standalone --nproc-per-node=2 -m pytest -m multigpu packages/ep-a2a/tests -q -p no:cacheprovider -rfEs -x \
    -k "against_reference or capture_replay or timeout or speculative or forced_remote or missing" \
    >"$OUT/multigpu-tests-subset.log" 2>&1
  echo "subset rc=$? ($(($(date +%s) - start)) s)"; grep -E "passed|failed|error|FAILED" "$OUT/multigpu-tests-subset.log" | tail -6
fi
echo "done ($(($(date +%s) - start)) s)"
