#!/usr/bin/env bash
# Same-call A/B of two source trees of ep-a2a on 2 GPUs: an older commit's package against the working
# tree, interleaved rounds; raw JSON per round under $OUT.
#
#   bash packages/ep-a2a/benchmarks/ab_trees.sh export db94267   # here: the old tree into .ab-old/ (git-ignored)
#   OUT=/tmp/ab ROUNDS=2 NEW_COMMIT=$(git rev-parse --short HEAD) \
#     bash packages/ep-a2a/benchmarks/ab_trees.sh run            # on the 2-GPU machine (carry .ab-old)
#   OUT=/tmp/ab bash packages/ep-a2a/benchmarks/ab_trees.sh profile
#   OUT=/tmp/ab ROUNDS=2 bash packages/ep-a2a/benchmarks/ab_trees.sh host
#
# run: each tree's own `bench_triton.py --quick --heaps torch --no-split`.
# host: each tree's own `bench_triton.py --host-profile --iters 60` (host time per step of the
#   exact-shape dispatch), ROUNDS rounds of old, new.
# profile: the working tree's `profile_small.py` over each tree's package, default tiles, 4096 tokens,
#   132 SMs, two measurements per process: DeepSeek-V3 in two rounds, Qwen3-30B-A3B in the first
#   (old, new per round); the rows record the tree in `commit` (old / new).
set -u
ab_env() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  mkdir -p "$OUT"
  start=$(date +%s)
}
case "${1:-}" in
export)
  rm -rf .ab-old && mkdir -p .ab-old
  git archive "$2" packages/ep-a2a/src packages/ep-a2a/benchmarks | tar -x -C .ab-old
  echo "$2" >.ab-old/COMMIT
  ;;
run | host)
  ab_env
  if [ "$1" = run ]; then args=(--quick --heaps torch --no-split) name=ab; else args=(--host-profile --iters 60) name=host; fi
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for tree in old new; do
      if [ "$tree" = old ]; then root=$PWD/.ab-old commit=$(cat .ab-old/COMMIT); else root=$PWD commit=${NEW_COMMIT:-}; fi
      EP_A2A_COMMIT=$commit PYTHONPATH=$root/packages/ep-a2a/src timeout 90 python3 -m torch.distributed.run \
        --standalone --nproc-per-node=2 "$root/packages/ep-a2a/benchmarks/bench_triton.py" "${args[@]}" \
        --json "$OUT/$name-$tree-$round.json" >"$OUT/$name-$tree-$round.log" 2>&1
      echo "$name $tree round $round rc=$? ($(($(date +%s) - start)) s)"
    done
  done
  ;;
profile)
  ab_env
  prof=$PWD/packages/ep-a2a/benchmarks/profile_small.py
  for round in 1 2; do
    for tree in old new; do
      root=$PWD
      [ "$tree" = old ] && root=$PWD/.ab-old
      for shape in deepseek-v3 qwen3-30b-a3b; do
        [ "$shape" = qwen3-30b-a3b ] && [ "$round" = 2 ] && continue
        log=/tmp/ab-$shape-$tree-$round.log  # (the device returns few files: JSON only under $OUT)
        PYTHONPATH=$root/packages/ep-a2a/src EP_A2A_COMMIT=$tree timeout 80 python3 -m torch.distributed.run \
          --standalone --nproc-per-node=2 "$prof" --tokens 4096 --iters 30 --shape $shape --variants default \
          default --json "$OUT/ab-$shape-$tree-$round.json" >"$log" 2>&1
        echo "$shape $tree $round rc=$? $(($(date +%s) - start)) s"
        grep "^==" "$log" | sed 's/.*graph/graph/'
      done
    done
  done
  ;;
*)
  echo "usage: $0 export <commit> | run | profile | host" >&2
  exit 2
  ;;
esac
