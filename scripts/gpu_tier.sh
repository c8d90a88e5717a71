#!/usr/bin/env bash
# The GPU tier (tests/gpu), on the device, with empty Inductor and Triton caches.
#   N=1 (the default): one `pytest tests/gpu` process; the tests that read the device's free memory
#      (`whole_device`) run last (tests/gpu/conftest.py), once the session's compile workers are up and idle.
#   N>1: in two parts: the whole_device tests alone in one process (no shared compile workers), then the rest
#      in N pytest processes sharing the GPU (pytest-xdist, a test file at a time per process: --dist loadfile
#      keeps a file's module fixtures in one process). On the device's 16 cores 2-4 processes took as long as
#      one (docs/history/benchmarks-2026-11.md, 2026-11-25).
#   N=1 bash scripts/gpu_tier.sh [more pytest args]; N=3 W=3 DIST=load ... (the device's image has pytest-xdist)
# W: compile workers per pytest process (tests/gpu/conftest.py --compile-workers; default: the engines' own
# automatic count, half the cores, at most 8, in every process).
# Each test phase over a second is appended to $OUT/test_times.txt as it ends (tests/gpu/conftest.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # wheels carried to the device: their --target dir
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
export DRAFTGRAPH_TEST_TIMES=$OUT/test_times.txt
N=${N:-1}
W=${W:+--compile-workers $W}
common=(-q -p no:cacheprovider -p no:logging --tb=short)
nvidia-smi --query-gpu=name --format=csv,noheader
# The host's speed: the tier is CPU-bound (tracing, Triton), and H100 hosts differ by up to 1.5x in it
# (docs/history/benchmarks-2026-11.md);
# compare tier times only between runs whose calibration is alike.
python3 - <<'PY'
import time
t0 = time.perf_counter(); s = 0
for i in range(3_000_000):
    s += i * i % 7
print(f"host calibration: 3M-iteration Python loop {time.perf_counter() - t0:.2f} s")
PY
t0=$SECONDS
if [ "$N" -le 1 ]; then
  python3 -m pytest "${common[@]}" --durations=15 $W tests/gpu "$@" 2>&1 \
    | tee "$OUT/tier.log" | grep -av "it/s\]\|s/it\]" | tail -45
  echo "GPU tier: $((SECONDS - t0)) s in one process"
else
  python3 -m pytest "${common[@]}" -m whole_device --compile-workers 0 tests/gpu "$@" 2>&1 | tee "$OUT/tier_alone.log" | tail -15
  alone=$((SECONDS - t0))
  python3 -m pytest "${common[@]}" -m "not whole_device" -n "$N" --dist "${DIST:-loadfile}" --durations=15 $W tests/gpu \
    "$@" 2>&1 | tee "$OUT/tier_shared.log" | grep -av "it/s\]\|s/it\]" | tail -45
  echo "GPU tier: $((SECONDS - t0)) s in all ($alone s alone, $((SECONDS - t0 - alone)) s in $N processes)"
fi
sort -rn "$OUT/test_times.txt" | head -${TOP:-25}
