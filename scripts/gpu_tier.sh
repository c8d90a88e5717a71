#!/usr/bin/env bash
# The GPU tier (tests/gpu), on the device, with empty Inductor and Triton caches, in two parts:
#   1. the tests that read the device's free memory (-m whole_device), alone in one process (no shared compile
#      workers: they compile nothing, or in their own process);
#   2. the rest in N pytest processes sharing the GPU (pytest-xdist, a test file at a time per process:
#      --dist loadfile keeps a file's module fixtures in one process). N=1: one process, no xdist.
#   N=1 bash scripts/gpu_tier.sh [more pytest args]; N=3 W=3 DIST=load ... (the device's image has pytest-xdist;
#   on its 16 cores 2-4 processes took as long as one: docs/benchmarks.md, session 15)
# W: compile workers per pytest process (tests/gpu/conftest.py --compile-workers; default: the engines' own
# automatic count, half the cores, at most 8, in every process).
# Each test phase over a second is appended to $OUT/test_times.txt as it ends (tests/gpu/conftest.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
export DRAFTGRAPH_TEST_TIMES=$OUT/test_times.txt
N=${N:-1}
W=${W:+--compile-workers $W}
common=(-q -p no:cacheprovider -p no:logging --tb=short)
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
python3 -m pytest "${common[@]}" -m whole_device --compile-workers 0 tests/gpu "$@" 2>&1 | tee "$OUT/tier_alone.log" | tail -15
alone=$((SECONDS - t0))
par=()
[ "$N" -gt 1 ] && par=(-n "$N" --dist "${DIST:-loadfile}")
python3 -m pytest "${common[@]}" -m "not whole_device" "${par[@]}" --durations=15 $W tests/gpu "$@" 2>&1 \
  | tee "$OUT/tier_shared.log" | grep -av "it/s\]\|s/it\]" | tail -45
echo "GPU tier: $((SECONDS - t0)) s in all ($alone s alone, $((SECONDS - t0 - alone)) s in $N processes)"
sort -rn "$OUT/test_times.txt" | head -${TOP:-25}
