#!/usr/bin/env bash
# Session 10: the 1B pair's cold / warm start (bench_startup.py) with the launchers' batch-size specialisations
# removed; each phase is stopped after a limit with every thread's stack printed.
# `STEP=gpu_tests bash scripts/gpu_next.sh`: `pytest tests/gpu` whole, timed (issue 16: <= 204 s on an H100).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="-q -p no:cacheprovider -p no:logging --tb=short --durations=15"
nvidia-smi --query-gpu=name --format=csv,noheader
step() {  # name, timeout, command...
  local name=$1 t=$2; shift 2; echo "== $name"; local s=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS - s)) s"
  grep -av "it/s\]\|s/it\]\|Warning\|warnings.warn" "$OUT/$name.log" | tail -${TAIL:-12} | cut -c1-900
}
if [ "${STEP:-startup}" = startup ]; then
  grep -n "compile_module_from_src\|def make_launcher\|class CudaLauncher" "$(python3 -c 'import triton,os;print(os.path.dirname(triton.__file__))')/backends/nvidia/driver.py" | head -5
  TAIL=40 step startup ${LIMIT:-330} python3 scripts/bench_startup.py --timeout 150 ${ARGS:-}
else
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
  TAIL=30 step gpu_tests 590 python3 -m pytest $P tests/gpu --ignore=tests/gpu/test_qwen3_5_cuda.py
fi
