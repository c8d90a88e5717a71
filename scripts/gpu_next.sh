#!/usr/bin/env bash
# What is left unverified on the GPU, in one call (carry .whl: fla-core and einops wheels): the V3.2 size
# test, the Qwen3.5 cases added on CUDA (target alone, MTP at K = 1 and 5, MoE), and the Qwen3.5 benchmark.
# Full logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="-q -p no:cacheprovider -p no:logging --tb=short"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
step() {  # name, timeout, command...
  local name=$1 t=$2; shift 2; echo "== $name"; local s=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS - s)) s"
  grep -v "it/s\]" "$OUT/$name.log" | tail -${TAIL:-12}
}
# step v32_sizes 60 python3 -m pytest $P tests/gpu/test_deepseek_v32_cuda.py -k sizes
PYTHONPATH=$PWD:/tmp/site step qwen35_new 200 python3 -m pytest $P tests/gpu/test_qwen3_5_cuda.py -s \
  -k "target or other_draft or moe"
PYTHONPATH=$PWD:/tmp/site TAIL=30 step bench_qwen35 300 python3 scripts/bench_qwen3_5.py
