#!/usr/bin/env bash
# Diagnose the loopback replay failures (see bench/stress_loopback.py): each case runs in its
# own process (a device assert ends the CUDA context) under a timeout; logs go to $OUT/diag.log.
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() {  # run "<env>" <args...>
  local envs=$1; shift
  echo "=== $envs $*" | tee -a "$OUT/diag.log"
  env $envs timeout ${CASE_TIMEOUT:-90} python3 bench/stress_loopback.py "$@" 2>&1 | grep -v "^\s*$" | tail -8 | tee -a "$OUT/diag.log"
}
IFS=';' read -ra CASES <<< "${DIAG_CASES:-}"
for c in "${CASES[@]}"; do
  envs=${c%%|*}; args=${c#*|}
  run "$envs" $args
done
