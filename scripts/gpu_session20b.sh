#!/usr/bin/env bash
# Session 20, second pair of calls: the step with this session's defaults (the norms in the projections, the KV
# write in RoPE, pieces that write the caches graphed) against session 19's (both fusions apart), speculative
# and plain, then a profile of the speculative step at B=1.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 520 python3 scripts/bench_step.py --kinds spec,plain --sizes 1,8,32 --variants "overlap,both apart" \
  --repeats 3 2>&1 | grep -av "Warning\|warn" | tee "$OUT/bench_step.txt" | grep -a -A14 "copy bandwidth"
timeout 60 python3 scripts/profile_step.py --sizes 1 --kinds spec --variants default --no-linear 2>&1 \
  | tee "$OUT/profile.txt" | grep -a -A14 "== spec"
