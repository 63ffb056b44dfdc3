#!/usr/bin/env bash
# Same-call A/B of two source trees of ep-a2a on 2 GPUs: an older commit's package against the working
# tree, interleaved rounds of `bench_triton.py --quick --heaps torch --no-split` (each tree runs its own
# benchmark script), raw JSON per round under $OUT.
#
#   bash packages/ep-a2a/benchmarks/ab_trees.sh export db94267   # here: the old tree into .ab-old/ (git-ignored)
#   OUT=/tmp/ab ROUNDS=2 NEW_COMMIT=$(git rev-parse --short HEAD) \
#     bash packages/ep-a2a/benchmarks/ab_trees.sh run            # on the 2-GPU machine (carry .ab-old)
set -u
case "${1:-}" in
export)
  rm -rf .ab-old && mkdir -p .ab-old
  git archive "$2" packages/ep-a2a/src packages/ep-a2a/benchmarks/bench_triton.py | tar -x -C .ab-old
  echo "$2" >.ab-old/COMMIT
  ;;
run)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  mkdir -p "$OUT"
  start=$(date +%s)
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for tree in old new; do
      if [ "$tree" = old ]; then root=$PWD/.ab-old commit=$(cat .ab-old/COMMIT); else root=$PWD commit=${NEW_COMMIT:-}; fi
      EP_A2A_COMMIT=$commit PYTHONPATH=$root/packages/ep-a2a/src timeout 90 python3 -m torch.distributed.run \
        --standalone --nproc-per-node=2 "$root/packages/ep-a2a/benchmarks/bench_triton.py" --quick --heaps torch \
        --no-split --json "$OUT/ab-$tree-$round.json" >"$OUT/ab-$tree-$round.log" 2>&1
      echo "$tree round $round rc=$? ($(($(date +%s) - start)) s)"
    done
  done
  ;;
*)
  echo "usage: $0 export <commit> | run" >&2
  exit 2
  ;;
esac
