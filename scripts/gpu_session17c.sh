#!/usr/bin/env bash
# Session 17's check of the main job and the mm + add pass: a new user's cold start (the built-in pair through the
# CLI, empty caches) with and without the pass, then per-kernel profiles of the 1B pair's plain step at B = 1.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python3 scripts/bench_cold_start.py --repeats 2 --variant pass: --variant addmm:DRAFTGRAPH_UNFUSE_ADDMM=0 \
  --args "--max-tokens 16" 2>&1 | grep -av "Warning\|warn" | tail -14
timeout 110 python3 scripts/profile_step.py --sizes 1 --kinds plain --variants default,addmm --no-linear 2>&1 \
  | grep -av "Warning\|warn" | tail -56
