#!/usr/bin/env bash
# Session 18: the RMSNorm ops (ops/norm) on the device: their CUDA tests and the GPU tests whose models use them,
# then the step with them against the step with Inductor's norms (bench_step variants overlap / torch norms), and
# the plain B = 1 step's kernels.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 280 python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short --compile-workers 4 \
  tests/gpu/test_norm_cuda.py tests/gpu/test_models_cuda.py tests/gpu/test_full_cuda.py tests/gpu/test_engine_cuda.py \
  tests/gpu/test_step_sync_cuda.py tests/gpu/test_kernels_ahead_cuda.py tests/gpu/test_piecewise_cuda.py 2>&1 | tail -15
timeout 200 python3 scripts/bench_step.py --sizes 1,32 --variants "overlap,torch norms" 2>&1 | grep -av "Warning\|warn" \
  | tee "$OUT/bench_step.txt" | grep -a -A12 "copy bandwidth"
timeout 90 python3 scripts/profile_step.py --sizes 1 --kinds plain --variants default --no-linear 2>&1 \
  | grep -av "Warning\|warn" | grep -a "==\|GPU kernel time\|us/step" | head -24
