#!/usr/bin/env bash
# A runnable copy of an older commit's package, for a baseline on the same card in the same device call
# (timings are compared only on one card; the committed results of another card are not a baseline).
#
#   bash bench/old_tree.sh 8e91ac7 .old/8e91ac7      # on this machine, before the device call (.old is
#                                                     # untracked and not ignored, so it travels)
#   (cd .old/8e91ac7 && PYTHONPATH=$PWD python3 bench/bench_tail.py --out $OUT/old)   # on the device
#
# The commit's k3tail/, triton_kernels/ and cute_fallback/ (the two kernel folders moved under k3tail/,
# as the install maps them) and its bench/ scripts.  Move the tree out of the repository afterwards:
# ruff and the tests would read it.
set -euo pipefail
c=${1:?commit}; dst=${2:?destination}
rm -rf "$dst" && mkdir -p "$dst"
git archive "$c" k3tail triton_kernels cute_fallback bench | tar x -C "$dst"
mv "$dst/triton_kernels" "$dst/k3tail/triton_kernels"
mv "$dst/cute_fallback" "$dst/k3tail/cute_fallback"
echo "$dst: $(git rev-parse --short "$c") ($(du -sh "$dst" | cut -f1))"
