#!/usr/bin/env bash
# Issue 16 with compile workers: the built-in pair cold (profile_compile) and its CLI run, the 1B pair's
# cold/warm start, the artifact GPU tests (artifacts saved from worker-compiled pieces).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="-q -p no:cacheprovider -p no:logging --tb=short"
fresh() { export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d); }
step() {  # name, timeout, command...
  local name=$1 t=$2; shift 2; echo "== $name"; local s=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS - s)) s"
  grep -av "it/s\]\|s/it\]\|Warning\|warnings.warn" "$OUT/$name.log" | tail -${TAIL:-8} | cut -c1-400
}
fresh; TAIL=14 step builtin_pool 120 python3 scripts/profile_compile.py --builtin --no-cprofile
fresh; TAIL=3 step cli 120 python3 -m draftgraph generate --device cuda
TAIL=10 step startup 200 python3 scripts/bench_startup.py
fresh; TAIL=4 step artifacts_gpu 150 python3 -m pytest $P tests/gpu/test_artifacts_cuda.py
