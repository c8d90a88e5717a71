#!/usr/bin/env bash
# Issue 17, first device call: the one-graph step's GPU tests (sync-free, profiler, every mode), the split-KV and
# sampling tests on CUDA, and the attention and sampling micro-benchmarks.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_step_sync_cuda.py tests/gpu/test_full_cuda.py tests/test_split_kv.py "tests/test_sampling.py" 2>&1 | grep -v "^tests.*Warning\|warnings.warn" | tail -25
echo "== bench_sampling"; python3 scripts/bench_sampling.py 2>&1 | tail -7
echo "== bench_decode_attention"; python3 scripts/bench_decode_attention.py 2>&1 | tail -30
