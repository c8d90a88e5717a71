#!/usr/bin/env bash
# Session 14's GPU checks: fuse_draft_loop "auto" (the loop unfused inside the one-graph step) against "on",
# through the CLI from empty caches; the 1B pair's cold and lazy warm start; the GPU tests the change touches.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local name=$1 t=$2; shift 2; echo "== $name"; local s=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS - s)) s"
  grep -av "it/s\]\|s/it\]\|Warning\|warnings.warn" "$OUT/$name.log" | tail -${TAIL:-12} | cut -c1-700; }
if [ "${PIP:-0}" = 1 ]; then pip install -q --no-index --no-deps .whl/*.whl; fi
TAIL=30 step cold_cli 300 python3 scripts/bench_cold_start.py --repeats 2 --args "--max-tokens 16" \
  --variant auto: --variant fused::--fuse-draft-loop\ on
TAIL=10 step startup_1b 150 python3 scripts/bench_startup.py --phases cold,warm_lazy --timeout 120
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
TAIL=14 step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider --tb=short --durations=8 \
  tests/gpu/test_full_cuda.py tests/gpu/test_memory_cuda.py tests/gpu/test_step_sync_cuda.py tests/gpu/test_advance_cuda.py
