#!/usr/bin/env bash
# Issue 28, device call 1: reproduce and localize the loopback W = 3 / 6 mismatch (one call).
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}; mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/triton-cache.tgz ] && tar xzf .tcache/triton-cache.tgz -C "$TRITON_CACHE_DIR" && echo "restored Triton cache"
bash bench/gpu_smoke.sh
d() { local t=$1; shift; echo "=== $*"; timeout "$t" python3 bench/diag_loopback_tiers.py "$@" 2>&1 | tee -a "$OUT/diag28.log" | grep -v "^\s*$"; }
eval "${DIAG_A:-d 330 --world-sizes 3 --ms 64 65 128 200}"
eval "${DIAG_B:-true}"
tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . && ls -la "$OUT/triton-cache.tgz"
