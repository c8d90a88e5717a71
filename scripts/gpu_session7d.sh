#!/usr/bin/env bash
# Session 7, last device call: the new families on CUDA (DeepSeek-V3.2 sparse kernels, Qwen3.5 GDN kernels with
# fla-core from .whl), the shared paged-attention device functions (test_split_kv on CUDA).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P="-q -p no:cacheprovider -p no:logging --tb=short"
echo "== without fla"; timeout 200 python3 -m pytest $P tests/test_split_kv.py tests/test_sparse_mla_triton.py tests/test_linear_attention_triton.py tests/gpu/test_deepseek_v32_cuda.py 2>&1 | grep -v "Warning\|warnings.warn\|^$" | tail -15
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
echo "== qwen3.5 with fla"; timeout 150 python3 -m pytest $P tests/gpu/test_qwen3_5_cuda.py 2>&1 | grep -v "Warning\|warnings.warn\|^$" | tail -15
