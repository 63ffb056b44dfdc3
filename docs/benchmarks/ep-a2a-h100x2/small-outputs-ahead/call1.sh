#!/usr/bin/env bash
# session 16 call 1: whole multigpu suite at NEW_COMMIT, then A/B (old tree .ab-old vs working tree):
# host profile rounds, then bench --quick rounds while the call's time lasts
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
EP_A2A_COMMIT=$NEW_COMMIT T_TESTS=${T_TESTS:-330} T_BENCH=0 VARIANTS_32="" VARIANTS_132="" \
  bash packages/ep-a2a/benchmarks/device_window.sh
left() { echo $((${BUDGET:-585} - ($(date +%s) - start))); }
for round in 1 2; do
  for tree in old new; do
    [ "$(left)" -gt 60 ] || break 2
    if [ "$tree" = old ]; then root=$PWD/.ab-old c=$(cat .ab-old/COMMIT); else root=$PWD c=$NEW_COMMIT; fi
    EP_A2A_COMMIT=$c PYTHONPATH=$root/packages/ep-a2a/src timeout 60 python3 -m torch.distributed.run \
      --standalone --nproc-per-node=2 "$root/packages/ep-a2a/benchmarks/bench_triton.py" --host-profile --iters 60 \
      --json "$OUT/host-$tree-$round.json" >"/tmp/host-$tree-$round.log" 2>&1
    echo "host $tree $round rc=$? ($(($(date +%s) - start)) s)"
  done
done
for round in 1 2; do
  for tree in old new; do
    [ "$(left)" -gt 95 ] || break 2
    if [ "$tree" = old ]; then root=$PWD/.ab-old c=$(cat .ab-old/COMMIT); else root=$PWD c=$NEW_COMMIT; fi
    EP_A2A_COMMIT=$c PYTHONPATH=$root/packages/ep-a2a/src timeout 90 python3 -m torch.distributed.run \
      --standalone --nproc-per-node=2 "$root/packages/ep-a2a/benchmarks/bench_triton.py" --quick --heaps torch \
      --no-split --num-sm 132 --iters 30 --json "$OUT/ab-$tree-$round.json" >"/tmp/ab-$tree-$round.log" 2>&1
    echo "ab $tree $round rc=$? ($(($(date +%s) - start)) s)"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "host-*.json"))):
    for r in json.load(open(f)).get("host_profile", []):
        print(os.path.basename(f), r["shape"], r["tokens"], r["speculative_rows"], {k: round(v, 1) for k, v in r["median_us_since_previous_step"].items()})
for f in sorted(glob.glob(os.path.join(sys.argv[1], "ab-*.json"))):
    for c in json.load(open(f)).get("cases", []):
        for k, r in c["results"].items():
            if k.startswith("ours") or k.startswith("nccl"):
                print(os.path.basename(f), c["tokens"], k, {kk: round(v * 1e3, 1) for kk, v in r.items() if isinstance(v, float) and "ms" in kk})
PY
echo "done ($(($(date +%s) - start)) s)"
