#!/usr/bin/env bash
# V3.2 with MTP at K = 1 and 5 on CUDA; where the built-in pair's cold start goes (empty caches, no profiler).
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
TAIL=25 step builtin_cold 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/c1 TRITON_CACHE_DIR=/tmp/t1 python3 scripts/profile_compile.py --builtin --no-cprofile
TAIL=14 step cli_cold 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/c2 TRITON_CACHE_DIR=/tmp/t2 python3 -m draftgraph generate --device cuda
# step v32_k 200 python3 -m pytest $P tests/gpu/test_deepseek_v32_cuda.py -k other_draft
