#!/usr/bin/env bash
# Session 19, call F: the SwiGLU down projection as one op (silu_mul_linear) on CUDA, then the step with every new
# op against each one turned off (bench_step variants overlap / torch rope / cuBLAS, 3 repeats), then the plain
# B = 1 step's kernels.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_linear_op.py tests/test_rope_op.py \
  tests/gpu/test_models_cuda.py tests/gpu/test_engine_cuda.py 2>&1 | tail -6
timeout 360 python3 scripts/bench_step.py --sizes 1,8,32 --variants "overlap,torch rope,cuBLAS" --repeats 3 2>&1 \
  | grep -av "Warning\|warn" | tee "$OUT/bench_step.txt" | grep -a -A14 "copy bandwidth"
timeout 120 python3 scripts/profile_step.py --sizes 1 --kinds plain --variants default --no-linear 2>&1 \
  | grep -av "Warning\|warn" | tee "$OUT/profile.txt" | grep -a "==\|GPU kernel time\|us/step" | head -30
