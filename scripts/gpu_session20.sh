#!/usr/bin/env bash
# Next session's first call (written in session 19, not yet run): the three opt-in fusions on CUDA -- the pre-norm
# inside the one-row GEMV (draftgraph::add_rms_norm_linear), the KV write inside the RoPE kernel
# (draftgraph::rope_qkv_write), the split-KV merge in the last split -- their tests, the GPU tests with all on,
# then the step with all of them against none (one variant at a time if they win).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_linear_op.py tests/test_rms_norm.py \
  tests/test_rope_op.py tests/test_split_kv.py 2>&1 | tail -4
timeout 120 python3 scripts/bench_gemv.py --fused --replays 50 2>&1 | tail -5
DRAFTGRAPH_NORM_LINEAR=1 DRAFTGRAPH_ROPE_KV_WRITE=1 DRAFTGRAPH_SPLIT_KV_FUSED_MERGE=1 timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short --compile-workers 4 \
  tests/gpu/test_models_cuda.py tests/gpu/test_engine_cuda.py tests/gpu/test_full_cuda.py 2>&1 | tail -4
timeout 300 python3 scripts/bench_step.py --kinds plain,spec --sizes 1,8,32 --variants "overlap,all opt-ins" \
  --repeats 3 2>&1 | grep -av "Warning\|warn" | tee "$OUT/bench_step.txt" | grep -a -A12 "copy bandwidth"
