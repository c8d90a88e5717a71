#!/usr/bin/env bash
# Session 18's last device call: the GPU tier (overlapped steps, on-device step metadata, the race by default, two
# side references, compile workers from pytest_configure), then bench_step at B = 1, 8, 32 (overlapped and serial).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DRAFTGRAPH_SAMPLE_PROFILE=$OUT/profile.txt N=1 timeout 360 bash scripts/gpu_tier.sh 2>&1 | tail -24
grep -a " side " "$OUT/test_times.txt"
timeout 170 python3 scripts/bench_step.py --sizes 1,8,32 --variants overlap,serial 2>&1 | grep -av "Warning\|warn" \
  | tee "$OUT/bench_step.txt" | grep -a -A12 "copy bandwidth"
