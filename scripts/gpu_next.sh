#!/usr/bin/env bash
# The shared dense/sparse MLA split kernel (ops/mla/triton_latent.py): its tests natively on CUDA, then the
# sparse-vs-dense benchmark (dense MLA was one program per (token, head block) over the whole context).
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
step mla_kernels 60 python3 -m pytest $P tests/test_sparse_mla_triton.py tests/test_deepseek.py -k "triton or dense"
TAIL=45 step bench_sparse_mla 60 python3 scripts/bench_sparse_mla.py
