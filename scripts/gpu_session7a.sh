#!/usr/bin/env bash
# Session 7, first device call: the GPU tests whose keys changed in session 6 (and the ops/ move), then where a
# steady FULL step's GPU time goes (scripts/profile_step.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short tests/gpu/test_artifacts_cuda.py tests/gpu/test_deepseek_cuda.py tests/gpu/test_soak_cuda.py tests/test_split_kv.py 2>&1 | grep -v "Warning\|warnings.warn\|^$" | tail -30
echo "== profile_step"; python3 scripts/profile_step.py 2>&1 | grep -v "it/s\]" | tail -150
