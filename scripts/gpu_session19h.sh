#!/usr/bin/env bash
# Session 19, call H (the last): each Llama layer's residual add left to the next layer's input norm (CUDA, norm
# ops on) through the GPU tests of the Llama-family paths; the step now (plain then spec, B = 1, 8, 32); then the
# built-in pair's cold start through the CLI from empty caches (issue 16: ready <= 15 s) with this session's ops on
# (their kernel variants compile ahead in threads) against all of them off.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short --compile-workers 4 \
  tests/test_rms_norm.py tests/gpu/test_models_cuda.py tests/gpu/test_full_cuda.py tests/gpu/test_engine_cuda.py \
  tests/gpu/test_step_sync_cuda.py tests/gpu/test_piecewise_cuda.py 2>&1 | tail -5
timeout 170 python3 scripts/bench_step.py --kinds plain,spec --sizes 1,8,32 --variants overlap --repeats 2 2>&1 \
  | grep -av "Warning\|warn" | tee "$OUT/bench_step.txt" | grep -a -A12 "copy bandwidth"
timeout 200 python3 scripts/bench_cold_start.py --repeats 2 --variant default: \
  --variant "ops off:DRAFTGRAPH_GEMV_KERNEL=0,DRAFTGRAPH_ROPE_KERNEL=0,DRAFTGRAPH_NORM_KERNEL=0" \
  --args "--max-tokens 16" 2>&1 | grep -av "Warning\|warn" | tail -10
