#!/usr/bin/env bash
# One device call for the forward side: GPU tests (forward, attn_dist, decode), the Gluon forward sweep
# (tune.py --only fwd), then, if the tests passed and a variant beat the current default over the sweep's
# shapes, that variant is written into GLUON_FWD (src/sparse_mla_attn/_gluon.py) and the committed
# benchmark (run.py) runs with it. The same edit is then committed from the development machine.
# Usage (repository root): OUT=... SPARSE_MLA_COMMIT=<sha> bash packages/sparse-mla-attn/benchmarks/_fwd_gpu_check.sh
export PYTHONPATH=$PWD/packages/sparse-mla-attn/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fwd_out}
mkdir -p "$OUT"
B=packages/sparse-mla-attn/benchmarks
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/tune.log"
timeout 150 python3 -m pytest packages/sparse-mla-attn/tests/test_forward.py packages/sparse-mla-attn/tests/test_attn_dist.py \
  packages/sparse-mla-attn/tests/test_decode.py -m gpu -q -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
[ "${SKIP_TUNE:-0}" = 1 ] || (cd $B && timeout 100 python3 tune.py --only fwd --out "$OUT/tune.json" 2>&1 | grep -v "^ *$" | tee -a "$OUT/tune.log")
# Winner: lowest summed time over the sweep's shapes among variants that ran every shape.
timeout 20 python3 - "$OUT/tune.json" packages/sparse-mla-attn/src/sparse_mla_attn/_gluon.py <<'PY' 2>&1 | tee -a "$OUT/tune.log" > "$OUT/pick.txt"
import json, re, sys
rows = [r for r in json.load(open(sys.argv[1]))[1:] if r.get("label") == "fwd" and "ms" in r]
tot, n = {}, {}
for r in rows:
    key = tuple(sorted((k, v) for k, v in r["config"].items() if k.startswith("G_")))
    tot[key] = tot.get(key, 0.0) + r["ms"]
    n[key] = n.get(key, 0) + 1
full = {k: v for k, v in tot.items() if n[k] == max(n.values())}
best = min(full, key=full.get)
print("totals (ms):", {str(dict(k)): round(v, 3) for k, v in full.items()})
src = open(sys.argv[2]).read()
cur = re.search(r"^GLUON_FWD = (\{.*\})$", src, re.M)
cur_cfg = eval(cur.group(1))
if all(cur_cfg.get(k) == v for k, v in best):
    print("PICK none (the current default is fastest)")
else:
    new = {**cur_cfg, **dict(best)}
    open(sys.argv[2], "w").write(src.replace(cur.group(0), "GLUON_FWD = " + repr(new)))
    print("PICK", new)
PY
if [ "$tests_rc" = 0 ] && grep -q "^PICK {" "$OUT/pick.txt"; then
  timeout 220 python3 $B/run.py --out-dir "$OUT" 2>&1 | tail -60 > "$OUT/bench.log"
else
  echo "benchmark skipped: tests rc $tests_rc, $(cat "$OUT/pick.txt" | tail -1)" | tee "$OUT/bench.log"
fi
rm -f "$OUT/pick.txt"
