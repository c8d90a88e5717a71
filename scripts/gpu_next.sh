#!/usr/bin/env bash
# What session 7 left unverified on the GPU, in one call (carry .whl: fla-core and einops wheels):
# the V3.2 size test (fixed), Qwen3.5 on CUDA with fla, the two family benchmarks, then the step with the
# argmax op and the row-only recovery distribution (graph memory of the sampled variant).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P="-q -p no:cacheprovider -p no:logging --tb=short"
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== v3.2 sizes"; timeout 120 python3 -m pytest $P tests/gpu/test_deepseek_v32_cuda.py -k sizes 2>&1 | tail -4
echo "== bench_sparse_mla"; timeout 150 python3 scripts/bench_sparse_mla.py 2>&1 | grep -v "it/s\]" | tail -25
echo "== bench_step"; timeout 200 python3 scripts/bench_step.py --sizes 1,32,128 2>&1 | grep -v "it/s\]" | tail -14
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
echo "== qwen3.5 with fla"; timeout 150 python3 -m pytest $P tests/gpu/test_qwen3_5_cuda.py 2>&1 | tail -8
echo "== bench_qwen3_5"; timeout 150 python3 scripts/bench_qwen3_5.py 2>&1 | grep -v "it/s\]" | tail -25
