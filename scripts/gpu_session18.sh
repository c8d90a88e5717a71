#!/usr/bin/env bash
# Session 18's first device call: where the Triton race and race_reference disagree (scripts/diag_race.py), then
# the GPU tier in one process (the soak's eager reference now runs in a side process: tests/gpu/side_process.py)
# with the sampling profile.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 60 python3 scripts/diag_race.py 2>&1 | grep -av "Warning\|warn" | tail -30
DRAFTGRAPH_SAMPLE_PROFILE=$OUT/profile.txt N=1 timeout 500 bash scripts/gpu_tier.sh
grep -a "side reference\|soak:" "$OUT/tier.log" | head
