#!/usr/bin/env bash
# Session 19, call D: the linear op's tests on CUDA (bf16/fp16 multi-row kernel), then the norm ops against
# Inductor's norms with the GEMV in both (bench_step variants overlap / norm ops, 3 repeats), then the plain B = 1
# step's kernels.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_linear_op.py 2>&1 | tail -4
timeout 330 python3 scripts/bench_step.py --sizes 1,8,32 --variants "overlap,norm ops" --repeats 3 2>&1 \
  | grep -av "Warning\|warn" | tee "$OUT/bench_step.txt" | grep -a -A14 "copy bandwidth"
timeout 150 python3 scripts/profile_step.py --sizes 1 --kinds plain --variants default --no-linear 2>&1 \
  | grep -av "Warning\|warn" | tee "$OUT/profile.txt" | grep -a "==\|GPU kernel time\|us/step" | head -30
