#!/usr/bin/env bash
# Session 7, third device call: the argmax op on CUDA (tests, bench) and the step with it (bench_step).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short tests/test_argmax.py tests/gpu/test_step_sync_cuda.py 2>&1 | grep -v "Warning\|warnings.warn\|^$" | tail -8
echo "== bench_argmax"; timeout 120 python3 scripts/bench_argmax.py 2>&1 | tail -16
echo "== bench_step"; python3 scripts/bench_step.py --sizes 1,32 2>&1 | grep -v "it/s\]" | tail -22
