# same-call A/B of .ab-old (HEAD) against the working tree: profile_small default tiles, interleaved
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
B=$PWD/packages/ep-a2a/benchmarks/profile_small.py
s=$(date +%s)
for round in 1 2; do for tree in old new; do
  root=$PWD; [ $tree = old ] && root=$PWD/.ab-old
  for shape in deepseek-v3 qwen3-30b-a3b; do
    [ $shape = qwen3-30b-a3b ] && [ $round = 2 ] && continue
    PYTHONPATH=$root/packages/ep-a2a/src EP_A2A_COMMIT=$tree timeout 80 python3 -m torch.distributed.run --standalone --nproc-per-node=2 $B --tokens 4096 --iters 30 --shape $shape --variants default default --json $OUT/ab-$shape-$tree-$round.json > /tmp/ab-$shape-$tree-$round.log 2>&1
    echo "$shape $tree $round rc=$? $(( $(date +%s) - s )) s"; grep "^==" /tmp/ab-$shape-$tree-$round.log | sed 's/.*graph/graph/'
  done
done; done
