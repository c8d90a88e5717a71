#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
fresh() { export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d); }
fresh; timeout 200 python3 scratch_dev/sampled.py 0 > $OUT/inproc.txt 2>&1; echo rc=$?; head -14 $OUT/inproc.txt | cut -c1-300
fresh; timeout 200 python3 scratch_dev/sampled.py > $OUT/pool.txt 2>&1; echo rc=$?; head -14 $OUT/pool.txt | cut -c1-300
