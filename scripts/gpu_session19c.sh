#!/usr/bin/env bash
# Session 19, call C: draftgraph::linear on the device: the op's tests on CUDA and the GPU tests whose models use
# it, then the step with it against the step on cuBLAS (bench_step variants overlap / cuBLAS).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 250 python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short --compile-workers 4 \
  tests/test_linear_op.py tests/gpu/test_models_cuda.py tests/gpu/test_full_cuda.py tests/gpu/test_engine_cuda.py \
  tests/gpu/test_step_sync_cuda.py tests/gpu/test_kernels_ahead_cuda.py 2>&1 | tail -15
timeout 330 python3 scripts/bench_step.py --sizes 1,8,32 --variants "overlap,cuBLAS" --repeats 3 2>&1 \
  | grep -av "Warning\|warn" | tee "$OUT/bench_step.txt" | grep -a -A14 "copy bandwidth"
