#!/usr/bin/env bash
# H200: the committed benchmark of main (.ab-old's package = main's); H100: host-profile A/B + suite
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$card"
start=$(date +%s)
if echo "$card" | grep -q H200; then
  rm -rf packages/ep-a2a/src && cp -r .ab-old/packages/ep-a2a/src packages/ep-a2a/src
  EP_A2A_COMMIT=b305fe1 T_TESTS=0 VARIANTS_32="" VARIANTS_132="default steal=0 default steal=0" bash packages/ep-a2a/benchmarks/device_window.sh
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
for round in 1 2; do
  for tree in old new; do
    root=$PWD; [ "$tree" = old ] && root=$PWD/.ab-old
    PYTHONPATH=$root/packages/ep-a2a/src EP_A2A_COMMIT=$tree timeout 90 python3 -m torch.distributed.run --standalone \
      --nproc-per-node=2 packages/ep-a2a/benchmarks/bench_triton.py --host-profile --iters 60 \
      --json $OUT/host-profile-$tree-$round.json > /tmp/hp-$tree-$round.log 2>&1
    echo "$tree $round rc=$? ($(($(date +%s) - start)) s)"
    python3 -c "
import json,sys; d=json.load(open('$OUT/host-profile-$tree-$round.json'))
for r in d['host_profile']: m=r['median_us_since_previous_step']; print(r['shape'], r['tokens'], {k: round(v,1) for k,v in m.items()})"
  done
done
PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m pytest -m multigpu \
  packages/ep-a2a/tests -q -p no:cacheprovider -rfEs -k "side_streams or exact_flow or against_reference or graph" >"$OUT/multigpu-tests-stream-cache.log" 2>&1
echo "suite rc=$? ($(($(date +%s) - start)) s)"; grep -E "passed|failed|error" $OUT/multigpu-tests-stream-cache.log | tail -3
