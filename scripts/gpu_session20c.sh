#!/usr/bin/env bash
# Session 20, last call: the GPU tier on the session's final code (the fusions on by default, pieces that write the
# caches graphed, three more eager references in side processes), then the built-in pair's cold start through the
# CLI with empty caches (issue 16's 15 s).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=1 timeout 420 bash scripts/gpu_tier.sh
timeout 120 python3 scripts/bench_cold_start.py --variant default: --repeats 2 2>&1 | tail -6
