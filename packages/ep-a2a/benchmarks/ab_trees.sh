#!/usr/bin/env bash
# Same-call A/B of two source trees of ep-a2a on 2 GPUs: an older commit's package against the working
# tree, interleaved rounds; raw JSON per round under $OUT.
#
#   bash packages/ep-a2a/benchmarks/ab_trees.sh export db94267   # here: the old tree into .ab-old/ (git-ignored)
#   OUT=/tmp/ab ROUNDS=2 NEW_COMMIT=$(git rev-parse --short HEAD) \
#     bash packages/ep-a2a/benchmarks/ab_trees.sh run            # on the 2-GPU machine (carry .ab-old)
#   OUT=/tmp/ab bash packages/ep-a2a/benchmarks/ab_trees.sh profile
#   OUT=/tmp/ab ROUNDS=2 bash packages/ep-a2a/benchmarks/ab_trees.sh host
#   bash packages/ep-a2a/benchmarks/ab_trees.sh export 99ec5da .ab-main  # any folder name .ab-*
#   OUT=/tmp/ab TREES="main=.ab-main new=." TOKENS="128 4096" ID_DTYPES="int32 int64" \
#     bash packages/ep-a2a/benchmarks/ab_trees.sh grid                  # (carry every .ab-* named)
#
# run: each tree's own `bench_triton.py --quick --heaps torch --no-split`.
# host: each tree's own `bench_triton.py --host-profile --iters 60` (host time per step of the
#   exact-shape dispatch), ROUNDS rounds of old, new.
# profile: the working tree's `profile_small.py` over each tree's package, default tiles, 4096 tokens,
#   132 SMs, two measurements per process: DeepSeek-V3 in two rounds, Qwen3-30B-A3B in the first
#   (old, new per round); the rows record the tree in `commit` (old / new).
# grid: the working tree's `profile_small.py` (graph replays, default tiles, 132 SMs) over each tree of
#   TREES (name=folder pairs, "." the working tree) x TOKENS x ID_DTYPES (int32), ROUNDS (2) interleaved
#   rounds of SHAPE (deepseek-v3); 40 iterations up to 256 tokens, 30 above. PROBE_TOKENS (unset: none)
#   first runs each tree once more with `--probe` at that token count (the stamps of trees whose
#   kernels have them). BUDGET (s, default 480) stops starting runs with under 40 s left. Writes
#   $OUT/grid.json (every run's JSON by name) and prints the median graph times per tree.
set -u
ab_env() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  mkdir -p "$OUT"
  start=$(date +%s)
}
case "${1:-}" in
export)
  dir=${3:-.ab-old}
  case "$dir" in .ab-*) ;; *) echo "export: the folder must be named .ab-* (git-ignored)" >&2; exit 2 ;; esac
  rm -rf "$dir" && mkdir -p "$dir"
  git archive "$2" packages/ep-a2a/src packages/ep-a2a/benchmarks | tar -x -C "$dir"
  echo "$2" >"$dir/COMMIT"
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
grid)
  ab_env
  prof=$PWD/packages/ep-a2a/benchmarks/profile_small.py
  left() { echo $((${BUDGET:-480} - ($(date +%s) - start))); }
  one() {  # name folder tokens dtype tag [--probe]
    local root=$PWD/$2 iters=30
    [ "$3" -le 256 ] && iters=40
    [ "$(left)" -ge 40 ] || { echo "$1 $3 $4 $5: skipped (budget)"; return; }
    PYTHONPATH=$root/packages/ep-a2a/src EP_A2A_COMMIT=$1 timeout 90 python3 -m torch.distributed.run \
      --standalone --nproc-per-node=2 "$prof" --tokens "$3" --iters $iters --shape "${SHAPE:-deepseek-v3}" \
      --id-dtype "$4" --variants default ${6:-} --json "/tmp/ab-grid/$1-$3-$4-$5.json" >/tmp/ab-grid/last.log 2>&1
    echo "$1 $3 $4 $5 rc=$? ($(($(date +%s) - start)) s) $(grep '^==' /tmp/ab-grid/last.log | sed 's/.*graph/graph/')"
  }
  rm -rf /tmp/ab-grid && mkdir -p /tmp/ab-grid
  if [ -n "${PROBE_TOKENS:-}" ]; then
    for tree in ${TREES:-old=.ab-old new=.}; do one "${tree%%=*}" "${tree#*=}" "$PROBE_TOKENS" int32 probe --probe; done
  fi
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for n in ${TOKENS:-128 4096}; do
      for dt in ${ID_DTYPES:-int32}; do
        for tree in ${TREES:-old=.ab-old new=.}; do one "${tree%%=*}" "${tree#*=}" "$n" "$dt" "r$round"; done
      done
    done
  done
  python3 - "$OUT/grid.json" <<'PY'
import glob, json, os, statistics, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/ab-grid/*.json"))}
json.dump(runs, open(sys.argv[1], "w"), indent=1)
per = {}
for name, r in runs.items():
    tree, n, dt, tag = name.rsplit("-", 3)
    if tag == "probe":
        continue
    v = r["variants"][0]
    per.setdefault((tree, n, dt), []).append((v["graph_dispatch_us"], v["graph_combine_us"]))
print("tree tokens ids: graph dispatch / combine, us (median of rounds; each round)")
for (tree, n, dt), xs in sorted(per.items(), key=lambda kv: (int(kv[0][1]), kv[0][2], kv[0][0])):
    d, c = zip(*xs)
    print(f"{tree:>10} {n:>5} {dt}: {statistics.median(d):7.1f} / {statistics.median(c):7.1f}   "
          + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in xs))
PY
  ;;
*)
  echo "usage: $0 export <commit> [.ab-folder] | run | profile | host | grid" >&2
  exit 2
  ;;
esac
