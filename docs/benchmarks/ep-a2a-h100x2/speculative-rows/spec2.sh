#!/usr/bin/env bash
# speculative rows on main's rows-ahead flow: whole multigpu suite, bench --quick x2 (default vs nospec rows), host profile
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; start=$(date +%s)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$card"
[ -n "${NEED_H200:-}" ] && { echo "$card" | grep -q H200 || exit 3; }
commit=${EP_A2A_COMMIT:-new}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
if [ "${T_TESTS:-200}" -gt 0 ]; then
PYTHONPATH=/tmp/site:$PWD/packages/ep-a2a/src:$PWD/packages/eplb-core/src timeout ${T_TESTS:-200} python3 -m torch.distributed.run \
  --standalone --nproc-per-node=2 -m pytest -m multigpu packages/ep-a2a/tests -q -p no:cacheprovider -rfEs ${K_TESTS:+-k "$K_TESTS"} \
  >"$OUT/multigpu-tests-$commit.log" 2>&1
echo "suite rc=$? ($(($(date +%s) - start)) s)"; grep -E "passed|failed|error" "$OUT/multigpu-tests-$commit.log" | tail -4
fi
for round in $(seq 1 ${ROUNDS:-2}); do
  EP_A2A_COMMIT=$commit PYTHONPATH=$PWD/packages/ep-a2a/src timeout 100 python3 -m torch.distributed.run \
    --standalone --nproc-per-node=2 packages/ep-a2a/benchmarks/bench_triton.py --quick --heaps torch \
    --no-split --num-sm 132 --iters 30 --json "/tmp/spec-$round.json" >"/tmp/spec-$round.log" 2>&1
  echo "bench round $round rc=$? ($(($(date +%s) - start)) s)"; tail -2 /tmp/spec-$round.log | cut -c1-300
done
EP_A2A_COMMIT=$commit PYTHONPATH=$PWD/packages/ep-a2a/src timeout 90 python3 -m torch.distributed.run \
    --standalone --nproc-per-node=2 packages/ep-a2a/benchmarks/bench_triton.py --host-profile --iters 60 \
    --json "$OUT/host-profile-$commit.json" >/tmp/hp.log 2>&1
echo "host profile rc=$? ($(($(date +%s) - start)) s)"; tail -3 /tmp/hp.log | cut -c1-400
python3 - "$OUT" "$commit" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/spec-*.json"))}
json.dump(runs, open(os.path.join(sys.argv[1], f"spec-bench-{sys.argv[2]}.json"), "w"), indent=1)
for name, d in runs.items():
    for c in d["cases"]:
        for k, r in c["results"].items():
            if k.startswith("ours") or k.startswith("nccl") or k == "ce":
                print(name, c["tokens"], k, {kk: (round(v * 1e3, 1) if isinstance(v, float) else v) for kk, v in r.items() if "ms" in kk or kk.startswith("spec")})
hp = json.load(open(os.path.join(sys.argv[1], f"host-profile-{sys.argv[2]}.json")))
for r in hp.get("host_profile", []):
    print(r["shape"], r["tokens"], r["speculative_rows"], {k: round(v, 1) for k, v in r["median_us_since_previous_step"].items()})
PY
echo "done ($(($(date +%s) - start)) s)"
