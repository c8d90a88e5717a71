#!/usr/bin/env bash
# The next session's GPU calls (session 10 left these open; docs/benchmarks.md, session 10):
#   bash scripts/gpu_next.sh                      the built-in pair's cold start under the sampling profiler and
#                                                 as `draftgraph generate --device cuda` (issue 16: <= 15 s),
#                                                 then the 1B pair's cold and lazy warm start (<= 30 s, <= 5 s);
#                                                 SAMPLING=1: then the sampling kernels' tests on CUDA;
#                                                 PRE="tests/gpu/x.py ...": those tests first; GENERATE=0: no CLI run
#   STEP=gpu_tests WORKERS=0 bash scripts/gpu_next.sh   `pytest tests/gpu` timed with engines' compile workers
#   STEP=gpu_tests bash scripts/gpu_next.sh              forced to 0, then (second call) at auto (issue 16:
#                                                        the tier in <= 204 s on an H100)
# Qwen3.5's GPU file needs fla-core: run with carry [".whl"] and PIP=1.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
step() {  # name, timeout, command...
  local name=$1 t=$2; shift 2; echo "== $name"; local s=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS - s)) s"
  grep -av "it/s\]\|s/it\]\|Warning\|warnings.warn" "$OUT/$name.log" | tail -${TAIL:-12} | cut -c1-900
}
if [ "${PIP:-0}" = 1 ]; then pip install -q --no-index --no-deps .whl/*.whl; fi
if [ "${STEP:-startup}" = cold ]; then  # the CLI's cold start, variant against variant (VARIANTS: --variant ...)
  TAIL=${TAIL:-40} step cold_start ${LIMIT:-400} python3 scripts/bench_cold_start.py --repeats ${REPEATS:-2} \
    ${VARIANTS:---variant pre: --variant nopre:DRAFTGRAPH_PRESTART_WORKERS=0}
  [ "${PROFILE:-1}" = 1 ] && fresh() { echo env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" TRITON_CACHE_DIR="$(mktemp -d)"; } && \
    TAIL=60 step builtin_profile 150 $(fresh) python3 scripts/profile_compile.py --builtin --no-cprofile --sample
  [ "${STARTUP:-1}" = 1 ] && TAIL=12 step startup 230 python3 scripts/bench_startup.py --phases cold,warm_lazy --timeout 150
elif [ "${STEP:-startup}" = startup ]; then
  fresh() { echo env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" TRITON_CACHE_DIR="$(mktemp -d)"; }  # empty caches
  if [ -n "${PRE:-}" ]; then TAIL=8 step pre_tests 240 $(fresh) python3 -m pytest -q -p no:cacheprovider --tb=short $PRE; fi
  TAIL=60 step builtin_profile 150 $(fresh) python3 scripts/profile_compile.py --builtin --no-cprofile --sample
  [ "${GENERATE:-1}" = 1 ] && TAIL=8 step builtin_generate 150 $(fresh) python3 -m draftgraph generate --device cuda
  TAIL=12 step startup 230 python3 scripts/bench_startup.py --phases cold,warm_lazy --timeout 150
  if [ "${SAMPLING:-0}" = 1 ]; then
    TAIL=6 step sampling_cuda 200 $(fresh) python3 -m pytest -q -p no:cacheprovider --tb=short --durations=5 \
      tests/test_sampling_triton.py tests/test_sampling.py
  fi
else
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
  W=${WORKERS:+--compile-workers $WORKERS}
  IGN=$([ "${PIP:-0}" = 1 ] || echo "--ignore=tests/gpu/test_qwen3_5_cuda.py")
  export DRAFTGRAPH_TEST_TIMES=$OUT/test_times.txt  # each test's time, written as it ends (tests/gpu/conftest.py)
  TAIL=30 step gpu_tests ${LIMIT:-590} python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
    --durations=15 ${TESTS:-tests/gpu $IGN} $W
  sort -rn "$OUT/test_times.txt" | head -${TOP:-40}
fi
