#!/usr/bin/env bash
# One device call for the forward side (sweeps 12, 13), every step under `timeout` and inside one overall
# deadline (DEADLINE_S seconds of this script) so that a hang cannot eat the device budget:
#   1. the package's GPU suite in three concurrent pytest processes (compilation is CPU-bound; results do
#      not depend on timing): test_forward.py; test_attn_dist.py + test_decode.py; the training side
#      (test_backward.py + test_indexer.py, which call the forward). A per-test limit (pytest-timeout,
#      thread method) names a test that hangs;
#   2. with AB=ad (sweeps 13, 14), if the attn_dist tests passed: tune.py's alternated A/B of the
#      default attn_dist (ad_ws) against the other variants of AD_AB_VARIANTS (and the forward), alone on
#      the GPU; the pre-declared rule (ab_decision.txt): the default wins if its median is lower than
#      every other variant's at every h_q 128 shape and it is bitwise reproducible;
#   3. if the forward side passed (and with AB=ad the new kernel won), the committed benchmark (run.py)
#      alone on the GPU.
# Usage (repository root): [AB=ad] OUT=... bash packages/sparse-mla-attn/benchmarks/_fwd_gpu_check.sh
# (Sweep 11's A/B and MODE=pingpong_default steps are in this file's history up to f53ca9e.)
export PYTHONPATH=$PWD/packages/sparse-mla-attn/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fwd_out}
DEADLINE_S=${DEADLINE_S:-320}
TESTS_S=${TESTS_S:-150}
mkdir -p "$OUT"
B=packages/sparse-mla-attn/benchmarks
T=packages/sparse-mla-attn/tests
left() { echo $((DEADLINE_S - SECONDS)); }
# min(step limit, time left), at least 1 (`timeout 0` would mean no limit)
cap() { local l; l=$(left); [ "$l" -lt 1 ] && l=1; [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu_tests.log"

suite() {  # name, test files...
  local name=$1; shift
  timeout "$(cap "$TESTS_S")" python3 -m pytest "$@" -m gpu -q -rfE -p no:cacheprovider \
    --timeout 100 -o timeout_method=thread --durations=8 > "$OUT/tests_$name.log" 2>&1
  echo "$name rc $? (t=${SECONDS}s)" >> "$OUT/tests_$name.log"
}
# SUITES: the suites to run (default all three; a later call may rerun only those whose code changed).
SUITES=${SUITES:-forward dist_decode training}
for n in $SUITES; do
  case $n in
    forward) suite forward $T/test_forward.py & ;;
    dist_decode) suite dist_decode $T/test_attn_dist.py $T/test_decode.py & ;;
    training) suite training $T/test_backward.py $T/test_indexer.py & ;;
  esac
done
wait
for n in $SUITES; do
  echo "== $n" >> "$OUT/gpu_tests.log"
  tail -30 "$OUT/tests_$n.log" >> "$OUT/gpu_tests.log"
done
grep -h " rc " "$OUT"/tests_*.log
WON=1
if [ "${AB:-}" = ad ]; then
  WON=0
  if grep -q "^dist_decode rc 0" "$OUT/tests_dist_decode.log"; then
    timeout "$(cap 120)" python3 $B/tune.py --only ad_ab --reps 2 --out "$OUT/tune13.json" > "$OUT/tune13.log" 2>&1
    echo "tune rc $? (t=${SECONDS}s)" | tee -a "$OUT/tune13.log"
    tail -8 "$OUT/tune13.log"
    python3 - "$OUT/tune13.json" > "$OUT/ab_decision.txt" 2>&1 <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r.get("label") == "ad_ab"]
ok = bool(rows) and all("error" not in r for r in rows)
for r in rows:
    v = r.get("variants", {})
    if r["h_q"] == 128:
        others = [n for n in v if n.startswith("ad_") and n != "ad_ws"]
        ok = ok and all(v["ad_ws"]["ms"] < v[n]["ms"] for n in others) and v["ad_ws"]["deterministic"]
    print(r["h_q"], r["s_kv"], {n: (x.get("ms"), round(x.get("ratio_to_fwd", 0), 3)) for n, x in v.items()})
print("WON" if ok else "LOST")
PY
    cat "$OUT/ab_decision.txt"
    grep -q "^WON" "$OUT/ab_decision.txt" && WON=1
  fi
fi
PASSED=1
for n in $SUITES; do
  [ "$n" = training ] || grep -q "^$n rc 0" "$OUT/tests_$n.log" || PASSED=0
done
if [ "$PASSED" = 1 ] && [ "$WON" = 1 ] && [ "$(left)" -gt 60 ]; then
  timeout "$(cap 200)" python3 $B/run.py --out-dir "$OUT" > "$OUT/bench.log" 2>&1
  echo "run.py rc $? (t=${SECONDS}s)" | tee -a "$OUT/bench.log"
  tail -45 "$OUT/bench.log"
else
  echo "benchmark skipped: forward-side tests failed, A/B lost (WON=$WON) or $(left) s left" | tee "$OUT/bench.log"
fi
echo "done at t=${SECONDS}s"
