#!/usr/bin/env bash
# Session 20, last call: the GPU tier with the side references below pytest's priority (tests/gpu/side_process.py).
set -uo pipefail
N=1 timeout 560 bash scripts/gpu_tier.sh
