#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
fresh() { export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d); }
fresh; timeout 200 python3 scratch_dev/sampled.py > $OUT/pool.txt 2>&1; echo rc=$?; grep -v Warn $OUT/pool.txt | head -14 | cut -c1-300
fresh; timeout 150 python3 -m draftgraph generate --device cuda > $OUT/cli.log 2>&1; echo rc=$?; grep -a "ready\|compiled\|tokens/s" $OUT/cli.log | cut -c1-300 | tail -4
