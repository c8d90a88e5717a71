#!/usr/bin/env bash
# Session 18's second device call: the race with 23-bit uniforms (CUDA tests, diag_race, bench_race: draw time,
# sampled step's graph memory and time with DRAFTGRAPH_RACE_KERNEL=0/1), then the GPU tier (compile workers from
# pytest_configure, the soak's reference beside it).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/test_race_sample.py tests/test_argmax.py tests/test_sampling.py 2>&1 | tail -2
timeout 60 python3 scripts/diag_race.py --rows 128,256,1024 2>&1 | grep -av "Warning\|warn" | tail -8
timeout 170 python3 scripts/bench_race.py 2>&1 | grep -av "Warning\|warn" | tail -12
DRAFTGRAPH_SAMPLE_PROFILE=$OUT/profile.txt N=1 timeout 340 bash scripts/gpu_tier.sh | tail -8
grep -a " side " "$OUT/test_times.txt"; true
