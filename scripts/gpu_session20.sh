#!/usr/bin/env bash
# Session 20, after the GPU tier with the new defaults (the norms in the projections, the KV write in RoPE): the op
# tests on CUDA, then the step against each fusion turned off and both (session 19's default), plain and
# speculative, then a profile of plain B=1.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=line -p no:warnings tests/test_linear_op.py \
  tests/test_rms_norm.py tests/test_rope_op.py tests/test_split_kv.py 2>&1 | tail -5
timeout 400 python3 scripts/bench_step.py --kinds plain,spec --sizes 1,8,32 \
  --variants "overlap,norm apart,kv apart,both apart" --repeats 3 2>&1 | grep -av "Warning\|warn" \
  | tee "$OUT/bench_step.txt" | grep -a -A14 "copy bandwidth"
timeout 80 python3 scripts/profile_step.py --sizes 1 --kinds plain --variants default --no-linear 2>&1 \
  | tee "$OUT/profile.txt" | grep -a -A16 "== plain"
