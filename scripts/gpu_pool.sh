#!/usr/bin/env bash
# Compile workers (issue 16, item 3) on the device: the built-in pair's cold start with the pool (auto) and
# without (0), the main job's CLI, the 1B pair's cold/warm start, and the artifact GPU tests.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="-q -p no:cacheprovider -p no:logging --tb=short"
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
fresh() { export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d); }
step() {  # name, timeout, command...
  local name=$1 t=$2; shift 2; echo "== $name"; local s=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS - s)) s"
  grep -av "it/s\]\|s/it\]\|Warning\|warnings.warn" "$OUT/$name.log" | tail -${TAIL:-8}
}
fresh; step builtin_pool 150 python3 scripts/profile_compile.py --builtin --no-cprofile
fresh; step builtin_inproc 150 python3 scripts/profile_compile.py --builtin --no-cprofile --workers 0
fresh; TAIL=4 step cli 150 python3 -m draftgraph generate --device cuda
TAIL=14 step startup 300 python3 scripts/bench_startup.py
fresh; step artifacts_gpu 200 python3 -m pytest $P tests/gpu/test_artifacts_cuda.py
