#!/usr/bin/env bash
# Session 19, call G: the GPU tier with this session's defaults (one-row GEMV, norm ops, fused RoPE one program per
# head, the SwiGLU down projection as one op) and its side references; then the step against cuBLAS linears
# (bench_step overlap / cuBLAS, B = 1 and 32, 2 repeats) and the plain B = 1 step's kernels.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_rope_op.py tests/test_linear_op.py \
  tests/test_rms_norm.py 2>&1 | tail -3
N=1 timeout 300 bash scripts/gpu_tier.sh 2>&1 | grep -av "^   \|^tests/gpu\|^  /opt\|_warn_once\|torch._C._cuda\|^$" | tail -22
timeout 75 python3 scripts/profile_step.py --sizes 1 --kinds plain --variants default --no-linear 2>&1 \
  | grep -av "Warning\|warn" | tee "$OUT/profile.txt" | grep -a "==\|GPU kernel time\|us/step" | head -12
timeout 150 python3 scripts/bench_step.py --kinds plain,spec --sizes 1,32 --variants "overlap,cuBLAS" --repeats 2 2>&1 \
  | grep -av "Warning\|warn" | tee "$OUT/bench_step.txt" | grep -a -A12 "copy bandwidth"
