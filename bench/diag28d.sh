#!/usr/bin/env bash
# Issue 28, device call: the loopback sweep at W = 3 (the M = 513 exchange-barrier timeout) with the host
# threads' stacks dumped when a run outlasts K3TAIL_STACK_DUMP_S; if it fails, again with CUDA modules
# loaded eagerly; then the W = 1 batch-invariance test (the reduction tree's first GPU check, issue 29).
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}; mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/triton-cache.tgz ] && tar xzf .tcache/triton-cache.tgz -C "$TRITON_CACHE_DIR" && echo "restored Triton cache"
bash bench/gpu_smoke.sh
T0=$(date +%s)
p() {  # p NAME LIMIT_S PYTEST_ARGS...: log to $OUT/NAME.log, show the lines that matter
  local name=$1 lim=$2; shift 2
  echo "=== $name ($(( $(date +%s) - T0 )) s in)"
  timeout "$lim" python3 -m pytest "$@" -m gpu -q -s -rfE -p no:cacheprovider -o timeout=$lim > "$OUT/$name.log" 2>&1
  echo "rc $?"
  grep -E "^W=|M=.*(differ|FAIL)|rows checked|host issue|passed|failed|Error|Thread 0x|File .*k3tail|File .*torch|File .*triton" \
    "$OUT/$name.log" | grep -v "tactic table" | head -${HEADN:-60}
}
export K3TAIL_STACK_DUMP_S=${K3TAIL_STACK_DUMP_S:-12}
p sweep3 ${SWEEP_S:-220} "tests/test_loopback_sweep.py::test_gpu_loopback_sweep_every_tier[3]"
if ! grep -q " passed" "$OUT/sweep3.log" || grep -q "failed" "$OUT/sweep3.log"; then
  CUDA_MODULE_LOADING=EAGER p sweep3_eager ${SWEEP_S:-220} "tests/test_loopback_sweep.py::test_gpu_loopback_sweep_every_tier[3]"
fi
tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
left=$(( ${BUDGET_S:-540} - ($(date +%s) - T0) ))
[ $left -gt 60 ] && p inv_w1 $left tests/test_invariance.py::test_invariance_w1
tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
echo "done in $(( $(date +%s) - T0 )) s"
