#!/usr/bin/env bash
# Session 18's cold-start check: the built-in pair through the CLI from empty caches (issue 16: ready <= 15 s) with
# the race and the step's metadata kernel now compiled ahead too, then the plain B = 1 step's kernels.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 scripts/bench_cold_start.py --repeats 2 --variant default: --args "--max-tokens 16" 2>&1 \
  | grep -av "Warning\|warn" | tail -8
timeout 100 python3 scripts/profile_step.py --sizes 1 --kinds plain,spec --variants default --no-linear 2>&1 \
  | grep -av "Warning\|warn" | grep -a "==\|GPU kernel time\|us/step" | head -40
