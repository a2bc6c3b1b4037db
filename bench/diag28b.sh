#!/usr/bin/env bash
# Issue 28, device call 2: what the wrong elements of the loopback one-shot all-reduce hold.
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}; mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/triton-cache.tgz ] && tar xzf .tcache/triton-cache.tgz -C "$TRITON_CACHE_DIR" && echo "restored Triton cache"
bash bench/gpu_smoke.sh
d() { echo "=== ${E:-} $*"; env ${E:-} timeout 100 python3 bench/diag_allreduce_race.py "$@" > "$OUT/d.log" 2>&1; echo "rc $?";
      cat "$OUT/d.log" >> "$OUT/diag28b.log"; grep -v "tactic table" "$OUT/d.log" | tail -${TAILN:-10}; }
TAILN=24 d --calls 30
d --calls 30 --bf16 --width 7168
d --calls 20 --chunked
d --calls 30 --world-size 2
E=K3TAIL_LOOPBACK_SPIN_SHARE=0.25 d --calls 30
E=K3TAIL_TRITON_DISPATCH=1 d --calls 30
tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
