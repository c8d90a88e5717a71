#!/usr/bin/env bash
# Session 20: the step at batch 128 with this session's defaults (issue 17 asks for its time and floor ratio).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 230 python3 scripts/bench_step.py --kinds spec,plain --sizes 128 --variants overlap --repeats 2 2>&1 \
  | grep -av "Warning\|warn" | grep -a -A8 "copy bandwidth\|ready in"
