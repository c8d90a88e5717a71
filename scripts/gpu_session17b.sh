#!/usr/bin/env bash
# Session 17's last device call: the GPU tier (registry ops, the mm + add pass), then the one-graph step with and
# without the pass (passes/unfuse_addmm.py; DRAFTGRAPH_UNFUSE_ADDMM=0 leaves cuBLAS addmm in), each with its
# profiler summary (kernels per step).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DRAFTGRAPH_SAMPLE_PROFILE=$OUT/profile.txt N=1 bash scripts/gpu_tier.sh
for v in 0 1; do
  echo "== DRAFTGRAPH_UNFUSE_ADDMM=$v"
  DRAFTGRAPH_UNFUSE_ADDMM=$v timeout "${BENCH_S:-140}" python3 scripts/bench_step.py --sizes 1,32 2>&1 \
    | grep -av "Warning\|warn" | tail -9
done
