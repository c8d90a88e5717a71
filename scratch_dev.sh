set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash scripts/gpu_next.sh
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short tests/gpu/test_artifacts_cuda.py 2>&1 | tail -15
