#!/usr/bin/env bash
# Session 7, second device call: Inductor options against cold start (built-in pair) and step time (1B pair).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for opt in "" "--inductor-option triton.autotune_pointwise=False"; do
  tmp=$(mktemp -d)
  echo "== draftgraph generate --device cuda $opt (empty caches)"
  start=$(date +%s.%N)
  TORCHINDUCTOR_CACHE_DIR=$tmp/ind TRITON_CACHE_DIR=$tmp/tri python3 -m draftgraph generate --device cuda $opt 2>&1 | grep -i "ready\|compil\|captur\|tok/s\|error" | tail -6
  echo "whole process: $(python3 -c "import time; print(round(time.time() - $start, 1))") s"
done
echo "== bench_inductor_options"
python3 scripts/bench_inductor_options.py --sizes 1 --variants default,combo,no-autotune 2>&1 | grep -v "it/s\]\|Warning\|warn" | tail -10
