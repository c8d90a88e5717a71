#!/usr/bin/env bash
# The built-in pair's cold start with the compile workers started early: no profiler, then under cProfile.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
step() {  # name, timeout, command...
  local name=$1 t=$2; shift 2; echo "== $name"; local s=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS - s)) s"
  grep -v "it/s\]" "$OUT/$name.log" | tail -${TAIL:-12}
}
TAIL=16 step builtin_cold 120 env TORCHINDUCTOR_CACHE_DIR=/tmp/c1 TRITON_CACHE_DIR=/tmp/t1 python3 scripts/profile_compile.py --builtin --no-cprofile
TAIL=4 step builtin_prof 200 env TORCHINDUCTOR_CACHE_DIR=/tmp/c3 TRITON_CACHE_DIR=/tmp/t3 python3 scripts/profile_compile.py --builtin
