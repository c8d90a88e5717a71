#!/usr/bin/env bash
# Session 20, after the GPU tier: the op tests on CUDA (the split-KV kernel's default path failed to compile on
# Triton 3.6 in the first call: fixed), then the step with each opt-in fusion side by side -- the pre-norm inside
# the one-row GEMV (DRAFTGRAPH_NORM_LINEAR), the KV write inside the RoPE kernel (DRAFTGRAPH_ROPE_KV_WRITE), the
# split-KV merge in the last split (DRAFTGRAPH_SPLIT_KV_FUSED_MERGE) -- and all three, then a profile of plain B=1.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_linear_op.py tests/test_rms_norm.py \
  tests/test_rope_op.py tests/test_split_kv.py 2>&1 | grep -av "^  \|warn" | tail -6
timeout 380 python3 scripts/bench_step.py --kinds plain,spec --sizes 1,8,32 \
  --variants "overlap,norm linear,kv in rope,fused merge,all opt-ins" --repeats 3 2>&1 | grep -av "Warning\|warn" \
  | tee "$OUT/bench_step.txt" | grep -a -A14 "copy bandwidth"
DRAFTGRAPH_NORM_LINEAR=1 DRAFTGRAPH_ROPE_KV_WRITE=1 DRAFTGRAPH_SPLIT_KV_FUSED_MERGE=1 timeout 100 python3 \
  scripts/profile_step.py --sizes 1 --kinds plain --variants default --no-linear 2>&1 | tee "$OUT/profile.txt" | head -24
