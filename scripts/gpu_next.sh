#!/usr/bin/env bash
# First GPU call of the next session (session 8 left these unverified on the device):
# 1. dense MLA on the shared split kernel (ops/mla/triton_latent.py): its kernel tests natively, the DeepSeek-V3
#    GPU suite (MLA in every mode), and the sparse-vs-dense benchmark (dense was ~372 us per layer at 4k);
# 2. the tests/gpu time (issue 16's halving target), the Qwen3.5 file in its own process (carry .whl).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="-q -p no:cacheprovider -p no:logging --tb=short"
nvidia-smi --query-gpu=name --format=csv,noheader
step() {  # name, timeout, command...
  local name=$1 t=$2; shift 2; echo "== $name"; local s=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS - s)) s"
  grep -v "it/s\]" "$OUT/$name.log" | tail -${TAIL:-12}
}
step mla_kernels 90 python3 -m pytest $P tests/test_sparse_mla_triton.py tests/test_deepseek.py -k "triton or dense"
step deepseek_gpu 150 python3 -m pytest $P tests/gpu/test_deepseek_cuda.py
TAIL=45 step bench_sparse_mla 90 python3 scripts/bench_sparse_mla.py
