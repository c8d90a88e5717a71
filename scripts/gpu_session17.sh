#!/usr/bin/env bash
# Session 17's device call: custom op dispatch (torch.library.custom_op against ops/registry.py) per call and in
# PIECEWISE steps of the 1B-shaped pair, then the GPU tier with its sampling profile (by test and category).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 scripts/bench_op_dispatch.py
for v in 1 0; do
  echo "== DRAFTGRAPH_TORCH_CUSTOM_OP=$v"
  DRAFTGRAPH_TORCH_CUSTOM_OP=$v timeout "${BENCH_S:-110}" python3 scripts/bench_piecewise.py --sizes 1,32 2>&1 \
    | grep -av "Warning\|warn" | tail -7
done
DRAFTGRAPH_SAMPLE_PROFILE=$OUT/profile.txt N=1 bash scripts/gpu_tier.sh
