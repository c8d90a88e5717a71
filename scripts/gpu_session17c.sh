#!/usr/bin/env bash
# Checks session 17 left for the device (no device time was left to run them):
# 1. the Triton race (ops/sampling/triton_race.py) against the torch ops on CUDA, then its draw time, memory, and
#    the sampled one-graph step's graph memory and time with DRAFTGRAPH_RACE_KERNEL=0/1 (scripts/bench_race.py);
# 2. a new user's cold start (the built-in pair through the CLI, empty caches) with and without the mm + add pass;
# 3. per-kernel profiles of the 1B pair's plain step at B = 1 with and without the pass.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/test_race_sample.py tests/test_argmax.py 2>&1 | tail -3
timeout 150 python3 scripts/bench_race.py 2>&1 | grep -av "Warning\|warn" | tail -14
timeout 170 python3 scripts/bench_cold_start.py --repeats 2 --variant pass: --variant addmm:DRAFTGRAPH_UNFUSE_ADDMM=0 \
  --args "--max-tokens 16" 2>&1 | grep -av "Warning\|warn" | tail -14
timeout 110 python3 scripts/profile_step.py --sizes 1 --kinds plain --variants default,addmm --no-linear 2>&1 \
  | grep -av "Warning\|warn" | tail -56
