#!/usr/bin/env bash
# Where the built-in pair's cold start goes, with and without compile workers (profiles dumped to $OUT).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
fresh() { export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d); }
step() {  # name, timeout, command...
  local name=$1 t=$2; shift 2; echo "== $name"; local s=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS - s)) s"
  grep -a "ready in\|traces" "$OUT/$name.log" | cut -c1-600
}
fresh; step prof_inproc 200 python3 scripts/profile_compile.py --builtin --workers 0 --dump $OUT/inproc.prof
fresh; step prof_pool 200 python3 scripts/profile_compile.py --builtin --dump $OUT/pool.prof
