#!/usr/bin/env bash
# One device call: cold start of the built-in pair with no mode flag, bench_startup, bench_compile_sizes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
tmp=$(mktemp -d)
echo "== draftgraph generate --device cuda (no mode flag), empty Inductor / Triton caches"
start=$(date +%s.%N)
TORCHINDUCTOR_CACHE_DIR=$tmp/ind TRITON_CACHE_DIR=$tmp/tri python3 -m draftgraph generate --device cuda 2>&1 | tail -25
echo "whole process: $(( $(date +%s) - ${start%.*} )) s"
echo "== bench_startup"
python3 scripts/bench_startup.py 2>&1 | tail -12
echo "== bench_compile_sizes"
python3 scripts/bench_compile_sizes.py 2>&1 | tail -30
