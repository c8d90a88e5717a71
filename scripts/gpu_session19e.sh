#!/usr/bin/env bash
# Session 19, call E: the new defaults (the one-row GEMV, the norm ops, the fused RoPE op) through the whole GPU
# tier, after the ops' own tests on CUDA.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_rope_op.py tests/test_linear_op.py \
  tests/test_rms_norm.py 2>&1 | tail -6
N=1 timeout 470 bash scripts/gpu_tier.sh
