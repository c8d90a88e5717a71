#!/usr/bin/env bash
# Issue 17, second device call: the one-graph step's GPU tests, the split-KV rule's picks, bench_step.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short tests/gpu/test_step_sync_cuda.py tests/gpu/test_full_cuda.py tests/test_split_kv.py 2>&1 | grep -v "Warning\|warnings.warn\|^$" | tail -40
echo "== bench_decode_attention"; python3 scripts/bench_decode_attention.py 2>&1 | tail -6
echo "== bench_step"; python3 scripts/bench_step.py 2>&1 | grep -v "it/s\]" | tail -30
