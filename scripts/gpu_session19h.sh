#!/usr/bin/env bash
# Session 19, call H: the built-in pair's cold start through the CLI from empty caches (issue 16: ready <= 15 s)
# with this session's ops on (their kernel variants compile ahead in threads) against all of them off.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 240 python3 scripts/bench_cold_start.py --repeats 2 --variant default: \
  --variant "ops off:DRAFTGRAPH_GEMV_KERNEL=0,DRAFTGRAPH_ROPE_KERNEL=0,DRAFTGRAPH_NORM_KERNEL=0" \
  --args "--max-tokens 16" 2>&1 | grep -av "Warning\|warn" | tail -10
