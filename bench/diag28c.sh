#!/usr/bin/env bash
# Issue 28, device call: the wait-vote fix A/B (.old = the code before it, carried) and the loopback sweep.
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}; mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/triton-cache.tgz ] && tar xzf .tcache/triton-cache.tgz -C "$TRITON_CACHE_DIR" && echo "restored Triton cache"
bash bench/gpu_smoke.sh
d() {  # d LABEL PYTHONPATH ARGS...
  local label=$1 pp=$2; shift 2
  echo "=== $label $*"
  env PYTHONPATH=$pp timeout 90 python3 ${pp:-.}/bench/diag_allreduce_race.py "$@" > "$OUT/d.log" 2>&1; echo "rc $?"
  cat "$OUT/d.log" >> "$OUT/diag28c.log"; grep -v "tactic table" "$OUT/d.log" | tail -${TAILN:-4}
}
python3 -c "import sys; sys.path.insert(0, '.old'); import k3tail.triton_kernels.lamport as l; print('old lamport:', l.__file__, hasattr(l, 'cta_any'))"
TAILN=12 d old .old --calls 20
d old .old --calls 20 --bf16 --width 7168
TAILN=6 d new "" --calls 20
d new "" --calls 20 --bf16 --width 7168
d new "" --calls 20 --world-size 2
d new "" --calls 20 --m 65
tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
echo "=== sweep"; timeout ${SWEEP_TIMEOUT:-330} python3 -m pytest tests/test_loopback_sweep.py -m gpu -q -s -rfE -p no:cacheprovider -o timeout=200 2>&1 | tee "$OUT/sweep.log" | grep -E "^W=|M=.*(differ|FAIL)|passed|failed|Error" | tail -40
tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
