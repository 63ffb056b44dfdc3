#!/usr/bin/env bash
# Three processes of probe_lead.py on the 2-GPU machine, from the repository root.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/packages/ep-a2a/src
for i in 1 2 3; do
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
    packages/ep-a2a/benchmarks/probe_lead.py "$OUT/lead-$i.json" >/tmp/lead.log 2>&1 || tail -20 /tmp/lead.log
  grep '^{' /tmp/lead.log
done
