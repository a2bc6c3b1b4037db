#!/usr/bin/env bash
# The whole GPU check in one device call: install offline, then the phases named on the command line
# (default: tests).  Logs and results go to $OUT.
#
#   bash bench/gpu_check.sh tests            # every GPU test (phases t1 t2 t3 below, in order)
#   bash bench/gpu_check.sh t1 prefill       # named phases: t1 t2 t3 (the GPU tests in three parts),
#                                            # prefill, bench, tiermap, tune, cli, pairing, sweep, invariance,
#                                            # w8 (loopback W = 8 latency vs bench_tail.json), profile,
#                                            # gemm, numerics, probe (issue 29)
#   K3TAIL_COMMIT=<sha> bash bench/gpu_check.sh ...   (the device's copy carries a stale .git: pass the
#   commit being measured, or the result files record the wrong one)
#
# Triton's compile cache travels between calls: a call restores .tcache/triton-cache.tgz (or its parts,
# .tcache/triton-cache.tgz.part-*) when present (.tcache is untracked and not ignored, so it travels) and
# writes the updated cache to $OUT as parts of at most 15 MB (a file over 16 MiB does not come back from
# the device); copy the parts to .tcache/ (and remove the older cache there) for the next call.
# Compiling is most of a cold GPU test run.
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -n "${K3TAIL_COMMIT:-}" ] && export K3TAIL_COMMIT || echo "note: K3TAIL_COMMIT unset; results record the copy's git HEAD"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if compgen -G ".tcache/triton-cache.tgz.part-*" > /dev/null; then
  mkdir -p "$TRITON_CACHE_DIR" && cat .tcache/triton-cache.tgz.part-* | tar xzf - -C "$TRITON_CACHE_DIR" \
    && echo "restored Triton cache (parts)"
elif [ -f .tcache/triton-cache.tgz ]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar xzf .tcache/triton-cache.tgz -C "$TRITON_CACHE_DIR" && echo "restored Triton cache"
fi
bash bench/gpu_smoke.sh
T0=$(date +%s)

run_tests() {  # run_tests NAME FILES...: the GPU tests of FILES, log to $OUT/gpu_NAME.log (-rP: the passed
              # tests' printed numbers too, e.g. the soak's summary line)
  local name=$1; shift
  local t=$(date +%s)
  timeout ${TEST_TIMEOUT:-500} python3 -m pytest "$@" -m gpu -q -rfEP -p no:cacheprovider -o timeout=${PYTEST_TIMEOUT:-200} \
    --durations=10 2>&1 | tee "$OUT/gpu_$name.log" | grep -E "passed|failed|FAILED|ERROR|Error|Timeout|s call|^soak"
  echo "phase $name took $(( $(date +%s) - t )) s"
}

