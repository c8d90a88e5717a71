#!/usr/bin/env bash
# One device call: the GPU tests that failed before, the attention tests on CUDA, the built-in pair's cold
# start with no mode flag, and bench_startup.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_piecewise_cuda.py "tests/gpu/test_full_cuda.py::test_every_mode_gives_the_same_tokens_and_acceptance" "tests/gpu/test_artifacts_cuda.py" tests/test_attention.py 2>&1 | tail -6
tmp=$(mktemp -d); start=$(date +%s)
echo "== draftgraph generate --device cuda (no mode flag), empty Inductor / Triton caches"
TORCHINDUCTOR_CACHE_DIR=$tmp/ind TRITON_CACHE_DIR=$tmp/tri python3 -m draftgraph generate --device cuda 2>&1 | grep -v "it/s\]\|compile/s\]\|size/s\]\|req/s\]" | tail -14
echo "whole process: $(( $(date +%s) - start )) s"
echo "== bench_startup"
python3 scripts/bench_startup.py 2>&1 | tail -9
