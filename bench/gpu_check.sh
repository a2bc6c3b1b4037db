#!/usr/bin/env bash
# The whole GPU check in one device call: install offline, then the phases named on the
# command line (default: tests).  Phases: tests, bench, prefill, tiermap, tune, cli.  Logs and results go to $OUT.
#   bash bench/gpu_check.sh tests
#   bash bench/gpu_check.sh bench cli
#   K3TAIL_COMMIT=<sha> bash bench/gpu_check.sh ...   (the device's copy carries a stale .git: pass the
#   commit being measured, or the result files record the wrong one)
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -n "${K3TAIL_COMMIT:-}" ] && export K3TAIL_COMMIT || echo "note: K3TAIL_COMMIT unset; results record the copy's git HEAD"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash bench/gpu_smoke.sh
phases=${*:-tests}
for phase in $phases; do
  case $phase in
    tests)
      timeout ${TEST_TIMEOUT:-420} python3 -m pytest ${TESTS:-tests} -m gpu -q -rfE -p no:cacheprovider \
        -o timeout=150 --durations=15 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error|Timeout|[0-9.]+ ulp|us |s call" ;;
    bench)
      for b in ${BENCHES:-bench_allreduce bench_finalize bench_tail}; do
        echo "== $b"; timeout ${BENCH_TIMEOUT:-200} python3 bench/$b.py --out bench/results 2>&1 | tee -a "$OUT/bench.log" | tail -25
      done ;;
    prefill)
      # issue 14's targets: Triton finalize, K3MoETail W=1, eager host time, loopback sharded vs allreduce
      echo "== bench_prefill"; timeout ${PREFILL_TIMEOUT:-300} python3 bench/bench_prefill.py --out bench/results ${PREFILL_ARGS:-} 2>&1 | tee -a "$OUT/prefill.log" | tail -30 ;;
    tiermap)
      # the tier map alone (default M grid 1..8192, W = 2, 4, 8), with the shipped tactic table
      echo "== k3tail bench"; timeout ${CLI_BENCH_TIMEOUT:-280} k3tail -v bench ${TIERMAP_ARGS:-} 2>&1 | tee -a "$OUT/cli.log" | grep -v "tactic table" | tail -40 ;;
    tune)
      # the tactic table (k3tail/tables/tactics.json) and the sweep report (bench/results/tune_*)
      echo "== k3tail tune"; timeout ${TUNE_TIMEOUT:-250} k3tail -v tune ${TUNE_ARGS:-} 2>&1 | tee -a "$OUT/cli.log" | tail -30 ;;
    cli)
      # tune first: the bench then runs with the tactics and crossovers it wrote
      echo "== k3tail tune"; timeout ${TUNE_TIMEOUT:-250} k3tail -v tune 2>&1 | tee -a "$OUT/cli.log" | tail -20
      echo "== k3tail bench"; timeout ${CLI_BENCH_TIMEOUT:-280} k3tail -v bench 2>&1 | tee -a "$OUT/cli.log" | tail -30 ;;
  esac
done
tar czf "$OUT/results.tgz" bench/results k3tail/tables 2>/dev/null
ls -la bench/results | tail -20
