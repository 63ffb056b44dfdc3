#!/usr/bin/env bash
# The 128-token graph dispatch of main at a9817fb across fresh processes on one 2x H100 machine:
# profile_small.py and bench_triton.py (the committed benchmark script), in this order.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=packages/ep-a2a/benchmarks
start=$(date +%s)
export PYTHONPATH=$PWD/packages/ep-a2a/src
gpu() { nvidia-smi --query-gpu=index,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader | tr '\n' ' '; echo; }
trun() { EP_A2A_COMMIT=a9817fb timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node=2 "$@"; }
gpu
for i in 1 2; do
  trun $P/profile_small.py --tokens 128 --iters 40 --shape deepseek-v3 --variants default --json $OUT/prof-$i.json 2>&1 | grep '^==' | sed 's/.*graph/graph/'
  echo "prof $i ($(($(date +%s) - start)) s)"; gpu
  trun $P/bench_triton.py --quick --tokens 128 --num-sm 132 --heaps torch --json $OUT/bench128-$i.json >/tmp/b128.log 2>&1 || tail -5 /tmp/b128.log
  echo "bench128 $i rc=$? ($(($(date +%s) - start)) s)"; gpu
done
trun $P/bench_triton.py --quick --num-sm 132 --heaps torch --json $OUT/benchquick.json >/tmp/bq.log 2>&1 || tail -5 /tmp/bq.log
echo "benchquick rc=$? ($(($(date +%s) - start)) s)"; gpu
trun $P/profile_small.py --tokens 128 --iters 40 --shape deepseek-v3 --variants default --json $OUT/prof-3.json 2>&1 | grep '^==' | sed 's/.*graph/graph/'
echo "prof 3 ($(($(date +%s) - start)) s)"; gpu
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/bench*.json")):
    d = json.load(open(f))
    for c in d["cases"]:
        if c["tokens"] != 128:
            continue
        r = c["results"].get("ours-graph-sm132", {})
        print(os.path.basename(f), c["shape"], "graph dispatch %.1f us, combine %.1f us" % (1e3 * r["dispatch_ms"], 1e3 * r["combine_ms"]))
PY
