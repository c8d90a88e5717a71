#!/usr/bin/env bash
# Session 18's third device call: the one-graph step with its metadata built on the device and overlapped steps
# (GPU tests that cover them), then bench_step: overlapped, serial and two graphs side by side.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 260 python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short --compile-workers 4 \
  tests/gpu/test_advance_cuda.py tests/gpu/test_step_sync_cuda.py tests/gpu/test_full_cuda.py \
  tests/gpu/test_soak_cuda.py tests/gpu/test_engine_cuda.py tests/gpu/test_kernels_ahead_cuda.py \
  "tests/gpu/test_deepseek_v32_cuda.py::test_steady_uniform_step_is_one_graph_and_one_wait" 2>&1 | tail -25
timeout 300 python3 scripts/bench_step.py --sizes 1,32 --variants overlap,serial 2>&1 | grep -av "Warning\|warn" | tee "$OUT/bench_step.txt" | tail -40