# The GPU tests in three phases (each well inside one call's 600 s; `tests` runs all three).
T1="tests/test_launch.py tests/test_warmup.py tests/test_module.py tests/test_numerics.py tests/test_projection.py tests/test_finalize.py"
T2="tests/test_tail.py tests/test_allreduce.py tests/test_large_m.py tests/test_prefill.py tests/test_exchange.py"
T3="tests/test_process_path.py tests/test_faults.py tests/test_spawn.py tests/test_device.py tests/test_cli.py"
phases=${*:-tests}
for phase in $phases; do
  case $phase in
    tests) run_tests t1 $T1; run_tests t2 $T2; run_tests t3 $T3 ;;
    t1) run_tests t1 ${TESTS:-$T1} ;;
    t2) run_tests t2 $T2 ;;
    t3) run_tests t3 $T3 ;;
    only) run_tests only $TESTS ;;
    bench)
      for b in ${BENCHES:-bench_allreduce bench_finalize bench_tail}; do
        echo "== $b"; timeout ${BENCH_TIMEOUT:-200} python3 bench/$b.py --out bench/results ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" | tail -25
      done ;;
    prefill)
      echo "== bench_prefill"; timeout ${PREFILL_TIMEOUT:-300} python3 bench/bench_prefill.py --out bench/results ${PREFILL_ARGS:-} 2>&1 | tee -a "$OUT/prefill.log" | grep -v "^ *$" | tail -40 ;;
    tiermap)
      echo "== k3tail bench"; timeout ${CLI_BENCH_TIMEOUT:-280} k3tail -v bench ${TIERMAP_ARGS:-} 2>&1 | tee -a "$OUT/cli.log" | grep -v "tactic table" | tail -40 ;;
    tune)
      echo "== k3tail tune"; timeout ${TUNE_TIMEOUT:-250} k3tail -v tune ${TUNE_ARGS:-} 2>&1 | tee -a "$OUT/cli.log" | tail -30 ;;
    cli)
      echo "== k3tail tune"; timeout ${TUNE_TIMEOUT:-250} k3tail -v tune 2>&1 | tee -a "$OUT/cli.log" | tail -20
      echo "== k3tail bench"; timeout ${CLI_BENCH_TIMEOUT:-280} k3tail -v bench 2>&1 | tee -a "$OUT/cli.log" | tail -30 ;;
    pairing) run_tests pairing tests/test_pairing.py ;;   # issue 20: uneven W = 3/6, process-path faults, soak
    sweep) run_tests sweep tests/test_loopback_sweep.py ;;   # issue 28: loopback W = 2..8, every launch boundary
    invariance) run_tests invariance ${TESTS:-tests/test_invariance.py} ;;   # issue 21
    w8)  # issue 20's latency check: loopback W = 8 TAIL_FUSION against the committed bench_tail.json
      echo "== bench_tail loopback"; timeout ${W8_TIMEOUT:-120} python3 bench/bench_tail.py --skip-kernel-b \
        --name bench_tail_w8_${K3TAIL_COMMIT:-head} --baseline bench/results/bench_tail.json --out bench/results 2>&1 \
        | tee -a "$OUT/w8.log" | grep -E "loopback|vs |wrote|failed" ;;
    gemm)  # issue 29: the GEMM family (and kernel B) against cuBLAS, bit-classes of every candidate
      echo "== bench_gemm"; timeout ${GEMM_TIMEOUT:-300} python3 bench/bench_gemm.py --quick --out bench/results \
        --name gemm_${K3TAIL_COMMIT:-head} ${GEMM_ARGS:-} 2>&1 | tee -a "$OUT/gemm.log" | tail -60 ;;
    numerics)  # issue 29 item 2: the tree against the single chain, the real GEMM on this GPU, vs fp64
      echo "== tree_numerics"; timeout ${NUMERICS_TIMEOUT:-200} python3 bench/tree_numerics.py --device cuda \
        --out bench/results/tree_numerics_${K3TAIL_COMMIT:-head}.json 2>&1 | tee -a "$OUT/numerics.log" | tail -50 ;;
    profile)  # issue 19: where one eager call's host time goes
      echo "== profile_host"; timeout ${PROFILE_TIMEOUT:-90} python3 bench/profile_host.py > "$OUT/profile_host.log" 2>&1
      grep -E "^== M" "$OUT/profile_host.log" ;;
    probe)  # issue 29: kernel A with one stage edited out (bench/probe_tail_a.py), and candidate fixes
      echo "== probe_tail_a"; timeout ${PROBE_TIMEOUT:-200} python3 bench/probe_tail_a.py --out bench/results \
        --name probe_tail_a_${K3TAIL_COMMIT:-head} ${PROBE_ARGS:-} 2>&1 | tee -a "$OUT/probe.log" \
        | grep -E "^[a-z0-9]+ +M=|failed|wrote|Error" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
echo "all phases took $(( $(date +%s) - T0 )) s"
tar czf "$OUT/results.tgz" bench/results k3tail/tables 2>/dev/null
[ -d "$TRITON_CACHE_DIR" ] && tar czf - -C "$TRITON_CACHE_DIR" . | split -b 15m - "$OUT/triton-cache.tgz.part-" \
  && ls -la "$OUT"/triton-cache.tgz.part-*
ls -la bench/results | tail -20
